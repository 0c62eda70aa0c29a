"""Leases (hlat/parallel/lease.py): ranks of one process, each with its own connection to a store this test hosts, a
lease of 1 s (a beat every 0.2 s). A rank whose beats stop is declared lost by its watcher within the lease and a
few beats, and every other rank reads the declaration; a rank that leaves cleanly is never declared; a rank whose
store is gone knows it within a beat, and one whose store stops answering (a cut link) when its lease runs out."""

import os
import socket
import time

import pytest
import torch.distributed as dist

from hlat.parallel.lease import Expired, Lease, watched_ranks
from hlat.parallel.store import AttemptStore

LEASE_S = 1.0


@pytest.fixture
def store():
    master = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    yield master
    del master


class Ranks:
    """`n` ranks' leases, one node per rank (each watches the next), their expiries collected."""

    def __init__(self, store, n: int, lease_s: float = LEASE_S):
        where = AttemptStore("localhost", store.port, "hlat/test", service=True)
        self.expired: dict[int, Expired] = {}
        self.leases = [Lease(where, r, n, 1, lease_s, self.catch(r)).__enter__() for r in range(n)]
        self.started = time.monotonic()

    def catch(self, rank: int):
        def on_expired(expired: Expired) -> None:
            self.expired[rank] = expired

        return on_expired

    def silence(self, rank: int) -> None:
        """The rank's beats stop, as a stopped process's or a cut-off host's would (it does not leave)."""
        self.leases[rank]._stop.set()
        for thread in self.leases[rank]._threads:
            thread.join()

    def wait(self, ranks: set[int], timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while set(self.expired) < ranks and time.monotonic() < deadline:
            time.sleep(0.02)
        return time.monotonic() - self.started

    def close(self) -> None:
        for lease in self.leases:
            lease._stop.set()


def test_the_watched_ranks_put_a_watcher_on_another_node():
    assert watched_ranks(0, 4, 2) == [1, 2] and watched_ranks(3, 4, 2) == [0, 1]  # node 1 = ranks 2, 3
    assert watched_ranks(0, 2, 8) == [1] and watched_ranks(0, 1, 8) == []


def test_a_silent_rank_is_declared_lost_within_its_lease_and_every_rank_learns_it(store):
    ranks = Ranks(store, 3)  # 0 watches 1, 1 watches 2, 2 watches 0
    try:
        time.sleep(2 * LEASE_S)  # beating: nobody is declared
        assert not ranks.expired
        ranks.silence(1)
        silenced = time.monotonic()
        ranks.wait({0, 2}, timeout=10 * LEASE_S)
        found_s = time.monotonic() - silenced
    finally:
        ranks.close()
    declared, read = ranks.expired[0], ranks.expired[2]
    assert (declared.kind, declared.rank, declared.declared_by) == ("peer", 1, 0)
    assert declared.who == {"host": socket.gethostname(), "pid": os.getpid()}
    assert LEASE_S <= declared.silent_s < 3 * LEASE_S  # the lease, and a beat that may be late on a loaded machine
    assert read == declared  # rank 2 does not watch rank 1: it read rank 0's declaration
    assert found_s < 5 * LEASE_S, found_s  # the lease, a late beat or two, and the reader's next beat


def test_a_rank_that_leaves_cleanly_is_not_declared(store):
    ranks = Ranks(store, 2)
    try:
        ranks.leases[1].__exit__(None, None, None)
        ranks.wait({0}, timeout=3 * LEASE_S)
    finally:
        ranks.close()
    assert not ranks.expired


def test_a_rank_whose_store_is_gone_knows_it_within_a_beat():
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    ranks = Ranks(store, 2, lease_s=5.0)  # long enough that an end within it is not the lease's
    try:
        time.sleep(LEASE_S / 2)
        del store  # the only reference: the server stops and its connections close, as when the service ends
        lost = time.monotonic()
        ranks.wait({0, 1}, timeout=10.0)
        found_s = time.monotonic() - lost
    finally:
        ranks.close()
    assert {e.kind for e in ranks.expired.values()} == {"store"}
    assert all(e.where.startswith("the hlat service at localhost:") and e.cause for e in ranks.expired.values())
    assert found_s < 2.5, found_s  # a beat (1 s), however late, not the lease (5 s)


class Unanswered:
    """A store whose every operation waits, as one across a cut link does (until TCP gives up)."""

    def __getattr__(self, name):
        return lambda *args: time.sleep(3600)


def test_a_rank_whose_store_stops_answering_ends_its_lease_on_time(store):
    ranks = Ranks(store, 2)
    try:
        ranks.leases[1].store = Unanswered()
        cut = time.monotonic()
        ranks.wait({1}, timeout=5 * LEASE_S)
        found_s = time.monotonic() - cut
    finally:
        ranks.close()
    expired = ranks.expired[1]
    assert (expired.kind, expired.rank, expired.cause) == ("store", 1, "no answer")
    assert LEASE_S - 0.3 < found_s < 3 * LEASE_S, found_s  # from the renewal before the cut, plus a late beat
