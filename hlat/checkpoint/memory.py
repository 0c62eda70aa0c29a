"""The memory tier: every `train.snapshot_every` steps, each rank's state in node-local memory, with a copy on
another node, so that a failure costs at most that many steps and a reload from memory (docs/fault-tolerance.md).

On each node, `<train.snapshot_dir>/<run key>/step_XXXXXXXX/` holds one snapshot in DCP's format: the files of the
node's own ranks (`__R_0.distcp`), the copies it keeps of its ward's files (the ranks of the previous node: rank
R's buddy is rank R + ranks per node, so losing any one node leaves a complete copy), DCP's `.metadata`, and one
`rank_R.json` per rank of the node, written last, listing what that rank wrote there (its own files and the copy
it received, each with its size and CRC-32), the saving world size and the run's token. A snapshot is written in
the background (training stalls only for the copy to host memory); every rank learns from the step's all-reduce
when all have written, and the tier then keeps only that newest complete snapshot and the next one being written.

A directory under /dev/shm outlives the process that wrote it (a killed trainer, an in-place restart), not its
node. On every start the ranks agree on one snapshot (`agree`): the newest whose files, over the surviving nodes,
cover every rank of the world that saved it, verified; a rank then fetches the files it needs from the node that
holds them (`fetch_needed`) and loads it through DCP, resharding to a smaller or larger world like any checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import shutil
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from hlat.checkpoint.store import STAGER_KEEPS_BUFFERS, RankWriteFailed, digests
from hlat.parallel.mesh import gather_objects
from hlat.paths import CONFIG_FILE

AUTO = -1  # train.snapshot_every = -1: every step, unless that costs training more than STALL_SHARE
STALL_SHARE = 0.05
STEADY_STEPS = 16  # the latest steps with no snapshot written during them: their median is the steady step time
_STEP = re.compile(r"^step_(\d{8})$")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
METADATA = ".metadata"


@dataclass(frozen=True)
class Node:
    """Where a rank sits among the nodes, from torchrun's environment (one node without it): ranks are numbered
    node by node, `per_node` on each."""

    index: int
    local_rank: int
    per_node: int
    world: int

    @classmethod
    def of_this_process(cls, world: int) -> Node:
        env = os.environ
        return cls(
            int(env.get("GROUP_RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world)), world
        )

    @property
    def count(self) -> int:
        return self.world // self.per_node

    @property
    def leader(self) -> bool:
        return self.local_rank == 0

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def buddy(self, rank: int) -> int | None:
        """The rank that keeps `rank`'s copy (on the next node), None on one node."""
        return (rank + self.per_node) % self.world if self.count > 1 else None

    def ward(self, rank: int) -> int | None:
        """The rank whose copy `rank` keeps (on the previous node)."""
        return (rank - self.per_node) % self.world if self.count > 1 else None


def snapshot_root(snapshot_dir: str | Path, run_dir: str | Path) -> Path:
    """This run's directory in node-local memory: one per run directory (its name and a hash of its path)."""
    run = Path(run_dir).resolve()
    return Path(snapshot_dir) / f"{run.name}-{hashlib.sha1(str(run).encode()).hexdigest()[:12]}"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def snapshot_steps(root: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in root.glob("step_*") if (m := _STEP.match(p.name))) if root.is_dir() else []


@dataclass
class _Flight:
    step: int
    written: threading.Event = field(default_factory=threading.Event)
    failure: str | None = None
    stall_s: float = 0.0  # the save's copy to host memory, which the step waited for
    during_s: list[float] = field(default_factory=list)  # the times of the steps run while it was written
    settled_s: float = 0.0  # the wait after those steps for it to be written on every rank


