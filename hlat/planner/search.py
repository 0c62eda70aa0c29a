"""Enumerate the valid layouts of a workload on a cluster, predict each, and rank them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from hlat import HlatError
from hlat.planner.layout import Layout, Workload, layout_problem
from hlat.planner.memory import Memory, memory
from hlat.planner.timing import StepTime, step_time
from hlat.profiles import HardwareProfile

OBJECTIVES = ("tokens_per_s", "tokens_per_dollar")
RECOMPUTE = ("none", "selective", "full")
MAX_MICRO_BATCH = 64
VIRTUAL_STAGES = (2, 4)
TOLERANCE = 0.03  # predictions this close count as equal
CP_MIN_TOKENS = 4096  # the fewest tokens of a sequence the search leaves a context-parallel rank


@dataclass(frozen=True)
class Plan:
    work: Workload
    layout: Layout
    hw: HardwareProfile
    nodes: int
    price: float  # USD per node-hour; 0 = unknown
    memory: Memory
    time: StepTime

    @property
    def predicted_tokens_per_s(self) -> float:
        return self.work.tokens_per_step / self.time.total

    @property
    def tokens_per_s(self) -> float:
        """What the plan promises: the prediction, but never more than the best MFU hlat has measured on this
        hardware gives (`above_measured_best` says when that cap applies); days and dollars follow from it."""
        capped = self.measured_best * self.peak_flops / self.flops_per_token
        return min(self.predicted_tokens_per_s, capped) if self.measured_best else self.predicted_tokens_per_s

    @property
    def step_s(self) -> float:
        return self.work.tokens_per_step / self.tokens_per_s

    @property
    def peak_flops(self) -> float:
        return self.nodes * self.hw.devices_per_node * self.hw.peak_tflops * 1e12

    @property
    def flops_per_token(self) -> float:
        return self.work.model.flops_per_token(self.work.seq_len)

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recomputation) per second over the cluster's peak, at the promised throughput."""
        return self.flops_per_token * self.tokens_per_s / self.peak_flops

    @property
    def predicted_mfu(self) -> float:
        return self.flops_per_token * self.predicted_tokens_per_s / self.peak_flops

    @property
    def dollars_per_hour(self) -> float:
        return self.nodes * self.price

    @property
    def tokens_per_dollar(self) -> float | None:
        return self.tokens_per_s * 3600 / self.dollars_per_hour if self.price else None

    def budget(self, tokens: float) -> tuple[float, float | None]:
        """Days and dollars to train `tokens`."""
        hours = tokens / self.tokens_per_s / 3600
        return hours / 24, (hours * self.dollars_per_hour if self.price else None)

    @property
    def measured_best(self) -> float:
        """The best MFU hlat has measured on this hardware in this precision's compute dtype, FP8 apart (0: none)."""
        return self.hw.best_mfu.of(self.work.precision, self.work.fp8)

    @property
    def above_measured_best(self) -> bool:
        """Predicted above any MFU hlat has measured on this hardware: nothing has shown it reachable."""
        return bool(self.measured_best) and self.predicted_mfu > self.measured_best

    def score(self, objective: str) -> float:
        """What the search ranks by: the prediction itself. Capped, every layout predicted above the measured best
        would score the same, and the simplest of them would rank first whatever its prediction."""
        per_s = self.predicted_tokens_per_s
        if objective == "tokens_per_s":
            return per_s
        return per_s * 3600 / self.dollars_per_hour if self.price else 0.0


