"""`hlat service`: the store and rendezvous of a multi-node job, on a host that trains nothing
(docs/fault-tolerance.md, "The service").

torchrun's c10d rendezvous keeps its state in a store, which by default lives in the agent of the endpoint's host, a
training host: losing that host ended the job on every host. Here the store is a `torch.distributed.TCPStore` that
`hlat service` hosts, and every training agent is its client (`hlat torchrun --rdzv-backend=hlat`: torch's own c10d
rendezvous at that store, `is_host` false). Each round of the rendezvous also gives its workers a namespace of their
own in the same store (`ServiceRendezvous`), where they form their process group and keep their leases
(`hlat.parallel.store`), so no training host keeps anything the others need. Under parallel.replica_groups the
service also decides which replica groups are members (`hlat.jobs.membership`). An agent that loses the service ends its
part of the job in one line naming it, with exit code 4 (`lost_service`: the job's restart resumes it).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import uuid
from datetime import timedelta

from torch.distributed import DistError, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    c10d_rendezvous_backend,
    dynamic_rendezvous,
    rendezvous_handler_registry,
)

from hlat import LOST_EXIT, SERVICE_NAMESPACE_ENV, HlatError
from hlat.jobs.launch import SERVICE_PORT
from hlat.jobs.membership import Membership

SERVICE_BACKEND = "hlat"  # torchrun's --rdzv-backend for a rendezvous at the service (registered by hlat torchrun)
NAMESPACE_KEY = "hlat/namespace"  # in the round's own keys: the namespace its workers meet in
READ_TIMEOUT_S = 60  # torch's c10d rendezvous's read_timeout when --rdzv-conf sets none
_said = threading.Lock()  # the service's loss is said once, by whichever part of the agent sees it first


def serve(port: int) -> int:
    """Host the store on `port` until SIGTERM or SIGINT; a port that cannot be listened on is a one-line error."""
    try:  # the store answers on every interface; its own client connects through loopback
        store = TCPStore("localhost", port, is_master=True, wait_for_workers=False)
    except DistError as e:
        raise HlatError(f"service: cannot listen on port {port}: {str(e).splitlines()[0]}") from None
    Membership(port).start()  # the replica groups' (parallel.replica_groups), decided here
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    host = socket.gethostname()
    print(
        f"hlat service: store and rendezvous on {host}:{port} (pid {os.getpid()}); training hosts run "
        f"hlat torchrun --rdzv-backend={SERVICE_BACKEND} --rdzv-endpoint={host}:{port}",
        flush=True,
    )
    try:
        while not stop.wait(3600):
            pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    del store
    print("hlat service: stopped", file=sys.stderr, flush=True)
    return 0


def lost_service(endpoint: str, cause: str) -> int:
    """Say in one line (once) that this agent lost the hlat service at `endpoint`; the exit code that says so."""
    if _said.acquire(blocking=False):
        print(
            f"hlat: error: lost the hlat service at {endpoint}, the job's store and rendezvous ({cause[:200]}): this "
            f"host's part of the job ends (exit code {LOST_EXIT}); where the service is gone, start it and the job "
            "again to resume from the newest snapshot or checkpoint",
            file=sys.stderr,
            flush=True,
        )
    return LOST_EXIT


def endpoint_of(endpoint: str) -> tuple[str, int]:
    """(host, port) of a --rdzv-endpoint, the port SERVICE_PORT when it names none."""
    host, colon, port = endpoint.rpartition(":")
    return (host, int(port)) if colon and port.isdigit() else (endpoint, SERVICE_PORT)


def register_backend() -> None:
    """Make `--rdzv-backend=hlat` known to torchrun in this process (torch's public handler registry)."""
    rendezvous_handler_registry.register(SERVICE_BACKEND, create_handler)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d rendezvous handler at the service, every agent its client, wrapped in `ServiceRendezvous`."""
    params.config["is_host"] = False  # the service hosts the store, whatever the host names say
    backend, store = c10d_rendezvous_backend.create_backend(params)
    watch = ServiceWatch(endpoint_of(params.endpoint), params.get_as_int("read_timeout", READ_TIMEOUT_S))
    return ServiceRendezvous(dynamic_rendezvous.create_handler(store, backend, params), watch)


class ServiceWatch:
    """The agent's own watch on the service. torch's store operations across a link that went silent wait for TCP to
    give up, a quarter of an hour, whatever their timeout: an agent whose service host died unseen, or whose own link
    was cut, would hang that long. Here a thread asks the service something every second and another ends the
    agent's part of the job when no answer came for `deadline_s` (the rendezvous's read_timeout), or at once when
    the service closed the connection. Shorter cuts pass: the agent's waiting operations go on when the link
    returns, and the host rejoins the job."""

    def __init__(self, endpoint: tuple[str, int], deadline_s: float):
        self.endpoint, self.deadline_s = endpoint, deadline_s
        self.answered = 0.0  # when the service last answered; 0 until started

    def start(self) -> None:
        if self.answered:
            return
        self.store = TCPStore(*self.endpoint, is_master=False, timeout=timedelta(seconds=self.deadline_s))
        self.answered = time.monotonic()
        for target in (self._ask, self._fence):
            threading.Thread(target=target, name=f"hlat-service-{target.__name__[1:]}", daemon=True).start()

    def _ask(self) -> None:
        while True:
            time.sleep(1.0)
            try:
                self.store.check([NAMESPACE_KEY])
            except DistError as e:  # a closed connection stays closed
                self._end(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            self.answered = time.monotonic()

    def _fence(self) -> None:
        while time.monotonic() - self.answered <= self.deadline_s:
            time.sleep(1.0)
        self._end(f"no answer for {self.deadline_s:g} s (read_timeout)")

    def _end(self, cause: str) -> None:
        os._exit(lost_service("{}:{}".format(*self.endpoint), cause))  # its workers end by their own leases


class ServiceRendezvous(RendezvousHandler):
    """torchrun's c10d rendezvous handler (`inner`), whose workers meet at the service too: each round's first node
    draws a namespace and writes it among the round's own keys, where every node of the round reads it; the agent
    passes it to the workers it starts (they inherit its environment) with the service as their MASTER_ADDR and
    MASTER_PORT. A namespace per round keeps a dead attempt's keys away from the next one, which one store for the
    whole job would otherwise mix (torchrun's restart count, which hlat once kept them apart by, is each node's own:
    pytorch/pytorch#108158)."""

    def __init__(self, inner: RendezvousHandler, watch: ServiceWatch):
        self.inner, self.watch = inner, watch

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        if info.rank == 0:
            info.store.set(NAMESPACE_KEY, f"hlat/{self.inner.get_run_id()}/{uuid.uuid4().hex}")
        os.environ[SERVICE_NAMESPACE_ENV] = info.store.get(NAMESPACE_KEY).decode()
        self.watch.start()  # once the service has answered: an agent may start before it
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(*self.watch.endpoint))

    def get_backend(self) -> str:
        return SERVICE_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False  # the workers make their own connection to the service (hlat.parallel.store)

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()
