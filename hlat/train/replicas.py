"""Data-parallel replica groups as fault domains (parallel.replica_groups; docs/fault-tolerance.md, "Replica groups").

Each replica group is a torchrun job of its own, whose default group and meshes are the group's alone, so that a
failure in one touches no other. What the groups share lives at the hlat service, in the job-wide namespace
`REPLICAS_NAMESPACE` (the service's side: `hlat.jobs.membership`):

  groups                    the number of replica groups
  ready/g{G}                JSON {"inc", "ranks", "lease_s"}: group G's incarnation asks to be a member
  down/g{G}                 the incarnation of group G whose rank ended on an error (a peer of its group gone)
  beat/g{G}/r{R}/{inc}      each rank's beat counter, added to by a thread of its own (`Membership`)
  epoch, epoch/{E}          the membership: {"e": E, "members": [[G, inc], ...]}, one epoch per change
  fail/e{E}                 a member's cross-replica collective of epoch E failed: the service calls the roll
  rollcall/e{E}, ack/e{E}/g{G}/r{R}   the roll call, and each rank's answer
  e{E}/step/g{G}            each member's committed step, when an epoch starts (`ReplicaGroups.join`)
  x/e{E}/r{R}, heal/e{E}/r{R}/{G}     where each epoch's cross-replica groups and healing pairs form

A step: every rank of a group agrees on the newest epoch any of them has seen; each local rank position forms a gloo
group with the same position of every member (`cross`, anew for each epoch); the step's gradient shards (and the
loss) are summed over it, and the step is committed where every rank of the group completed that all-reduce (agreed
with the step's own flags: `hlat.train.step`). A wait on a peer is abandoned as soon as a later epoch comes (gloo
cannot cancel an operation in flight: the group is kept referenced, its thread ends at its timeout), and the step
runs again in that epoch. A group behind the highest committed step when an epoch starts receives, rank by rank,
the local shards of the weights and the optimizer state, the step, the data position with the rounds of data in hand
and the generators from a group at that step, over a group of the two (a broadcast: gloo's send and receive have
no futures to watch).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import DistError
from torch.distributed.tensor import DTensor

from hlat import REPLICAS_NAMESPACE, SERVICE_NAMESPACE_ENV
from hlat.checkpoint.state import TrainState, rng_state, set_rng_state
from hlat.dtensor import local
from hlat.files import append_text
from hlat.parallel import Topology
from hlat.parallel.lease import Expired
from hlat.parallel.store import AttemptStore
from hlat.torch_private import gloo_group
from hlat.train.step import Batches, Share

BEAT_S = 0.25  # a member's beat and its look at the epoch: a roll call is answered within this


class Lost(Exception):
    """The epoch dropped a member this rank was waiting on (or a heal failed): the epoch is abandoned."""


def connect(where: AttemptStore, timeout_s: float) -> dist.Store:
    """A new connection to the job-wide replica namespace at the service."""
    store = dist.TCPStore(where.host, where.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(REPLICAS_NAMESPACE, store)


class Membership:
    """This rank's beat at the service and its view of the epoch, kept by a thread with a connection of its own, so
    that a rank busy in a step or blocked in a collective still beats, answers a roll call and learns of a new
    epoch. Each group the epoch drops is handed to `on_dropped` (an `Expired` of kind "replica":
    `hlat.train.faults.lease_expired` decides whether this rank ends or goes on)."""

    def __init__(self, where: AttemptStore, group: int, rank: int, inc: str, on_dropped: Callable[[Expired], None]):
        self.where, self.group, self.rank, self.inc, self.on_dropped = where, group, rank, inc, on_dropped
        self.epoch, self.members = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hlat-replica-membership", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = connect(self.where, 30)
            while not self._stop.wait(BEAT_S):
                self._look(store)
        except DistError as e:  # the service is gone: as a lease that cannot be renewed
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.on_dropped(Expired("store", self.rank, 0.0, self.where.describe(), cause=cause))

    def _look(self, store: dist.Store) -> None:
        store.add(f"beat/g{self.group}/r{self.rank}/{self.inc}", 1)
        if not store.check(["epoch"]):
            return
        view = json.loads(store.get("epoch"))
        if view["e"] != self.epoch:
            members = [tuple(m) for m in view["members"]]
            dropped = [m for m in self.members if m not in members]
            self.epoch, self.members = view["e"], members
            for group, _ in dropped:
                self.on_dropped(Expired("replica", group, 0.0, self.where.describe(), cause=f"epoch {self.epoch}"))
        call = f"rollcall/e{self.epoch}"
        if store.check([call]):
            store.set(f"ack/e{self.epoch}/g{self.group}/r{self.rank}", "1")

    def after(self, epoch: int) -> bool:
        """Whether this thread has seen an epoch after `epoch`. Each rank's thread learns of an epoch on its own beat,
        so it may still be at an earlier one than the epoch its group agreed on (`ReplicaGroups.begin`): only a later
        one ends `epoch`."""
        return self.epoch > epoch


class ReplicaGroups:
    """A rank's side of the replica groups: the epoch agreed at each step, the cross-replica all-reduce, the join
    and its heal. `state` is the trainer's `TrainState`, `batches` its `Batches` (its `share` set here)."""

    def __init__(
        self,
        topo: Topology,
        group: int,
        groups: int,
        timeout_s: float,
        lease_s: float,
        run_dir: Path,
        state: TrainState,
        batches: Batches,
        on_dropped: Callable[[Expired], None],
    ):
        self.where: AttemptStore = topo.store
        self.group, self.groups, self.rank, self.ranks = group, groups, topo.rank, topo.world_size
        self.timeout_s, self.lease_s, self.state, self.batches = timeout_s, lease_s, state, batches
        self.side = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # the group's own ranks
        self.inc = os.environ.get(SERVICE_NAMESPACE_ENV, "").rsplit("/", 1)[-1]  # this start of the group's workers
        self.store = connect(self.where, timeout_s)
        self.membership = Membership(self.where, group, self.rank, self.inc, on_dropped)
        self.epoch, self.members, self.cross = -1, [], None
        self.graveyard: list = []  # groups abandoned with an operation in flight: kept until their threads end
        self.dp, self.dp_rank, self.log = topo.cfg.dp, topo.dp_rank, run_dir / f"replicas_rank{topo.rank}.jsonl"

    def __enter__(self) -> ReplicaGroups:
        """Beat, then (rank 0, once every rank is there) ask the service to admit this incarnation. A group that
        joins a running job makes no round of data before it heals: the live group hands it the rounds it holds."""
        self.membership.start()
        dist.barrier(group=self.side)
        if self.rank == 0:
            self.store.set("groups", str(self.groups))
            self.store.set(
                f"ready/g{self.group}", json.dumps({"inc": self.inc, "ranks": self.ranks, "lease_s": self.lease_s})
            )
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.membership.stop()
        if exc_type is None and self.rank == 0:  # every step done: a group that starts now has no one to join
            self.store.set("finished", str(self.state.step))
        elif exc_type is not None:  # this rank ends (a peer of its group is gone): the service drops the group now
            with contextlib.suppress(DistError):
                self.store.set(f"down/g{self.group}", self.inc)

    @property
    def me(self) -> tuple[int, str]:
        return (self.group, self.inc)

    def begin(self) -> None:
        """Before each step: the epoch the group's ranks agree on; a new one forms its cross-replica groups and
        joins (healing this group if it is behind). Waits until this incarnation is a member."""
        while True:
            epoch = self._agreed_epoch()
            if epoch == self.epoch:
                return
            members = [tuple(m) for m in json.loads(self.store.get(f"epoch/{epoch}"))] if epoch else []
            self.ended_without_us()
            if self.me not in members:
                time.sleep(0.05)  # not admitted yet (a dropped member is ended by its membership's thread)
                continue
            ok, heal = True, None
            try:  # every rank of the group takes the epoch, or none: its side group's collectives stay in step
                self._form(epoch, members)
                heal = self.join()
            except (Lost, DistError, RuntimeError):
                ok = False
            if agree(ok, self.side):
                self.healed(heal)
                return
            self.abandon()

    def ended_without_us(self) -> None:
        """A group that asks to join a job whose groups have all finished ends: there is no one to heal from, and
        the finished groups' checkpoints hold the run's end."""
        if not agree(not self.store.check(["finished"]), self.side):  # the group's ranks end together
            print(
                f"hlat: rank {self.rank} of replica group {self.group}: the job's other replica groups finished; "
                "this group ends",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(0)

    def _agreed_epoch(self) -> int:
        seen = torch.tensor([self.membership.epoch], dtype=torch.int64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.side)
        return int(seen.item())

    def _form(self, epoch: int, members: list) -> None:
        self.epoch, self.members = epoch, members
        position, live = members.index(self.me), len(members)
        self.batches.share = Share(position, live)
        store = dist.PrefixStore(f"x/e{epoch}/r{self.rank}", self.store)
        self.cross = self.watched(lambda: gloo_group(store, position, live, self.timeout_s)) if live > 1 else None

    def watched(self, make: Callable):
        """`make()` (a group, which waits in the store for every peer to connect), given up as soon as an epoch
        drops a member: it runs in a thread of its own, left to end at its timeout."""
        made: list = []
        thread = threading.Thread(target=lambda: made.append(make()), name="hlat-replica-form", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.02)
            if self.membership.after(self.epoch):
                self.graveyard.append(thread)
                raise Lost(f"epoch {self.membership.epoch} came while epoch {self.epoch}'s groups formed")
        if not made:
            raise Lost(f"epoch {self.epoch}'s group did not form")
        return made[0]

    def abandon(self) -> None:
        """The epoch is lost: keep its groups referenced and wait for the service's next one, asking for it (a
        failure report: the service's roll call keeps the members that answer) where no member was dropped, so that
        groups whose ranks gave the epoch up at different points meet again in a fresh one."""
        self.graveyard.append(self.cross)
        self.cross = None
        if not self.membership.after(self.epoch):
            with contextlib.suppress(DistError):
                self.store.set(f"fail/e{self.epoch}", f"g{self.group}r{self.rank} gave the epoch up")
        while not self.membership.after(self.epoch):
            time.sleep(0.02)

    def wait(self, work) -> None:
        """Wait for `work`; raise Lost as soon as a later epoch comes. An epoch ends for a member that was dropped,
        one that was admitted, or a member that gave the epoch up (a group whose join failed while the others'
        succeeded): the others must not wait for it in a collective it has left."""
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        while not done.wait(0.02):
            if self.membership.after(self.epoch):
                raise Lost(f"epoch {self.membership.epoch} came while epoch {self.epoch}'s collective ran")
        work.wait()  # raises the collective's own error

    def all_reduce(self, params: list[torch.Tensor], local_loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """This rank's gradient shards and loss averaged over the live groups' same ranks, in one all-reduce of one
        flat buffer; (the loss, whether the all-reduce completed). A failure is reported to the service."""
        if self.cross is None:
            return local_loss, True
        grads = [local(p.grad) for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1).float().cpu() for g in grads] + [local_loss.float().reshape(1).cpu()])
        try:
            self.wait(self.cross.allreduce([flat]))
        except Lost:
            return local_loss, False
        except (DistError, RuntimeError):  # a peer's process died: its connection was reset
            self.store.set(f"fail/e{self.epoch}", f"g{self.group}r{self.rank}")
            return local_loss, False
        flat /= len(self.members)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat[-1].to(local_loss.device), True

    def takes_turn(self, interval: int) -> bool:
        """Whether this group writes the job's `interval`-th periodic checkpoint: the live groups hold the same state,
        so they take the checkpoints in turns, each written once (every group writes the last step's)."""
        return self.members[interval % len(self.members)] == self.me

    def committed(self) -> None:
        """Record the step just committed (`replicas_rank<R>.jsonl` in the group's run directory): its epoch, the
        live groups, this process, the micro-batches and tokens it trained on, so that a run's data can be counted."""
        record = {"step": self.state.step + 1, "epoch": self.epoch, "live": len(self.members), "pid": os.getpid()}
        record["time"] = time.time()
        record |= self.batches.trained(self.dp, self.dp_rank)
        append_text(self.log, json.dumps(record) + "\n", self.log.parent)

    def step_failed(self) -> None:
        """The group agreed that some rank's all-reduce did not complete: the step is not committed; the epoch is
        abandoned."""
        self.abandon()

    # --- joining ---------------------------------------------------------------------------------------------

    def join(self) -> tuple[int, int, torch.Tensor | None]:
        """Every member posts its committed step; each group behind the highest receives, rank by rank, the state of
        the first group at it. (the group it came from, the step, what this rank received: None when not behind);
        loaded by `healed` once the group's ranks agree that every one has it."""
        if self.rank == 0:
            self.store.set(f"e{self.epoch}/step/g{self.group}", str(self.state.step))
        keys = [f"e{self.epoch}/step/g{g}" for g, _ in self.members]
        self._wait_keys(keys)
        posted = [int(v) for v in self.store.multi_get(keys)]
        top = max(posted)
        source, behind = posted.index(top), [i for i, s in enumerate(posted) if s < top]
        position, received = self.members.index(self.me), None
        if position == source:
            for i in behind:
                self._pair(i, 0).send(heal_payload(self.state, self.batches), self.wait)
        elif position in behind:
            received = self._pair(position, 1).receive(self.wait)
        return self.members[source][0], top, received

    def healed(self, heal: tuple[int, int, torch.Tensor | None]) -> None:
        """Load what this rank received, if anything, and say where the group stands."""
        source, top, received = heal
        if received is not None:
            load_heal_payload(self.state, self.batches, received)
        if self.rank == 0:
            print(
                f"hlat: replica group {self.group}: epoch {self.epoch}, {len(self.members)} groups live from step "
                f"{self.state.step}" + (f"; healed from group {source} at step {top}" if received is not None else ""),
                file=sys.stderr,
                flush=True,
            )

    def _wait_keys(self, keys: list[str]) -> None:
        while not self.store.check(keys):
            if self.membership.after(self.epoch):
                raise Lost(f"epoch {self.membership.epoch} came while epoch {self.epoch}'s members posted their steps")
            time.sleep(0.02)

    def _pair(self, behind: int, rank: int) -> Pair:
        store = dist.PrefixStore(f"heal/e{self.epoch}/r{self.rank}/{behind}", self.store)
        return Pair(self.watched(lambda: gloo_group(store, rank, 2, self.timeout_s)))


