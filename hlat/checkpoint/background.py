"""The one background writer of both tiers (`BackgroundWriter`): a state dict is copied to host memory at once
(training stalls only for that copy), written with DCP in a background thread, and the tier's own work after the
write (the durable tier's checksums; the memory tier's copy to its buddy and its record) runs there too. Its result,
or this rank's failure (`RankWriteFailed`), waits in the `Flight` for the tier to commit it. At most one write is in
flight per writer, and each writer runs its collectives on a CPU group of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.torch_version import TorchVersion

from hlat import HlatError
from hlat.files import refused_write

# torch < 2.13 empties a stager's copy tables after each stage (the next stage on it fails): there each write gets
# a stager of its own, and a write stalls for the host buffers' allocation too
STAGER_KEEPS_BUFFERS = TorchVersion(torch.__version__) >= "2.13"


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


class BackgroundWriter:
    def __init__(self, pinned: bool, group: dist.ProcessGroup | None):
        """`pinned`: copy into pinned host memory (a GPU's state, copied without waiting for its queued work);
        `group`: a CPU group of every rank for DCP's collectives, this writer's own (None in one process)."""
        self.staging = StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=pinned
        )
        # one stager for the run keeps its host buffers, so that a write stalls only for the copy
        self.stager = DefaultStager(self.staging) if STAGER_KEEPS_BUFFERS else None
        self.group = group
        self.in_flight: Flight | None = None

    def start(self, state: dict, target: Path, then: Callable[[], object], started: float) -> Flight:
        """Copy `state` to host memory and write it into `target` in the background, then run `then` there (its
        result is the flight's); `started`: when the caller began this save (the stall counts from it)."""
        stager = self.stager or DefaultStager(self.staging)
        future = dcp.async_save(state, checkpoint_id=target, async_stager=stager, process_group=self.group)
        flight = self.in_flight = Flight(target, time.perf_counter() - started)
        future.add_done_callback(lambda f: self._written(f, flight, then, None if self.stager else stager))
        return flight

    @staticmethod
    def _written(future, flight: Flight, then: Callable[[], object], stager: DefaultStager | None) -> None:
        try:  # in DCP's writer thread
            future.result()
            flight.result = then()
        except BaseException as e:  # reported at the commit, on every rank
            flight.failure = RankWriteFailed.of(e)
        if stager is not None:
            stager.close()
        flight.written.set()

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
        """Release the host buffers, unless a write still reads them (it stays uncommitted: the process is ending, and
        waiting for a write to a lost peer would hang it)."""
        if self.stager is not None and (self.in_flight is None or self.in_flight.written.is_set()):
            self.stager.close()
