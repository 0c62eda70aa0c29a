"""The one background writer of both tiers (hlat/checkpoint/background.py) and its writer process: what it writes
loads back to the bit, its checksums are the files' own, its staging buffer and a dropped snapshot's files are
reused, a snapshot after the first of a layout is written with no DCP save and no collective, a failed write is one
line and the process goes on, and the process runs at the lowest priority and ends with its trainer. What the
tiers guarantee with it: tests/test_checkpoint_memory.py, test_faults.py, test_hosts.py."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

from hlat.checkpoint import background
from hlat.checkpoint.background import BackgroundWriter, CheckpointFiles, Flight
from hlat.checkpoint.cadence import SnapshotCadence
from hlat.checkpoint.durable import read_checkpoint
from hlat.checkpoint.memory import RUN_FILE, MemoryTier, Node
from hlat.checkpoint.memory_restore import holdings
from hlat.checkpoint.writer_process import SPARE
from hlat.paths import step_dirs, step_name

dcp_save = dcp.save


def live_state() -> dict:
    """A state dict of each kind a snapshot holds: tensors of several dtypes (an empty one, a scalar), objects."""
    return {
        "model": {
            "w": torch.randn(3, 5),
            "half": torch.randn(7).to(torch.bfloat16),
            "empty": torch.zeros(0, 4),
            "step": torch.tensor(3, dtype=torch.int64),
        },
        "trainer": json.dumps({"step": 2, "data": [1, 2]}),
        "optim_settings": pickle.dumps({"lr": 0.1}),
    }


def blank(state: dict) -> dict:
    return {
        k: blank(v) if isinstance(v, dict) else torch.full_like(v, 7) if isinstance(v, torch.Tensor) else ""
        for k, v in state.items()
    }


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def written(writer: BackgroundWriter, state: dict, target: Path) -> Flight:
    """The write of `state` into `target`, done; raw files' metadata written after them, as the memory tier does."""

    def then(metadata, digests: dict) -> dict:
        if writer.files is not CheckpointFiles:
            (target / ".metadata").write_bytes(pickle.dumps(metadata))
        return digests

    writer.start(state, target, then, time.perf_counter())
    return writer.take()


@pytest.fixture
def dcp_saves(monkeypatch) -> list:
    """One entry per DCP save that a background writer runs."""
    saves = []
    monkeypatch.setattr(background.dcp, "save", counting(saves))
    return saves


def counting(saves: list):
    """DCP's save, which appends the checkpoint of each call to `saves`."""

    def counted(*args, **kwargs):
        saves.append(kwargs["checkpoint_id"])
        return dcp_save(*args, **kwargs)

    return counted


@pytest.mark.parametrize("dcp_format", [False, True])
def test_what_it_writes_loads_back_to_the_bit_and_its_checksums_are_the_files(dcp_format, tmp_path, dcp_saves):
    """A snapshot (raw tensors, read by hlat's reader) and a durable checkpoint (DCP's own format, which DCP's own
    reader loads), each written twice from the same staging buffer (the second holds the second state, its objects
    of other sizes), then once from a state of another layout (the buffer made again). A durable checkpoint is
    DCP's save each time; a snapshot only at the first of a layout."""
    writer = BackgroundWriter(False, None, dcp_format=dcp_format)
    try:
        live = live_state()
        for target in (tmp_path / "first", tmp_path / "second", tmp_path / "third"):
            if target.name == "third":
                live["model"]["w"] = torch.randn(4, 6)
            flight = written(writer, live, target)
            assert flight.failure is None and flight.stall_s > 0
            assert (dcp_saves[-1] == target) == (dcp_format or target.name != "second")
            assert flight.result == {
                name: [(target / name).stat().st_size, zlib.crc32((target / name).read_bytes())]
                for name in flight.result
            }
            loaded = blank(live)
            if dcp_format:
                dcp.load(loaded, checkpoint_id=target)
            else:
                read_checkpoint(target, loaded)
            assert_equal(loaded, live)
            if target.name == "first":
                staging = writer.staging
            else:
                assert (writer.staging is staging) == (target.name == "second")
            live["model"]["w"] += 1
            live["trainer"] = json.dumps({"step": 3})
            live["optim_settings"] = pickle.dumps({"lr": 0.1, "betas": (0.9, 0.95)})
    finally:
        writer.close()


