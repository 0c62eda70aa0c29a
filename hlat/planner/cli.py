"""`hlat plan`: rank parallel layouts for a model on a cluster, predict one layout, or calibrate a profile.

`--config` takes what `hlat train --config` takes (recipes, files, repeated and merged in order, then
`--section.key value` overrides), and the plan prices what that config would train: its model, precision mode,
compilation, batch and sequence, token budget (steps x global_batch x seq_len), cluster and `[parallel]` layout
(unless `--search`). `--model` names a preset."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from hlat import HlatError
from hlat.config.cli import add_cluster_arguments, cluster_overrides
from hlat.fields import ConfigError, update
from hlat.models.config import PRESETS, model_config
from hlat.optim.config import FP8_RECIPES, PrecisionConfig
from hlat.optim.modes import MODES
from hlat.parallel.config import ParallelConfig
from hlat.planner.advice import advise
from hlat.planner.calibration import Sample, fit_factors, read_run
from hlat.planner.layout import Layout, Workload, layout_problem
from hlat.planner.rehearsal import own_trainer_note, with_rehearsal
from hlat.planner.report import Request, fp8_note, show
from hlat.planner.search import OBJECTIVES, RECOMPUTE, TOLERANCE, evaluate, search
from hlat.profiles import HardwareProfile, load_profile
from hlat.resources import recipe_names

HLAT_TOKENS = 1.8e12  # HLAT's training budget: the default for a preset
LAYOUT_FLAGS = (
    "tp",
    "pp",
    "cp",
    "ep",
    "dp_shard",
    "microbatch",
    "schedule",
    "virtual_stages",
    "recompute",
    "zero1",
    "no_sp",
)


def register(commands) -> None:
    parser = commands.add_parser("plan", help="choose a parallel layout and predict memory, step time and cost")
    add_arguments(parser)
    parser.set_defaults(func=run, overrides=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        action="append",
        help="a recipe (e.g. hlat-7b) or TOML config, as `hlat train --config` takes it (repeatable, "
        "merged in order; then --section.key value overrides): the plan prices what it would "
        "train, on its [cluster], with its [parallel] layout unless --search",
    )
    parser.add_argument(
        "--model", help=f"a model preset ({', '.join(PRESETS)}); with --config it replaces the config's model"
    )
    add_cluster_arguments(parser)
    parser.add_argument("--search", action="store_true", help="rank layouts even when the config states one")
    parser.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step (default: the config's, else 1024)"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        help="sequence length (default: the config's, else the model's "
        "max_seq_len, as `hlat describe`; the output says which)",
    )
    parser.add_argument(
        "--precision", choices=sorted(MODES), help="training precision mode (default: the config's, else bf16_mixed)"
    )
    parser.add_argument(
        "--fp8",
        choices=("none", *FP8_RECIPES),
        help="FP8 matmuls in the blocks' linear layers with this scaling recipe (precision.fp8; "
        "default: the config's, else none), priced at the rates preflight measured for it",
    )
    parser.add_argument(
        "--compile", action="store_true", help="compiled blocks (parallel.compile; default: the config's)"
    )
    parser.add_argument(
        "--expert-load",
        type=float,
        default=1.0,
        help="a mixture of experts under expert parallelism: the choices the busiest rank's experts take against an "
        "even share (default 1; a run logs its busiest expert's as moe_imbalance, docs/moe.md)",
    )
    add_ranking_arguments(parser)
    add_layout_arguments(parser)


def add_ranking_arguments(parser: argparse.ArgumentParser) -> None:
    """How the plan ranks, prices and reports layouts."""
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="tokens_per_s",
        help="rank by throughput, or by tokens per dollar (then smaller clusters are tried too)",
    )
    parser.add_argument(
        "--price",
        choices=("on_demand", "reserved"),
        help="which of the profile's node-hour prices (default: the config's cost.pricing, else "
        "on_demand; a profile without it takes its other price and says so)",
    )
    parser.add_argument("--price-per-node-hour", type=float, help="USD per node-hour, instead of the profile's")
    parser.add_argument(
        "--tokens",
        type=float,
        help="token budget to cost (default: the config's train.steps x global_batch x seq_len, else 1.8e12)",
    )
    parser.add_argument("--top", type=int, default=5, help="how many layouts to show (default 5)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help=f"predictions this close to the best count as equal, and the simplest of them ranks "
        f"first (default {TOLERANCE})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--emit",
        metavar="PATH",
        help="write the best layout as [parallel]/[train] TOML; with --calibrate, write the fitted profile",
    )
    parser.add_argument(
        "--calibrate",
        nargs="+",
        metavar="RUN_DIR",
        help="fit the profile's factors to hlat runs (config.toml + metrics.jsonl)",
    )
    parser.add_argument(
        "--rehearsal",
        metavar="FILE",
        help="hlat rehearse --json of this layout: its measured memory (and compute, if rehearsed "
        "on this hardware) in place of the composed figures",
    )


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    layout = parser.add_argument_group("a given layout (predict it alone)")
    layout.add_argument("--tp", type=int)
    layout.add_argument("--pp", type=int)
    layout.add_argument("--cp", type=int, help="context parallelism: each sequence split over cp ranks")
    layout.add_argument("--ep", type=int, help="expert parallelism: each layer's experts over ep of the FSDP ranks")
    layout.add_argument("--dp-shard", type=int, help="FSDP degree (dp_replicate is what is left)")
    layout.add_argument("--microbatch", type=int, help="sequences per micro-batch")
    layout.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    layout.add_argument("--virtual-stages", type=int, help="model chunks per pipeline rank (interleaved_1f1b)")
    layout.add_argument("--recompute", choices=RECOMPUTE, help="activation checkpointing")
    layout.add_argument("--zero1", action="store_true", help="shard optimizer states across data parallelism")
    layout.add_argument("--no-sp", action="store_true", help="no sequence parallelism")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = _load_config(args, overrides)
    from hlat.config.job import load_config

    cluster = cfg.cluster if cfg else load_config(None, cluster_overrides(args)).cluster
    if not cluster.hardware:
        raise HlatError(
            "hlat plan: --hardware is required" + (" (the config states no [cluster] hardware)" if cfg else "")
        )
    hw = load_profile(cluster.hardware)
    if args.calibrate:
        return _calibrate(args, hw)
    cluster.check_processes(hw)
    # the devices the job uses on each node: as many as its processes (`hlat launch` starts the same)
    hw = replace(hw, devices_per_node=cluster.nproc_per_node)
    req = _request(args, cfg, hw, cluster.nodes)
    return _predict(args, req) if req.layout else _search(args, req)


def _predict(args: argparse.Namespace, req: Request) -> int:
    """The given layout alone; beside it what --search chooses, when the layout does not suit the hardware (a
    tensor-parallel group across nodes, or needlessly slow links: `hlat.planner.advice`)."""
    plan = evaluate(req.work, req.layout, req.hw, req.nodes, req.price)
    plan, said = with_rehearsal(plan, args.rehearsal) if args.rehearsal else (plan, [])
    said += [note] if (note := own_trainer_note(plan)) else []
    advice = advise(req.work, req.layout, req.hw, req.nodes, req.price, req.tokens)
    plans = [plan, *([advice.best] if advice and advice.best else [])]
    if advice:
        req.notes.append(advice.line)
        said += ["#2: what --search chooses"] if advice.best else []
    origin = f"of the config{_changed(args)}" if args.config else "given"
    show(
        req,
        plans,
        f"layout {origin}, {plan.layout.describe()}" + "".join(f"; {line}" for line in said),
        args.json,
        args.emit if plan.memory.fits else None,
    )
    if not plan.memory.fits:  # --json keeps stdout whole: its plan says "fits": false
        print(f"does not fit: {plan.memory.shortfall()}", file=sys.stderr if args.json else sys.stdout)
        return 1
    return 0


def _search(args: argparse.Namespace, req: Request) -> int:
    if args.rehearsal:
        raise HlatError("--rehearsal: prices the layout it rehearsed; give that layout (a config's own, no --search)")
    if not 0 <= args.tolerance < 1:
        raise HlatError(f"--tolerance: must be in [0, 1), got {args.tolerance}")
    work, hw = req.work, req.hw
    result = search(work, hw, req.nodes, args.objective, req.price, args.tolerance)
    if not result.plans:
        nearest = result.nearest
        why = f"; the closest, {nearest.layout.describe()}, {nearest.memory.shortfall()}" if nearest else ""
        raise HlatError(f"no layout of {work.model.preset or 'the model'} fits {req.nodes} x {hw.name}{why}")
    show(
        req,
        result.plans[: args.top],
        f"{result.considered:,} layouts considered in {result.seconds:.2f} s, {len(result.plans):,} fit; "
        f"within {args.tolerance:.0%} of the best counts as equal, simplest first",
        args.json,
        args.emit,
    )
    return 0


def _load_config(args: argparse.Namespace, overrides: list[str]):
    """The config `hlat train --config` would run (None without --config); `--model` must name a preset."""
    if args.model and args.model not in PRESETS:
        if args.model in recipe_names() or args.model.endswith(".toml") or Path(args.model).is_file():
            raise HlatError(
                f"--model {args.model}: --model names a model preset ({', '.join(PRESETS)}); for a "
                f"recipe or config file use --config {args.model}"
            )
        model_config(args.model)  # the unknown-preset error, listing the presets
    if not args.config:
        if overrides:
            raise HlatError(f"hlat plan: {overrides[0]}: --section.key overrides apply to a --config")
        return None
    from hlat.config.job import load_config

    preset = ["--model.preset", args.model] if args.model else []
    return load_config(args.config, preset + cluster_overrides(args) + overrides)


def _request(args: argparse.Namespace, cfg, hw: HardwareProfile, nodes: int) -> Request:
    work, seq_len_from = _workload(args, cfg)
    price, price_note = _price(args, cfg, hw)
    tokens = args.tokens or (cfg.train.steps * work.tokens_per_step if cfg else HLAT_TOKENS)
    if tokens <= 0:
        raise HlatError(f"--tokens: must be positive, got {tokens}")
    notes = [line for line in (hw.measured.mismatch(work.precision), fp8_note(work, hw)) if line]
    return Request(
        work,
        hw,
        nodes,
        price,
        price_note,
        tokens,
        _layout(args, cfg, work, nodes * hw.devices_per_node),
        notes,
        seq_len_from,
    )


def _workload(args: argparse.Namespace, cfg) -> tuple[Workload, str]:
    """What the plan trains, and what set its sequence length (`figures_seq_len`, as `hlat describe`)."""
    from hlat.config.job import figures_seq_len

    if cfg:
        model, train = cfg.model, cfg.train
        batch, precision, compiled = train.global_batch, cfg.precision, cfg.parallel.compile
    elif args.model:
        model = model_config(args.model)
        batch, precision, compiled = 1024, PrecisionConfig("bf16_mixed"), False
    else:
        raise HlatError("hlat plan: give --model PRESET or --config RECIPE_OR_FILE")
    seq_len, seq_len_from = figures_seq_len(args.seq_len, cfg.train.seq_len if cfg else None, model)
    batch = args.global_batch or batch
    if seq_len < 1 or batch < 1:
        raise HlatError(f"--seq-len and --global-batch must be positive, got {seq_len} and {batch}")
    if args.expert_load < 1:
        raise HlatError(f"--expert-load: {args.expert_load} is below an even share (1)")
    mode, fp8 = args.precision or precision.mode, args.fp8 or precision.fp8
    return Workload(model, seq_len, batch, mode, args.compile or compiled, fp8, args.expert_load), seq_len_from


def _price(args: argparse.Namespace, cfg, hw: HardwareProfile) -> tuple[float, str]:
    """USD per node-hour and where it comes from: --price-per-node-hour, the config's cost.price_per_device_hour,
    else the profile's price of the kind asked for (or its other price, said so)."""
    if args.price_per_node_hour is not None:
        if args.price_per_node_hour < 0:
            raise HlatError(f"--price-per-node-hour: must be >= 0, got {args.price_per_node_hour}")
        return args.price_per_node_hour, "--price-per-node-hour"
    if cfg and cfg.cost.price_per_device_hour:
        return cfg.cost.price_per_device_hour * hw.devices_per_node, "the config's cost.price_per_device_hour"
    kind = args.price or (cfg.cost.pricing if cfg else "on_demand")
    other = "reserved" if kind == "on_demand" else "on_demand"
    source = f" ({hw.price_note()})" if hw.price_note() else ""
    if hw.price(kind):
        return hw.price(kind), f"{hw.name} {kind.replace('_', '-')}{source}"
    if hw.price(other):
        return hw.price(other), (
            f"{hw.name} has no {kind.replace('_', '-')} price: its {other.replace('_', '-')} price{source}"
        )
    return 0.0, f"{hw.name} states no price{source}: pass --price-per-node-hour"


