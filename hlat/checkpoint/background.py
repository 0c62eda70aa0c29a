"""The one background writer of both tiers (`BackgroundWriter`). A save copies the state's tensors into one buffer of
shared memory kept for the run (`Staging`: training stalls only for that copy); DCP then plans the save in a thread
here (a few milliseconds of Python, its plans cached from save to save), and the files are written by this rank's
writer process (`hlat.checkpoint.writer_process`: long-lived, at the lowest CPU priority, checksumming each file as it
writes it), as are the tier's files after the write (the memory tier's copy to its buddy and its record). The memory
tier's files are the staged bytes as they are (`hlat.checkpoint.raw`); a durable checkpoint is in DCP's own format
(`WriteCheckpointFiles`). A save's result, or this rank's failure (`RankWriteFailed`), waits in the `Flight` for the
tier to commit it. At most one write is in flight per writer, and each writer runs its collectives on a CPU group
of its own.

Only the first snapshot of a staging layout is DCP's save: the later ones of the memory tier repeat its plan and
its metadata (`Planned`: each tensor is where it was, and the raw file's index finds the objects, whose sizes
change), with no DCP save and no collective. DCP's save took 17-18 ms of the thread's CPU at every snapshot of the
tiny model (44 MB a rank, 2 ranks on 2 cores), the repeated plan 2.6-3.3 ms (its items resolved, the objects
serialized); a snapshot every step then cost 3.1% of the step in all (stall 1.8%, steps 1.3% slower), against
4.5% with DCP's save every time in the same runs (`benchmarks/results/recovery_cost.md`, docs/fault-tolerance.md).
"""

from __future__ import annotations

import io
import itertools
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from socket import send_fds, socketpair

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from hlat import HlatError
from hlat.checkpoint.raw import RawChunk, objects_tail
from hlat.checkpoint.writer_process import Checksummed, Request, WriteFile, Writer
from hlat.dtensor import local
from hlat.files import refused_write
from hlat.torch_private import forget_plans, own_plan_cache

ALIGN = 64  # each staged tensor starts on a cache line
# DCP warns on every call that no process group exists; single-process saving is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class RankWriteFailed(Exception):
    """A rank's failed write, gathered at the commit: its reason, and whether the file system refused it (a full
    disk, no permission) or the failure may pass (an I/O error, a stale NFS handle)."""

    def __init__(self, reason: str, refused: bool):
        super().__init__(reason)
        self.reason, self.refused = reason, refused

    @classmethod
    def of(cls, e: BaseException) -> RankWriteFailed:
        return cls(failure_reason(e), refused_write(e) is not None)

    def __reduce__(self):  # gathered across ranks: pickled with both fields
        return RankWriteFailed, (self.reason, self.refused)


def failure_reason(e: BaseException) -> str:
    """The first line of the root cause of an error: a refused write wherever it surfaces (a full disk reaches
    torch.save's caller as a RuntimeError with the ENOSPC in its context), else what DCP's CheckpointException wraps
    (each rank's error)."""
    e = refused_write(e) or e
    if isinstance(e, (HlatError, RankWriteFailed)):  # a rank's reason, already in words
        return str(e)
    while isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}{f' ({e.filename})' if e.filename else ''}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__  # a KeyError's text is a key


@dataclass
class Flight:
    """One write in flight: where, how long the step stalled for its copy, and once `written`, the result of the
    tier's work after the write, or this rank's failure."""

    target: Path
    stall_s: float
    written: threading.Event = field(default_factory=threading.Event)
    result: object = None
    failure: RankWriteFailed | None = None


