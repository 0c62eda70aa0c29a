"""Where the workers of one attempt of a torchrun job meet: the store their default process group forms in
(`start_process_group`) and their leases live in (`hlat.parallel.lease`), each user on a connection of its own.

- At the hlat service (`hlat torchrun --rdzv-backend=hlat`, docs/fault-tolerance.md, "The service"): the service's
  store, at MASTER_ADDR:MASTER_PORT, under the namespace the attempt's rendezvous drew (SERVICE_NAMESPACE_ENV), the
  same on every node. No training host hosts anything here: losing any of them costs what losing another costs.
- `hlat torchrun` without the service: a fresh store of each attempt's own, hosted by its rank 0.
- Plain torchrun: the store its agents keep for the whole job, each attempt under its restart count's prefix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hlat import SERVICE_NAMESPACE_ENV
from hlat.parallel.device import backend_for


@dataclass(frozen=True)
class AttemptStore:
    host: str
    port: int
    prefix: str  # this attempt's namespace ("" for a store of the attempt's own)
    service: bool  # the hlat service's store (else one a training process hosts)

    def connect(self, timeout_s: float, host_it: bool = False) -> dist.Store:
        """A new connection (or, `host_it`, the store itself, hosted here), whose operations fail after
        `timeout_s`."""
        store = dist.TCPStore(
            self.host, self.port, is_master=host_it, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        return dist.PrefixStore(self.prefix, store) if self.prefix else store

    def describe(self) -> str:
        where = f"{self.host}:{self.port}"
        return f"the hlat service at {where}" if self.service else f"the job's store at {where}"


def attempt_store() -> AttemptStore:
    """This torchrun worker's attempt store (see the module's docstring)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if namespace := os.environ.get(SERVICE_NAMESPACE_ENV):
        return AttemptStore(host, port, namespace, service=True)
    return AttemptStore(host, port, f"hlat/attempt{restart_attempt()}" if shares_agent_store() else "", False)


def restart_attempt() -> int:
    """Which attempt of its torchrun job this worker is: 0, or n after torchrun restarted the workers n times in
    place (--max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def shares_agent_store() -> bool:
    """Whether this torchrun worker meets its peers in the store its agents keep for the whole job (torchrun's
    default) rather than in a store of this attempt's own (`hlat torchrun`: `hlat/jobs/torchrun.py`)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def start_process_group(device: torch.device, timeout_s: float, bind_device: bool = False) -> AttemptStore:
    """The default process group of a torchrun job (the backend of `device`'s type), formed in this attempt's store,
    which it returns; `bind_device`: its communicators are made at once, on `device` (preflight).

    Where the workers share the agents' store (plain torchrun), restarting them in place leaves the dead attempt's
    keys in it: a rank of the new attempt could read a peer's old address before the peer wrote its new one, and
    gloo then fails to connect ("Connection refused", pytorch/pytorch#167288; NCCL is reported alike). Here 5 of
    10 restarted 2-rank gloo jobs failed so, 0 of 20 with each attempt in a namespace of its own. The attempt
    number is each node's own count (pytorch/pytorch#108158): on several nodes it differs after a failure, so
    `hlat torchrun` gives each attempt a fresh store instead, hosted by its rank 0 and formed in unprefixed, or, at
    the hlat service, a namespace there that every node of the attempt agrees on."""
    timeout = timedelta(seconds=timeout_s)
    where = attempt_store()
    if where.service:
        store, rank, world_size = where.connect(timeout_s), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(where.prefix, store) if where.prefix else store
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if bind_device and device.type != "cpu" else None,
    )
    return where