def _layout_flags_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, f) not in (None, False) for f in LAYOUT_FLAGS)


def _layout(args: argparse.Namespace, cfg, work: Workload, devices: int) -> Layout | None:
    """The layout to price alone: with a config, its `[parallel]` and micro-batch with only what the layout flags
    name changed (unless --search without them), resolved on `devices`; without one, the flags' (data
    parallelism takes the remaining devices); None to search."""
    if cfg and (_layout_flags_given(args) or not args.search):
        parallel = replace(_changed_parallel(args, cfg.parallel), compile=work.compile)
        try:
            return Layout(parallel.resolved(devices), args.microbatch or cfg.train.micro_batch)
        except ConfigError as e:
            raise HlatError(f"the config's layout{_changed(args)}: {e}") from None
    if _layout_flags_given(args):
        return _given_layout(args, work, devices)
    return None


def _changed_parallel(args: argparse.Namespace, parallel: ParallelConfig) -> ParallelConfig:
    """The config's `[parallel]` with the fields the layout flags name set; data parallelism fills what the
    degrees leave (dp_replicate, when --dp-shard names the sharding)."""
    changes = {name: getattr(args, name) for name in ("tp", "pp", "cp", "virtual_stages") if getattr(args, name)}
    if args.dp_shard:
        changes |= {"dp_shard": args.dp_shard, "dp_replicate": -1}
    elif changes and -1 not in (parallel.dp_shard, parallel.dp_replicate):
        changes["dp_shard"] = -1  # both degrees stated: sharding takes what the changed degrees leave
    if args.schedule or (args.virtual_stages or 1) > 1:
        changes["pp_schedule"] = args.schedule or "interleaved_1f1b"
    changes |= {"activation_checkpoint": args.recompute} if args.recompute else {}
    changes |= {"zero1": True} if args.zero1 else {}
    changes |= {"sequence_parallel": False} if args.no_sp else {}
    return replace(parallel, **changes)


