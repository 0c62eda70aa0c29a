"""The replica groups' membership, decided by `hlat service` (docs/fault-tolerance.md, "Replica groups"); the
workers' side, and the keys both read, are `hlat.train.replicas`'s.

A group's incarnation (one start of its workers) is live while every rank's beat counter moves, by the service's
own clock, within its lease (the group's train.lease_s), and until a rank of it says that it ends on an error (a
peer of its group gone: the group is out at once). The service publishes a new epoch, the members' list, when a
member is no longer live, when a member reports a failed cross-replica collective (then a roll call: the groups
whose every rank answers within `ROLL_CALL_S` stay; a killed rank's group is out in that time rather than the
lease's), or when a live group asks to join. The first epoch waits for every group (or `FIRST_WAIT_S`), so that a
job's groups start together. A dropped incarnation is never admitted again: its group starts anew, as a new
incarnation, and heals.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

from torch.distributed import DistError, PrefixStore, TCPStore

from hlat import REPLICAS_NAMESPACE

TICK_S = 0.05
ROLL_CALL_S = 1.5  # six of a member's beats (hlat.train.replicas.BEAT_S): a loaded host's thread answers in time
FIRST_WAIT_S = 60.0


class Membership:
    """The service's decisions, made by a thread of its own on a connection to the service's store."""

    def __init__(self, port: int):
        self.store = PrefixStore(
            REPLICAS_NAMESPACE, TCPStore("localhost", port, is_master=False, timeout=timedelta(seconds=30))
        )
        self.epoch, self.members, self.dropped = 0, [], set()
        self.seen: dict[str, tuple[int, float]] = {}  # beat key: (counter, when it last moved)
        self.first_ready: float | None = None
        self.thread = threading.Thread(target=self._run, name="hlat-service-membership", daemon=True)

    def start(self) -> None:
        self.store.set("epoch/0", "[]")
        self.store.set("epoch", json.dumps({"e": 0, "members": []}))
        self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(TICK_S)
            try:
                self.tick()
            except DistError:  # the service is stopping
                return

    def tick(self) -> None:
        groups = int(self.store.get("groups")) if self.store.check(["groups"]) else 0
        live = self.live(groups)
        if lost := [m for m in self.members if m not in live]:
            self.publish([m for m in self.members if m not in lost], f"lost {lost}")
        elif self.members and self.store.check([f"fail/e{self.epoch}"]):
            reporter = self.store.get(f"fail/e{self.epoch}").decode()
            self.publish(self.roll_call(), f"a failure reported by {reporter}, roll call")
        elif joining := sorted(m for m in live if m not in self.members and m not in self.dropped):
            waited = time.monotonic() - (self.first_ready or time.monotonic())
            if self.epoch or len(joining) == groups or waited > FIRST_WAIT_S:
                self.publish(sorted(self.members + joining), f"joining {joining}")

    def live(self, groups: int) -> dict[tuple[int, str], dict]:
        """{(group, incarnation): what it asked with} of every group asking to be a member whose ranks' beats all
        moved within its lease."""
        now, live = time.monotonic(), {}
        for g in range(groups):
            if not self.store.check([f"ready/g{g}"]):
                continue
            asked = json.loads(self.store.get(f"ready/g{g}"))
            self.first_ready = self.first_ready or now
            if self.store.check([f"down/g{g}"]) and self.store.get(f"down/g{g}").decode() == asked["inc"]:
                continue  # a rank of it ended on an error: out now, not at its lease
            keys = [f"beat/g{g}/r{r}/{asked['inc']}" for r in range(asked["ranks"])]
            if not self.store.check(keys):
                continue
            fresh = True
            for key, value in zip(keys, self.store.multi_get(keys)):
                counter = int(value)
                last, moved = self.seen.get(key, (-1, now))
                self.seen[key] = (counter, now if counter != last else moved)
                fresh = fresh and now - self.seen[key][1] < asked["lease_s"]
            if fresh:
                live[g, asked["inc"]] = asked
        return live

    def roll_call(self) -> list:
        """The members whose every rank answers the roll call of this epoch within ROLL_CALL_S."""
        self.store.set(f"rollcall/e{self.epoch}", "1")
        keys = {}
        for g, inc in self.members:
            ranks = json.loads(self.store.get(f"ready/g{g}"))["ranks"]
            keys[g, inc] = [f"ack/e{self.epoch}/g{g}/r{r}" for r in range(ranks)]
        deadline = time.monotonic() + ROLL_CALL_S
        while time.monotonic() < deadline and not all(self.store.check(k) for k in keys.values()):
            time.sleep(TICK_S)
        return [m for m in self.members if self.store.check(keys[m])]

    def publish(self, members: list, why: str) -> None:
        self.dropped.update(set(self.members) - set(members))
        self.epoch, self.members = self.epoch + 1, members
        self.store.set(f"epoch/{self.epoch}", json.dumps(members))
        self.store.set("epoch", json.dumps({"e": self.epoch, "members": members}))
        names = ", ".join(f"group {g}" for g, _ in members) or "none"
        print(f"hlat service: replica epoch {self.epoch} ({why}): members {names}", flush=True)
