"""The memory tier (train.snapshot_every): a killed run resumes from node-local memory, exactly, recomputing at
most one snapshot interval; a damaged snapshot is refused for the next good copy; the tier's memory is freed when
a run ends; the default cadence keeps a snapshot's cost under the goal. A lost node's state found on its buddy,
across hosts: tests/test_hosts.py."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_train import config, final_weights, losses

from hlat.checkpoint.memory import (
    AUTO,
    STALL_SHARE,
    MemoryTier,
    Node,
    files_to_read,
    snapshot_root,
    snapshot_steps,
    step_dir,
)
from hlat.cli import main
from hlat.config.job import load_config
from hlat.paths import complete_checkpoints
from hlat.train.loop import train

# Runs hlat train (argv[2:]) and SIGKILLs this process right after the memory tier committed its snapshot of step
# argv[1]: the run dies with that snapshot complete in memory, and the next one perhaps being written.
KILL_AFTER_SNAPSHOT = """
import os, signal, sys
import hlat.checkpoint.memory as memory
from hlat.cli import main
commit = memory.MemoryTier.commit
def commit_then_die(self, failed):
    step = self.in_flight.step if self.in_flight else None
    failure = commit(self, failed)
    if step == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    return failure
memory.MemoryTier.commit = commit_then_die
if __name__ == "__main__":  # not in the data workers, which start by importing this file
    sys.exit(main(["train", *sys.argv[2:]]))
"""


def write_config(path: Path, cfg) -> Path:
    path.write_text(cfg.to_toml())
    return path


def killed_after_snapshot(tmp_path: Path, cfg_file: Path, step: int, *extra: str) -> str:
    script = tmp_path / "kill_after_snapshot.py"
    script.write_text(KILL_AFTER_SNAPSHOT)
    done = subprocess.run(
        [sys.executable, str(script), str(step), "--config", str(cfg_file), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == -signal.SIGKILL, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_dcp_names_the_file_of_each_chunk_it_reads(tmp_path):
    """`files_to_read` relies on DCP's metadata naming each chunk's file (no public API returns it): if torch
    changes that, this fails here, not in a restore."""
    dcp.save({"a": torch.ones(4), "b": torch.zeros(2)}, checkpoint_id=tmp_path)
    assert files_to_read(tmp_path, {"a": torch.empty(4)}) == {"__0_0.distcp"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    cfg = config(root / "run", steps=6, snapshot_every=0)  # the reference runs without the tier it checks
    train(cfg)
    return root / "run", cfg


@pytest.mark.parametrize("damaged", [False, True])
def test_a_killed_run_resumes_from_memory_exactly_or_from_disk_when_the_snapshot_is_damaged(
    damaged, uninterrupted, tmp_path, capsys
):
    """Snapshots every step, durable checkpoints every 2. Killed once the snapshot of step 2 is committed (step 3
    computed, not yet counted): the run resumes from memory at step 2 (a tie with the durable checkpoint: memory
    loads faster), recomputing one step (the interval), and ends bit-exact with the uninterrupted run. With a byte
    of that snapshot flipped, it is refused and the run resumes from the durable checkpoint of step 2, still exact.
    The finished run leaves no snapshot behind."""
    snapshots = tmp_path / "shm"
    cfg = config(tmp_path / "run", steps=6, ckpt_every=2, snapshot_every=1, snapshot_dir=str(snapshots))
    cfg_file = write_config(tmp_path / "job.toml", cfg)
    killed_after_snapshot(tmp_path, cfg_file, 2)
    root = snapshot_root(snapshots, tmp_path / "run")
    assert snapshot_steps(root) == [2] and [s for s, _ in complete_checkpoints(tmp_path / "run")] == [2]
    if damaged:
        data = step_dir(root, 2) / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    capsys.readouterr()
    train(load_config(cfg_file, ["--train.resume", "auto"]))
    out = capsys.readouterr().out
    expected = "checkpoints/step_00000002 at step 2" if damaged else "memory tier's snapshot"
    expected += "" if damaged else f" {step_dir(root, 2)} at step 2"
    assert expected in " ".join(out.split()), out
    assert losses(tmp_path / "run") == losses(uninterrupted[0])
    a, b = final_weights(uninterrupted[0], uninterrupted[1]), final_weights(tmp_path / "run", cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not root.exists()


def test_a_fresh_start_clears_the_memory_of_a_run_directory_it_reuses(tmp_path):
    snapshots = tmp_path / "shm"
    cfg = config(tmp_path / "run", steps=4, snapshot_every=1, snapshot_dir=str(snapshots))
    cfg_file = write_config(tmp_path / "job.toml", cfg)
    killed_after_snapshot(tmp_path, cfg_file, 2)
    root = snapshot_root(snapshots, tmp_path / "run")
    assert snapshot_steps(root)
    train(load_config(cfg_file))  # no checkpoint on disk: a fresh start, which must not pick up step 2
    assert len(losses(tmp_path / "run")) == 4 and not root.exists()


def test_a_snapshot_dir_that_cannot_be_written_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    cfg = config(tmp_path / "run", steps=2, snapshot_every=1, snapshot_dir=str(tmp_path / "a_file"))
    assert main(["train", "--config", str(write_config(tmp_path / "job.toml", cfg))]) == 2
    err = capsys.readouterr().err
    assert "hlat: error: train.snapshot_dir: cannot write" in err and "Traceback" not in err, err


def test_the_default_cadence_measures_a_snapshots_cost_and_keeps_it_under_the_goal(tmp_path):
    """train.snapshot_every = -1: the first snapshot is of the process's second step (after a steady one); its cost,
    measured once committed, is the copy the step waited for, the time the steps run while it was written took over
    the steady steps' median, and the wait after them; then a snapshot every K steps, the fewest that keep that cost
    under STALL_SHARE of their time, tuned again after the 2nd, 4th, 8th, ... measured snapshot."""
    tier = MemoryTier(tmp_path, AUTO, "token", 0, Node(0, 0, 1, 1), None, "", torch.device("cpu"))
    due = []
    for step, step_s in enumerate((3.0, 1.0), 1):  # the first step, slow with its warm-up, is no steady one
        tier.stepped(step_s)
        due.append(tier.due(step))
    assert due == [False, True] and list(tier.steady) == [1.0]
    tier.save(2, {"w": torch.zeros(4)}, time.perf_counter())
    flight = tier.in_flight
    tier.stepped(1.3)  # run while the snapshot was written: 0.3 s slower than the steady step
    assert not tier.due(3)
    assert tier.settle() is None and tier.tune_due()
    every, cost, step_s = tier.tune()
    assert step_s == 1.0 and cost == pytest.approx(flight.stall_s + 0.3 + flight.settled_s) and flight.stall_s > 0
    assert cost / every <= STALL_SHARE * step_s < cost / max(every - 1, 1e-9)  # the fewest
    assert [step for step in range(3, 4 * every) if tier.due(step)] == [every, 2 * every, 3 * every]
    retuned = []
    for measured in (2, 3, 4):  # tuned again after the 2nd and 4th measured snapshots, not the 3rd
        tier.save(measured * every, {"w": torch.zeros(4)}, time.perf_counter())
        tier.stepped(1.3)
        assert tier.settle() is None
        retuned.append(tier.tune_due())
        if retuned[-1]:
            tier.tune()
    assert retuned == [True, False, True]