def _changed(args: argparse.Namespace) -> str:
    """' with --cp 4 --recompute full': the layout flags given, as typed ('' without any)."""
    given = [(f, getattr(args, f)) for f in LAYOUT_FLAGS if getattr(args, f) not in (None, False)]
    flags = " ".join(f"--{f.replace('_', '-')}" + ("" if value is True else f" {value}") for f, value in given)
    return f" with {flags}" if flags else ""


def _given_layout(args: argparse.Namespace, work: Workload, devices: int) -> Layout:
    tp, pp, cp, shard = args.tp or 1, args.pp or 1, args.cp or 1, args.dp_shard or 1
    if devices % (tp * pp * cp * shard):
        raise HlatError(f"tp {tp} x pp {pp} x cp {cp} x dp_shard {shard} does not divide the {devices} devices")
    v = args.virtual_stages or 1
    schedule = args.schedule or ("interleaved_1f1b" if v > 1 else "1f1b")
    dp = devices // (tp * pp * cp)
    if args.zero1 and not args.dp_shard:  # ZeRO-1 shards over dp_shard: all of data parallelism by default
        shard = dp
    return Layout.of(
        tp=tp,
        pp=pp,
        cp=cp,
        ep=args.ep or 1,
        dp_replicate=dp // shard,
        dp_shard=shard,
        micro_batch=args.microbatch or 1,
        pp_schedule=schedule,
        virtual_stages=v,
        sequence_parallel=not args.no_sp,
        zero1=args.zero1,
        activation_checkpoint=args.recompute or "selective",
        compile=work.compile,
    )


