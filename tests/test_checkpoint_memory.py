"""The memory tier (train.snapshot_every): a killed run resumes from node-local memory, exactly, recomputing at
most one snapshot interval; a damaged snapshot is refused for the next good copy; the tier's memory is freed when
a run ends; the default cadence keeps a snapshot's cost under the goal. A lost node's state found on its buddy,
across hosts: tests/test_hosts.py."""

import contextlib
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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_faults import children, restarting_torchrun, strict_records, trained_state
from test_train import config, final_weights, losses

from hlat.checkpoint.background import BackgroundWriter, RawFiles
from hlat.checkpoint.cadence import AUTO, STALL_SHARE, SnapshotCadence
from hlat.checkpoint.memory import MemoryTier, Node
from hlat.checkpoint.memory_restore import files_to_read
from hlat.cli import main
from hlat.config.job import load_config
from hlat.paths import complete_checkpoints, snapshot_root, step_dirs, step_name
from hlat.train.loop import train

# Runs hlat train (argv[2:]) and SIGKILLs this process right after the memory tier committed its snapshot of step
# argv[1]: the run dies with that snapshot complete in memory, and the next one perhaps being written.
KILL_AFTER_SNAPSHOT = """
import os, signal, sys
import hlat.checkpoint.memory as memory
from hlat.cli import main
commit = memory.MemoryTier.commit
def commit_then_die(self, failed):
    flight = self.writer.in_flight
    step = int(flight.target.name.removeprefix('step_')) if flight else None
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
    assert [s for s, _ in step_dirs(root)] == [2] and [s for s, _ in complete_checkpoints(tmp_path / "run")] == [2]
    if damaged:
        data = (root / step_name(2)) / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    capsys.readouterr()
    summary = train(load_config(cfg_file, ["--train.resume", "auto"]))
    out = capsys.readouterr().out
    assert summary.first_loss == losses(tmp_path / "run")[0]  # the run's first, not the resumed process's
    expected = "checkpoints/step_00000002 at step 2" if damaged else "memory tier's snapshot"
    expected += "" if damaged else f" {(root / step_name(2))} at step 2"
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
    assert step_dirs(root)
    train(load_config(cfg_file))  # no checkpoint on disk: a fresh start, which must not pick up step 2
    assert len(losses(tmp_path / "run")) == 4 and not root.exists()


def test_resume_auto_with_nothing_to_resume_from_says_so_and_starts_at_step_0(tmp_path, capsys):
    cfg = config(tmp_path / "run", steps=2, snapshot_every=1)
    assert train(load_config(write_config(tmp_path / "job.toml", cfg), ["--train.resume", "auto"])).steps == 2
    out = capsys.readouterr().out
    assert (
        f"nothing complete to resume from in {tmp_path / 'run'} (no checkpoint, no snapshot): starting at step 0"
        in (" ".join(out.split()))
    )
    assert len(losses(tmp_path / "run")) == 2


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
    cadence = SnapshotCadence(AUTO)
    tier = MemoryTier(tmp_path, "run", "token", 0, Node(0, 0, 1, 1), BackgroundWriter(False, None), "", cadence)
    due = []
    for step, step_s in enumerate((3.0, 1.0), 1):  # the first step, slow with its warm-up, is no steady one
        cadence.stepped(step_s)
        due.append(cadence.due(step))
    assert due == [False, True] and list(cadence.steady) == [1.0]
    tier.save(2, {"w": torch.zeros(4)}, time.perf_counter())
    cost_of_2 = cadence.measuring
    cadence.stepped(1.3)  # run while the snapshot was written: 0.3 s slower than the steady step
    assert not cadence.due(3)
    assert tier.settle() is None and cadence.tune_due()
    every, cost, step_s = cadence.tune()
    assert step_s == 1.0 and cost == pytest.approx(cost_of_2.stall_s + 0.3 + cost_of_2.settled_s)
    assert cost_of_2.stall_s > 0 and cadence.metric_fields()["snapshot_cost_s"] == pytest.approx(cost, abs=1e-4)
    assert cost / every <= STALL_SHARE * step_s < cost / max(every - 1, 1e-9)  # the fewest
    assert [step for step in range(3, 4 * every) if cadence.due(step)] == [every, 2 * every, 3 * every]
    retuned = []
    for measured in (2, 3, 4):  # tuned again after the 2nd and 4th measured snapshots, not the 3rd
        tier.save(measured * every, {"w": torch.zeros(4)}, time.perf_counter())
        cadence.stepped(1.3)
        assert tier.settle() is None
        retuned.append(cadence.tune_due())
        if retuned[-1]:
            cadence.tune()
    assert retuned == [True, False, True]


def test_hlat_snapshots_lists_a_killed_runs_snapshots_and_clears_them_keeping_a_running_ones(tmp_path, capsys):
    """A killed run never resumed leaves its snapshots in node-local memory: `hlat snapshots` lists them, and
    `--clear` removes them while it keeps those of a run whose directory a live job holds."""
    from test_writer import holder

    snapshots = tmp_path / "shm"
    cfg = config(tmp_path / "killed", steps=4, snapshot_every=1, snapshot_dir=str(snapshots))
    killed_after_snapshot(tmp_path, write_config(tmp_path / "job.toml", cfg), 2)
    killed = snapshot_root(snapshots, tmp_path / "killed")
    running = snapshot_root(snapshots, tmp_path / "running")
    shutil.copytree(killed, running)  # a running run's tier, as the killed one's was
    (running / "run.json").write_text(json.dumps({"run_dir": str((tmp_path / "running").resolve())}))
    job = holder(tmp_path / "running")
    try:
        assert main(["snapshots", "--snapshot-dir", str(snapshots)]) == 0
        listed = capsys.readouterr().out
        assert f"{killed}: {(tmp_path / 'killed').resolve()}, step 2," in listed and "not running" in listed
        assert f"running (pid {job.pid}" in listed
        assert main(["snapshots", "--snapshot-dir", str(snapshots), "--clear"]) == 0
        assert f"cleared {killed}" in capsys.readouterr().out
        assert not killed.exists() and [s for s, _ in step_dirs(running)] == [2]
    finally:
        job.stdin.close()
        job.wait()


@pytest.mark.parametrize("every", [AUTO, 1])
def test_metrics_hold_the_snapshots_measured_cost_and_cadence_under_either_setting(tmp_path, every):
    """metrics.jsonl (and so TensorBoard and the trackers) holds the interval the snapshots run at and the measured
    cost of the newest one, its parts apart, with a fixed train.snapshot_every as with the tuned one."""
    cfg = config(tmp_path / "run", steps=4, snapshot_every=every, snapshot_dir=str(tmp_path / "shm"))
    summary = train(cfg)
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["snapshot_every"] >= 1 and (every == AUTO or last["snapshot_every"] == every)
    parts = last["snapshot_stall_s"] + last["snapshot_slowdown_s"] + last["snapshot_settle_s"]
    assert last["snapshot_stall_s"] > 0 and last["snapshot_cost_s"] == pytest.approx(parts, abs=2e-4)
    assert last["snapshot_share"] > 0 and summary.snapshots == {k: last[k] for k in summary.snapshots}


@pytest.fixture
def small_tmpfs(tmp_path):
    """`mount(megabytes)`: a tmpfs of that size of its own (the memory tier's node-local memory, with little to
    spare), unmounted after the test; skipped where mounting is not allowed (CI runs as root)."""
    mounted = []

    def mount(megabytes: float) -> Path:
        target = tmp_path / f"tmpfs{len(mounted)}"
        target.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={int(megabytes * 1024)}k", "tmpfs", str(target)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture(scope="module")
def tight_job(tmp_path_factory, warm_torchrun):
    """A 2-rank job of 10 steps, a snapshot every step and a checkpoint every 3, and its uninterrupted run
    (reference/ beside its config; on the session's torchrun launch: the same arithmetic as a fresh torchrun's)."""
    root = tmp_path_factory.mktemp("tight")
    cfg = config(root / "run", steps=10, decay_steps=10, ckpt_every=3, snapshot_every=1)
    cfg.data.workers = 0
    cfg_file = write_config(root / "c.toml", cfg)
    done = warm_torchrun.run(2, ["train", "--config", str(cfg_file), "--train.run_dir", str(root / "reference")])
    assert done.returncode == 0, done.stdout[-3000:]
    return cfg_file, cfg


def other_runs_snapshot(snapshot_dir: Path, megabytes: float) -> Path:
    """Another run's snapshot (a run killed and never resumed, its directory gone), of that many megabytes, or as much
    of it as fits: it fills the tmpfs."""
    root = snapshot_dir / "other-run-0123456789ab"
    (root / step_name(7)).mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"run_dir": "/nowhere/other-run"}))
    with open(root / step_name(7) / "__0_0.distcp", "wb") as out:
        with contextlib.suppress(OSError):  # No space left on device: the tmpfs is full
            for _ in range(int(megabytes * 16)):
                out.write(b"\0" * 65536)
                out.flush()
    return root


def wait_for(job: subprocess.Popen, log: Path, run: Path, step: int, seen: str = "") -> None:
    """Until `step` is in the run's metrics.jsonl (and `seen` in the job's log)."""
    metrics, deadline = run / "metrics.jsonl", time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step and seen in log.read_text()):
        assert job.poll() is None and time.time() < deadline, log.read_text()[-5000:]
        time.sleep(0.05)


@pytest.mark.parametrize("filled", [False, True])
def test_a_restart_on_a_tmpfs_with_little_to_spare_goes_on_by_itself_and_exactly(
    filled, tight_job, small_tmpfs, tmp_path
):
    """A 2-rank job under `hlat torchrun --max-restarts 2` whose tmpfs holds the memory tier's need (2 snapshots)
    with 20% to spare, one trainer SIGKILLed after step 5: the restart's room check counts the run's own snapshot
    (it used to refuse every restart: exit code 2), resumes from memory and finishes with the uninterrupted run's
    losses and weights. `filled`: another run's snapshot fills the tmpfs after step 2; the next snapshot write fails
    and the tier turns itself off and frees its memory; the restart after the kill still finds no room, says so in
    one warning naming the other run's snapshot, resumes from the newest checkpoint and finishes exactly. Either way
    the finished run leaves nothing of its own in the tmpfs."""
    cfg_file, cfg = tight_job
    shm, run, log = small_tmpfs(4.1), tmp_path / "run", tmp_path / "job.log"  # the need: 3.4 MB
    command = [*restarting_torchrun(cfg_file), "--train.run_dir", str(run), "--train.snapshot_dir", str(shm)]
    with open(log, "w") as out:
        job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if filled:
            wait_for(job, log, run, 2)
            other = other_runs_snapshot(shm, 8)
        wait_for(job, log, run, 5, seen="memory tier is off" if filled else "")
        os.kill(children(job.pid)[-1], signal.SIGKILL)  # one trainer (the job is torchrun itself)
        job.wait(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = log.read_text()
    assert job.returncode == 0, out[-5000:]
    if filled:
        # rank 0 speaks for the job: the failed write, then the room check at the restart naming the other run
        write, room = [line for line in out.splitlines() if "the memory tier is off" in line]
        assert "a snapshot write failed (No space left on device" in write, out[-5000:]
        assert f"{shm} on node 0 has" in room and f"snapshots there: {other}: /nowhere/other-run, step 7," in room
        assert "resumed from" in out and "checkpoints/step_" in out
    else:
        assert "resumed from the memory tier's snapshot" in out and "memory tier is off" not in out, out[-5000:]
    reference = cfg_file.parent / "reference"
    assert [(r["loss"], r["grad_norm"]) for r in strict_records(run)] == [
        (r["loss"], r["grad_norm"]) for r in strict_records(reference)
    ]
    weights, ref_weights = trained_state(run, cfg)[0], trained_state(reference, cfg)[0]
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert sorted(shm.iterdir()) == ([other] if filled else [])


def train_with_one_snapshot_refused(rank: int, step: int, argv: list[str]) -> int:
    """`hlat train argv` in which rank `rank`'s snapshot write of step `step` is refused for want of space; the other
    ranks' writes go through (a warm_torchrun job)."""
    save = BackgroundWriter._save

    def refused_on_one_rank(self, staged, files):
        if isinstance(files, RawFiles) and dist.get_rank() == rank and Path(files.path).name == step_name(step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(files.path))
        return save(self, staged, files)

    BackgroundWriter._save = refused_on_one_rank
    try:
        return main(["train", *argv])
    finally:
        BackgroundWriter._save = save