class MemoryTier:
    """Writes this rank's snapshots (see the module's docstring). `save` at a step every rank reaches; `written`
    says this rank is done with the one in flight (ridden on the step's all-reduce); `commit` then, on every rank at
    the same step, drops the older snapshot; where the all-reduce did not find all written, `settle` waits for
    them after the step. At most one is in flight."""

    def __init__(
        self, root: Path, every: int, token: str, rank: int, node: Node, group, config_toml: str, device: torch.device
    ):
        """`group`: a CPU process group of every rank, for the background writes (None in one process); `device`:
        the training's (pinned host memory for a GPU's copies; on the CPU, the writes take the step's cores)."""
        pinned = device.type == "cuda"
        self.root, self.token, self.rank, self.node = root, token, rank, node
        self.group, self.config_toml = group, config_toml
        self.staging = StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=pinned
        )
        self.stager = DefaultStager(self.staging) if STAGER_KEEPS_BUFFERS else None
        self.in_flight: _Flight | None = None
        self.saves = 0
        # train.snapshot_every = -1 measures what snapshots cost and tunes K (`tune`): the process's first snapshot
        # is of its second step, after a steady one (the first, with its warm-up, is none); then every K steps
        self.auto = every == AUTO
        self.every = 0 if self.auto else every
        self.steady: deque[float] = deque(maxlen=STEADY_STEPS)
        self.steps_run = 0  # by this process
        self.costs: list[float] = []  # the measured costs of the snapshots committed since the last tuning
        self.measured = 0

    def due(self, step: int) -> bool:
        if self.auto and not self.measured:
            return not self.saves and self.steps_run == 2
        return self.every > 0 and step % self.every == 0

    def stepped(self, step_s: float) -> None:
        """A step ended in `step_s`: the time of a step run while a snapshot was written, or of a steady one (not
        the process's first, slow with its warm-up)."""
        self.steps_run += 1
        if self.in_flight is not None:
            self.in_flight.during_s.append(step_s)
        elif self.steps_run > 1:
            self.steady.append(step_s)

    def cost_s(self, flight: _Flight) -> float | None:
        """What a committed snapshot cost the training, measured: the copy the step waited for, the steps run while
        it was written over the steady step time (on a CPU that trains, the write takes their cores; with cores
        of its own, little), and the wait for every rank to have written it. None before a steady step."""
        if not self.steady:
            return None
        slowdown = sum(flight.during_s) - len(flight.during_s) * statistics.median(self.steady)
        return max(0.0, flight.stall_s + slowdown + flight.settled_s)

    def tune_due(self) -> bool:
        """train.snapshot_every = -1 tunes K once its 1st, 2nd, 4th, 8th, ... snapshot is committed and measured (so
        that it follows a run whose step time changes, a collective each time): on every rank alike."""
        return bool(self.costs) and self.measured & (self.measured - 1) == 0

    def tune(self) -> tuple[int, float, float]:
        """Snapshot every K steps, K the fewest that keep the snapshots' measured cost (their mean since the last
        tuning) under STALL_SHARE of their steps' time; the largest K of all ranks, so that they all snapshot the
        same steps (agreed over the default group: the tier's own carries the snapshot being written). Returns K,
        the cost and the steady step time."""
        cost, step_s = statistics.fmean(self.costs), statistics.median(self.steady)
        every = max(1, math.ceil(cost / (STALL_SHARE * max(step_s, 1e-9))))
        self.every, self.costs = max(gather_objects(every)), []
        return self.every, cost, step_s

    def settle(self) -> str | None:
        """Wait until every rank has written the snapshot in flight, and commit it (a collective of every rank at the
        same step, after a step whose all-reduce did not find them all written): returns its failure, as `commit`
        does. Called after every step, so that the snapshot taken before it is complete before another counts as
        done: a failure then never costs more than the steps since the last snapshot."""
        started = time.perf_counter()
        self.in_flight.written.wait()
        failed = torch.tensor([float(self.in_flight.failure is not None)])
        if self.group is not None:
            dist.all_reduce(failed, group=self.group)
        self.in_flight.settled_s = time.perf_counter() - started
        return self.commit(bool(failed.item()))

    def save(self, step: int, state: dict, started: float) -> None:
        """Snapshot `state` (a state dict, taken since `started`: the stall counts it) as step `step`: copied to
        host memory now, written in the background (the one before is settled: `settle`)."""
        self.saves += 1
        target = step_dir(self.root, step)
        target.mkdir(parents=True, exist_ok=True)
        stager = self.stager or DefaultStager(self.staging)
        future = dcp.async_save(state, checkpoint_id=target, async_stager=stager, process_group=self.group)
        flight = self.in_flight = _Flight(step, stall_s=time.perf_counter() - started)
        future.add_done_callback(lambda f: self._written(f, flight, target, None if self.stager else stager))

    def _written(self, future, flight: _Flight, target: Path, stager) -> None:  # in DCP's writer thread
        try:
            future.result()
            own = sorted(p.name for p in target.glob(f"__{self.rank}_*.distcp"))
            received = self._exchange(target, own)
            self._share_metadata(target)
            if self.node.leader:
                (target / CONFIG_FILE).write_text(self.config_toml)
            self._mark(target, flight.step, own + received + ([METADATA, CONFIG_FILE] if self.node.leader else []))
        except BaseException as e:  # reported at the commit, on every rank
            flight.failure = RankWriteFailed.of(e).reason
        if stager is not None:
            stager.close()
        flight.written.set()

    def _exchange(self, target: Path, own: list[str]) -> list[str]:
        """Send this rank's files to its buddy and keep its ward's: the names of the files received."""
        buddy, ward = self.node.buddy(self.rank), self.node.ward(self.rank)
        if buddy is None:
            return []
        outgoing = {name: (target / name).read_bytes() for name in own}
        requests = send_object(outgoing, buddy, self.group)  # non-blocking: every rank sends and receives at once
        incoming = recv_object(ward, self.group)
        for request in requests:
            request.wait()
        for name, data in incoming.items():
            (target / name).write_bytes(data)
        return sorted(incoming)

    def _share_metadata(self, target: Path) -> None:
        """DCP's coordinator (rank 0) wrote `.metadata` on its node; every other node's leader writes a copy."""
        if self.node.count == 1:
            return
        objects = [(target / METADATA).read_bytes() if self.rank == 0 else None]
        dist.broadcast_object_list(objects, src=0, group=self.group)
        if self.node.leader and self.rank != 0:
            (target / METADATA).write_bytes(objects[0])

    def _mark(self, target: Path, step: int, names: list[str]) -> None:
        record = {"step": step, "world": self.node.world, "token": self.token, "files": digests(target, names)}
        tmp = target / f".rank_{self.rank}.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.rename(target / f"rank_{self.rank}.json")

    def written(self) -> bool:
        return self.in_flight is not None and self.in_flight.written.is_set()

    def commit(self, failed: bool) -> str | None:
        """Every rank has written the snapshot in flight: keep it as the newest, drop the older ones (each node's
        leader). `failed`: some rank's write failed; the snapshot is dropped instead and its reason returned where
        this rank knows it."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return None
        if failed:
            if self.node.leader:
                shutil.rmtree(step_dir(self.root, flight.step), ignore_errors=True)
            return flight.failure or "a snapshot write failed on another rank"
        if self.auto and (cost := self.cost_s(flight)) is not None:
            self.costs.append(cost)
            self.measured += 1
        if self.node.leader:
            for step in snapshot_steps(self.root):
                if step < flight.step:
                    shutil.rmtree(step_dir(self.root, step), ignore_errors=True)
        return None

    def discard_after(self, step: int) -> None:
        """A rollback to `step`: snapshots of later steps belong to the abandoned timeline (on every rank)."""
        self._settle()
        if self.node.leader:
            for later in snapshot_steps(self.root):
                if later > step:
                    shutil.rmtree(step_dir(self.root, later), ignore_errors=True)

    def drop(self) -> None:
        """The run ended with a durable checkpoint at its last step: free the node's memory (on every rank)."""
        self._settle()
        if self.node.leader:
            shutil.rmtree(self.root, ignore_errors=True)

    def _settle(self) -> None:
        """Wait until no rank writes into the tier any more: this rank's write in flight, then every rank's."""
        if self.in_flight is not None:
            self.in_flight.written.wait()
            self.in_flight = None
        if self.group is not None:
            dist.barrier(group=self.group)

    def close(self) -> None:
        if self.in_flight is not None:
            self.in_flight.written.wait()
        if self.stager is not None:
            self.stager.close()


