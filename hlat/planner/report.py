"""What `hlat plan` prints: a table of plans (or JSON), where the first one's step time and memory go, and the
remarks a user needs to trust it: where the price comes from, what the profile's measurements do not cover, and
which predictions exceed the best MFU hlat has measured on the hardware."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hlat.fields import to_toml
from hlat.planner.layout import Layout, Workload
from hlat.planner.memory import GIB
from hlat.planner.rehearsal import own_trainer_memory
from hlat.planner.search import Plan
from hlat.profiles import HardwareProfile


@dataclass
class Request:
    """What a plan prices, resolved from the flags and the config."""

    work: Workload
    hw: HardwareProfile
    nodes: int
    price: float  # USD per node-hour; 0: unknown
    price_note: str  # where the price comes from
    tokens: float  # the token budget to cost
    layout: Layout | None = None  # a layout to price alone (the flags', or the config's); None: search
    notes: list[str] = field(default_factory=list)  # one-line remarks printed under the table
    seq_len_from: str = ""  # what set the sequence length (--seq-len, train.seq_len, the model's max_seq_len)


def si(x: float) -> str:
    return f"{x / 1e6:.3g}M" if x >= 1e6 else f"{x / 1e3:.3g}k" if x >= 1e3 else f"{x:.3g}"


def budget_text(tokens: float) -> str:
    """A token budget: '450B', '1.89T'."""
    return f"{si(tokens / 1e9)}B" if tokens < 1e12 else f"{tokens / 1e12:.3g}T"


def compute_dtype(work: Workload) -> str:
    """The dtype of the blocks' matmuls, as `[best_mfu]` names it."""
    return "fp8" if work.fp8 != "none" else "fp32" if work.precision == "fp32" else "bf16"


def fp8_note(work: Workload, hw: HardwareProfile) -> str:
    """For an FP8 plan: how it is priced, that its rates are compiled ones (eager FP8 is far slower), and that no cap
    applies where hlat has measured no FP8 run ('' without FP8)."""
    if work.fp8 == "none":
        return ""
    eager = "" if work.compile else "; without parallel.compile FP8's casts run as kernels of their own: slower"
    cap = (
        ""
        if hw.best_mfu.fp8
        else (
            f"; hlat has measured no FP8 run on {hw.name} ([best_mfu] fp8 = 0), so no measured best MFU caps this plan"
        )
    )
    return (
        f"FP8 ({work.fp8}): the blocks' linear layers at the profile's measured FP8 rates (compiled, casts "
        f"included; {hw.measured.source}){eager}; the output layer and attention in bf16; memory as "
        f"{work.precision}{cap}"
    )


def ceiling_note(req: Request) -> str:
    """The line that explains the mark on an MFU above the best hlat has measured on the hardware."""
    best, hw = req.hw.best_mfu.of(req.work.precision, req.work.fp8), req.hw
    dtype = compute_dtype(req.work)
    return (
        f"* predicted above the best MFU hlat has measured on {hw.name} in {dtype} ({best:.1%}, "
        f"{hw.best_mfu.source}): no hlat run has reached more, so the plan promises that best (its step time, "
        "days and cost follow from it); in brackets the uncapped prediction, by which layouts rank"
    )


def plan_row(plan: Plan, tokens: float) -> dict:
    days, dollars = plan.budget(tokens)
    m, t = plan.memory, plan.time
    return {
        "layout": plan.layout.describe(),
        "nodes": plan.nodes,
        **plan.layout.config_sections(plan.work),
        "fits": m.fits,
        "memory_gib": {k: round(v / GIB, 3) for k, v in asdict(m).items()} | {"total": round(m.total / GIB, 3)},
        # where the profile prices another stack's activations (trn: NeuronX Distributed's), hlat's own trainer's
        "hlat_trainer_memory_gib": round(own.total / GIB, 3) if (own := own_trainer_memory(plan)) else None,
        "step_time_s": {k: round(v, 4) for k, v in asdict(t).items() if k not in ("layer", "data_parallel")}
        | {"total": round(t.total, 4)},
        "layer": t.layer,
        "data_parallel": t.data_parallel,
        "tokens_per_s": round(plan.tokens_per_s, 1),
        "mfu": round(plan.mfu, 4),
        "above_measured_best": plan.above_measured_best,  # then tokens_per_s and mfu are capped at that best
        "predicted_tokens_per_s": round(plan.predicted_tokens_per_s, 1),
        "predicted_mfu": round(plan.predicted_mfu, 4),
        "tokens_per_dollar": round(plan.tokens_per_dollar) if plan.tokens_per_dollar else None,
        "budget": {"tokens": tokens, "days": round(days, 2), "dollars": round(dollars) if dollars else None},
    }


def print_json(req: Request, plans: list[Plan], note: str) -> None:
    work, hw = req.work, req.hw
    print(
        json.dumps(
            {
                "model": work.model.preset,
                "hardware": hw.name,
                "nodes": req.nodes,
                "seq_len": work.seq_len,
                "seq_len_from": req.seq_len_from,
                "global_batch": work.global_batch,
                "precision": work.precision,
                "fp8": work.fp8,
                "compile": work.compile,
                "tokens": req.tokens,
                "price_per_node_hour": req.price or None,
                "price_source": req.price_note,
                "measured_best_mfu": hw.best_mfu.of(work.precision, work.fp8) or None,
                "measured_best_source": hw.best_mfu.source,
                "fit": hw.fit.source,
                "figures": hw.sources(),
                "note": note,
                "notes": req.notes,
                "plans": [plan_row(p, req.tokens) for p in plans],
            },
            indent=2,
        )
    )