def leaves(state: dict, path: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """(path of keys, value) of every value of a nested state dict that is not itself a dict."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from leaves(value, (*path, key))
        else:
            yield (*path, key), value


def layout_of(value: torch.Tensor, shard: torch.Tensor) -> tuple:
    """What a staged copy of `value` (whose local shard is `shard`) depends on: the shard's dtype and shape, and a
    DTensor's mesh, placements and shape."""
    return (
        shard.dtype,
        shard.shape,
        (value.device_mesh, value.placements, value.shape) if isinstance(value, DTensor) else None,
    )


class Staging:
    """A copy of every tensor of a state dict (a DTensor's local shard) in one buffer of shared memory (`fd`, which
    the writer process maps too), each 64-byte aligned, reused from save to save for states of the same layout:
    the same tensors' layouts, and objects under the same keys."""

    def __init__(self, state: dict, fd: int, pinned: bool):
        tensors = [(path, value, local(value)) for path, value in leaves(state) if isinstance(value, torch.Tensor)]
        starts, size = [], 0
        for _, _, shard in tensors:
            starts.append(size)
            size += -(-shard.nbytes // ALIGN) * ALIGN
        if os.fstat(fd).st_size < max(size, 1):  # the writer process maps the grown buffer at its next request
            os.ftruncate(fd, max(size, 1))
        self.buffer = torch.frombuffer(mmap.mmap(fd, max(size, 1)), dtype=torch.uint8)
        self.pinned = pinned and pin(self.buffer)
        self.copies: dict[tuple, tuple] = {}  # path: (the copy, what DCP is given for it, the layout it holds)
        self.objects = [path for path, value in leaves(state) if not isinstance(value, torch.Tensor)]
        for (path, value, shard), start in zip(tensors, starts):
            copy = self.buffer[start : start + shard.nbytes].view(shard.dtype).view(shard.shape)
            self.copies[path] = copy, as_dtensor_like(copy, value), layout_of(value, shard)

    def stage(self, state: dict) -> dict | None:
        """Copy `state`'s tensors in: the state dict with the copies in their place (a DTensor's rewrapped), which
        DCP plans from; None where `state` is not of the layout this buffer holds (another is made)."""
        staged: dict = {}
        copied, objects = 0, []
        for path, value in leaves(state):
            if isinstance(value, torch.Tensor):
                shard, held = local(value), self.copies.get(path)
                if held is None or held[2] != layout_of(value, shard):
                    return None
                held[0].copy_(shard, non_blocking=self.pinned)
                value, copied = held[1], copied + 1
            else:
                objects.append(path)
            parent = staged
            for key in path[:-1]:
                parent = parent.setdefault(key, {})
            parent[path[-1]] = value
        if self.pinned:  # the copies from the device are done before the writer reads them
            torch.cuda.current_stream().synchronize()
        return staged if copied == len(self.copies) and objects == self.objects else None

    def region(self, tensor: torch.Tensor) -> tuple[int, int]:
        """Where a staged tensor lies in the buffer: (start, size); an empty one nowhere, (0, 0)."""
        if tensor.nbytes == 0:  # its data pointer is null
            return 0, 0
        start = tensor.data_ptr() - self.buffer.data_ptr()
        if not tensor.is_contiguous() or not 0 <= start <= self.buffer.numel() - tensor.nbytes:
            raise RuntimeError("a tensor DCP writes is not one of the staged copies")
        return start, tensor.nbytes

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())


def pin(buffer: torch.Tensor) -> bool:
    """Page-lock the staging buffer (a GPU's state is copied into it without waiting for the copy to pageable
    memory); whether it could be."""
    if not torch.cuda.is_available():
        return False
    return int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1)) == 0