def snapshot_state(step: int, rows: int, mesh=None) -> dict:
    """A snapshot's state at `step`: a weight of `rows` rows (sharded by rows over `mesh`), a bfloat16 tensor, a
    scalar, and objects whose sizes grow with the step."""
    w = torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) + step
    if mesh is not None:
        shard = w.chunk(mesh.size())[mesh.get_local_rank()].clone()
        w = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride())
    return {
        "model": {"w": w, "b": torch.full((3,), step / 3).to(torch.bfloat16), "count": torch.tensor(step)},
        "trainer": json.dumps({"step": step, "data": list(range(step))}),
        "optim_settings": pickle.dumps({"lr": [0.1] * step}),
    }


ROWS = {1: 8, 2: 8, 3: 8, 4: 10}  # the state of step 4 is of another layout


def fast_path_worker(out: str) -> None:  # one rank of a job of tests/warm_torchrun.py
    """Snapshots of steps 1-4 by a memory tier of 2 ranks (one node), each kept in `out`/kept. At steps 2 and 3
    rank 1 writes its whole snapshot before rank 0 starts its own: a collective in rank 1's save would wait for rank
    0 until the group's timeout, and fail the write. Each rank's count of DCP saves per step, and the inode of its
    file of each snapshot: `out`/rankR.json."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, saves, counts, inodes = dist.get_rank(), [], [], []
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    mesh = init_device_mesh("cpu", (2,))
    background.dcp.save = counting(saves)
    root = Path(out) / "snapshots"
    tier = MemoryTier(
        root, "run", "token", rank, Node(0, rank, 2, 2), BackgroundWriter(False, group, 20), "", SnapshotCadence(1)
    )
    try:
        for step, rows in ROWS.items():
            done_before, apart = len(saves), step in (2, 3)
            if apart and rank == 0:
                dist.barrier()
            tier.save(step, snapshot_state(step, rows, mesh), time.perf_counter())
            if apart and rank == 1:
                tier.writer.in_flight.written.wait()
                assert tier.writer.in_flight.failure is None, tier.writer.in_flight.failure
                dist.barrier()
            assert tier.settle() is None
            counts.append(len(saves) - done_before)
            inodes.append((root / step_name(step) / f"__{rank}_0.distcp").stat().st_ino)
            if rank == 0:
                shutil.copytree(root / step_name(step), Path(out) / "kept" / step_name(step))
            dist.barrier()
        Path(out, f"rank{rank}.json").write_text(json.dumps({"dcp_saves": counts, "inodes": inodes}))
    finally:
        background.dcp.save = dcp_save
        tier.close()
        dist.destroy_process_group(group)


def test_a_snapshot_after_the_first_of_a_layout_skips_dcp_and_loads_back_exactly(tmp_path, warm_torchrun):
    """On 2 ranks (a sharded weight, tensors DCP gives one rank, objects only the first rank writes, their sizes
    changed at every step): DCP saves the first snapshot and the first of another layout; the two between are
    written with no DCP save and no collective. Each rank writes into the files of the snapshot before the one kept
    (step 3 into step 1's), whichever rank writes first. Every snapshot is complete by its records and loads back
    exactly through the restore path's reader, into one process."""
    done = warm_torchrun.call(2, "test_background_writer:fast_path_worker", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        held = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert held["dcp_saves"] == [1, 0, 0, 1]
        assert held["inodes"][2] == held["inodes"][0] and held["inodes"][3] == held["inodes"][1], held
    kept = holdings(tmp_path / "kept", "token")
    assert {step: (held.ranks, held.metadata) for step, held in kept.items()} == {s: ({0, 1}, True) for s in ROWS}
    for step, rows in ROWS.items():
        expected = snapshot_state(step, rows)
        loaded = blank(expected)
        read_checkpoint(tmp_path / "kept" / step_name(step), loaded)
        assert_equal(loaded, expected)


def test_a_failed_write_is_this_ranks_failure_in_one_line_and_the_process_goes_on(tmp_path):
    (tmp_path / "bad" / "__0_0.distcp").mkdir(parents=True)  # the file it would write is a directory
    writer = BackgroundWriter(False, None)
    try:
        flight = written(writer, live_state(), tmp_path / "bad")
        assert flight.failure is not None and not flight.failure.refused
        assert flight.failure.reason == f"Is a directory ({tmp_path / 'bad' / '__0_0.distcp'})"
        assert written(writer, live_state(), tmp_path / "good").failure is None
    finally:
        writer.close()


def test_the_runs_record_refused_costs_the_trainer_nothing_and_is_written_at_a_later_snapshot(tmp_path):
    """The run's record in the tier, written by the node's first rank as its first snapshot starts, refused (a tmpfs
    that another job filled; here a directory in its place): the training loop goes on, the snapshot is written
    and committed, and a later snapshot writes the record."""
    (tmp_path / RUN_FILE).mkdir()
    tier = MemoryTier(
        tmp_path, "run", "token", 0, Node(0, 0, 1, 1), BackgroundWriter(False, None), "", SnapshotCadence(1)
    )
    try:
        tier.save(1, live_state(), time.perf_counter())
        assert tier.settle() is None and set(holdings(tmp_path, "token")) == {1}
        (tmp_path / RUN_FILE).rmdir()
        tier.save(2, live_state(), time.perf_counter())
        assert tier.settle() is None and json.loads((tmp_path / RUN_FILE).read_text())["token"] == "token"
    finally:
        tier.close()


def test_a_snapshot_is_written_into_the_files_of_the_one_dropped_before_it(tmp_path):
    """Once a snapshot is committed, the one before it becomes the spare directory (its records and metadata
    removed first: never a snapshot again), and the next snapshot is written into its files: the same inode, whose
    pages a tmpfs keeps."""
    tier = MemoryTier(
        tmp_path, "run", "token", 0, Node(0, 0, 1, 1), BackgroundWriter(False, None), "", SnapshotCadence(1)
    )
    try:
        inodes = []
        for step in (1, 2, 3):
            tier.save(step, live_state(), time.perf_counter())
            assert tier.settle() is None
            inodes.append((tmp_path / f"step_{step:08d}" / "__0_0.distcp").stat().st_ino)
            if step == 2:
                spare = tmp_path / SPARE
                assert [s for s, _ in step_dirs(tmp_path)] == [2] and set(holdings(tmp_path, "token")) == {2}
                assert not list(spare.glob("rank_*.json")) and not (spare / ".metadata").exists()
        assert inodes[2] == inodes[0] != inodes[1]
    finally:
        tier.close()


def test_the_writer_process_runs_at_the_lowest_priority_and_ends_with_its_trainer(tmp_path):
    """One writer process serves every background writer of a trainer (a channel each), at nice 19 (it lowers
    its own), and ends as soon as the trainer is gone, kill -9 included."""
    one = BackgroundWriter(False, None)
    other = BackgroundWriter(False, None, dcp_format=True)
    assert one.channel.process is other.channel.process
    one.close()
    other.close()
    code = (
        "import time; from hlat.checkpoint.background import BackgroundWriter; "
        "w = BackgroundWriter(False, None); print(w.channel.process.pid, flush=True); time.sleep(600)"
    )
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(trainer.stdout.readline())
        deadline = time.time() + 60
        while os.getpriority(os.PRIO_PROCESS, pid) != 19 and time.time() < deadline:  # it lowers its own
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    deadline = time.time() + 30
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped by whoever adopted it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
