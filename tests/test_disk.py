"""Full disks and unwritable run directories (docs/fault-tolerance.md, "Failed writes"): wherever a write is refused,
the run ends in one line naming the path and the cause, with exit code 2 (not retried by --max-restarts), and the
previous checkpoint stays intact; and a run whose checkpoints cannot fit is refused before its first step.

A full disk is the kernel's own ENOSPC: the file being written is swapped for a link to /dev/full, whose writes
always fail with it (a small tmpfs is not available to tests)."""

import contextlib
import errno
import io
import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from test_faults import write_config
from test_train import config

from hlat import files
from hlat.checkpoint.durable import verify_checkpoint
from hlat.cli import main
from hlat.paths import complete_checkpoints
from hlat.train.metrics import MetricsLog

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


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


class NearlyFullFile(io.FileIO):
    """A file on a disk with 512 KB left: the small entries DCP writes first fit, the tensors that torch.save writes
    after them meet the kernel's own ENOSPC (/dev/full's)."""

    room = 512 * 1024

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            with open("/dev/full", "wb", buffering=0) as full:
                return full.write(data)
        self.room -= size
        return super().write(data)


@contextlib.contextmanager
def nearly_full_stream(self, path, mode):  # FileSystem.create_stream: the step-4 checkpoint's files fill the disk
    with NearlyFullFile(path, mode) if "step_00000004" in str(path) else open(path, mode) as stream:
        yield stream


def test_full_disk_in_torch_save_names_the_disk_not_the_zip_writer(tmp_path, capsys, monkeypatch):
    """DCP writes each tensor with torch.save, which reports a full disk as `RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos`, the ENOSPC only in its context: the line still says what happened."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    cfg_file = two_step_run(tmp_path)
    monkeypatch.setattr(FileSystem, "create_stream", nearly_full_stream)
    assert main(["train", "--config", str(cfg_file)]) == 2
    err = one_line(capsys)
    assert (
        f"cannot write checkpoint {tmp_path}/run/checkpoints/step_00000004.partial: No space left on device; "
        f"the previous checkpoint {tmp_path}/run/checkpoints/step_00000002 is intact" in err
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


Usage = namedtuple("Usage", "total used free")


def test_a_run_whose_checkpoints_cannot_fit_is_refused_before_its_first_step(tmp_path, capsys, monkeypatch):
    """The free-space check, on resume, against the size of the checkpoint resumed from (its manifest) times the
    rotation: keep_checkpoints = 2 with one already there needs room for 2 more."""
    cfg_file = two_step_run(tmp_path)
    checkpoint = complete_checkpoints(tmp_path / "run")[0][1]
    size = sum(size for size, _ in json.loads((checkpoint / "manifest.json").read_text()).values())
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 2 * size + 1, 2 * size - 1))
    assert main(["train", "--config", str(cfg_file)]) == 2
    err = one_line(capsys)
    assert (
        f"not enough free space for the checkpoints of {tmp_path}/run: {files.size_text(2 * size - 1)} free, 2 x "
        f"{files.size_text(size)} needed (train.keep_checkpoints = 2, and the one being written)" in err
    )
    only_step_2_intact(tmp_path / "run")
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # nothing ran

    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: Usage(10**12, 0, 2 * size))
    assert main(["train", "--config", str(cfg_file)]) == 0


def test_a_fresh_run_is_checked_against_its_weights_and_optimizer_states(tmp_path, capsys, monkeypatch):
    """Before any checkpoint exists: parameters x (weight + optimizer bytes) of the precision mode (fp32: 4 + 8);
    the first checkpoint written is that size within its files' headers and small entries (about 20 KB per
    parameter tensor: a few percent of this 1.4M-parameter model, nothing of a large one). A file system that
    reports no size at all (some FUSE mounts: 0 of 0) is not checked."""
    cfg = config(tmp_path / "run", steps=2, ckpt_every=2)
    cfg.model.dim, cfg.model.ffn_dim = 256, 512
    cfg.data.workers = 0
    cfg_file = write_config(tmp_path / "c.toml", cfg)
    estimate = cfg.model.num_params() * 12
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: Usage(10**12, 10**12, 1000))
    assert main(["train", "--config", str(cfg_file)]) == 2
    assert f"{files.size_text(1000)} free, 3 x {files.size_text(estimate)} needed" in one_line(capsys)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: Usage(0, 0, 0))
    assert main(["train", "--config", str(cfg_file)]) == 0
    written = sum(
        size
        for size, _ in json.loads((complete_checkpoints(tmp_path / "run")[0][1] / "manifest.json").read_text()).values()
    )
    assert estimate <= written < 1.1 * estimate


def test_keeping_every_checkpoint_warns_when_they_will_outgrow_the_disk(tmp_path, capsys, monkeypatch):
    cfg = config(tmp_path / "run", steps=8, ckpt_every=2, keep_checkpoints=0)
    cfg.data.workers = 0
    estimate = cfg.model.num_params() * 12
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: Usage(10**12, 0, int(2.5 * estimate)))
    assert main(["train", "--config", str(write_config(tmp_path / "c.toml", cfg))]) == 0
    assert (
        f"has room for 2 of the 4 checkpoints of {files.size_text(estimate)} this run will keep"
        in capsys.readouterr().out
    )


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