def as_dtensor_like(copy: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return copy
    return DTensor.from_local(
        copy, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    )


def shared_memory() -> int:
    """A file descriptor of anonymous shared memory, freed with the last process that holds it."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("hlat-staging")
    with tempfile.TemporaryFile() as f:  # an unlinked file where there is no memfd (not Linux)
        return os.dup(f.fileno())


class WriterProcess:
    """This rank's writer process (`hlat.checkpoint.writer_process`), shared by its background writers: started
    with the first, each of which opens a `Channel` to it; it ends with this process."""

    running: WriterProcess | None = None

    def __init__(self):
        ours, theirs = socketpair()
        code = "import sys; from hlat.checkpoint.writer_process import main; main(*map(int, sys.argv[1:]))"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=writer_environment(),
        )
        theirs.close()
        self.control = ours

    @classmethod
    def channel(cls, staging_fd: int) -> Channel:
        """A channel to the process (started where none runs) for a background writer of `staging_fd`."""
        if cls.running is None or cls.running.process.poll() is not None:
            cls.running = cls()
        ours, theirs = socketpair()
        send_fds(cls.running.control, [b"c"], [theirs.fileno(), staging_fd])
        theirs.close()
        return Channel(Connection(ours.detach()), cls.running.process)


def writer_environment() -> dict:
    """The trainer's environment, less what makes a process one of the job's ranks (torchrun's RANK, WORLD_SIZE and
    the like: whoever looks for the trainers by their rank finds none here), and with no device of its own."""
    keep = {k: v for k, v in os.environ.items() if not k.endswith(("RANK", "WORLD_SIZE"))}
    return keep | {"CUDA_VISIBLE_DEVICES": ""}


@dataclass
class Channel:
    """A background writer's channel to the writer process: `call` runs a request there, in turn."""

    conn: Connection
    process: subprocess.Popen

    def call(self, request: Request):
        try:
            self.conn.send(request)
            done, result = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the writer process ended (exit code {self.process.poll()})") from None
        if not done:
            raise result
        return result

    def close(self) -> None:
        """The process ends this channel once it answered what it is doing."""
        self.conn.close()


class CachedPlanner(dcp.DefaultSavePlanner):
    """DCP's planner, its plans cached from save to save under `key`: one writer's, for one layout of its state
    (DCP keeps the cache per process: a key per planner class would hand the plans of a run to the next run in the
    same process, of another layout, and hang its collectives)."""

    def __init__(self, key: str):
        super().__init__(enable_plan_caching=True)
        own_plan_cache(self, key)


class RawFiles(FileSystemWriter):
    """The memory tier's files (`hlat.checkpoint.raw`): this rank's staged tensors that DCP's plan gives it, as
    their raw bytes (runs of the staging buffer), then its objects, written by the writer process. `plan`: the
    plan of the last write."""

    def __init__(self, path: Path, staging: Staging, channel: Channel):
        super().__init__(path, sync_files=False)  # node-local memory: nothing to force to storage
        self.staging, self.channel, self.digests = staging, channel, {}

    def write_data(self, plan: SavePlan, planner) -> Future:
        name, tensors, objects = f"__{self.rank}_0.distcp", [], []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                objects.append((item, data.getvalue()))
            else:
                tensors.append((*self.staging.region(data), item, data))
        runs: list[list[int]] = []  # [start, size] in the buffer: staged tensors next to each other are one run
        results, at = [], 0
        for start, size, item, data in sorted(tensors, key=lambda t: t[0]):
            if size == 0:
                chunk = RawChunk(name, 0, 0, str(data.dtype).removeprefix("torch."), tuple(data.shape))
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=chunk))
                continue
            if runs and start - sum(runs[-1]) < ALIGN:
                runs[-1][1] = start + size - runs[-1][0]
            else:
                runs.append([start, size])
                at = sum(n for _, n in runs[:-1])
            dtype = str(data.dtype).removeprefix("torch.")
            chunk = RawChunk(name, at + start - runs[-1][0], size, dtype, tuple(data.shape))
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=chunk))
        at = sum(n for _, n in runs)  # the objects' index: their lengths are not in the metadata (raw.py)
        for slot, (item, data) in enumerate(objects):
            chunk = RawChunk(name, at, slot=slot)
            results.append(WriteResult(index=item.index, size_in_bytes=len(data), storage_data=chunk))
        tail = objects_tail([data for _, data in objects])
        self.digests[name] = self.channel.call(WriteFile(str(Path(self.path) / name), tuple(map(tuple, runs)), tail))
        self.plan = plan
        return done(results)

    def write_again(self, planned: Planned, staged: dict) -> Metadata:
        """Write `staged` (of the layout `planned` was made for) as DCP's save of that layout did, with no DCP save:
        its plan's items resolved by DCP's planner, set up on `staged` (each tensor the same region of the staging
        buffer, so the same places; each object serialized as DCP does). Returns DCP's metadata of this save."""
        self.set_up_storage_writer(False, rank=planned.rank)
        self.fs.mkdir(self.path)  # as DCP's plan does on every rank: the node's first rank may not have made it yet
        planner = dcp.DefaultSavePlanner()
        planner.set_up_planner(staged)
        self.write_data(planned.plan, planner)
        return replace(planned.metadata, storage_meta=self.storage_meta())


