"""The one background writer of both tiers (hlat/checkpoint/background.py) and its writer process: what it writes
loads back to the bit, its checksums are the files' own, its staging buffer and a dropped snapshot's files are
reused, a failed write is one line and the process goes on, and the process runs at the lowest priority and ends
with its trainer. What the tiers guarantee with it: tests/test_memory_tier.py, test_faults.py, test_hosts.py."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hlat.checkpoint.background import BackgroundWriter, Flight
from hlat.checkpoint.cadence import SnapshotCadence
from hlat.checkpoint.durable import read_checkpoint
from hlat.checkpoint.memory import SPARE, MemoryTier, Node
from hlat.checkpoint.memory_restore import holdings
from hlat.paths import step_dirs


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
    writer.start(state, target, lambda metadata, digests: digests, time.perf_counter())
    return writer.take()


@pytest.mark.parametrize("dcp_format", [False, True])
def test_what_it_writes_loads_back_to_the_bit_and_its_checksums_are_the_files(dcp_format, tmp_path):
    """A snapshot (raw tensors, read by hlat's reader) and a durable checkpoint (DCP's own format, which DCP's own
    reader loads), each written twice from the same staging buffer (the second holds the second state), then once
    from a state of another layout (the buffer made again)."""
    writer = BackgroundWriter(False, None, dcp_format=dcp_format)
    try:
        live = live_state()
        for target in (tmp_path / "first", tmp_path / "second", tmp_path / "third"):
            if target.name == "third":
                live["model"]["w"] = torch.randn(4, 6)
            flight = written(writer, live, target)
            assert flight.failure is None and flight.stall_s > 0
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
    finally:
        writer.close()


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