def evaluate(work: Workload, layout: Layout, hw: HardwareProfile, nodes: int, price: float = 0.0) -> Plan:
    """The prediction for one layout; raises HlatError when the layout cannot run the workload at all."""
    problem = layout_problem(work, layout, nodes * hw.devices_per_node)
    if problem:
        raise HlatError(f"layout {layout.describe()}: {problem}")
    return Plan(work, layout, hw, nodes, price, memory(work, layout, hw), step_time(work, layout, hw))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_degrees(seq_len: int, ranks: int) -> list[int]:
    """The cp degrees the search tries on `ranks` (the devices tensor parallelism leaves): 1, and every divisor
    that leaves each rank at least CP_MIN_TOKENS of a sequence: below that the gathers of keys and values cost
    more than splitting the sequence saves (Llama 3 ran 8,192 tokens per rank at 131k tokens; the sequences
    pretraining runs at, 4,096 tokens and less, are never split)."""
    return [1] + [cp for cp in _divisors(ranks)[1:] if seq_len // cp >= CP_MIN_TOKENS and seq_len % (2 * cp) == 0]


def shardings(dp: int, cp: int, hw: HardwareProfile) -> list[tuple[int, bool]]:
    """(dp_shard, zero1) of the data-parallel arrangements to try: replicated (with cp > 1 FSDP over the cp ranks,
    which share the sharding, where the stack has FSDP), ZeRO-1 and FSDP over all of them."""
    out = [(1, False)] if cp == 1 or hw.supports_fsdp else []
    out += [(dp, True)] if dp * cp > 1 else []
    return out + ([(dp, False)] if dp > 1 and hw.supports_fsdp else [])


def expert_degrees(work: Workload, shards: int, tp: int, per_node: int) -> list[int]:
    """The ep degrees the search tries: 1, and for a mixture of experts every divisor of n_experts that divides the
    dp_shard x cp ranks and keeps an expert-parallel group inside a node (its all-to-alls on the node's links)."""
    model = work.model
    if not model.moe:
        return [1]
    return [ep for ep in _divisors(model.n_experts) if shards % ep == 0 and (ep == 1 or ep * tp <= per_node)]


def candidates(work: Workload, hw: HardwareProfile, nodes: int) -> Iterator[Layout]:
    """Every valid layout: tp within a node (or whole nodes), cp for long sequences (`context_degrees`), pp
    dividing the layers, dp the rest; every micro-batch size; 1F1B, and interleaved 1F1B where it applies (GPipe
    never beats 1F1B: same time, more memory); sequence parallelism whenever tp > 1 (never worse); every
    recomputation; DDP, ZeRO-1 and FSDP; expert parallelism within a node (`expert_degrees`); each block compiled or
    not as the workload says."""
    model, per_node = work.model, hw.devices_per_node
    devices = nodes * per_node
    for tp in _divisors(devices):
        if (per_node % tp and tp % per_node) or model.n_heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
            continue
        if model.ffn_dim % tp or model.vocab_size % tp or work.seq_len % tp:
            continue
        for cp, pp in (
            (c, p) for c in context_degrees(work.seq_len, devices // tp) for p in _divisors(devices // (tp * c))
        ):
            dp = devices // (tp * cp * pp)
            if model.n_layers % pp or work.global_batch % dp:
                continue
            for mb in _divisors(work.global_batch // dp):
                if mb > MAX_MICRO_BATCH:
                    break
                schedules = [("1f1b", 1)]
                if pp > 1:  # the trainer's check refuses an interleaving its micro-batches cannot fill
                    schedules += [("interleaved_1f1b", v) for v in VIRTUAL_STAGES if model.n_layers % (pp * v) == 0]
                for (schedule, v), (shard, zero1), recompute in (
                    (s, z, r) for s in schedules for z in shardings(dp, cp, hw) for r in RECOMPUTE
                ):
                    for ep in expert_degrees(work, shard * cp, tp, per_node):
                        layout = Layout.of(
                            tp=tp,
                            pp=pp,
                            cp=cp,
                            ep=ep,
                            dp_replicate=dp // shard,
                            dp_shard=shard,
                            micro_batch=mb,
                            pp_schedule=schedule,
                            virtual_stages=v,
                            sequence_parallel=tp > 1,
                            zero1=zero1,
                            activation_checkpoint=recompute,
                            compile=work.compile,
                        )
                        if layout_problem(work, layout, devices) is None:  # the trainer's own check
                            yield layout


@dataclass
class SearchResult:
    plans: list[Plan]  # the layouts that fit, best first
    considered: int
    nearest: Plan | None  # when nothing fits: the layout needing the least memory
    seconds: float


def simplicity(plan: Plan) -> tuple:
    """Fewer pipeline stages, no interleaving, less recomputation, then more memory left free (context
    parallelism adds no schedule to follow: at long sequences the layout that splits them often leaves the most)."""
    layout = plan.layout
    return layout.pp, layout.virtual_stages, RECOMPUTE.index(layout.activation_checkpoint), plan.memory.total


def search(
    work: Workload,
    hw: HardwareProfile,
    nodes: int,
    objective: str = "tokens_per_s",
    price: float = 0.0,
    tolerance: float = TOLERANCE,
) -> SearchResult:
    """Rank every layout that fits in memory. With tokens_per_dollar the search also tries smaller clusters
    (halving the node count), since fewer nodes can cost less per token.

    Predictions closer than `tolerance` to the best are below the model's accuracy (its fits are off by 5-10%
    on held-out runs), so among those the simplest layout ranks first."""
    if objective not in OBJECTIVES:
        raise HlatError(f"--objective: {objective!r} is not one of {', '.join(OBJECTIVES)}")
    if objective == "tokens_per_dollar" and not price:
        raise HlatError(f"--objective tokens_per_dollar: profile {hw.name!r} has no price of that kind")
    start = time.perf_counter()
    node_counts = [nodes]
    while objective == "tokens_per_dollar" and node_counts[-1] % 2 == 0:
        node_counts.append(node_counts[-1] // 2)
    fitting, nearest, considered = [], None, 0
    for n in node_counts:
        for layout in candidates(work, hw, n):
            considered += 1
            mem = memory(work, layout, hw)
            if not mem.fits:
                if nearest is None or mem.total < nearest.memory.total:
                    nearest = Plan(work, layout, hw, n, price, mem, step_time(work, layout, hw))
                continue
            fitting.append(Plan(work, layout, hw, n, price, mem, step_time(work, layout, hw)))
    fitting.sort(key=lambda p: -p.score(objective))
    if fitting:
        cutoff = fitting[0].score(objective) * (1 - tolerance)
        tied = sorted((p for p in fitting if p.score(objective) >= cutoff), key=simplicity)
        fitting = tied + fitting[len(tied) :]
    return SearchResult(fitting, considered, None if fitting else nearest, time.perf_counter() - start)
