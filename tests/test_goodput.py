"""Goodput follows its own definition (hlat/train/goodput.py, docs/fault-tolerance.md): productive time is the step
time the final model contains, whatever failed on the way; every start counts, one killed during start-up too."""

import json
import os
import subprocess
import sys
import time

import pytest
from test_disk import SUPERVISED
from test_faults import strict_records, write_config
from test_train import config

# The trainer of a supervised run, killed (SIGKILL, once each, the moment written down first) at three places: two
# steps after the checkpoint of step 3; between the rename that completes the checkpoint of step 9 and anything
# after it; and during the next start-up (its start already begun).
KILLED_THREE_TIMES = """
import os, signal, sys, time
from pathlib import Path
from hlat.cli import main
from hlat.checkpoint.durable import DurableTier
from hlat.train.trainer import Trainer

def mark(name):
    return Path(os.environ["KILL_MARKS"], name)

def kill_once(name, now):
    if now and not mark(name).exists():
        mark(name).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

def after_step(self, result, real=Trainer.after_step):
    real(self, result)
    kill_once("after step 5", self.step == 5)

def restore(self, real=Trainer.restore):
    kill_once("during start-up", self.tiers.start.path is not None and mark("checkpoint 9 renamed").exists())
    real(self)

def rotate(self, newest, real=DurableTier._rotate):
    kill_once("checkpoint 9 renamed", newest == 9)
    real(self, newest)

Trainer.after_step, Trainer.restore, DurableTier._rotate = after_step, restore, rotate
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_a_run_killed_three_times_splits_its_failures_and_its_ettr_matches_its_own_step_times(tmp_path):
    """The reported ETTR is productive time over wall time; computed from metrics.jsonl, which holds a record of
    each step the final model contains (its time, less its data wait, from the run of it that made it in), over the
    same wall time, it must agree to the rounding of the records (well within 3%).

    The first failure (killed after step 5, checkpoints every 3 steps) is split in order: its moments come around
    the kill (the last progress before it, the supervisor's sight after it, the restart before the first resumed
    step's record); it resumed from step 3 and recomputed steps 4 and 5, whose seconds are those of their records
    in metrics.jsonl (log_every = 1) to the records' rounding."""
    cfg = config(tmp_path / "run", steps=12, decay_steps=12, ckpt_every=3, snapshot_every=0)  # durable resumes
    cfg.data.workers = 0
    (tmp_path / "marks").mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            SUPERVISED,
            KILLED_THREE_TIMES,
            "--config",
            str(write_config(tmp_path / "c.toml", cfg)),
            "--max-restarts",
            "3",
        ],
        env={**os.environ, "KILL_MARKS": str(tmp_path / "marks")},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    assert len(os.listdir(tmp_path / "marks")) == 3
    assert len((tmp_path / "run" / "restarts.jsonl").read_text().splitlines()) == 3
    goodput = json.loads((tmp_path / "run" / "goodput.json").read_text())
    assert goodput["starts"] == 4  # the one killed during start-up included
    records = strict_records(tmp_path / "run")
    steps = [r["step"] for r in records]
    assert steps == list(range(1, 13))  # one record per step of the final model (log_every = 1)
    step_time = sum(
        r["step_time_s"] * (step - before) - r["data_wait_s"] for r, step, before in zip(records, steps, [0, *steps])
    )
    computed = step_time / goodput["wall_s"]
    print(
        f"ETTR reported {goodput['ettr']:.4f}, computed from metrics.jsonl {computed:.4f}; productive "
        f"{goodput['productive_s']:.3f} s against {step_time:.3f} s; lost {goodput['lost_s']:.3f} s, recomputed "
        f"{goodput['recomputed_s']:.3f} s"
    )
    assert abs(goodput["ettr"] - computed) <= 0.03 * computed
    assert goodput["lost_s"] > 0 and goodput["recomputed_s"] > 0  # steps 4 and 5 were run again

    killed = float((tmp_path / "marks" / "after step 5").read_text())
    failure = goodput["failures"][0]
    assert failure["after_step"] == 5 and failure["seen_by"] == "supervisor: killed by SIGKILL"
    # goodput.json's moments are rounded to 1 ms
    assert failure["progress_at"] <= killed + 5e-4 <= failure["seen_at"] + 1e-3 <= failure["restart_at"] + 2e-3
    first_resumed = next(r for r in records if r["step"] == 4)
    parts = failure["detection_s"] + failure["restart_s"] + failure["load_s"]
    assert min(failure["detection_s"], failure["restart_s"], failure["load_s"]) > 0
    assert parts <= first_resumed["time"] - failure["progress_at"] + 3e-3  # three parts rounded to 1 ms
    assert abs(failure["downtime_s"] - failure["detection_s"] - failure["restart_s"]) <= 2e-3
    assert (failure["resumed_step"], failure["high_water_step"], failure["recomputed_steps"]) == (3, 5, 2)
    rerun = sum(r["step_time_s"] - r["data_wait_s"] for r in records if r["step"] in (4, 5))
    # step_time_s and data_wait_s are rounded to 1e-4 each in the two records, recomputed_s to 1e-3
    assert abs(failure["recomputed_s"] - rerun) <= 4 * 0.5e-4 + 0.5e-3
    assert goodput["failure_totals"]["failures"] == records[-1]["failures"] == 3
    assert "3: downtime" in done.stdout  # the run summary's line of the failures in total