# --- restoring ---------------------------------------------------------------------------------------------


@dataclass
class Held:
    """What one node holds of the snapshot of a step, verified against the ranks' records."""

    world: int
    ranks: set[int]  # the ranks whose files it holds
    metadata: bool
    files: set[str]


def holdings(root: Path, token: str) -> dict[int, Held]:
    """{step: what this node holds of it}, counting only files that match the records of the ranks that wrote
    them, for this run (`token`). A damaged or partial file is left out, so a snapshot it belongs to is complete
    only where another node holds a good copy."""
    found = {}
    for step in snapshot_steps(root):
        target, held = step_dir(root, step), None
        for marker in sorted(target.glob("rank_*.json")):
            try:
                record = json.loads(marker.read_text())
            except (OSError, ValueError):
                continue
            if record.get("token") != token or record.get("step") != step:
                continue
            held = held or Held(record["world"], set(), False, set())
            for name, (size, crc) in record["files"].items():
                if held.world == record["world"] and verified(target / name, size, crc):
                    held.files.add(name)
                    held.metadata |= name == METADATA
                    if m := _RANK_FILE.match(name):
                        held.ranks.add(int(m.group(1)))
        if held is not None:
            found[step] = held
    return found


def verified(path: Path, size: int, crc: int) -> bool:
    try:
        return path.stat().st_size == size and digests(path.parent, [path.name])[path.name][1] == crc
    except OSError:
        return False