def test_a_snapshot_write_refused_on_another_rank_is_named_by_the_rank_that_speaks(warm_torchrun, tmp_path):
    """Rank 1's snapshot write of step 3 is refused (no space); rank 0's succeeds. Rank 0, which speaks for the job,
    says why the tier turned itself off with rank 1's reason (it said only "on another rank"), and the run goes on
    with its checkpoints."""
    cfg = config(tmp_path / "run", steps=5, decay_steps=5, ckpt_every=5, snapshot_every=1)
    cfg.data.workers = 0
    argv = ["--config", str(write_config(tmp_path / "c.toml", cfg))]
    done = warm_torchrun.call(2, "test_checkpoint_memory:train_with_one_snapshot_refused", 1, 3, argv)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [off] = [line for line in done.stdout.splitlines() if "the memory tier is off" in line]
    assert f"a snapshot write failed (No space left on device ({tmp_path / 'snapshots'}/" in off, off
    assert step_name(3) in off and len(losses(tmp_path / "run")) == 5


def test_a_fresh_start_without_room_for_the_tier_is_refused_naming_the_other_runs_there(small_tmpfs, tmp_path, capsys):
    """A fresh start has nothing to lose by waiting: too small a tmpfs is refused in one line (exit code 2) that names
    the other runs' snapshots holding it, with their sizes and whether a live job writes them."""
    shm = small_tmpfs(2)
    other = other_runs_snapshot(shm, 1)
    cfg = config(tmp_path / "run", steps=2, snapshot_every=1, snapshot_dir=str(shm))
    assert main(["train", "--config", str(write_config(tmp_path / "job.toml", cfg))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hlat: error: train.snapshot_dir: {shm} on node 0 has ") and err.count("\n") == 1, err
    assert f"other runs' snapshots there: {other}: /nowhere/other-run, step 7, 1.0 MB, not running;" in err
    assert not (tmp_path / "run" / "checkpoints" / "step_00000001").exists()
