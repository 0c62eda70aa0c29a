"""`hlat rehearse` on the command line (torch is imported only when it runs): one rank of the full-size job on this
machine, its memory, compute and collectives beside the planner's (hlat.measure.rehearse)."""

from __future__ import annotations

import argparse
import json

from hlat import HlatError
from hlat.planner.memory import GIB


def register(commands) -> None:
    parser = commands.add_parser(
        "rehearse", help="run one rank of the full-size job on this machine (collectives faked) and hold the planner "
                         "to what it measures",
        description="Config overrides (--section.key value) are accepted, as for hlat train.")
    parser.add_argument("--config", action="append", required=True,
                        help="TOML config or recipe name (repeatable, merged in order)")
    parser.add_argument("--rank", default="", help="rank(s) to rehearse, e.g. 0 or 0,8191 (default: the first "
                                                   "rank of the first and of the last pipeline stage)")
    parser.add_argument("--world-size", type=int, help="ranks in the job (default: [cluster] nodes x nproc_per_node)")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2; the last is measured)")
    parser.add_argument("--micro-batches", type=int,
                        help="micro-batches per step (default: the step's own; fewer are scaled to it)")
    parser.add_argument("--hardware", help="profile the planner prices this machine with (default: this device's)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run, overrides=True)


def ranks(text: str) -> list[int] | None:
    try:
        return [int(r) for r in text.split(",") if r] or None
    except ValueError:
        raise HlatError(f"--rank: expected comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.measure.rehearse import prepare, rehearse
    from hlat.config.job import load_config

    cfg = load_config(args.config, overrides)
    setup = prepare(cfg, args.world_size, ranks(args.rank), args.steps, args.micro_batches, args.hardware)
    results = rehearse(setup)
    summary = {"config": args.config, "model": cfg.model.preset or cfg.model.family, "world_size": setup.world_size,
               "layout": setup.planned_layout.describe(), "parallel": setup.layout.__dict__,
               "model_config": cfg.model.__dict__, "micro_batch": cfg.train.micro_batch,
               "seq_len": cfg.train.seq_len, "global_batch": cfg.train.global_batch, "precision": cfg.precision.mode,
               "fp8": cfg.precision.fp8, "device": cfg.train.device, "hardware": setup.hardware.name,
               "micro_batches": {"rehearsed": setup.micro_batches, "step": setup.step_micro_batches},
               "notes": notes(setup), "ranks": results}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        show(summary)
    return 0


def notes(setup) -> list[str]:
    said = ["tokens are random (the data stream's exchange cannot run in a fake world)",
            "collectives and sends complete at once: compute times exclude communication",
            "the checkpoint is counted from its state dict, not written"]
    if setup.micro_batches < setup.step_micro_batches:
        said.append(f"{setup.micro_batches} of the step's {setup.step_micro_batches} micro-batches rehearsed: step "
                    "compute, per-micro-batch collectives and activations in flight are scaled to the step")
    return said


def show(summary: dict) -> None:
    from hlat.console import make_console

    console = make_console()
    console.print(f"hlat rehearse: {summary['model']}, {summary['layout']}, world {summary['world_size']:,}, "
                  f"seq {summary['seq_len']}, {summary['precision']}; planner figures: {summary['hardware']}",
                  highlight=False)
    for result in summary["ranks"]:
        console.print(rank_table(result))
        console.print(collective_table(result))
        if result["fits"]:
            fit = result["fits"]
            console.print(f"rank {result['rank']} {'fits' if fit['fits'] else 'does NOT fit'} one {fit['hardware']} "
                          f"device: {fit['needed'] / GIB:.2f} of {fit['capacity'] / GIB:.0f} GiB", highlight=False)
        if result["skipped_update"]:
            console.print(f"the update was skipped: {result['skipped_update']}")
    for note in summary["notes"]:
        console.print(f"note: {note}", highlight=False)


def rank_table(result: dict):
    from rich.table import Table

    coords = ", ".join(f"{k} {v}" for k, v in result["coordinates"].items())
    table = Table(title=f"rank {result['rank']} ({coords}; stages {result['stages']}, {result['layers']} blocks)")
    for col in ("figure", "measured", "planner", "difference"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for name, figure in result["memory"].items():
        table.add_row(f"{name.replace('_', ' ')} (GiB)", *compared(figure, GIB))
        if "step" in figure:
            table.add_row("  at the step's micro-batches", *compared(figure["step"], GIB))
    checkpoint = result["checkpoint"]
    table.add_row("checkpoint state dict (GiB)", *compared({"measured": checkpoint["held"],
                                                           "planned": checkpoint["planned"]}, GIB))
    times = result["time"]
    table.add_row("start-up (s)", f"{times['startup_s']:.3g}", "", "")
    table.add_row("step compute, rehearsed (s)", *compared(times["compute_s"], 1))
    table.add_row("  forward / backward and rest / update (s)",
                  f"{times['forward_s']:.3g} / {times['backward_and_rest_s']:.3g} / {times['update_s']:.3g}", "", "")
    table.add_row("step compute, the real step (s)", *compared(times["step_compute_s"], 1))
    peak = result["peak_memory"]
    table.add_row(f"{peak['kind']} (GiB)", f"{peak['bytes'] / GIB:.3f}", "", "")
    return table


def compared(figure: dict, unit: float) -> tuple[str, str, str]:
    measured, planned = figure["measured"] / unit, figure["planned"] / unit
    difference = f"{measured / planned - 1:+.1%}" if planned else ("" if not measured else "not planned")
    return f"{measured:.4g}", f"{planned:.4g}", difference


def collective_table(result: dict):
    from rich.table import Table

    table = Table(title=f"rank {result['rank']}: collectives per step (as rehearsed; the real step; the planner's)")
    for col in ("kind", "mesh dim", "count", "MiB", "step count", "step MiB", "planner MiB", "difference"):
        table.add_column(col, justify="left" if col in ("kind", "mesh dim") else "right")
    for row in result["collectives"]:
        figure = {"measured": row["step_bytes"], "planned": row["planned_step_bytes"]}
        table.add_row(row["kind"], row["dim"], f"{row['count']:g}", f"{row['bytes'] / 2**20:.4g}",
                      f"{row['step_count']:g}", *compared(figure, 2**20))
    return table