def test_each_failure_is_split_and_the_totals_are_the_sums_of_the_list(tmp_path, monkeypatch):
    """Three attempts on a clock the test holds: the first dies after step 5 (the supervisor sees it 3 s later),
    the second after step 6 (nobody sees it), the third ends cleanly, and a fourth start after that is no failure.
    Each failure's moments are the ones the test set; its high water comes from progress.json (goodput.json was
    last written at the checkpoint of step 3); the totals are the sums of the list."""
    from hlat.files import record_seen
    from hlat.train.goodput import Goodput

    clock = [1000.0]
    monkeypatch.setattr("time.time", lambda: clock[0])

    def attempt(resume_step: int, steps: range) -> Goodput:
        g = Goodput(tmp_path, True, clock[0], "run")
        g.resumed(resume_step)
        clock[0] += 3
        g.start_up_done()
        for step in steps:
            clock[0] += 1
            g.step(step, 1.0, 0.0, bad=False)
            if step == 3:
                g.saving(3)
                g.committed(3)
        return g

    attempt(0, range(1, 6))  # killed after step 5, at 1008
    clock[0] += 3
    record_seen(tmp_path, "supervisor", "killed by SIGKILL")  # at 1011
    clock[0] += 2
    attempt(3, range(4, 7))  # starts at 1013; killed after step 6, at 1019
    clock[0] += 6
    attempt(3, range(4, 9)).finished()  # starts at 1025
    clock[0] += 100
    Goodput(tmp_path, True, clock[0], "run")
    account = json.loads((tmp_path / "goodput.json").read_text())
    first, second = account["failures"]
    assert first == {
        "after_step": 5,
        "progress_at": 1008.0,
        "seen_at": 1011.0,
        "seen_by": "supervisor: killed by SIGKILL",
        "restart_at": 1013.0,
        "detection_s": 3.0,
        "restart_s": 2.0,
        "downtime_s": 5.0,
        "load_s": 3.0,
        "resumed_step": 3,
        "high_water_step": 5,
        "recomputed_steps": 2,
        "recomputed_s": 2.0,
    }
    assert second == {
        "after_step": 6,
        "progress_at": 1019.0,
        "seen_at": None,
        "seen_by": None,
        "restart_at": 1025.0,
        "detection_s": None,
        "restart_s": None,
        "downtime_s": 6.0,
        "load_s": 3.0,
        "resumed_step": 3,
        "high_water_step": 6,
        "recomputed_steps": 3,
        "recomputed_s": 3.0,
    }
    assert account["failure_totals"] == {
        "failures": 2,
        "not_observed": 1,
        "detection_s": 3.0,
        "restart_s": 2.0,
        "downtime_s": 11.0,
        "load_s": 6.0,
        "recomputed_steps": 5,
        "recomputed_s": 5.0,
    }
    assert account["starts"] == 4 and account["recomputed_s"] == 5.0


def test_an_account_is_its_runs_and_a_refused_start_takes_its_own_back(tmp_path, monkeypatch):
    """A start of another run (a fresh start, a new token) after an attempt that never ended (a run given up, killed)
    begins an account of its own: no failure, its ETTR from its own start. A start refused before its first step (an
    HlatError) leaves goodput.json byte for byte as it found it, so that the next start sees no failure in it; one
    refused after a step is a failure like any other."""
    from hlat import HlatError
    from hlat.train.goodput import Goodput

    clock = [1000.0]
    monkeypatch.setattr("time.time", lambda: clock[0])
    abandoned = Goodput(tmp_path, True, clock[0], "given up")
    abandoned.step(1, 1.0, 0.0, bad=False)  # killed after a step, never resumed
    clock[0] += 50
    fresh = Goodput(tmp_path, True, clock[0], "fresh")
    assert fresh.failures == [] and fresh["starts"] == 1 and fresh["first_start"] == clock[0]
    fresh.step(1, 1.0, 0.0, bad=False)
    fresh.saving(1)
    fresh.committed(1)
    fresh.finished()
    written = (tmp_path / "goodput.json").read_bytes()
    clock[0] += 10
    refused = Goodput(tmp_path, True, clock[0], "fresh")  # a resume with a mistyped tokenizer path, say
    assert refused.refused(HlatError("data.tokenizer: no such file")) and not refused.refused(RuntimeError("lost"))
    refused.take_back_if_refused(HlatError, HlatError("data.tokenizer: no such file"), None)
    assert (tmp_path / "goodput.json").read_bytes() == written
    clock[0] += 10
    resumed = Goodput(tmp_path, True, clock[0], "fresh")
    assert resumed.failures == [] and resumed["starts"] == 2
    resumed.step(2, 1.0, 0.0, bad=False)
    assert not resumed.refused(HlatError("step 2: a full disk"))  # after a step: the run's own failure


def test_a_refused_start_leaves_nothing_that_the_next_fresh_start_counts(tmp_path, capsys):
    """A start refused before its first step (a mistyped tokenizer path) leaves no account behind, and the fresh start
    that follows in the same run directory reports no failure, its ETTR from its own time."""
    from hlat.cli import main

    cfg = config(tmp_path / "run", steps=2)
    good = tmp_path / "good.toml"
    good.write_text(cfg.to_toml())
    cfg.data.tokenizer = str(tmp_path / "no-such-tokenizer.json")
    mistyped = tmp_path / "mistyped.toml"
    mistyped.write_text(cfg.to_toml())
    assert main(["train", "--config", str(mistyped)]) == 2
    assert "no-such-tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "run" / "goodput.json").exists() and not (tmp_path / "run" / "failures").exists()
    started = time.time()
    assert main(["train", "--config", str(good)]) == 0
    account = json.loads((tmp_path / "run" / "goodput.json").read_text())
    assert account["failures"] == [] and account["starts"] == 1 and account["first_start"] >= started
    assert "failures" in capsys.readouterr().out and account["ettr"] > 0
