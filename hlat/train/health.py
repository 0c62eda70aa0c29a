"""Health while the run trains: naming a rank that has become slower than its peers.

A synchronous job runs at the pace of its slowest rank, and the other ranks wait for it inside every collective
(FSDP's gathers and reductions between blocks, tensor parallelism's inside them, the step's all-reduce), so
the step time says that the job slowed down, not which rank did. Each rank therefore times its own compute: the
forward of each of its model blocks, from after the block's parameters are gathered (FSDP's hook, which runs
first) to the block's output, summed over the step; and its wait in the step's all-reduce
(`hlat.train.step.reduce_step`), both added up once the step's figures are read (nothing waits for them).
Host clocks on the CPU, timing events on an accelerator (a host clock would time only the kernels' launch).

Every `train.log_every` steps the ranks' means since the last record are gathered in one small all-gather (three
numbers per rank) at the record, where the host synchronises anyway: nothing is added to a step. A rank whose
compute exceeds the median of the other ranks of its pipeline stage by `health.slow_margin` in
`health.slow_intervals` records in a row is named, with its host, in the log and in metrics.jsonl, and
training goes on. Under tensor parallelism a slow rank's tensor-parallel peers wait for it inside the blocks, so
the whole group is named.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from hlat.config.job import HealthConfig
from hlat.groups import gather_objects
from hlat.parallel import Topology


class Stopwatch:
    """Marks on the timeline of the work: the host clock on a CPU, timing events on an accelerator's stream (reused
    from step to step once read: creating an event costs more than recording one)."""

    def __init__(self, device: torch.device):
        self.device = None if device.type == "cpu" else device
        self.events: list[torch.Event] = []
        self.used = 0

    def mark(self):
        if self.device is None:
            return time.perf_counter()
        if self.used == len(self.events):
            self.events.append(torch.Event(device=self.device, enable_timing=True))
        self.used += 1
        self.events[self.used - 1].record()
        return self.events[self.used - 1]

    def rewind(self) -> None:
        """Every mark so far has been read: their events may be recorded again."""
        self.used = 0

    def seconds(self, start, end) -> float:
        if self.device is None:
            return end - start
        end.synchronize()  # recorded before the host read the step's figures: already done
        return start.elapsed_time(end) / 1e3


class SlowRanks:
    """Which ranks have been slow for `intervals` records in a row, from each record's per-rank figures."""

    def __init__(self, cfg: HealthConfig, hosts: list[str], console: Console):
        self.margin, self.intervals, self.hosts, self.console = cfg.slow_margin, cfg.slow_intervals, hosts, console
        self.slow_for = [0] * len(hosts)  # records in a row each rank has been slow

    def update(self, compute: list[float], wait: list[float], stages: list[int]) -> dict:
        """The record's health fields from each rank's compute and wait per step (seconds) and pipeline stage;
        a rank that becomes persistently slow, or recovers, is announced."""
        ratios = peer_ratios(compute, stages)
        named_before = self.named()
        self.slow_for = [n + 1 if ratio > 1 + self.margin else 0 for n, ratio in zip(self.slow_for, ratios)]
        for rank in self.named():
            if rank not in named_before:
                self.console.print(
                    f"health: rank {rank} ({self.hosts[rank]}) is slow: its forward takes {compute[rank]:.4g} s per "
                    f"step, {ratios[rank]:.2f}x the median of its peers, for {self.intervals} log intervals in a "
                    "row; training goes on",
                    soft_wrap=True,
                    highlight=False,
                )
        for rank in set(named_before) - set(self.named()):
            self.console.print(
                f"health: rank {rank} ({self.hosts[rank]}) is back within {self.margin:.0%} of its peers",
                soft_wrap=True,
                highlight=False,
            )
        slowest = max(range(len(ratios)), key=ratios.__getitem__)
        record = {
            "rank_compute_s": statistics.median(compute),
            "rank_compute_max_s": max(compute),
            "slowest_rank": slowest,
            "slowest_rank_ratio": round(ratios[slowest], 4),
            "collective_wait_s": statistics.median(wait),
            "collective_wait_max_s": max(wait),
        }
        if self.named():
            record["slow_ranks"] = [
                {
                    "rank": r,
                    "host": self.hosts[r],
                    "ratio": round(ratios[r], 4),
                    "compute_s": compute[r],
                    "wait_s": wait[r],
                }
                for r in self.named()
            ]
        return record

    def named(self) -> list[int]:
        return [rank for rank, n in enumerate(self.slow_for) if self.intervals and n >= self.intervals]


