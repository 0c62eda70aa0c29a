"""The memory tier: every `train.snapshot_every` steps, each rank's state in node-local memory, with a copy on
another node, so that a failure costs at most that many steps and a reload from memory (docs/fault-tolerance.md).

On each node, `<train.snapshot_dir>/<run key>/step_XXXXXXXX/` holds one snapshot, in DCP's metadata with each rank's
tensors raw (`hlat.checkpoint.raw`): the files of the node's own ranks (`__R_0.distcp`), the copies it keeps of its
ward's files (the ranks of the previous node: rank R's buddy is rank R + ranks per node, so losing any one node
leaves a complete copy), DCP's `.metadata`, and one `rank_R.json` per rank of the node, written last, listing what
that rank wrote there (its own files and the copy it received, each with its size and CRC-32), the saving world size
and the run's token. A snapshot is written in the background by the rank's writer process (training stalls only
for the copy to its staging buffer); every rank learns from the step's all-reduce when all have written, and the
tier then keeps only that newest complete snapshot and the next one being written, into the files of the one
before (`.spare` meanwhile: each file is moved into the next snapshot as its writer overwrites it in place, and a
tmpfs keeps their pages).

A directory under /dev/shm outlives the process that wrote it (a killed trainer, an in-place restart), not its
node: the restore side (`hlat.checkpoint.memory_restore`) finds and gathers what the surviving nodes hold. How often
it snapshots, and what that costs, is `hlat.checkpoint.cadence`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hlat.checkpoint.background import BackgroundWriter
from hlat.checkpoint.cadence import SnapshotCadence
from hlat.checkpoint.writer_process import SPARE, Listen, Meet, SealSnapshot
from hlat.files import Holder, live_holder, size_text
from hlat.groups import gather_objects
from hlat.paths import CONFIG_FILE, step_dirs, step_name

METADATA = ".metadata"
RUN_FILE = "run.json"  # in a run's directory of the tier: the run directory it belongs to, for `hlat snapshots`


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


class MemoryTier:
    """Writes this rank's snapshots (see the module's docstring) with its background `writer`. `save` at a step every
    rank reaches (`cadence.due`); `written` says this rank is done with the one in flight (ridden on the step's
    all-reduce); `commit` then, on every rank at the same step, drops the older snapshot; where the all-reduce did not
    find all written, `settle` waits for them after the step. At most one is in flight."""

    def __init__(
        self,
        root: Path,
        run_dir: str,
        token: str,
        rank: int,
        node: Node,
        writer: BackgroundWriter,
        config_toml: str,
        cadence: SnapshotCadence,
    ):
        self.root, self.run_dir, self.token, self.rank, self.node = root, run_dir, token, rank, node
        self.writer, self.group, self.config_toml, self.cadence = writer, writer.group, config_toml, cadence
        self.met_buddy = False

    def save(self, step: int, state: dict, started: float) -> None:
        """Snapshot `state` (a state dict, taken since `started`: the stall counts it) as step `step`: copied to the
        staging buffer now, written in the background (the one before is settled: `settle`)."""
        target = self.root / step_name(step)
        if self.node.leader:
            self._record_run()
        flight = self.writer.start(state, target, lambda metadata, _: self._after_write(target, metadata), started)
        self.cadence.saved(flight.stall_s)

    def _record_run(self) -> None:
        """The run's record in the tier (each node's first rank, at its first snapshot), for `hlat snapshots`.
        Refused (a tmpfs that another job filled), it ends no trainer: it is written at a later snapshot, and a
        snapshot's write that fails turns the tier off on every rank."""
        with contextlib.suppress(OSError):
            if not (self.root / RUN_FILE).is_file():
                (self.root / RUN_FILE).write_text(json.dumps({"run_dir": self.run_dir, "token": self.token}) + "\n")

    def _after_write(self, target: Path, metadata) -> list[str]:  # in the write's thread
        """The writer process's work after this rank's file: the copy to the buddy and of the ward's, DCP's metadata
        and the config (each node's first rank), this rank's record."""
        extra = {METADATA: pickle.dumps(metadata), CONFIG_FILE: self.config_toml.encode()} if self.node.leader else {}
        exchange = self._meet_buddy()
        step = int(target.name.removeprefix("step_"))
        seal = SealSnapshot(str(target), step, self.rank, self.node.world, self.token, extra, exchange)
        return self.writer.call(seal)

    def _meet_buddy(self) -> bool:
        """Whether this rank copies its files to a buddy; the first time, where the buddy's writer process listens
        (every rank's, gathered: a collective of the writes' threads)."""
        buddy = self.node.buddy(self.rank)
        if buddy is not None and not self.met_buddy:
            port = self.writer.call(Listen())
            addresses = gather_objects((own_address(), port), self.group)
            # a copy that stalls fails in half the collective timeout, so that the settle's collective after it
            # still ends within the timeout of a silent peer (a cut link)
            self.writer.call(Meet(addresses[buddy], self.writer.timeout_s / 2))
            self.met_buddy = True
        return buddy is not None

    def written(self) -> bool:
        return self.writer.written()

    def failed(self) -> bool:
        """Whether this rank's write of the snapshot in flight failed (once `written`)."""
        return self.writer.written() and self.writer.in_flight.failure is not None

    def settle(self) -> str | None:
        """Wait until every rank has written the snapshot in flight, and commit it (a collective of every rank at the
        same step, after a step whose all-reduce did not find them all written): returns its failure, as `commit`
        does. Called after every step, so that the snapshot taken before it is complete before another counts as
        done: a failure then never costs more than the steps since the last snapshot."""
        started = time.perf_counter()
        self.writer.in_flight.written.wait()
        failed = torch.tensor([float(self.failed())])
        if self.group is not None:
            dist.all_reduce(failed, group=self.group)
        self.cadence.settled(time.perf_counter() - started)
        return self.commit(bool(failed.item()))

    def commit(self, failed: bool) -> str | None:
        """Every rank has written the snapshot in flight: keep it as the newest, drop the older ones (each node's
        leader). `failed` (alike on every rank): some rank's write failed; the snapshot is dropped instead, and the
        first failed rank's reason returned on every rank (gathered: the rank that speaks may have written its own)."""
        flight = self.writer.take()
        if flight is None:
            return None
        self.cadence.committed(failed)
        step = int(flight.target.name.removeprefix("step_"))
        if failed:
            if self.node.leader:
                shutil.rmtree(flight.target, ignore_errors=True)
            failures = gather_objects(flight.failure, self.group) if self.group is not None else [flight.failure]
            return next(f.reason for f in failures if f is not None)
        if self.node.leader:
            for older, path in step_dirs(self.root):
                if older < step:
                    retire(path, self.root / SPARE)
        return None

    def discard_after(self, step: int) -> None:
        """A rollback to `step`: snapshots of later steps belong to the abandoned timeline (on every rank)."""
        self._quiesce()
        if self.node.leader:
            for later, path in step_dirs(self.root):
                if later > step:
                    shutil.rmtree(path, ignore_errors=True)

    def drop(self) -> None:
        """Free the node's memory (on every rank): the run ended with a durable checkpoint at its last step, or the
        tier turned itself off."""
        self._quiesce()
        if self.node.leader:
            shutil.rmtree(self.root, ignore_errors=True)

    def _quiesce(self) -> None:
        """Wait until no rank writes into the tier any more: this rank's write in flight, then every rank's."""
        self.writer.take()
        self.cadence.committed(failed=True)  # not committed: its cost is not counted
        if self.group is not None:
            dist.barrier(group=self.group)

    def close(self) -> None:
        self.writer.close()


