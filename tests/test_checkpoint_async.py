"""Asynchronous saves (train.async_checkpoint, hlat/checkpoint/background.py): committed like synchronous ones
(manifest verified, rotation applied) and resumed along the same trajectory, to the bit; a save killed while it is
still being written in the background is never loaded."""

import os
import signal
import subprocess
import sys
import time

from test_faults import strict_records, write_config
from test_train import config, train

from hlat.checkpoint.durable import verify_checkpoint
from hlat.paths import complete_checkpoints


def test_asynchronous_checkpoints_resume_like_synchronous_ones(tmp_path):
    """train.async_checkpoint: the checkpoints are committed (manifest verified, rotation applied) and a resume
    from them follows the same trajectory as synchronous saves, to the bit."""

    def run(name: str, **fields):
        cfg = config(tmp_path / name, keep_checkpoints=2, ckpt_every=2, **fields)
        cfg.data.workers = 0
        train(cfg)

    run("sync", steps=6)
    run("async", steps=3, async_checkpoint=True)
    run("async", steps=6, async_checkpoint=True, resume="auto")
    assert [s for s, _ in complete_checkpoints(tmp_path / "async")] == [4, 6]
    for _, path in complete_checkpoints(tmp_path / "async"):
        verify_checkpoint(path)
    assert [(r["loss"], r["grad_norm"]) for r in strict_records(tmp_path / "async")] == [
        (r["loss"], r["grad_norm"]) for r in strict_records(tmp_path / "sync")
    ]


HOLD_THE_STEP_4_WRITE = """
import sys, time
from pathlib import Path
import torch.distributed.checkpoint as dcp
from hlat.cli import main
save = dcp.save
def hold(state, checkpoint_id, **kwargs):  # in the write's thread, once every file and the .metadata are written
    metadata = save(state, checkpoint_id=checkpoint_id, **kwargs)
    if Path(checkpoint_id).name == "step_00000004.partial":
        Path(sys.argv[1]).touch()
        time.sleep(600)
    return metadata
dcp.save = hold
sys.exit(main(["train", "--config", sys.argv[2]]))
"""


def test_kill_9_during_an_asynchronous_write_resumes_from_the_previous_checkpoint(tmp_path):
    """kill -9 while a save is still being written in the background (held there, after DCP wrote its files and
    .metadata, before the write is done): that save stays a `.partial` directory that nothing loads, and the run
    resumes from the previous checkpoint along the uninterrupted run's trajectory."""

    def job(name: str, **fields):
        cfg = config(tmp_path / name, ckpt_every=2, keep_checkpoints=0, async_checkpoint=True, **fields)
        cfg.data.workers = 0
        return cfg

    train(job("reference"))
    held = tmp_path / "held"
    trainer = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_STEP_4_WRITE, str(held), str(write_config(tmp_path / "c.toml", job("run")))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 180
        while not held.exists() and trainer.poll() is None and time.time() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        out, _ = trainer.communicate(timeout=60)
    assert held.exists(), out
    partial = tmp_path / "run" / "checkpoints" / "step_00000004.partial"
    assert (partial / ".metadata").is_file()  # a complete DCP checkpoint, but never committed
    assert [s for s, _ in complete_checkpoints(tmp_path / "run")] == [2]
    train(job("run", resume="auto"))
    assert [(r["loss"], r["grad_norm"]) for r in strict_records(tmp_path / "run")] == [
        (r["loss"], r["grad_norm"]) for r in strict_records(tmp_path / "reference")
    ]
    assert [s for s, _ in complete_checkpoints(tmp_path / "run")] == [2, 4, 6, 8]
