"""The durable tier's checkpoints (hlat/checkpoint/durable.py, docs/fault-tolerance.md): committed whole or not at all
(a `.partial` directory is ignored, and a fresh start never overwrites checkpoints), checked against their manifest
by every reader, a damaged one refused when named and passed over for the previous one at a resume or a rollback,
and a refused or failed write leaving the previous checkpoint intact."""

import contextlib
import errno
import io
import json
import os
import shutil
from pathlib import Path

import pytest
from test_disk import needs_dev_full, one_line, only_step_2_intact, two_step_run
from test_faults import strict_records, write_config
from test_train import config, train
from torch.distributed.checkpoint.api import CheckpointException

from hlat.checkpoint import durable as ckpt
from hlat.checkpoint.durable import verify_checkpoint
from hlat.cli import main
from hlat.paths import complete_checkpoints
from hlat.train import trainer


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    run = tmp_path_factory.mktemp("good") / "run"
    cfg = config(run, steps=4, ckpt_every=2, keep_checkpoints=0)
    cfg.data.workers = 0
    train(cfg)
    return run


def flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def edit_step(path: Path) -> None:  # the trainer state is JSON inside the data file
    data = path.read_bytes()
    assert b'"step": 4' in data
    path.write_bytes(data.replace(b'"step": 4', b'"step": 5'))