def newest_complete(gathered: list[dict[int, Held]]) -> int | None:
    """The newest step whose snapshot the nodes hold between them whole (every rank of its world, and the
    metadata), from every rank's `holdings` (ranks of one node report the same)."""
    steps = sorted({s for held in gathered for s in held}, reverse=True)
    for step in steps:
        parts = [held[step] for held in gathered if step in held]
        world = parts[0].world
        ranks = set().union(*(p.ranks for p in parts if p.world == world))
        if ranks == set(range(world)) and any(p.metadata for p in parts):
            return step
    return None


def files_to_read(path: Path, state: dict) -> set[str]:
    """The files of the DCP checkpoint `path` that loading `state` (this rank's state dict) reads. DCP keeps each
    tensor chunk's file in `storage_data[index].relative_path`, which no public API returns (tests/test_memory_tier.py
    fails loudly if torch changes it)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def fetch(target: Path, held: set[str], wanted: set[str], node: Node, rank: int, group) -> tuple[set[str], int]:
    """Make this node's copy of a snapshot (`target`, of which it holds the verified files `held`) hold the files in
    `wanted` (this rank's wish; every rank calls it, a collective over the CPU `group`): each file a node lacks is
    sent by the lowest rank of a node that holds it to the lowest rank of the node that wants it. Returns what the
    node holds now, and the bytes this rank received."""
    gathered = all_gather(group, (rank, node.index, held, wanted))
    holders: dict[str, int] = {}
    for other, _, files, _ in gathered:
        for name in files:
            holders.setdefault(name, other)
    node_files: dict[int, set[str]] = {}
    for _, index, files, _ in gathered:
        node_files.setdefault(index, set()).update(files)
    transfers, claimed = [], set()
    for other, index, _, wants in gathered:
        for name in sorted(wants - node_files[index]):
            if (index, name) not in claimed and name in holders:
                claimed.add((index, name))
                transfers.append((holders[name], other, name))
    received, now = (
        0,
        node_files[node.index] | {name for _, receiver, name in transfers if gathered[receiver][1] == node.index},
    )
    for sender, receiver, name in transfers:
        if rank == sender:
            for request in send_object((target / name).read_bytes(), receiver, group):
                request.wait()
        elif rank == receiver:
            data = recv_object(sender, group)
            target.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(data)
            received += len(data)
    if group is not None:
        dist.barrier(group=group)
    return now, received


def all_gather(group, obj) -> list:
    if group is None:
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def send_object(obj, dst: int, group) -> list:
    """Start sending a picklable object to rank `dst` (its size, then its bytes); the requests to wait on."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return [dist.isend(size, dst, group=group), dist.isend(payload, dst, group=group)]


def recv_object(src: int, group):
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    return pickle.loads(payload.numpy().tobytes())
