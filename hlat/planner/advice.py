"""The one line `hlat plan`, `hlat launch` and `hlat train` print when a layout does not suit its hardware: a
tensor-parallel group that spans nodes (its collectives, several per layer, then cross the inter-node fabric), or a
layout whose communication the profile's links make needlessly slow; it names what `hlat plan --search` chooses
on that hardware, with its predicted step time, MFU and price.

"Needlessly slow": the layout spends more than COMM_SHARE of its step in exposed communication and the search's
first layout is more than SLOWER times faster, far beyond the step-time model's error (5-10% on held-out runs,
docs/planner-validation.md), so the gap is the layout's, not the model's.

The planner's predicted step also sets the hang watchdog that `hlat launch` renders where a config leaves it off
(`watchdog`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hlat import HlatError
from hlat.fields import ConfigError
from hlat.planner.layout import Layout, Workload
from hlat.planner.report import budget_text, si
from hlat.planner.search import Plan, evaluate, search
from hlat.profiles import HardwareProfile, load_profile

COMM_SHARE = 0.25
SLOWER = 1.25
WATCHDOG_STEPS = 30  # the hang watchdog's timeout, in the planner's predicted steps (`watchdog`)


@dataclass(frozen=True)
class Advice:
    line: str
    best: Plan | None  # what the search chooses (None: nothing fits, or no hardware profile to plan with)


def spans_nodes(tp: int, per_node: int) -> bool:
    """Whether tensor-parallel groups (the mesh's innermost dimension: consecutive ranks) cross a node boundary."""
    return tp > per_node or per_node % tp != 0


def summary(plan: Plan, tokens: float, communicating: str = "") -> str:
    """'2.79 s/step, 33.0% MFU, 14.5 days, $8.78M' (`communicating`: what of the step goes to communication)."""
    days, dollars = plan.budget(tokens)
    return (
        f"{plan.step_s:.3g} s/step{communicating}, {plan.mfu:.1%} MFU, {days:,.1f} days"
        f"{f', ${si(dollars)}' if dollars else ''}"
    )


def advise(
    work: Workload,
    layout: Layout,
    hw: HardwareProfile,
    nodes: int,
    price: float,
    tokens: float,
    per_node: int | None = None,
) -> Advice | None:
    """The line for `layout` on `nodes` x `hw`, or None when the layout suits the hardware. `per_node`: the processes
    a launch places on each node, when not one per device of the profile: the layout, and the search's, are priced
    on nodes that use that many devices (what `hlat plan --nproc-per-node` prices)."""
    per_node = per_node or hw.devices_per_node
    hw = replace(hw, devices_per_node=per_node)
    crosses = nodes > 1 and spans_nodes(layout.tp, per_node)
    try:
        mine = evaluate(work, layout, hw, nodes, price)
    except HlatError:
        return None  # a layout that cannot run at all is refused where it runs, in a line of its own
    found = search(work, hw, nodes, price=price).plans
    best = found[0] if found else None
    t = mine.time
    comm = t.tp_comm + t.ep_comm + t.pp_comm + t.dp_comm
    slow = best is not None and comm > COMM_SHARE * t.total and mine.step_s > SLOWER * best.step_s
    if not crosses and not slow:
        return None
    where = f"{nodes} x {hw.name}"
    if crosses:
        what = (
            f"tensor parallelism across nodes: {layout.describe()} puts each TP{layout.tp} group on "
            f"{-(-layout.tp // per_node)} {hw.name} nodes of {per_node} processes, its collectives over the "
            f"inter-node fabric: predicted {summary(mine, tokens, f' ({comm:.3g} s communicating)')}"
        )
    else:
        ep = f", EP {t.ep_comm:.3g}" if t.ep_comm else ""
        split = f" ({comm:.3g} s communicating: TP {t.tp_comm:.3g}{ep}, PP {t.pp_comm:.3g}, DP {t.dp_comm:.3g})"
        what = f"{layout.describe()} is needlessly slow on {hw.name}'s links: predicted {summary(mine, tokens, split)}"
    choice = (
        f"; `hlat plan --search` on {where} chooses {best.layout.describe()}: {summary(best, tokens)}"
        if best
        else f"; no layout of the model fits {where}"
    )
    return Advice(f"{what}{choice} (for {budget_text(tokens)} tokens)", best)


def config_advice(cfg, nodes: int, per_node: int) -> str | None:
    """The line for a config (`hlat.config.job.Config`) run on `nodes` x `per_node` processes of its
    `cluster.hardware`; without a profile, only a tensor-parallel group across nodes is named."""
    devices = nodes * per_node
    try:
        parallel = cfg.parallel.resolved(devices)
    except ConfigError:
        return None  # refused where the layout is checked, in its own line
    if not cfg.cluster.hardware:
        if nodes > 1 and spans_nodes(parallel.tp, per_node):
            return (
                f"tensor parallelism across nodes: parallel.tp {parallel.tp} spans nodes of {per_node} processes "
                "(its collectives cross the inter-node network every layer); set cluster.hardware for the "
                "layout `hlat plan --search` would choose"
            )
        return None
    try:
        work, layout, hw, price = priced(cfg, parallel, per_node)
        advice = advise(work, layout, hw, nodes, price, cfg.train.steps * work.tokens_per_step, per_node)
    except HlatError:  # hardware the planner cannot price (an unmeasured FP8 recipe): nothing to compare
        return None
    return advice.line if advice else None


def priced(cfg, parallel, per_node: int) -> tuple[Workload, Layout, HardwareProfile, float]:
    """What the planner prices of a config with a `cluster.hardware` profile, its layout resolved (`parallel`):
    the workload, the layout, the profile and the price of a node of `per_node` devices an hour."""
    hw = load_profile(cfg.cluster.hardware)
    other = "reserved" if cfg.cost.pricing == "on_demand" else "on_demand"
    price = cfg.cost.price_per_device_hour * per_node or hw.price(cfg.cost.pricing) or hw.price(other)
    work = Workload(
        cfg.model,
        cfg.train.seq_len,
        cfg.train.global_batch,
        cfg.precision.mode,
        cfg.parallel.compile,
        cfg.precision.fp8,
    )
    return work, Layout(replace(parallel, compile=work.compile), cfg.train.micro_batch), hw, price


def watchdog(cfg) -> tuple[float, float] | None:
    """The hang watchdog's timeout for a config on its cluster: WATCHDOG_STEPS times the planner's predicted step
    time (on `cluster.nodes` x `cluster.nproc_per_node` of `cluster.hardware`), rounded up to whole minutes, so that
    step noise and a save's copy and commit never trip it while a frozen rank is named within minutes; and that step
    time. None where the planner cannot predict the step (no hardware profile, a layout that does not fit)."""
    c = cfg.cluster
    if not c.hardware:
        return None
    try:
        work, layout, hw, price = priced(cfg, cfg.parallel.resolved(c.world_size), c.nproc_per_node)
        plan = evaluate(work, layout, replace(hw, devices_per_node=c.nproc_per_node), c.nodes, price)
    except (HlatError, ConfigError):
        return None
    step_s = plan.time.total  # the step as predicted, not capped at the best MFU measured (`hlat plan`'s #1 step)
    return 60 * math.ceil(WATCHDOG_STEPS * step_s / 60), step_s