@dataclass(frozen=True)
class Planned:
    """What the first save of a staging layout (DCP's save) leaves for the later ones of the memory tier: this
    rank's final plan (its write items, the rank that wrote them) and DCP's global metadata, which dcp.save returns
    on every rank."""

    plan: SavePlan
    rank: int
    metadata: Metadata


class CheckpointFiles(FileSystemWriter):
    """A durable checkpoint's files, in DCP's own format, written by the writer process (`WriteCheckpointFiles`)."""

    def __init__(self, path: Path, staging: Staging, channel: Channel):
        super().__init__(path)
        self.staging, self.channel, self.digests = staging, channel, {}

    def write_data(self, plan: SavePlan, planner) -> Future:
        tensors, objects = {}, {}
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                objects[item.index] = data.getvalue()
            else:
                tensors[item.index] = (*self.staging.region(data), data.dtype, data.shape)
        results, self.digests = self.channel.call(WriteCheckpointFiles(str(self.path), plan, tensors, objects))
        return done(results)


def done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


@dataclass(frozen=True)
class WriteCheckpointFiles(Request):
    """Write this rank's files of a DCP checkpoint (`plan`, its tensors `tensors` {index: (start, size, dtype,
    shape)} in the staging buffer and its objects serialized) with DCP's file writer, in the writer process (which
    imports torch for it): their WriteResults, and {file: [size, CRC-32]} from the bytes as they were written."""

    path: str
    plan: SavePlan
    tensors: dict
    objects: dict

    def run(self, writer: Writer) -> tuple[list, dict]:
        buffer = torch.frombuffer(writer.mapped(), dtype=torch.uint8)
        files = FileSystemWriter(self.path)
        files.fs = ChecksummedFileSystem()
        staged = {
            index: buffer[start : start + size].view(dtype).view(shape)
            for index, (start, size, dtype, shape) in self.tensors.items()
        }
        results = files.write_data(self.plan, Resolver(staged, self.objects)).value()
        return results, files.fs.digests


@dataclass
class Resolver:
    """What a DCP planner gives the file writer for each item: the staged tensor, or the object's bytes."""

    tensors: dict
    objects: dict

    def resolve_data(self, item):
        return self.tensors[item.index] if item.index in self.tensors else io.BytesIO(self.objects[item.index])


class ChecksummedFileSystem(FileSystem):
    """DCP's file system, whose files are checksummed as they are written (`digests`: {name: [size, CRC-32]})."""

    def __init__(self):
        super().__init__()
        self.digests: dict[str, list[int]] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with Checksummed(Path(path)) as stream:
            yield stream
        self.digests[Path(path).name] = stream.digest


PLAN_KEYS = itertools.count()


