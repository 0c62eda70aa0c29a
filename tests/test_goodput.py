"""Goodput follows its own definition (hlat/train/goodput.py, docs/fault-tolerance.md): productive time is the step
time the final model contains, whatever failed on the way; every start counts, one killed during start-up too."""

import json
import os
import subprocess
import sys

import pytest
from test_disk import SUPERVISED
from test_faults import strict_records, write_config
from test_train import config

# The trainer of a supervised run, killed (SIGKILL, once each) at three places: two steps after the checkpoint of
# step 3; during the next start-up (its start already begun); and between the rename that completes the checkpoint
# of step 9 and anything after it.
KILLED_THREE_TIMES = """
import os, signal, sys
from pathlib import Path
from hlat.cli import main
from hlat.checkpoint.store import Checkpointer
from hlat.train.trainer import Trainer

def kill_once(name, now):
    mark = Path(os.environ["KILL_MARKS"], name)
    if now and not mark.exists():
        mark.touch()
        os.kill(os.getpid(), signal.SIGKILL)

def after_step(self, result, real=Trainer.after_step):
    real(self, result)
    kill_once("after step 5", self.step == 5)

def restore(self, resume_from, real=Trainer.restore):
    kill_once("during start-up", resume_from is not None)
    real(self, resume_from)

def rotate(self, newest, real=Checkpointer._rotate):
    kill_once("checkpoint 9 renamed", newest == 9)
    real(self, newest)

Trainer.after_step, Trainer.restore, Checkpointer._rotate = after_step, restore, rotate
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_ettr_of_a_run_killed_three_times_matches_its_own_step_times(tmp_path):
    """The reported ETTR is productive time over wall time; computed from metrics.jsonl, which holds a record of
    each step the final model contains (its time, less its data wait, from the run of it that made it in), over the
    same wall time, it must agree to the rounding of the records (well within 3%)."""
    cfg = config(tmp_path / "run", steps=12, decay_steps=12, ckpt_every=3)
    cfg.data.workers = 0
    (tmp_path / "marks").mkdir()
    done = subprocess.run([sys.executable, "-c", SUPERVISED, KILLED_THREE_TIMES, "--config",
                           str(write_config(tmp_path / "c.toml", cfg)), "--max-restarts", "3"],
                          env={**os.environ, "KILL_MARKS": str(tmp_path / "marks")},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert len(os.listdir(tmp_path / "marks")) == 3
    assert len((tmp_path / "run" / "restarts.jsonl").read_text().splitlines()) == 3
    goodput = json.loads((tmp_path / "run" / "goodput.json").read_text())
    assert goodput["starts"] == 4  # the one killed during start-up included
    records = strict_records(tmp_path / "run")
    steps = [r["step"] for r in records]
    assert steps == list(range(1, 13))  # one record per step of the final model (log_every = 1)
    step_time = sum(r["step_time_s"] * (step - before) - r["data_wait_s"]
                    for r, step, before in zip(records, steps, [0, *steps]))
    computed = step_time / goodput["wall_s"]
    print(f"ETTR reported {goodput['ettr']:.4f}, computed from metrics.jsonl {computed:.4f}; productive "
          f"{goodput['productive_s']:.3f} s against {step_time:.3f} s; lost {goodput['lost_s']:.3f} s, recomputed "
          f"{goodput['recomputed_s']:.3f} s")
    assert abs(goodput["ettr"] - computed) <= 0.03 * computed
    assert goodput["lost_s"] > 0 and goodput["recomputed_s"] > 0  # steps 4 and 5 were run again
