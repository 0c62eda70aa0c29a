"""`hlat plan`: rank parallel layouts for a model on a cluster, predict one layout, or calibrate a profile."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from hlat import HlatError
from hlat.config import ConfigError, load_toml, to_toml, update
from hlat.models.config import PRESETS, model_config
from hlat.optim.modes import MODES
from hlat.parallel.config import ParallelConfig
from hlat.planner.layout import Layout, Workload, layout_problem
from hlat.planner.memory import GIB
from hlat.planner.calibration import Sample, fit_factors, read_run
from hlat.planner.profiles import HardwareProfile, load_profile, profile_names
from hlat.planner.search import OBJECTIVES, RECOMPUTE, TOLERANCE, Plan, evaluate, search
from hlat.resources import config_path, recipe_names

HLAT_TOKENS = 1.8e12  # HLAT's training budget
LAYOUT_FLAGS = ("tp", "pp", "dp_shard", "microbatch", "schedule", "virtual_stages", "recompute", "zero1", "no_sp")


def register(commands) -> None:
    parser = commands.add_parser("plan", help="choose a parallel layout and predict memory, step time and cost")
    add_arguments(parser)
    parser.set_defaults(func=run, overrides=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="preset name (e.g. llama2-7b), or a recipe (e.g. hlat-7b) or TOML config: its "
                                        "[train] seq_len/global_batch, [precision] mode and [cluster] are defaults, "
                                        "and its [parallel] layout is priced as it stands (unless --search)")
    parser.add_argument("--hardware", help=f"profile name ({', '.join(profile_names())}) or a profile TOML path")
    parser.add_argument("--nodes", type=int, help="number of nodes (default: the config's [cluster] nodes, or 1)")
    parser.add_argument("--search", action="store_true", help="rank layouts even when the config states one")
    parser.add_argument("--global-batch", type=int, help="sequences per optimizer step (default 1024)")
    parser.add_argument("--seq-len", type=int, help="sequence length (default: the model's max_seq_len)")
    parser.add_argument("--precision", choices=sorted(MODES), help="training precision mode (default bf16_mixed)")
    parser.add_argument("--objective", choices=OBJECTIVES, default="tokens_per_s",
                        help="rank by throughput, or by tokens per dollar (then smaller clusters are tried too)")
    parser.add_argument("--price", choices=("on_demand", "reserved"), default="on_demand", help="node-hour price")
    parser.add_argument("--tokens", type=float, default=HLAT_TOKENS, help="token budget to cost (default 1.8e12)")
    parser.add_argument("--top", type=int, default=5, help="how many layouts to show (default 5)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"predictions this close to the best count as equal, and the simplest of them ranks "
                             f"first (default {TOLERANCE})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--emit", metavar="PATH", help="write the best layout as [parallel]/[train] TOML; with "
                                                       "--calibrate, write the fitted profile")
    parser.add_argument("--calibrate", nargs="+", metavar="RUN_DIR",
                        help="fit the profile's factors to hlat runs (config.toml + metrics.jsonl)")
    layout = parser.add_argument_group("a given layout (predict it alone)")
    layout.add_argument("--tp", type=int)
    layout.add_argument("--pp", type=int)
    layout.add_argument("--dp-shard", type=int, help="FSDP degree (dp_replicate is what is left)")
    layout.add_argument("--microbatch", type=int, help="sequences per micro-batch")
    layout.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    layout.add_argument("--virtual-stages", type=int, help="model chunks per pipeline rank (interleaved_1f1b)")
    layout.add_argument("--recompute", choices=RECOMPUTE, help="activation checkpointing")
    layout.add_argument("--zero1", action="store_true", help="shard optimizer states across data parallelism")
    layout.add_argument("--no-sp", action="store_true", help="no sequence parallelism")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    job = _job_config(args.model) if args.model and not args.calibrate else {}
    cluster = job.get("cluster", {})
    args.hardware = args.hardware or cluster.get("hardware")
    if not args.hardware:
        raise HlatError("hlat plan: --hardware is required")
    hw = load_profile(args.hardware)
    args.nodes = cluster.get("nodes", 1) if args.nodes is None else args.nodes
    if args.nodes < 1:
        raise HlatError(f"--nodes: must be >= 1, got {args.nodes}")
    if args.calibrate:
        return _calibrate(args, hw)
    work = _workload(args, job)
    price = hw.price(args.price)
    given = any(getattr(args, f) not in (None, False) for f in LAYOUT_FLAGS)
    if given or ("parallel" in job and not args.search):
        layout = _given_layout(args, hw) if given else _config_layout(job, args.nodes * hw.devices_per_node)
        plan = evaluate(work, layout, hw, args.nodes, price)
        _show(args, work, hw, [plan], f"layout {'given' if given else 'of ' + args.model}, {plan.layout.describe()}",
              args.emit if plan.memory.fits else None)
        if not plan.memory.fits:
            print(f"does not fit: {plan.memory.shortfall()}")
            return 1
        return 0
    if not 0 <= args.tolerance < 1:
        raise HlatError(f"--tolerance: must be in [0, 1), got {args.tolerance}")
    result = search(work, hw, args.nodes, args.objective, price, args.tolerance)
    if not result.plans:
        nearest = result.nearest
        why = f"; the closest, {nearest.layout.describe()}, {nearest.memory.shortfall()}" if nearest else ""
        raise HlatError(f"no layout of {work.model.preset or 'the model'} fits {args.nodes} x {hw.name}{why}")
    _show(args, work, hw, result.plans[:args.top],
          f"{result.considered:,} layouts considered in {result.seconds:.2f} s, {len(result.plans):,} fit; "
          f"within {args.tolerance:.0%} of the best counts as equal, simplest first", args.emit)
    return 0


def _job_config(model: str) -> dict:
    """The TOML tables of a recipe or config file; {} for a preset name."""
    if model in PRESETS:
        return {}
    if not model.endswith(".toml") and model not in recipe_names() and not Path(model).is_file():
        model_config(model)  # names neither a preset nor a recipe: the unknown-preset error lists the presets
    data = load_toml(config_path(model))
    if not isinstance(data.get("model"), dict):
        raise HlatError(f"--model {model}: no [model] table")
    return data


def _config_layout(job: dict, devices: int) -> Layout:
    """The config's own `[parallel]` layout (absent keys: the trainer's defaults) resolved on `devices`."""
    try:
        parallel = update(ParallelConfig(), job["parallel"], "parallel.").resolved(devices)
    except ConfigError as e:
        raise HlatError(f"--model: {e}") from None
    return Layout(parallel, job.get("train", {}).get("micro_batch", 1))


def _workload(args: argparse.Namespace, job: dict) -> Workload:
    if not args.model:
        raise HlatError("hlat plan: --model is required (a preset name, a recipe or a TOML config)")
    train, precision = job.get("train", {}), job.get("precision", {}).get("mode", "bf16_mixed")
    if job:
        table = dict(job["model"])
        model = model_config(table.pop("preset", ""), **table)
    else:
        model = model_config(args.model)
    seq_len = args.seq_len or train.get("seq_len") or model.max_seq_len
    batch = args.global_batch or train.get("global_batch") or 1024
    precision = args.precision or precision
    if precision not in MODES:
        raise HlatError(f"precision {precision!r} is not one of {', '.join(MODES)}")
    if seq_len < 1 or batch < 1:
        raise HlatError(f"--seq-len and --global-batch must be positive, got {seq_len} and {batch}")
    return Workload(model, seq_len, batch, precision)


def _given_layout(args: argparse.Namespace, hw: HardwareProfile) -> Layout:
    tp, pp, shard = args.tp or 1, args.pp or 1, args.dp_shard or 1
    devices = args.nodes * hw.devices_per_node
    if devices % (tp * pp * shard):
        raise HlatError(f"tp {tp} x pp {pp} x dp_shard {shard} does not divide the {devices} devices")
    v = args.virtual_stages or 1
    schedule = args.schedule or ("interleaved_1f1b" if v > 1 else "1f1b")
    dp = devices // (tp * pp)
    if args.zero1 and not args.dp_shard:  # ZeRO-1 shards over dp_shard: all of data parallelism by default
        shard = dp
    return Layout.of(tp=tp, pp=pp, dp_replicate=dp // shard, dp_shard=shard, micro_batch=args.microbatch or 1,
                     pp_schedule=schedule, virtual_stages=v, sequence_parallel=not args.no_sp, zero1=args.zero1,
                     activation_checkpoint=args.recompute or "selective")


def _row(plan: Plan, tokens: float) -> dict:
    days, dollars = plan.budget(tokens)
    m, t = plan.memory, plan.time
    return {
        "layout": plan.layout.describe(), "nodes": plan.nodes, **plan.layout.config_sections(plan.work),
        "fits": m.fits, "memory_gib": {k: round(v / GIB, 3) for k, v in asdict(m).items()} | {
            "total": round(m.total / GIB, 3)},
        "step_time_s": {k: round(v, 4) for k, v in asdict(t).items() if k not in ("layer", "data_parallel")} | {
            "total": round(t.total, 4)},
        "layer": t.layer, "data_parallel": t.data_parallel,
        "tokens_per_s": round(plan.tokens_per_s, 1), "mfu": round(plan.mfu, 4),
        "tokens_per_dollar": round(plan.tokens_per_dollar) if plan.tokens_per_dollar else None,
        "budget": {"tokens": tokens, "days": round(days, 2), "dollars": round(dollars) if dollars else None},
    }


def _show(args: argparse.Namespace, work: Workload, hw: HardwareProfile, plans: list[Plan], note: str,
          emit: str | None) -> None:
    """Print the plans (a table, or JSON with --json); write the first as config tables to `emit`."""
    if emit:
        best = plans[0]
        header = (f"# hlat plan: {work.model.preset or work.model.family} on {best.nodes} x {hw.name}: "
                  f"{best.layout.describe()}, predicted {best.time.total:.3g} s/step, "
                  f"{best.tokens_per_s:,.0f} tokens/s, {best.memory.total / GIB:.1f} GiB/device\n")
        Path(emit).write_text(header + to_toml(best.layout.run_config(work)))
    if args.json:
        print(json.dumps({"model": work.model.preset, "hardware": hw.name, "nodes": args.nodes,
                          "seq_len": work.seq_len, "global_batch": work.global_batch, "precision": work.precision,
                          "fit": hw.fit.source, "figures": hw.sources(), "note": note, "plans": [_row(p, args.tokens) for p in plans]},
                         indent=2))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 120)  # one line per layout, numbers unclipped
    devices = args.nodes * hw.devices_per_node
    budget = f"{args.tokens / 1e12:g}T"
    table = Table(title=f"{work.model.preset or work.model.family} on {args.nodes} x {hw.name} ({devices:,} "
                        f"device{'s' if devices > 1 else ''}): seq {work.seq_len}, batch {work.global_batch} "
                        f"({_si(work.tokens_per_step)} tokens), {work.precision}, {args.price.replace('_', '-')} "
                        "price", caption=f"{note}. Figures: {hw.sources()}.", box=box.SIMPLE_HEAD)
    show_nodes = any(p.nodes != args.nodes for p in plans)
    for col in ("#", "layout", *(["nodes"] if show_nodes else []), "GiB", "s/step", "tok/s", "MFU", "tok/$",
                f"days/{budget}", f"$/{budget}"):
        table.add_column(col, justify="left" if col == "layout" else "right", no_wrap=True)
    for i, p in enumerate(plans, 1):
        days, dollars = p.budget(args.tokens)
        table.add_row(str(i), p.layout.describe(), *([str(p.nodes)] if show_nodes else []),
                      f"{p.memory.total / GIB:.1f}", f"{p.time.total:.3g}", _si(p.tokens_per_s), f"{p.mfu:.1%}",
                      _si(p.tokens_per_dollar) if p.tokens_per_dollar else "-", f"{days:,.1f}",
                      f"${_si(dollars)}" if dollars else "-")
    console.print(table)
    t, m = plans[0].time, plans[0].memory
    console.print(f"#1 step {t.total:.3g} s = compute {t.compute:.3g} + TP {t.tp_comm:.3g} + PP {t.pp_comm:.3g} "
                  f"+ bubble {t.bubble:.3g} + DP {t.dp_comm:.3g} + optimizer {t.optimizer:.2g} (layer: {t.layer}"
                  f"{f'; data parallelism: {t.data_parallel}' if t.data_parallel else ''})")
    console.print(f"#1 memory {m.total / GIB:.1f} of {m.capacity / GIB:.0f} GiB = weights {m.weights / GIB:.1f} "
                  f"+ grads {m.grads / GIB:.1f} + optimizer {m.optimizer / GIB:.1f} + activations "
                  f"{m.activations / GIB:.1f} + FSDP buffers {m.buffers / GIB:.1f} + overhead {m.overhead / GIB:.1f}")
    if emit:
        console.print(f"wrote {emit}")


def _si(x: float) -> str:
    return f"{x / 1e6:.3g}M" if x >= 1e6 else f"{x / 1e3:.3g}k" if x >= 1e3 else f"{x:.3g}"


def run_sample(run_dir: str, hw: HardwareProfile) -> Sample:
    """What an hlat run did, read back exactly: its model, precision, batch and resolved layout (the trainer
    writes config.toml with dp_shard resolved for its world size) and its median step time."""
    config, step_s = read_run(run_dir)
    try:
        table = dict(config.get("model", {}))
        model = model_config(table.pop("preset", ""), **table)
        parallel = update(ParallelConfig(), config.get("parallel", {}), "parallel.")
        train = config["train"]
        work = Workload(model, train["seq_len"], train["global_batch"], config["precision"]["mode"])
    except (ConfigError, KeyError, TypeError) as e:
        raise HlatError(f"--calibrate {run_dir}: config.toml: {e}") from None
    if parallel.dp_shard == -1:
        raise HlatError(f"--calibrate {run_dir}: config.toml has parallel.dp_shard = -1 (written by an older hlat): "
                        "the run's world size is unknown")
    layout = Layout(parallel, train["micro_batch"])
    problem = layout_problem(work, layout, layout.devices)
    if problem:
        raise HlatError(f"--calibrate {run_dir}: {problem}")
    return Sample(str(run_dir), work, layout, hw, step_s)


def _calibrate(args: argparse.Namespace, hw: HardwareProfile) -> int:
    samples = [run_sample(run_dir, hw) for run_dir in args.calibrate]
    free = ("flops_factor", "layer_overhead_ms")[:len(samples)]
    fit = fit_factors(samples, free, hw.fit, f"calibrated on {len(samples)} hlat run(s): {', '.join(args.calibrate)}")
    fitted = replace(hw, fit=fit)
    from hlat.planner.timing import step_time

    for s in samples:
        predicted = step_time(s.workload, s.layout, fitted).total
        print(f"{s.name}: measured {s.step_s:.4g} s/step, predicted {predicted:.4g} s ({predicted / s.step_s - 1:+.1%})")
    text = fitted.to_toml()
    if args.emit:
        Path(args.emit).write_text(text)
        print(f"wrote {args.emit}")
    else:
        print(text)
    return 0