def emit_config(path: str, req: Request, best: Plan) -> None:
    """Write the plan's layout as the config tables `hlat train --config` runs as they are."""
    work = req.work
    header = (
        f"# hlat plan: {work.model.preset or work.model.family} on {best.nodes} x {req.hw.name}: "
        f"{best.layout.describe()}, predicted {best.time.total:.3g} s/step, "
        f"{best.tokens_per_s:,.0f} tokens/s, {best.memory.total / GIB:.1f} GiB/device\n"
    )
    Path(path).write_text(header + to_toml(best.layout.run_config(work)))


def print_table(req: Request, plans: list[Plan], note: str) -> None:
    from rich import box
    from rich.table import Table

    from hlat.console import make_console

    console = make_console()
    console.width = max(console.width, 120)  # one line per layout, numbers unclipped
    work, hw = req.work, req.hw
    devices = req.nodes * hw.devices_per_node
    budget = budget_text(req.tokens)
    price = f"${req.price:g}/node-hour, {req.price_note}" if req.price else req.price_note
    marks = [ceiling_note(req)] if any(p.above_measured_best for p in plans) else []
    table = Table(
        title=f"{work.model.preset or work.model.family} on {req.nodes} x {hw.name} ({devices:,} "
        f"device{'s' if devices > 1 else ''}): seq {work.seq_len} ({req.seq_len_from}), "
        f"batch {work.global_batch} "
        f"({si(work.tokens_per_step)} tokens), {work.precision}"
        f"{f', fp8 {work.fp8}' if work.fp8 != 'none' else ''}{', compiled' if work.compile else ''}",
        caption="\n".join([f"{note}. Price: {price}. Figures: {hw.sources()}.", *marks]),
        box=box.SIMPLE_HEAD,
    )
    show_nodes = any(p.nodes != req.nodes for p in plans)
    for col in (
        "#",
        "layout",
        *(["nodes"] if show_nodes else []),
        "GiB",
        "s/step",
        "tok/s",
        "MFU",
        "tok/$",
        f"days/{budget}",
        f"$/{budget}",
    ):
        table.add_column(col, justify="left" if col == "layout" else "right", no_wrap=True)
    for i, p in enumerate(plans, 1):
        days, dollars = p.budget(req.tokens)
        table.add_row(
            str(i),
            p.layout.describe(),
            *([str(p.nodes)] if show_nodes else []),
            memory_cell(p),
            f"{p.step_s:.3g}",
            si(p.tokens_per_s),
            f"{p.mfu:.1%}* ({p.predicted_mfu:.1%})" if p.above_measured_best else f"{p.mfu:.1%}",
            si(p.tokens_per_dollar) if p.tokens_per_dollar else "-",
            f"{days:,.1f}",
            f"${si(dollars)}" if dollars else "-",
        )
    console.print(table)
    print_breakdown(console, plans[0], req.notes)


def memory_cell(plan: Plan) -> str:
    """GiB per device; where the profile prices another stack's activations, hlat's own trainer's beside it."""
    own = own_trainer_memory(plan)
    return f"{plan.memory.total / GIB:.1f}" + (f" (hlat {own.total / GIB:.1f})" if own else "")


def print_breakdown(console, plan: Plan, notes: list[str]) -> None:
    """Where the first plan's step time and memory go, then the request's remarks."""
    t, m = plan.time, plan.memory
    cp = f" + CP {t.cp_comm:.3g}" if plan.layout.cp > 1 else ""
    cp += f" + EP {t.ep_comm:.3g}" if plan.layout.ep > 1 else ""
    console.print(
        f"#1 step {t.total:.3g} s = compute {t.compute:.3g} + TP {t.tp_comm:.3g}{cp} + PP {t.pp_comm:.3g} "
        f"+ bubble {t.bubble:.3g} + DP {t.dp_comm:.3g} + optimizer {t.optimizer:.2g} (layer: {t.layer}"
        f"{f'; data parallelism: {t.data_parallel}' if t.data_parallel else ''})"
    )
    console.print(
        f"#1 memory {m.total / GIB:.1f} of {m.capacity / GIB:.0f} GiB = weights {m.weights / GIB:.1f} "
        f"+ grads {m.grads / GIB:.1f} + optimizer {m.optimizer / GIB:.1f} + activations "
        f"{m.activations / GIB:.1f} + FSDP buffers {m.buffers / GIB:.1f} + overhead {m.overhead / GIB:.1f}"
        + (
            f" (as {plan.hw.name}'s stack keeps it, {plan.hw.activations}; hlat's own trainer: "
            f"{own.total / GIB:.1f} GiB)"
            if (own := own_trainer_memory(plan))
            else ""
        )
    )
    for line in notes:
        console.print(line)


def show(req: Request, plans: list[Plan], note: str, as_json: bool, emit: str | None) -> None:
    """Print the plans (a table, or JSON); write the first as config tables to `emit`."""
    if emit:
        emit_config(emit, req, plans[0])
    if as_json:
        print_json(req, plans, note)
        return
    print_table(req, plans, note)
    if emit:
        print(f"wrote {emit}")
