"""Fault tolerance of the run as a whole: bad steps never reach a checkpoint, a killed run restarts bit-exact, a
hung rank is named, and a stop checkpoints once (docs/fault-tolerance.md). The checkpoint package's own faults
(damaged checkpoints, failed and asynchronous writes): tests/test_checkpoint_*.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train import config, final_weights, train

from hlat.cli import main
from hlat.paths import complete_checkpoints


def strict_records(run_dir: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return [json.loads(line, parse_constant=refuse) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def write_config(path: Path, cfg) -> Path:
    path.write_text(cfg.to_toml())
    return path


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


def test_nan_step_stops_in_one_line(tmp_path, capsys):
    cfg_file = write_config(tmp_path / "c.toml", nan_config(tmp_path / "run", "stop"))
    assert main(["train", "--config", str(cfg_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert "step 3: loss is nan; stopped" in err and "step_00000002" in err and "\n" not in err
    assert [s for s, _ in complete_checkpoints(tmp_path / "run")] == [2]


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
    # the surviving rank said why it ended in one line, not a traceback of torch's internals (unless torchrun saw
    # the death first and stopped it before its collective failed)
    assert "Traceback (most recent call last)" not in out, out[-5000:]
    assert "a peer is lost or unreachable" in out or "closing signal SIGTERM" in out, out[-5000:]
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