def run_sample(run_dir: str, hw: HardwareProfile) -> Sample:
    """What an hlat run did, read back exactly: its model, precision, batch and resolved layout (the trainer
    writes config.toml with dp_shard resolved for its world size) and its median step time."""
    config, step_s = read_run(run_dir)
    try:
        table = dict(config.get("model", {}))
        model = model_config(table.pop("preset", ""), **table)
        parallel = update(ParallelConfig(), config.get("parallel", {}), "parallel.")
        train = config["train"]
        precision = update(PrecisionConfig(), config["precision"], "precision.")
        work = Workload(model, train["seq_len"], train["global_batch"], precision.mode, parallel.compile, precision.fp8)
    except (ConfigError, KeyError, TypeError) as e:
        raise HlatError(f"--calibrate {run_dir}: config.toml: {e}") from None
    if parallel.dp_shard == -1:
        raise HlatError(
            f"--calibrate {run_dir}: config.toml has parallel.dp_shard = -1 (written by an older hlat): "
            "the run's world size is unknown"
        )
    layout = Layout(parallel, train["micro_batch"])
    problem = layout_problem(work, layout, layout.devices)
    if problem:
        raise HlatError(f"--calibrate {run_dir}: {problem}")
    return Sample(str(run_dir), work, layout, hw, step_s)


def _calibrate(args: argparse.Namespace, hw: HardwareProfile) -> int:
    samples = [run_sample(run_dir, hw) for run_dir in args.calibrate]
    free = ("flops_factor", "layer_overhead_ms")[: len(samples)]
    fit = fit_factors(samples, free, hw.fit, f"calibrated on {len(samples)} hlat run(s): {', '.join(args.calibrate)}")
    fitted = replace(hw, fit=fit)
    from hlat.planner.timing import step_time

    for s in samples:
        predicted = step_time(s.workload, s.layout, fitted).total
        print(
            f"{s.name}: measured {s.step_s:.4g} s/step, predicted {predicted:.4g} s ({predicted / s.step_s - 1:+.1%})"
        )
    text = fitted.to_toml()
    if args.emit:
        Path(args.emit).write_text(text)
        print(f"wrote {args.emit}")
    else:
        print(text)
    return 0
