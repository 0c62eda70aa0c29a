"""Each rank's lease in its attempt's store (docs/fault-tolerance.md, "Leases"), so that a silent peer (a host cut
off, stopped, lost without a reset) is found in seconds rather than when a collective times out.

A thread beats every `beat_s` (about a second): it adds 1 to this rank's counter in the store and reads, in one more
request, the counters of the ranks it watches (the next ranks, as many as a node holds, so that every rank has a
watcher on another node) and the attempt's count of declared losses. A watched rank whose counter has not moved for
`lease_s`, by the watcher's own clock (no clocks are compared across hosts), is declared lost: recorded in the store,
where every other rank reads it at its next beat. A rank that cannot renew its own lease (the store unreachable, or
an operation on it outlasting the lease: the service is lost, or this host is cut off) knows that its peers declare it
lost, or that the job lost its store. Either way the lease hands an `Expired` to `on_expired` (once), the one place
that acts on it. A rank that leaves cleanly says so, and is no longer watched.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from torch.distributed import DistError

from hlat.parallel.store import AttemptStore

LEFT = 10**15  # added to a counter by a rank that leaves cleanly: no longer watched
LOST_COUNT, LOST_RECORD = "lease/lost", "lease/lost_record"


@dataclass
class Expired:
    """A lease that ran out: `rank`'s (a peer declared lost, kind "peer"), this rank's own (kind "store": it
    could not renew it, `cause` says why), or replica group `rank`'s membership (kind "replica": the service dropped
    it, `cause` names the epoch; hlat.train.replicas)."""

    kind: Literal["peer", "store", "replica"]
    rank: int
    silent_s: float
    where: str  # the store, described
    who: dict = field(default_factory=dict)  # the silent rank's host and pid, as it wrote them at its start
    declared_by: int | None = None  # the rank that declared the peer lost (this one, or another watcher)
    cause: str = ""


def watched_ranks(rank: int, world_size: int, per_node: int) -> list[int]:
    """The ranks after `rank` (cyclically), as many as a node holds: a whole node's ranks are then watched by the
    previous node's, and each rank by at least one rank on another node."""
    return [(rank + i) % world_size for i in range(1, min(per_node, world_size - 1) + 1)]


def beat_interval(lease_s: float) -> float:
    """A second, or a fifth of a shorter lease: a beat can be late a few times over before the lease runs out."""
    return min(1.0, lease_s / 5)


class Lease:
    """This rank's lease and its watch over its peers', held from `__enter__` to `__exit__` (a clean exit leaves)."""

    def __init__(
        self,
        where: AttemptStore,
        rank: int,
        world_size: int,
        per_node: int,
        lease_s: float,
        on_expired: Callable[[Expired], None],
    ):
        self.where, self.rank, self.lease_s, self.on_expired = where, rank, lease_s, on_expired
        self.beat_s = beat_interval(lease_s)
        self.watched = watched_ranks(rank, world_size, per_node)
        self.renewed = time.monotonic()  # when this rank's counter last went up
        self._stop, self._leaving, self._fired = threading.Event(), threading.Event(), threading.Lock()
        # the beats, and the fence: a store operation on a cut link waits for TCP to give up (a quarter of an
        # hour), whatever the store's timeout, so the lease's own end is kept by a thread that never waits on it
        self._threads = [
            threading.Thread(target=target, name=f"hlat-lease-{target.__name__[1:]}", daemon=True)
            for target in (self._beat, self._fence)
        ]

    def __enter__(self) -> Lease:
        self.store = self.where.connect(self.lease_s)
        self.store.set(f"lease/{self.rank}/who", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        for r in [self.rank, *self.watched]:
            self.store.add(f"lease/{r}", 0)  # made now, so that reading them never waits for a late rank
        self.store.add(LOST_COUNT, 0)
        self.renewed = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:  # a clean end: the ranks still finishing must not declare this one lost
            self._leaving.set()
        self._stop.set()
        self._threads[0].join(timeout=self.lease_s)  # its last act is to leave, unless the store is out of reach

    def _beat(self) -> None:
        keys = [f"lease/{r}" for r in self.watched] + [LOST_COUNT]
        seen = {r: (-1, self.renewed) for r in self.watched}  # counter, when it last moved
        while not self._stop.wait(self.beat_s):
            try:
                self.store.add(f"lease/{self.rank}", 1)
                self.renewed = time.monotonic()
                *counters, lost = (int(v) for v in self.store.multi_get(keys))
                expired = self._declared() if lost else self._silent(seen, counters, self.renewed)
            except DistError as e:  # a closed connection stays closed: the service is gone
                expired = self._unrenewed(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            if expired is not None:
                return self._expire(expired)
        if self._leaving.is_set():
            with contextlib.suppress(DistError):  # the store is gone: nobody is left to watch
                self.store.add(f"lease/{self.rank}", LEFT)

    def _fence(self) -> None:
        while not self._stop.wait(self.beat_s):
            if time.monotonic() - self.renewed > self.lease_s:
                return self._expire(self._unrenewed("no answer"))

    def _unrenewed(self, cause: str) -> Expired:
        return Expired("store", self.rank, time.monotonic() - self.renewed, self.where.describe(), cause=cause)

    def _expire(self, expired: Expired) -> None:
        """Hand the first expiry to `on_expired`, and stop."""
        if self._fired.acquire(blocking=False):
            self._stop.set()
            self.on_expired(expired)

    def _silent(self, seen: dict, counters: list[int], now: float) -> Expired | None:
        """Declare the first watched rank whose counter has not moved for the lease, if any."""
        for r, counter in zip(self.watched, counters):
            last, moved = seen[r]
            if counter >= LEFT:
                seen[r] = (counter, now)  # left cleanly: never silent
            elif counter != last:
                seen[r] = (counter, now)
            elif now - moved > self.lease_s:
                return self._declare(r, now - moved)
        return None

    def _declare(self, r: int, silent_s: float) -> Expired:
        who = self.store.get(f"lease/{r}/who") if self.store.check([f"lease/{r}/who"]) else b"{}"
        expired = Expired("peer", r, silent_s, self.where.describe(), json.loads(who), self.rank)
        self.store.set(LOST_RECORD, json.dumps(expired.__dict__))
        self.store.add(LOST_COUNT, 1)
        return expired

    def _declared(self) -> Expired:
        """The loss another rank declared."""
        return Expired(**json.loads(self.store.get(LOST_RECORD)))