def agree(ok: bool, group) -> bool:
    """Whether every rank of the group is ok."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


@dataclass
class Pair:
    """A group of two: the healthy group's rank (0) and the same rank of the group it heals (1)."""

    group: dist.ProcessGroup

    def send(self, payload: torch.Tensor, wait: Callable) -> None:
        wait(self.group.broadcast([torch.tensor([payload.numel()], dtype=torch.int64)], dist.BroadcastOptions()))
        wait(self.group.broadcast([payload], dist.BroadcastOptions()))

    def receive(self, wait: Callable) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64)
        wait(self.group.broadcast([size], dist.BroadcastOptions()))
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        wait(self.group.broadcast([payload], dist.BroadcastOptions()))
        return payload


# --- what a heal carries ---------------------------------------------------------------------------------------


def heal_tensors(state: TrainState) -> tuple[list[torch.Tensor], dict]:
    """This rank's local shards of the weights and of every optimizer state tensor, and what describes the rest:
    each state tensor's key, whether it is a DTensor, its local shape and dtype (a group that never stepped has
    none yet), the optimizer's other per-parameter values and its settings."""
    tensors = [local(p).detach() for part in state.parts for p in part.parameters()]
    layout, others = [], []
    for optimizer in state.optimizers:
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            held = optimizer.state.get(p, {})
            kinds = [
                (k, isinstance(v, DTensor), tuple(local(v).shape), v.dtype) for k, v in held.items() if is_tensor(v)
            ]
            layout.append(kinds)
            others.append({k: v for k, v in held.items() if not is_tensor(v)})
            tensors += [local(held[k]).detach() for k, *_ in kinds]
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in state.optimizers]
    return tensors, {"layout": layout, "others": others, "groups": groups}


