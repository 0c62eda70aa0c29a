"""Full disks and unwritable run directories (docs/fault-tolerance.md, "Failed writes"): wherever a write is refused,
the run ends in one line naming the path and the cause, with exit code 2 (not retried by --max-restarts), and the
previous checkpoint stays intact. A checkpoint's own refused writes: tests/test_checkpoint_durable.py; the room its
checkpoints need: tests/test_checkpoint_room.py.

A full disk is the kernel's own ENOSPC: the file being written is swapped for a link to /dev/full, whose writes
always fail with it (a small tmpfs is not available to tests)."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_faults import write_config
from test_train import config

from hlat import files
from hlat.checkpoint.durable import verify_checkpoint
from hlat.cli import main
from hlat.paths import complete_checkpoints
from hlat.train.metrics import MetricsLog

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
pytestmark = needs_dev_full


def fill(path: Path) -> None:
    """From now on, writing `path` fails as on a full disk."""
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/full")


def two_step_run(tmp_path: Path, steps: int = 4, **fields) -> Path:
    """A run to step 2 (checkpointed), and the config of its continuation to `steps`."""
    cfg = config(tmp_path / "run", steps=2, ckpt_every=2, **fields)
    cfg.data.workers = 0
    assert main(["train", "--config", str(write_config(tmp_path / "first.toml", cfg))]) == 0
    cfg.train.steps, cfg.train.resume = steps, "auto"
    return write_config(tmp_path / "c.toml", cfg)


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("hlat: error: ") and "\n" not in err, err
    return err


def only_step_2_intact(run: Path) -> None:
    ((step, path),) = complete_checkpoints(run)
    verify_checkpoint(path)
    assert step == 2 and not list((run / "checkpoints").glob("*.partial"))


def fill_at_step_4(target: str):
    """A MetricsLog.write that fills the disk under `target` just before step 4's record (the resumed run's
    TensorBoard writer, which opened its own events file at step 3, included)."""
    real = MetricsLog.write

    def write(self, record):
        if record["step"] == 4:
            if target == "TensorBoard events":
                for events in self.run_dir.glob("events.out.tfevents.*"):
                    fill(events)
            elif target == "goodput.json":
                fill(self.run_dir / "goodput.json.tmp")  # written there, then renamed
            else:
                fill(self.run_dir / target)
        return real(self, record)

    return write


@pytest.mark.parametrize("target", ["metrics.jsonl", "goodput.json", "TensorBoard events"])
def test_full_disk_between_checkpoints_is_one_line_and_exit_2(target, tmp_path, capsys, monkeypatch):
    """Full between checkpoints: a metrics record, goodput.json, or TensorBoard's own writer thread (which fails in
    the background and surfaces at the next flush) ends the run in one line, exit code 2."""
    cfg_file = two_step_run(tmp_path)
    monkeypatch.setattr(MetricsLog, "write", fill_at_step_4(target))
    assert main(["train", "--config", str(cfg_file)]) == 2
    err = one_line(capsys)
    path = str(tmp_path / "run") + ("" if target == "TensorBoard events" else f"/{target}")
    assert (
        f"cannot write {'TensorBoard events in ' if target == 'TensorBoard events' else ''}{path}: "
        f"No space left on device; the previous checkpoint {tmp_path / 'run'}/checkpoints/step_00000002 is "
        "intact" in err
    )
    only_step_2_intact(tmp_path / "run")


SUPERVISED = """
import sys
from hlat.cli import main
import hlat.jobs.supervise as supervise
child = sys.argv[1]  # the trainer's script, in place of `python -m hlat train`
supervise.child_command = lambda train_args, nproc: [sys.executable, "-c", child, *train_args]
sys.exit(main(["train", *sys.argv[2:]]))
"""

GOODPUT_FILLS_AT_STEP_3 = """
import sys
from pathlib import Path
from hlat.cli import main
from hlat.train.goodput import Goodput
real = Goodput.step
def step(self, number, *args, **kwargs):
    if number == 3:  # goodput.json is written through goodput.json.tmp: now on a full disk
        Path(self.run_dir, "goodput.json.tmp").symlink_to("/dev/full")
    return real(self, number, *args, **kwargs)
Goodput.step = step
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_a_full_disk_is_not_retried_by_the_supervisor(tmp_path):
    cfg_file = two_step_run(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", SUPERVISED, GOODPUT_FILLS_AT_STEP_3, "--config", str(cfg_file), "--max-restarts", "3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("hlat: error:")]
    assert errors == [
        f"hlat: error: cannot write {tmp_path}/run/goodput.json: No space left on device; the previous "
        f"checkpoint {tmp_path}/run/checkpoints/step_00000002 is intact"
    ]
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "restarts.jsonl").exists()
    only_step_2_intact(tmp_path / "run")


def test_refused_writes_are_found_wherever_they_surface():
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    except RuntimeError as e:
        assert files.refused_write(e) is full  # the context
    from torch.distributed.checkpoint.api import CheckpointException

    wrapped = CheckpointException("write", {3: (RuntimeError("x"), None)})
    wrapped.failures[3][0].__cause__ = PermissionError(errno.EACCES, "Permission denied")
    assert files.refused_write(wrapped).errno == errno.EACCES  # a rank's failure, by cause
    assert files.refused_write(Exception("No space left on device (os error 28)")).errno == errno.ENOSPC  # tokenizers
    assert files.refused_write(OSError(errno.EIO, "Input/output error")) is None  # may be transient: retried