def own_address() -> str:
    """This node's address as the other nodes reach it: the one it sends from to the rendezvous host (torchrun's
    MASTER_ADDR), else its host name."""
    with contextlib.suppress(OSError, KeyError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((os.environ["MASTER_ADDR"], 9))  # no packet sent: the route's source address is chosen
        return probe.getsockname()[0]
    return socket.gethostname()


def retire(path: Path, spare: Path) -> None:
    """Drop a snapshot no longer kept: it becomes the spare directory (its records and metadata removed first, so
    that it never passes for a snapshot), whose files the next snapshot's writers take; the spare before it, whose
    files the snapshot just committed took, goes with whatever no rank took."""
    shutil.rmtree(spare, ignore_errors=True)
    try:
        for name in [METADATA, *(p.name for p in path.glob("rank_*.json"))]:
            (path / name).unlink(missing_ok=True)
        path.rename(spare)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class Kept:
    """What node-local memory holds of one run: its directory of the tier, the run directory it belongs to (None where
    unknown), the steps of its snapshots, their bytes, and the live job that writes that run directory (None: none)."""

    root: Path
    run_dir: str | None
    steps: list[int]
    size: int
    holder: Holder | None

    def text(self) -> str:
        """One line for `hlat snapshots` and the room check's refusal."""
        steps = (
            f"step{'s' * (len(self.steps) != 1)} {', '.join(map(str, self.steps))}"
            if self.steps
            else "no complete step"
        )
        state = f"running ({self.holder.describe()})" if self.holder else "not running"
        return f"{self.root}: {self.run_dir or 'run directory unknown'}, {steps}, {size_text(self.size)}, {state}"


def kept_snapshots(snapshot_dir: str | Path) -> list[Kept]:
    """Every run's snapshots under `snapshot_dir` on this node (`hlat snapshots`)."""
    kept = []
    for root in sorted(p for p in Path(snapshot_dir).glob("*") if p.is_dir()) if Path(snapshot_dir).is_dir() else []:
        try:
            run_dir = json.loads((root / RUN_FILE).read_text())["run_dir"]
        except (OSError, ValueError, KeyError, TypeError):
            run_dir = None
        holder = live_holder(run_dir) if run_dir else None
        kept.append(Kept(root, run_dir, [step for step, _ in step_dirs(root)], tree_bytes(root), holder))
    return kept


def tree_bytes(root: Path) -> int:
    """The bytes of the files under `root` (0 where it is gone; a file removed while counted counts nothing)."""
    total = 0
    for path in root.rglob("*") if root.is_dir() else []:
        with contextlib.suppress(OSError):
            total += path.stat().st_size if path.is_file() else 0
    return total