def peer_ratios(compute: list[float], stages: list[int]) -> list[float]:
    """Each rank's compute over the median of the other ranks of its pipeline stage (1 without peers). Each stage
    is sorted once: thousands of ranks take milliseconds at every record, on every rank."""
    ratios = [1.0] * len(compute)
    for stage in set(stages):
        ranks = sorted((r for r, s in enumerate(stages) if s == stage), key=compute.__getitem__)
        values = [compute[r] for r in ranks]
        for position, rank in enumerate(ranks):
            median = median_without(values, position)
            ratios[rank] = compute[rank] / median if median > 0 else 1.0
    return ratios


def median_without(values: list[float], position: int) -> float:
    """The median of sorted `values` without the one at `position` (0 when none is left)."""
    n = len(values) - 1
    if n == 0:
        return 0.0
    middle = [n // 2] if n % 2 else [n // 2 - 1, n // 2]  # positions among the others
    return sum(values[i if i < position else i + 1] for i in middle) / len(middle)


class Health:
    """This rank's side of the check: the block hooks that time its forward (and, on the rank health.debug_delay
    names, slow it down), its wait in the step's all-reduce, and the gather at each record (`check`)."""

    def __init__(
        self, cfg: HealthConfig, topo: Topology, device: torch.device, parts: list[nn.Module], console: Console
    ):
        self.topo, self.device, self.clock = topo, device, Stopwatch(device)
        delay_rank, delay_s = cfg.delay()
        self.delay_s = delay_s if delay_rank == topo.rank else 0.0
        self.checking = dist.is_initialized() and topo.world_size > 1 and cfg.slow_intervals > 0
        self.timing, self.started, self.spans, self.wait = False, None, [], (None, None)
        self.totals = [0.0, 0.0, 0]  # compute seconds, wait seconds, steps since the last record
        self.slow = SlowRanks(cfg, gather_objects(socket.gethostname()) if self.checking else [], console)
        blocks = [block for part in parts for block in part.layers.values()]
        self.first = blocks[0] if blocks else None  # the block the debug delay slows
        if self.checking or self.delay_s:
            for block in blocks:
                block.register_forward_pre_hook(self.block_started)
                block.register_forward_hook(self.block_ended)

    # hooks run inside a compiled block's call: kept out of the graph (a host clock and a list would break it,
    # and their guards recompile it per block)
    @torch.compiler.disable
    def block_started(self, module: nn.Module, args) -> None:
        if self.timing and self.checking:
            self.started = self.clock.mark()
        if self.timing and self.delay_s and module is self.first:
            time.sleep(self.delay_s)

    @torch.compiler.disable
    def block_ended(self, module: nn.Module, args, output) -> None:
        if self.timing and self.checking:
            self.spans.append((self.started, self.clock.mark()))

    @contextlib.contextmanager
    def computing(self):
        """The step's forward and backward: block forwards are timed (not validation's)."""
        self.timing = True
        try:
            yield
        finally:
            self.timing = False

    @contextlib.contextmanager
    def at_collective(self):
        """The step's all-reduce: this rank's wait in it, marked (and added up by `step_read`)."""
        start = self.clock.mark() if self.checking else None
        yield
        if self.checking:
            self.wait = (start, self.clock.mark())

    def step_read(self) -> None:
        """The host has read the step's figures, so every mark of the step is behind it: the step's compute and its
        wait are added to the interval without waiting for the device."""
        if self.checking:
            self.totals[0] += sum(self.clock.seconds(a, b) for a, b in self.spans)
            self.totals[1] += self.clock.seconds(*self.wait)
            self.totals[2] += 1
        self.spans.clear()
        self.clock.rewind()

    def check(self) -> dict:
        """At a record, on every rank (an all-gather): the health fields of the steps since the last one."""
        compute, wait, steps = self.totals
        if not self.checking or not steps:  # no steps since the last record: the same on every rank
            return {}
        self.totals = [0.0, 0.0, 0]
        mine = torch.tensor(
            [compute / steps, wait / steps, float(self.topo.pp_rank)], dtype=torch.float64, device=self.device
        )
        rows = [torch.empty_like(mine) for _ in range(self.topo.world_size)]
        dist.all_gather(rows, mine)
        figures = torch.stack(rows).tolist()
        return self.slow.update([f[0] for f in figures], [f[1] for f in figures], [int(f[2]) for f in figures])
