"""Fault tolerance: damaged checkpoints fall back or are refused, bad steps never reach a checkpoint, failed
writes keep the previous checkpoint, and a hung rank is named (docs/fault-tolerance.md)."""

import concurrent.futures
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train import config, final_weights, train
from torch.distributed.checkpoint.api import CheckpointException

from hlat.checkpoint import store as ckpt
from hlat.checkpoint.store import verify_checkpoint
from hlat.cli import main
from hlat.paths import complete_checkpoints
from hlat.train import trainer


def strict_records(run_dir: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return [json.loads(line, parse_constant=refuse) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def write_config(path: Path, cfg) -> Path:
    path.write_text(cfg.to_toml())
    return path


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


def nan_config(run: Path, policy: str, **train_fields):
    cfg = config(run, steps=6, ckpt_every=2, keep_checkpoints=0, debug_nan_step=3, on_bad_step=policy, **train_fields)
    cfg.data.workers = 0
    return cfg


def test_nan_step_is_skipped_and_never_checkpointed(tmp_path):
    run = tmp_path / "run"
    cfg = nan_config(run, "skip")
    train(cfg)
    records = strict_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[2]["loss"] is None and records[2]["grad_norm"] is None  # written as null, not NaN
    assert all(r["loss"] is not None for r in records[3:]) and records[-1]["bad_steps"] == 1
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4, 6]  # 4 and 6 come after the bad step 3
    assert all(torch.isfinite(w).all() for w in final_weights(run, cfg).values())


def test_nan_step_rolls_back_past_the_bad_data(tmp_path, capsys):
    run = tmp_path / "run"
    train(nan_config(run, "rollback"))
    out = capsys.readouterr().out
    assert "rolled back to" in out and "step_00000002 (step 2)" in out
    records = strict_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # the bad step 3 was run again, on new data
    assert all(r["loss"] is not None for r in records)
    reference = tmp_path / "reference"
    cfg = config(reference, steps=6)
    cfg.data.workers = 0
    train(cfg)
    assert strict_records(reference)[2]["loss"] != records[2]["loss"]  # step 3 saw the next batches
    assert [r["loss"] for r in strict_records(reference)[:2]] == [r["loss"] for r in records[:2]]


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


def test_nan_step_stops_in_one_line(tmp_path, capsys):
    cfg_file = write_config(tmp_path / "c.toml", nan_config(tmp_path / "run", "stop"))
    assert main(["train", "--config", str(cfg_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert "step 3: loss is nan; stopped" in err and "step_00000002" in err and "\n" not in err
    assert [s for s, _ in complete_checkpoints(tmp_path / "run")] == [2]


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    real_save, calls = ckpt.dcp.save, []

    def save(state, checkpoint_id):  # the second save fails as DCP reports a full disk
        calls.append(checkpoint_id)
        if len(calls) == 2:
            failure = OSError(errno.ENOSPC, "No space left on device", str(Path(checkpoint_id) / "__0_0.distcp"))
            raise CheckpointException("write", {0: (failure, None)})
        return real_save(state, checkpoint_id=checkpoint_id)

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
    real_save, real_async_save = ckpt.dcp.save, ckpt.dcp.async_save

    def save(state, checkpoint_id, **kwargs):
        if "step_00000004" in str(checkpoint_id):
            raise CheckpointException("write", {0: (failure, None)})
        return real_save(state, checkpoint_id=checkpoint_id)

    def async_save(state, checkpoint_id, **kwargs):  # the write fails in the background, as DCP reports it
        if "step_00000004" not in str(checkpoint_id):
            return real_async_save(state, checkpoint_id=checkpoint_id, **kwargs)
        future = concurrent.futures.Future()
        future.set_exception(CheckpointException("write", {0: (failure, None)}))
        return future

    monkeypatch.setattr(ckpt.dcp, "save", save)
    monkeypatch.setattr(ckpt.dcp, "async_save", async_save)
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


def test_unwritable_run_dir_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    cfg = config(tmp_path / "file" / "run", steps=1)
    assert main(["train", "--config", str(write_config(tmp_path / "c.toml", cfg))]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.run_dir: cannot write" in err and str(tmp_path / "file") in err and "\n" not in err


def stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (Linux): state, ppid, pgrp, session..."""
    return stat_of(Path(f"/proc/{pid}"))


def alive(pid: int) -> bool:
    """Until every thread has exited: a killed process's main thread can be a zombie while its other threads still
    hold its open files (a run directory's lock among them)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    return any((fields := stat_of(task)) is not None and fields[0] != "Z" for task in tasks)


def stat_of(proc: Path) -> list[str] | None:
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def session_processes(sid: int) -> list[int]:
    return [
        pid
        for pid in (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())
        if (fields := stat(pid)) is not None and fields[0] != "Z" and fields[3] == str(sid)
    ]


def children(pid: int) -> list[int]:
    """The process's children; none once it has ended (it may end while we look)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def trained_state(run_dir: Path, cfg) -> tuple[dict, dict]:
    """Model and optimizer state of the run's newest checkpoint."""
    from hlat.checkpoint.state import TrainState
    from hlat.models import build_model, materialize
    from hlat.optim import build_optimizer

    model = materialize(build_model(cfg.model), "cpu")
    optimizer = build_optimizer(model, cfg.optim)
    TrainState([model], [optimizer], None).load(complete_checkpoints(run_dir)[-1][1], data_and_rng=False)
    return model.state_dict(), optimizer.state_dict()["state"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_supervisor_restarts_after_kill_9_bit_exact_and_leaves_nothing_behind(nproc, tmp_path, warm_torchrun):
    """kill -9 of the trainer, or of one rank of a 2-rank torchrun job (and so of nothing else): the supervisor
    starts the job again with --resume auto; the steps after the last checkpoint are run again to the same
    losses, gradient norms and final state as an uninterrupted run, and no tokenizer worker or resource tracker
    of the killed processes outlives them. The supervisor itself loads no torch (it stays small beside the job)."""

    def job_config(name: str):
        cfg = config(tmp_path / name, steps=10, decay_steps=10, ckpt_every=3)
        cfg.data.workers = 1
        return cfg

    def run_reference() -> None:
        """The uninterrupted run in the same layout: in this process, or on the session's torchrun launch."""
        if nproc == 1:
            train(job_config("reference"))
            return
        done = warm_torchrun.run(
            2, ["train", "--config", str(write_config(tmp_path / "reference.toml", job_config("reference")))]
        )
        assert done.returncode == 0, done.stdout[-3000:]

    with open(tmp_path / "run.log", "w") as log:
        supervisor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hlat",
                "train",
                "--config",
                str(write_config(tmp_path / "run.toml", job_config("run"))),
                "--max-restarts",
                "2",
                "--nproc-per-node",
                str(nproc),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.time() + 120
        while (not metrics.exists() or len(metrics.read_text().splitlines()) < 4) and time.time() < deadline:
            time.sleep(0.05)
        (child,) = children(supervisor.pid)
        assert "libtorch" not in Path(f"/proc/{supervisor.pid}/maps").read_text()  # it only starts processes
        victim = children(child)[-1] if nproc > 1 else child  # a torchrun worker, or the trainer
        doomed = [victim] + [p for c in children(victim) for p in [c, *children(c)]]  # workers, tracker
        os.kill(victim, signal.SIGKILL)
        run_reference()  # while the supervisor restarts the job
        supervisor.wait(timeout=300)
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
    assert supervisor.returncode == 0, (tmp_path / "run.log").read_text()
    (restart,) = [json.loads(line) for line in (tmp_path / "run" / "restarts.jsonl").read_text().splitlines()]
    assert restart["exit"] == ("killed by SIGKILL" if nproc == 1 else "exit code 1")  # torchrun's, for a worker
    assert [(r["loss"], r["grad_norm"]) for r in strict_records(tmp_path / "run")] == [
        (r["loss"], r["grad_norm"]) for r in strict_records(tmp_path / "reference")
    ]
    cfg = config(tmp_path / "reference", steps=10, decay_steps=10)
    (weights, optim), (ref_weights, ref_optim) = (
        trained_state(tmp_path / "run", cfg),
        trained_state(tmp_path / "reference", cfg),
    )
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert all(torch.equal(optim[i][k], ref_optim[i][k]) for i in ref_optim for k in ref_optim[i])
    deadline = time.time() + 10
    while any(alive(p) for p in doomed) and time.time() < deadline:
        time.sleep(0.1)
    assert not session_processes(supervisor.pid) and not [p for p in doomed if alive(p)]


def launch_rendered_torchrun(cfg_file: Path, port: int) -> list[str]:
    """The `hlat torchrun` command `hlat launch` renders into a SLURM script for this config (2 ranks on 1 node,
    2 restarts), at an hlat service on this host's `port`."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hlat",
            "launch",
            "--config",
            str(cfg_file),
            "--target",
            "slurm",
            "--nodes",
            "1",
            "--nproc-per-node",
            "2",
            "--cluster.max_restarts",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("srun --het-group=1 hlat torchrun"))
    line = line.replace('"$service_node:29500"', f"127.0.0.1:{port}").replace('"$SLURM_JOB_ID"', "7")
    words = line.removesuffix(" &").split()  # the script runs it in the background
    return [sys.executable, "-m", "hlat", *words[words.index("torchrun") :]]


def restarting_torchrun(cfg_file: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hlat",
        "torchrun",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=2",
        "-m",
        "hlat",
        "train",
        "--config",
        str(cfg_file),
    ]


@pytest.fixture(scope="module")
def restart_job(tmp_path_factory, warm_torchrun) -> tuple[Path, object]:
    """A 2-rank job of 10 steps checkpointing every 3, and its uninterrupted run (in reference/ beside it; on the
    session's torchrun launch, whose 2-rank jobs compute what a fresh torchrun's do, to the bit)."""
    root = tmp_path_factory.mktemp("restart")
    cfg = config(root / "run", steps=10, decay_steps=10, ckpt_every=3)
    cfg.data.workers = 0
    cfg_file = write_config(root / "c.toml", cfg)
    done = warm_torchrun.run(2, ["train", "--config", str(cfg_file), "--train.run_dir", str(root / "reference")])
    assert done.returncode == 0, done.stdout[-3000:]
    return cfg_file, cfg


@pytest.mark.slow
@pytest.mark.parametrize("launched", ["hlat torchrun", "as hlat launch renders it"])
def test_torchrun_restarts_a_killed_worker_in_place_bit_exact(launched, restart_job, tmp_path):
    """kill -9 of one rank of a 2-rank job that torchrun restarts in place (--max-restarts, no supervisor): the
    new attempt forms its process group (each attempt in its own namespace of the job's store), continues the run
    from its last checkpoint although its command line has no --resume, and ends with an uninterrupted run's
    losses and weights. As `hlat launch` renders it, the job meets at an `hlat service` (each attempt in a namespace of
    its own there)."""
    cfg_file, cfg = restart_job
    run, port = tmp_path / "run", free_port()
    rendered = launch_rendered_torchrun(cfg_file, port) if launched != "hlat torchrun" else None
    service = rendered and subprocess.Popen(
        [sys.executable, "-m", "hlat", "service", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    command = rendered or restarting_torchrun(cfg_file)
    job = subprocess.Popen(
        [*command, "--train.run_dir", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        metrics, deadline = run / "metrics.jsonl", time.time() + 120
        while (not metrics.exists() or len(metrics.read_text().splitlines()) < 5) and time.time() < deadline:
            assert job.poll() is None, job.communicate()[0][-5000:]  # ended before step 5: say why
            time.sleep(0.05)
        if not (workers := children(job.pid)):  # still starting, or between attempts: say where it is
            os.killpg(job.pid, signal.SIGKILL)
            pytest.fail(f"no trainer to kill at step 5 or 120 s:\n{job.communicate()[0][-5000:]}")
        os.kill(workers[-1], signal.SIGKILL)  # one worker (the job is torchrun itself)
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        if service:
            service.terminate()
            service.wait()
    assert job.returncode == 0, out[-5000:]
    assert "resumed from" in out and "Connection refused" not in out
    # goodput's split of the failure: the surviving rank saw its collective fail (hlat.train.recovery)
    (failure,) = json.loads((run / "goodput.json").read_text())["failures"]
    assert failure["seen_by"].startswith(("rank0: ", "rank1: ")), failure
    assert failure["progress_at"] <= failure["seen_at"] <= failure["restart_at"] and failure["load_s"] > 0
    assert failure["recomputed_steps"] == failure["high_water_step"] - failure["resumed_step"] >= 0
    reference = cfg_file.parent / "reference"
    assert [(r["loss"], r["grad_norm"]) for r in strict_records(run)] == [
        (r["loss"], r["grad_norm"]) for r in strict_records(reference)
    ]
    weights, ref_weights = trained_state(run, cfg)[0], trained_state(reference, cfg)[0]
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks_training(tmp_path: Path, launcher: list[str], **fields) -> subprocess.Popen:
    """A 2-rank job (FSDP) of endless steps under `launcher`, once it has logged 2 steps."""
    cfg = config(tmp_path / "run", steps=10_000, decay_steps=10_000, **fields)
    cfg.data.workers = 0
    cfg_file = write_config(tmp_path / "c.toml", cfg)
    job = subprocess.Popen(
        [
            sys.executable,
            *launcher,
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "hlat",
            "train",
            "--config",
            str(cfg_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 180
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 2) and time.time() < deadline:
        time.sleep(0.1)
    return job


@pytest.mark.slow
def test_hang_watchdog_names_the_stopped_rank_and_the_job_exits_3(tmp_path):
    """One rank of a 2-rank `hlat torchrun` job stopped with SIGSTOP: the other rank's watchdog notices that no step
    finished within train.hang_timeout_s (long before the collective timeout), writes its stacks into the run
    directory, names the rank that stopped answering and kills it (it cannot act on torchrun's SIGTERM; torchrun
    would wait 30 s before killing it), so the job ends at once with the watchdog's exit code 3, not torchrun's 1."""
    job = two_ranks_training(tmp_path, ["-m", "hlat", "torchrun"], hang_timeout_s=4, collective_timeout_s=300)
    try:
        ranks = {
            v: p
            for p in children(job.pid)
            for v in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            if v.startswith(b"RANK=")
        }
        hung = ranks[b"RANK=1"]
        os.kill(hung, signal.SIGSTOP)
        out, _ = job.communicate(timeout=120)  # nobody kills the stopped rank but the watchdog
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 3, out
    report = (tmp_path / "run" / "hang" / "rank0.txt").read_text()
    first = report.splitlines()[0]
    assert "rank 0 on" in first and "no step finished for 4 s" in first and "ranks not responding: 1" in first
    assert "(killed on this node: 1)" in first and not alive(hung)
    assert "torch/distributed" in report and "train/loop.py" in report  # rank 0 waits in a collective
    assert first in out and "hlat: a trainer exited with code 3; so does the job" in out


def test_long_documents_are_tokenized_in_pieces_to_the_same_tokens(tmp_path, monkeypatch):
    """A document longer than MAX_PIECE_CHARS is tokenized piece by piece (cut before a space) into the same
    tokens and the same packed rows as at once (the memory this saves: benchmarks/long_document_memory.py)."""
    import numpy as np

    from hlat.data import rounds
    from hlat.data.sources import resolve_data_files
    from hlat.data.tokenizer import get_tokenizer

    cfg = config(tmp_path / "run")
    tok = get_tokenizer(cfg.data, resolve_data_files(cfg.data), 512, tmp_path)
    text = Path(json.__file__).read_text() * 3
    monkeypatch.setattr(rounds, "MAX_PIECE_CHARS", 200)
    assert "".join(rounds.text_pieces(text)) == text
    assert max(map(len, rounds.text_pieces(text))) <= 200
    (whole,), (pieces,) = tok.encode_batch([text]), rounds.encode_bounded(tok, [text])
    assert isinstance(pieces, np.ndarray) and pieces.tolist() == whole
    short = ["a short document", "another one"]
    assert rounds.encode_bounded(tok, short) == tok.encode_batch(short)
    a, _ = rounds.best_fit([whole, *tok.encode_batch(short)], tok.eos_id, 33)
    b, _ = rounds.best_fit(rounds.encode_bounded(tok, [text, *short]), tok.eos_id, 33)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("one_stager", [True, False])
def test_asynchronous_checkpoints_resume_like_synchronous_ones(one_stager, tmp_path, monkeypatch):
    """train.async_checkpoint: the checkpoints are committed (manifest verified, rotation applied) and a resume
    from them follows the same trajectory as synchronous saves, to the bit; with one stager for the run (its
    host buffers reused) and with a stager per save (torch < 2.13)."""
    monkeypatch.setattr(ckpt, "STAGER_KEEPS_BUFFERS", one_stager)

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
import hlat.checkpoint.store as c
from hlat.cli import main
own = c._own_digests
def hold(partial, rank):  # in DCP's writer thread, once every file and the .metadata of the save are written
    if partial.name.startswith("step_00000004"):
        Path(sys.argv[1]).touch()
        time.sleep(600)
    return own(partial, rank)
c._own_digests = hold
sys.exit(main(["train", "--config", sys.argv[2]]))
"""


def test_kill_9_during_an_asynchronous_write_resumes_from_the_previous_checkpoint(tmp_path):
    """kill -9 while a save is still being written in the background (held there, after DCP wrote its files and
    .metadata, before this rank's checksums): that save stays a `.partial` directory that nothing loads, and the
    run resumes from the previous checkpoint along the uninterrupted run's trajectory."""

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


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_and_exits_0(tmp_path):
    """A scheduler's SIGTERM to `hlat torchrun` (torchrun itself exits 1 whatever its workers did): torchrun passes
    it on, both ranks checkpoint the same step (asynchronously: FSDP's sharded state staged to host memory) and
    return, and the job exits 0."""
    job = two_ranks_training(tmp_path, ["-m", "hlat", "torchrun"], async_checkpoint=True)
    try:
        os.kill(job.pid, signal.SIGTERM)  # to torchrun only, as srun or a pod's deletion delivers it
        out, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out
    assert "stopped by signal" in out and "every trainer checkpointed" in out
    ((stopped_at, _),) = complete_checkpoints(tmp_path / "run")
    assert stopped_at == len(strict_records(tmp_path / "run")) >= 2


def test_a_stop_is_clean_only_when_every_local_trainer_returned(tmp_path, monkeypatch):
    from hlat.jobs.torchrun import FINISHED_DIR, all_finished, mark_finished

    monkeypatch.setenv(FINISHED_DIR, str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not all_finished(tmp_path)
    monkeypatch.setenv("RANK", "3")
    mark_finished()
    assert not all_finished(tmp_path)  # rank 2 is still running (or hung, or was killed)
    monkeypatch.setenv("RANK", "2")
    mark_finished()
    assert all_finished(tmp_path)