def is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def heal_payload(state: TrainState, batches: Batches) -> torch.Tensor:
    """Everything a healing rank receives, in one byte buffer: the header's length, the pickled header (step, data
    position and rounds in hand, generators, the optimizer's layout and settings), the tensors' bytes."""
    tensors, described = heal_tensors(state)
    header = {"step": state.step, "data": batches.handover(), "rng": rng_state(), **described}
    head = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8)
    body = [t.contiguous().reshape(-1).cpu().view(torch.uint8) for t in tensors]
    return torch.cat([torch.tensor([head.numel()], dtype=torch.int64).view(torch.uint8), head, *body])


def load_heal_payload(state: TrainState, batches: Batches, payload: torch.Tensor) -> None:
    """Set this rank's state from a healthy peer's `heal_payload`: the optimizer's state made in its layout first."""
    length = int(payload[:8].view(torch.int64).item())
    header = pickle.loads(payload[8 : 8 + length].numpy().tobytes())
    params = [p for optimizer in state.optimizers for group in optimizer.param_groups for p in group["params"]]
    owners = [o for o in state.optimizers for group in o.param_groups for _ in group["params"]]
    for p, optimizer, kinds, others in zip(params, owners, header["layout"], header["others"]):
        made = {k: torch.empty(shape, dtype=dtype, device=p.device) for k, _, shape, dtype in kinds}
        optimizer.state[p] = {**others, **{k: as_parameter(made[k], p) if d else made[k] for k, d, *_ in kinds}}
    for optimizer, groups in zip(state.optimizers, header["groups"]):
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
    tensors, _ = heal_tensors(state)
    offset = 8 + length
    with torch.no_grad():
        for t in tensors:
            n = t.numel() * t.element_size()
            t.copy_(payload[offset : offset + n].clone().view(t.dtype).view(t.shape))  # clone: aligned for its dtype
            offset += n
    state.step = header["step"]
    batches.take_over(header["data"])
    set_rng_state(header["rng"])


def as_parameter(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`t`, this rank's local part, as a DTensor laid out like the parameter `p`."""
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