class BackgroundWriter:
    def __init__(self, pinned: bool, group: dist.ProcessGroup | None, timeout_s: float = 600.0, dcp_format=False):
        """`pinned`: page-lock the staging buffer (a GPU's state); `group`: a CPU group of every rank for DCP's
        collectives, this writer's own (None in one process); `timeout_s`: how long a copy to another node may take;
        `dcp_format`: write DCP's own file format (a durable checkpoint), else raw files (`hlat.checkpoint.raw`)."""
        self.pinned, self.group, self.timeout_s = pinned, group, timeout_s
        self.files = CheckpointFiles if dcp_format else RawFiles
        self.fd = shared_memory()
        self.channel = WriterProcess.channel(self.fd)  # now: the process is ready by the first save
        self.staging: Staging | None = None
        self.in_flight: Flight | None = None
        self.plans = ""  # DCP's cached plans' key: this writer's, for its staging buffer's layout
        self.planned: Planned | None = None  # raw files: DCP's save of this layout, which later saves repeat

    def start(self, state: dict, target: Path, then: Callable[[object, dict], object], started: float) -> Flight:
        """Copy `state`'s tensors into the staging buffer, and write it into `target` in the background, then run
        `then(DCP's metadata, {file: [size, crc]} of this rank's files)` there (its result is the flight's; raw
        files' `.metadata` is `then`'s to write: DCP writes it only at the first save of a layout); `started`: when
        the caller began this save (the stall counts from it)."""
        staged = self.staging.stage(state) if self.staging is not None else None
        if staged is None:  # the first save, or a state of another layout
            if self.staging is not None:
                self.staging.close()
                forget_plans(self.plans)
            self.staging = Staging(state, self.fd, self.pinned)
            self.plans, self.planned = f"hlat-{next(PLAN_KEYS)}", None
            staged = self.staging.stage(state)
        flight = self.in_flight = Flight(target, time.perf_counter() - started)
        threading.Thread(target=self._write, args=(flight, staged, then), daemon=True).start()
        return flight

    def _write(self, flight: Flight, staged: dict, then: Callable[[object, dict], object]) -> None:
        files = self.files(flight.target, self.staging, self.channel)
        try:  # in a thread of the trainer, which waits for the writer process most of the time
            metadata = self._save(staged, files)
            flight.result = then(metadata, files.digests)
        except BaseException as e:  # reported at the commit, on every rank
            flight.failure = RankWriteFailed.of(e)
        flight.written.set()

    def _save(self, staged: dict, files: RawFiles | CheckpointFiles) -> Metadata:
        """DCP's save of `staged` into `files`, at the first save of a staging layout (and at every one in DCP's
        format); the memory tier's later saves of the layout repeat its plan, with no DCP save and no collective."""
        if self.planned is not None:
            return files.write_again(self.planned, staged)
        metadata = dcp.save(
            staged,
            checkpoint_id=files.path,
            storage_writer=files,
            planner=CachedPlanner(self.plans),
            process_group=self.group,
        )
        if isinstance(files, RawFiles):
            # Every rank takes the same path at each save, so no rank waits in DCP's collectives for one that skips
            # them: dcp.save returns on every rank or raises on every rank, and `planned` is dropped only with the
            # staging layout, which changes on every rank at the same save (it is of the state, whose tensors every
            # rank makes alike; a DTensor's includes its global shape, mesh and placements). DCP's plan cache,
            # keyed by the layout, relies on the same.
            self.planned = Planned(files.plan, files.rank, metadata)
        return metadata

    def call(self, request: Request):
        """Run `request` in the writer process (from the write's thread)."""
        return self.channel.call(request)

    def written(self) -> bool:
        """Whether this rank is done with the write in flight (False with none)."""
        return self.in_flight is not None and self.in_flight.written.is_set()

    def take(self) -> Flight | None:
        """The write in flight once this rank is done with it (waiting for it), and none in flight after."""
        flight, self.in_flight = self.in_flight, None
        if flight is not None:
            flight.written.wait()
        return flight

    def close(self) -> None:
        """Close this writer's channel, and release its staging buffer unless a write still reads it (it stays
        uncommitted: the process is ending, and waiting for a write to a lost peer would hang it)."""
        self.channel.close()
        if self.staging is not None and (self.in_flight is None or self.in_flight.written.is_set()):
            self.staging.close()
        os.close(self.fd)  # the memory lasts while a mapping holds it
        forget_plans(self.plans)
