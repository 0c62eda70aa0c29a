"""`hlat rehearse` on the command line (torch is imported only when it runs): one rank of the full-size job on this
machine, its memory, compute and collectives beside the planner's (hlat.measure.rehearse)."""

from __future__ import annotations

import argparse
import json
import sys

from hlat import HlatError
from hlat.planner.memory import GIB

WHERE_IT_RUNS = {"train.device", "train.run_dir"}  # overrides that move a rehearsal, not change its job


def register(commands) -> None:
    parser = commands.add_parser(
        "rehearse",
        help="run one rank of the full-size job on this machine (collectives faked) and hold the planner "
        "to what it measures",
        description="Config overrides (--section.key value) are accepted, as for hlat train.",
    )
    parser.add_argument(
        "--config", action="append", required=True, help="TOML config or recipe name (repeatable, merged in order)"
    )
    parser.add_argument(
        "--rank",
        default="",
        help="rank(s) to rehearse, e.g. 0 or 0,8191 (default: the first "
        "rank of the first and of the last pipeline stage)",
    )
    parser.add_argument("--world-size", type=int, help="ranks in the job (default: [cluster] nodes x nproc_per_node)")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2; the last is measured)")
    parser.add_argument(
        "--micro-batches", type=int, help="micro-batches per step (default: the step's own; fewer are scaled to it)"
    )
    parser.add_argument("--hardware", help="profile the planner prices this machine with (default: this device's)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run, overrides=True)


def ranks(text: str) -> list[int] | None:
    try:
        return [int(r) for r in text.split(",") if r] or None
    except ValueError:
        raise HlatError(f"--rank: expected comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.config.job import load_config
    from hlat.measure.rehearse import prepare, rehearse

    cfg = load_config(args.config, overrides)
    setup = prepare(cfg, args.world_size, ranks(args.rank), args.steps, args.micro_batches, args.hardware)
    try:
        stated = load_config(args.config, []) if overrides else cfg
        setup.changes = job_changes(stated, cfg, setup.world_size)
        setup.full_layers = stated.model.n_layers if stated.model.n_layers != cfg.model.n_layers else 0
    except HlatError:  # the files alone do not make a job: what the command line added is all that can be said
        setup.changes = [" ".join(overrides)]
    job = first_line(cfg, setup)
    print(f"hlat rehearse: {job}", file=sys.stderr, flush=True)  # before the progress lines, the job rehearsed
    results = rehearse(setup)
    summary = {
        "job": job,
        "changes": setup.changes,
        "config": args.config,
        "model": cfg.model.preset or cfg.model.family,
        "world_size": setup.world_size,
        "layout": setup.planned_layout.describe(),
        "parallel": setup.layout.__dict__,
        "model_config": cfg.model.__dict__,
        "micro_batch": cfg.train.micro_batch,
        "seq_len": cfg.train.seq_len,
        "global_batch": cfg.train.global_batch,
        "precision": cfg.precision.mode,
        "fp8": cfg.precision.fp8,
        "device": cfg.train.device,
        "hardware": setup.hardware.name,
        "micro_batches": {"rehearsed": setup.micro_batches, "step": setup.step_micro_batches},
        "notes": notes(setup),
        "ranks": results,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        show(summary)
    return 0


def job_changes(stated, cfg, world: int) -> list[str]:
    """What the command line changed of the job its config files state (`--section.key` overrides, a
    `--world-size` other than [cluster]'s), where it runs apart."""
    from hlat.checkpoint.resume import config_changes

    changes = config_changes(stated, cfg, WHERE_IT_RUNS)
    return changes + (
        [f"world size: {stated.cluster.world_size:,} -> {world:,}"] if world != stated.cluster.world_size else []
    )


def first_line(cfg, setup) -> str:
    """The job rehearsed, and whether it is the one its config states (then its verdicts are that job's)."""
    layers = f" ({setup.full_layers} in the config: each fit is extrapolated to them)" if setup.full_layers else ""
    changed = (
        f"a CHANGED job: {'; '.join(setup.changes)}{layers}" if setup.changes else "the job as its config states it"
    )
    return (
        f"{cfg.model.preset or cfg.model.family}, {setup.planned_layout.describe()}, world "
        f"{setup.world_size:,}, seq {cfg.train.seq_len}, {cfg.precision.mode}: {changed}"
    )


def notes(setup) -> list[str]:
    said = [
        "tokens are random (the data stream's exchange cannot run in a fake world)",
        "collectives and sends complete at once: compute times exclude communication",
        "the checkpoint is counted from its state dict, not written",
    ]
    if setup.micro_batches < setup.step_micro_batches:
        said.append(
            f"{setup.micro_batches} of the step's {setup.step_micro_batches} micro-batches rehearsed: forward and "
            "backward, per-micro-batch collectives and activations in flight are scaled to the step"
        )
    return said


def show(summary: dict) -> None:
    from hlat.console import make_console

    console = make_console()
    console.print(f"hlat rehearse: {summary['job']}; planner figures: {summary['hardware']}", highlight=False)
    for result in summary["ranks"]:
        console.print(rank_table(result))
        console.print(collective_table(result))
        if result["fits"]:
            console.print(verdict(result, summary["changes"]), highlight=False)
        if result["non_finite"]:
            console.print(
                f"rank {result['rank']}: {result['non_finite']}, as numbers in a fake world may be (a "
                "faked collective delivers whatever its buffer held): the update ran all the same and its "
                "gradients and optimizer states are measured",
                highlight=False,
            )
    for note in summary["notes"]:
        console.print(f"note: {note}", highlight=False)


def fits(fit: dict) -> str:
    return (
        f"{'fits' if fit['fits'] else 'does NOT fit'} one {fit['hardware']} device: {fit['needed'] / GIB:.2f} of "
        f"{fit['capacity'] / GIB:.0f} GiB"
    )


def verdict(result: dict, changes: list[str]) -> str:
    """Whether the rank fits its cluster's device; for a changed job, that it is the changed job's, and the fit
    at the config's depth where the change shortened the model (or why it cannot be extrapolated)."""
    line, full = f"rank {result['rank']} {fits(result['fits'])}", result["full_job_fits"]
    if not changes:
        return line
    line += f" as changed ({'; '.join(changes)})"
    if full and "cannot" in full:
        return f"{line}; at the config's {full['n_layers']} layers it cannot be extrapolated: {full['cannot']}"
    if full:
        return (
            f"{line}; at the config's {full['n_layers']} layers, extrapolated (each figure plus the planner's "
            f"for the blocks added), it {fits(full)}"
        )
    return f"{line}; not extrapolated to the job its config states (only a shorter model.n_layers is)"


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
    table.add_row(
        "checkpoint state dict (GiB)",
        *compared({"measured": checkpoint["held"], "planned": checkpoint["planned"]}, GIB),
    )
    times = result["time"]
    table.add_row("start-up (s)", f"{times['startup_s']:.3g}", "", "")
    # the planner's compute is the micro-batches' forward and backward: the update is a row of its own
    table.add_row("forward and backward, rehearsed (s)", *compared(times["compute_s"], 1))
    table.add_row(
        "  forward / backward and rest (s)",
        f"{times['forward_s']:.3g} / {times['backward_and_rest_s']:.3g}",
        "",
        "",
    )
    table.add_row("forward and backward, the real step (s)", *compared(times["step_compute_s"], 1))
    table.add_row("optimizer update (s)", f"{times['update_s']:.3g}", "", "")
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
        table.add_row(
            row["kind"],
            row["dim"],
            f"{row['count']:g}",
            f"{row['bytes'] / 2**20:.4g}",
            f"{row['step_count']:g}",
            *compared(figure, 2**20),
        )
    return table
