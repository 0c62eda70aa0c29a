"""How often the memory tier snapshots (`train.snapshot_every`), and what each snapshot costs the training, measured
(docs/fault-tolerance.md).

A snapshot's cost is what training lost to it: the copy to host memory the step waited for (the stall), how much
longer than the steady steps the steps run while it was written took (the slowdown: on a CPU that trains, the write
takes the step's cores; with cores of its own, little), and the wait after those steps for every rank to have
written it (the settle). It is measured for every committed snapshot, whatever the setting, and reported in the
metrics; `train.snapshot_every = -1` (`AUTO`) also tunes the interval from it: every step, unless a snapshot costs
more than `STALL_SHARE` of its steps' time, then the fewest steps apart that keep it under.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from hlat.groups import gather_objects

AUTO = -1  # train.snapshot_every = -1: every step, unless that costs training more than STALL_SHARE
STALL_SHARE = 0.05
STEADY_STEPS = 16  # the latest steps with no snapshot written during them: their median is the steady step time


@dataclass
class SnapshotCost:
    """What one snapshot cost, as it was measured."""

    stall_s: float  # the save's copy to host memory, which the step waited for
    during_s: list[float] = field(default_factory=list)  # the times of the steps run while it was written
    settled_s: float = 0.0  # the wait after those steps for it to be written on every rank


class SnapshotCadence:
    """Which steps snapshot, and the measured cost of those committed: none before a steady step (a process's first
    step, with its warm-up, is none); under `AUTO` the first snapshot at once, then every K steps, K tuned."""

    def __init__(self, every: int):
        self.auto = every == AUTO
        self.every = 0 if self.auto else every
        self.steady: deque[float] = deque(maxlen=STEADY_STEPS)
        self.steps_run = 0  # by this process
        self.saves = 0
        self.measuring: SnapshotCost | None = None  # the snapshot being written
        self.costs: list[float] = []  # the costs of the snapshots committed since the last tuning
        self.measured = 0
        self.last: dict | None = None  # the newest committed snapshot's cost, for the metrics

    def due(self, step: int) -> bool:
        """Whether the state at `step` is snapshot: never before a steady step (so that what a snapshot slows is
        measured against one: a process's first snapshot is of its second step at the earliest); under `AUTO` the
        first once, then every tuned K steps."""
        if not self.steady:
            return False
        if self.auto and not self.measured:
            return not self.saves
        return self.every > 0 and step % self.every == 0

    def saved(self, stall_s: float) -> None:
        """A snapshot was taken, the step stalling `stall_s` for its copy."""
        self.saves += 1
        self.measuring = SnapshotCost(stall_s)

    def stepped(self, step_s: float) -> None:
        """A step ended in `step_s`: the time of a step run while a snapshot was written, or of a steady one (not
        the process's first, slow with its warm-up)."""
        self.steps_run += 1
        if self.measuring is not None:
            self.measuring.during_s.append(step_s)
        elif self.steps_run > 1:
            self.steady.append(step_s)

    def settled(self, wait_s: float) -> None:
        if self.measuring is not None:
            self.measuring.settled_s = wait_s

    def committed(self, failed: bool) -> None:
        """The snapshot being written was committed (or dropped, `failed`): its cost is known, once a steady step
        time is."""
        cost, self.measuring = self.measuring, None
        if failed or cost is None or not self.steady:
            return
        steady = statistics.median(self.steady)
        slowdown = max(0.0, sum(cost.during_s) - len(cost.during_s) * steady)
        total = cost.stall_s + slowdown + cost.settled_s
        self.last = {"stall_s": cost.stall_s, "slowdown_s": slowdown, "settle_s": cost.settled_s, "cost_s": total}
        self.costs.append(total)
        self.measured += 1

    def tune_due(self) -> bool:
        """`AUTO` tunes K once its 1st, 2nd, 4th, 8th, ... snapshot is committed and measured (so that it follows a
        run whose step time changes, a collective each time): on every rank alike."""
        return self.auto and bool(self.costs) and self.measured & (self.measured - 1) == 0

    def tune(self) -> tuple[int, float, float]:
        """Snapshot every K steps, K the fewest that keep the snapshots' measured cost (their mean since the last
        tuning) under STALL_SHARE of their steps' time; the largest K of all ranks, so that they all snapshot the
        same steps (agreed over the default group: the tier's own carries the snapshot being written). Returns K,
        the cost and the steady step time."""
        cost, step_s = statistics.fmean(self.costs), statistics.median(self.steady)
        every = max(1, math.ceil(cost / (STALL_SHARE * max(step_s, 1e-9))))
        self.every, self.costs = max(gather_objects(every)), []
        return self.every, cost, step_s

    def metric_fields(self) -> dict:
        """For a metrics record: the interval, and the newest committed snapshot's measured cost (its parts, and the
        whole as a share of the steady step time over the interval it is taken at now), once there is one."""
        fields: dict = {"snapshot_every": self.every}
        if self.last is not None:
            share = self.last["cost_s"] / max(statistics.median(self.steady) * max(self.every, 1), 1e-9)
            fields |= {f"snapshot_{k}": round(v, 4) for k, v in {**self.last, "share": share}.items()}
        return fields