DAMAGE = {
    "flipped byte": lambda c: flip_byte(c / "__0_0.distcp"),
    "truncated file": lambda c: (c / "__0_0.distcp").write_bytes((c / "__0_0.distcp").read_bytes()[:1000]),
    "emptied file": lambda c: (c / "__0_0.distcp").write_bytes(b""),
    "deleted file": lambda c: (c / "__0_0.distcp").unlink(),
    "damaged metadata": lambda c: flip_byte(c / ".metadata", 100),
    "missing metadata": lambda c: (c / ".metadata").unlink(),
    "edited trainer state": lambda c: edit_step(c / "__0_0.distcp"),
    "missing manifest": lambda c: (c / "manifest.json").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_falls_back_or_is_refused(damage, two_checkpoints, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    newest = run / "checkpoints" / "step_00000004"
    DAMAGE[damage](newest)
    with pytest.raises(ckpt.DamagedCheckpoint, match="step_00000004"):
        verify_checkpoint(newest)
    cfg = config(run, steps=5)
    cfg.data.workers = 0
    cfg_file = write_config(tmp_path / "c.toml", cfg)

    assert main(["train", "--config", str(cfg_file), "--resume", str(newest)]) == 2  # named explicitly: refused
    err = capsys.readouterr().err.strip()
    assert "step_00000004" in err and "refusing" in err and "\n" not in err

    assert main(["train", "--config", str(cfg_file), "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "damaged checkpoint" in line]
    assert len(warnings) == 1 and "step_00000004" in warnings[0] and "falling back" in warnings[0]
    assert "resumed from" in out and "step_00000002 at step 2" in out
    assert [r["step"] for r in strict_records(run)] == [1, 2, 3, 4, 5]
    assert [s for s, _ in complete_checkpoints(run)] == [2, 5]  # rotation (keep 2) counts only good ones
    assert (run / "checkpoints" / "step_00000004.damaged").is_dir()  # set aside for inspection
    verify_checkpoint(run / "checkpoints" / "step_00000005")


def test_every_reader_of_a_checkpoint_refuses_a_flipped_byte(two_checkpoints, tmp_path, capsys):
    """export-hf, eval, generate and train.init_from check the manifest before loading; `hlat checkpoint verify`
    reports each checkpoint of a run."""
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    good, damaged = (run / "checkpoints" / f"step_0000000{s}" for s in (2, 4))
    flip_byte(damaged / "__0_0.distcp")
    problem = "damaged checkpoint: __0_0.distcp does not match its checksum"
    fine_tune = config(tmp_path / "fine", steps=1, init_from=str(damaged))
    fine_tune.data.workers = 0
    for argv in (
        ["export-hf", str(run), "--out", str(tmp_path / "hf")],
        ["eval", str(run), "--data", json.__file__],
        ["generate", str(damaged), "--prompt", "def"],
        ["train", "--config", str(write_config(tmp_path / "fine.toml", fine_tune))],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err == f"hlat: error: {damaged}: {problem}", argv
    assert not (tmp_path / "hf").exists() and not (tmp_path / "fine" / "metrics.jsonl").exists()
    # over several checkpoints, eval refuses the damaged one and still evaluates the others
    assert main(["eval", str(run), "--all", "--data", json.__file__, "--max-batches", "1", "--json"]) == 2
    out, err = capsys.readouterr()
    assert [json.loads(line)["checkpoint"] for line in out.splitlines()] == [str(good)]
    assert err.splitlines() == [
        f"hlat: error: {damaged}: {problem}",
        "hlat eval: 1 of 2 checkpoints damaged, not evaluated",
    ]

    assert main(["checkpoint", "verify", str(run)]) == 1
    assert capsys.readouterr().out.splitlines() == [f"ok       {good}", f"DAMAGED  {damaged}: {problem}"]
    assert main(["checkpoint", "verify", str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"checkpoint": str(good), "step": 2, "ok": True, "problem": None}
    assert main(["checkpoint", "verify", str(tmp_path / "hf")]) == 2  # holds no checkpoint


def test_a_rollback_passes_over_a_checkpoint_damaged_since_it_was_written(tmp_path, capsys, monkeypatch):
    """Step 4's checkpoint gets a flipped byte before bad step 5 rolls back: it would load without an error, so
    the rollback verifies, sets it aside and goes back to step 2."""
    real_action = trainer.bad_step_action

    def damage_then_decide(train_cfg, bad, reason, step, last):
        flip_byte(last / "__0_0.distcp")
        return real_action(train_cfg, bad, reason, step, last)

    monkeypatch.setattr(trainer, "bad_step_action", damage_then_decide)
    run = tmp_path / "run"
    cfg = config(run, steps=6, ckpt_every=2, keep_checkpoints=0, debug_nan_step=5, on_bad_step="rollback")
    cfg.data.workers = 0
    train(cfg)
    damaged = run / "checkpoints" / "step_00000004"
    out = capsys.readouterr().out
    assert (
        (
            f"{damaged}: damaged checkpoint: __0_0.distcp does not match its checksum; falling back to the previous "
            "checkpoint"
        )
        in out
        and "rolled back to" in out
        and "step_00000002 (step 2)" in out
    )
    assert [r["step"] for r in strict_records(run)] == [1, 2, 3, 4, 5, 6]  # 3 to 6 run again after step 5
    assert damaged.with_name("step_00000004.damaged").is_dir()  # kept for inspection; step 4 saved afresh
    for _, path in complete_checkpoints(run):
        verify_checkpoint(path)
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4, 6]


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    real_save, calls = ckpt.dcp.save, []

    def save(state, checkpoint_id, **kwargs):  # the second checkpoint fails as DCP reports a full disk
        if ".partial" in str(checkpoint_id):  # a checkpoint, not a snapshot of the memory tier
            calls.append(checkpoint_id)
        if len(calls) == 2 and ".partial" in str(checkpoint_id):
            failure = OSError(errno.ENOSPC, "No space left on device", str(Path(checkpoint_id) / "__0_0.distcp"))
            raise CheckpointException("write", {0: (failure, None)})
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(ckpt.dcp, "save", save)
    cfg = config(tmp_path / "run", steps=4, ckpt_every=2)
    cfg.data.workers = 0
    assert main(["train", "--config", str(write_config(tmp_path / "c.toml", cfg))]) == 2
    err = capsys.readouterr().err.strip()
    assert "No space left on device" in err and "step_00000004.partial" in err and "\n" not in err
    assert "step_00000002 is intact" in err
    ((step, path),) = complete_checkpoints(tmp_path / "run")
    verify_checkpoint(path)
    assert step == 2 and not list((tmp_path / "run" / "checkpoints").glob("*.partial"))


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("code", [errno.EDQUOT, errno.EIO])
def test_a_refused_checkpoint_write_is_one_line_and_another_keeps_its_traceback(
    code, asynchronous, tmp_path, capsys, monkeypatch
):
    """Step 4's write fails with `code`: refused (a spent quota), the run ends in one line with exit code 2, not
    retried; an I/O error that may pass raises (traceback, exit code 1: restarts retry it). Either way the partial
    checkpoint is removed and step 2's is intact."""
    failure = OSError(code, os.strerror(code), "__0_0.distcp")
    real_save = ckpt.dcp.save

    def save(state, checkpoint_id, **kwargs):  # asynchronous: it fails in the background, as DCP reports it
        if "step_00000004" in str(checkpoint_id):
            raise CheckpointException("write", {0: (failure, None)})
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(ckpt.dcp, "save", save)
    cfg = config(tmp_path / "run", steps=4, ckpt_every=2, async_checkpoint=asynchronous)
    cfg.data.workers = 0
    argv = ["train", "--config", str(write_config(tmp_path / "c.toml", cfg))]
    if code == errno.EIO:
        # the synchronous write raises DCP's own error; the background one, its reason carried to the commit
        with pytest.raises(ckpt.RankWriteFailed if asynchronous else CheckpointException, match="Input/output error"):
            main(argv)
    else:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"hlat: error: cannot write checkpoint {tmp_path}/run/checkpoints/step_00000004.partial: "
            f"{os.strerror(code)} (__0_0.distcp); the previous checkpoint "
            f"{tmp_path}/run/checkpoints/step_00000002 is intact"
        )
    ((step, path),) = complete_checkpoints(tmp_path / "run")
    verify_checkpoint(path)
    assert step == 2 and not list((tmp_path / "run" / "checkpoints").glob("*.partial"))


def test_partial_checkpoint_is_ignored(tmp_path):
    run = tmp_path / "run"
    train(config(run, steps=2))
    (run / "checkpoints" / "step_00000005.partial").mkdir()  # as a crash mid-save would leave it
    train(config(run, steps=4, resume="auto"))
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4]
    assert not list((run / "checkpoints").glob("*.partial"))


def test_fresh_start_never_overwrites_checkpoints(tmp_path, capsys):
    train(config(tmp_path / "run", steps=1))
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(config(tmp_path / "run").to_toml())
    assert main(["train", "--config", str(cfg_file)]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


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


@needs_dev_full
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
