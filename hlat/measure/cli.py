"""`hlat preflight` (torch is imported only when it runs)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hlat import HlatError


def register(commands) -> None:
    parser = commands.add_parser("preflight", help="burn-in: measure compute, links and numerics on every rank; "
                                                   "write a measured hardware profile for the planner",
                                 description="Run alone or under torchrun (every rank). Config overrides "
                                             "(--section.key value) are accepted.")
    add_arguments(parser)
    parser.set_defaults(func=run, overrides=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config: its model, seq_len, micro_batch, precision, tp, sequence "
                                         "parallelism, recomputation and optimizer are measured")
    parser.add_argument("--model", help="preset name instead of the config's model")
    parser.add_argument("--tp", default="", help="tensor-parallel degrees whose matmul shapes to measure, e.g. 1,2 "
                                                 "(default: 1 and the config's tp)")
    parser.add_argument("--micro-batches", default="", help="micro-batch sizes whose matmul shapes to measure, "
                                                            "e.g. 1,4 (default: the config's micro_batch)")
    parser.add_argument("--dp", default="", help="data-parallel arrangements to time whole blocks under too, over "
                                                 "the ranks tensor parallelism leaves: fsdp, zero1, ddp, or none "
                                                 "(default: the config's)")
    parser.add_argument("--dtypes", default="", help="fp32,bf16 (default: the precision mode's compute dtype)")
    parser.add_argument("--sizes", default="", help="collective sizes in bytes, comma-separated "
                                                    "(default 4 KiB to 16 MiB and the model's own messages)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed repetitions per measurement (the fastest is kept)")
    parser.add_argument("--threshold", type=float, default=0.8,
                        help="a rank or link below this share of the median fails (default 0.8)")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="of free device memory to allocate")
    parser.add_argument("--hardware", help="profile whose public figures --out starts from (default: cpu, or the "
                                           "closest known accelerator)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", help="write a hardware profile with the measurements, for hlat plan --hardware")
    parser.add_argument("--debug-delay", default="", metavar="RANK:MS", help=argparse.SUPPRESS)
    parser.add_argument("--debug-perturb", type=int, default=-1, metavar="RANK", help=argparse.SUPPRESS)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise HlatError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise HlatError(f"{flag}: values must be >= 1, got {text!r}")
    return values


def options(args: argparse.Namespace, overrides: list[str]):
    from hlat.train.config import load_config
    from hlat.measure.preflight import DATA_PARALLEL, Options

    if args.model:
        overrides = ["--model.preset", args.model] + overrides
    cfg = load_config(args.config, overrides)
    if not 0 < args.threshold <= 1 or not 0 < args.memory_fraction <= 1:
        raise HlatError(f"--threshold and --memory-fraction must be in (0, 1], got {args.threshold} and "
                        f"{args.memory_fraction}")
    if args.repeats < 1:
        raise HlatError(f"--repeats: must be >= 1, got {args.repeats}")
    dtypes = tuple(d for d in args.dtypes.split(",") if d) or (
        ("fp32",) if cfg.precision.mode == "fp32" else ("bf16",))
    if set(dtypes) - {"fp32", "bf16"}:
        raise HlatError(f"--dtypes: expected fp32 and/or bf16, got {args.dtypes!r}")
    tps = _ints(args.tp, "--tp") or tuple(sorted({1, cfg.parallel.tp}))
    for tp in tps:
        if cfg.model.n_heads % tp or cfg.model.ffn_dim % tp or cfg.model.vocab_size % tp:
            raise HlatError(f"--tp: {tp} does not divide the model's heads, ffn_dim or vocab_size")
    p = cfg.parallel
    data_parallel = tuple(a for a in args.dp.split(",") if a) or (
        ("zero1" if p.zero1 else "ddp" if p.dp_shard == 1 else "fsdp"),)
    data_parallel = () if data_parallel == ("none",) else data_parallel
    if set(data_parallel) - set(DATA_PARALLEL):
        raise HlatError(f"--dp: expected {', '.join(DATA_PARALLEL)} or none, got {args.dp!r}")
    delay_rank, delay_ms = -1, 0.0
    if args.debug_delay:
        try:
            rank, ms = args.debug_delay.split(":")
            delay_rank, delay_ms = int(rank), float(ms)
        except ValueError:
            raise HlatError(f"--debug-delay: expected RANK:MS, got {args.debug_delay!r}") from None
    sizes = _ints(args.sizes, "--sizes") if args.sizes else default_sizes(cfg.model)
    micro_batches = _ints(args.micro_batches, "--micro-batches") or (cfg.train.micro_batch,)
    return Options(model=cfg.model, seq_len=cfg.train.seq_len, micro_batch=max(micro_batches),
                   other_micro_batches=micro_batches, tps=tps,
                   dtypes=dtypes, repeats=args.repeats, threshold=args.threshold,
                   memory_fraction=args.memory_fraction, delay_rank=delay_rank, delay_ms=delay_ms,
                   perturb_rank=args.debug_perturb, precision=cfg.precision.mode,
                   sequence_parallel=cfg.parallel.sequence_parallel,
                   recompute=cfg.parallel.activation_checkpoint, data_parallel=data_parallel, sizes=sizes,
                   optim=cfg.optim, device=cfg.train.device)


def default_sizes(model) -> tuple[int, ...]:
    """4 KiB to 16 MiB by 8x, and the sizes of the model's own data-parallel messages (fp32, without tensor
    parallelism: one block, and the rest of the model), up to 1 GiB: the trainer reduces and gathers one
    `fully_shard` unit at a time, and the rate at 16 MiB need not hold at a 200 MB embedding."""
    from hlat.planner.layout import Layout
    from hlat.planner.memory import sharded_units
    from hlat.measure.preflight import Options

    units = {min(int(params) * 4, 2 ** 30) for _, params in sharded_units(model, Layout.of())}
    return tuple(sorted(set(Options.sizes) | {u for u in units if u > 0}))


def base_profile(name: str | None, device_type: str):
    from hlat.planner.profiles import load_profile

    if name:
        return load_profile(name)
    if device_type == "cuda":
        import torch

        gpu = torch.cuda.get_device_name()
        return load_profile("p5e.48xlarge" if "H200" in gpu else "p5.48xlarge" if "H100" in gpu else "p4d.24xlarge")
    return load_profile("cpu")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.parallel.device import pick_device
    from hlat.measure.preflight import measured_profile, report_json, run_preflight

    o = options(args, overrides)
    report = run_preflight(o)
    main = os.environ.get("RANK", "0") == "0"
    if main:
        if args.json:
            print(report_json(report))
        else:
            show(report)
        if args.out:
            profile = measured_profile(report, base_profile(args.hardware, pick_device(o.device).type),
                                       int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            Path(args.out).write_text(profile.to_toml())
            print(f"wrote {args.out}", file=sys.stderr if args.json else sys.stdout)
        for line in report.problems:
            print(f"hlat preflight: {line}", file=sys.stderr)
    # rank 0 speaks for the job: torchrun would stop it mid-report if another rank exited non-zero first
    return 1 if report.problems and main else 0


def show(report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 120)
    table = Table(title=f"hlat preflight: {report.ranks} rank(s), {report.device}")
    for col in ("measurement", "shape", "ms", "rate"):
        table.add_column(col, justify="left" if col in ("measurement", "shape") else "right")
    for r in report.compute:
        table.add_row(r["what"], r["shape"], f"{r['seconds'] * 1e3:.3g}", r["rate"])
    console.print(table)
    if report.collectives:
        table = Table(title="collectives (bus bandwidth as nccl-tests reports it)")
        for col in ("op", "bytes", "ms", "algbw GB/s", "busbw GB/s"):
            table.add_column(col, justify="right")
        for r in report.collectives:
            table.add_row(r["op"], f"{r['bytes']:,}", f"{r['seconds'] * 1e3:.3g}", f"{r['algbw_gbs']:.3g}",
                          f"{r['busbw_gbs']:.3g}")
        console.print(table)
        table = Table(title=f"links (send/recv); overlap of an all-reduce with compute: {report.overlap:.0%}")
        for col in ("pair", "hosts", "bytes", "GB/s"):
            table.add_column(col, justify="right")
        for r in report.links:
            table.add_row(f"{r['src']} -> {r['dst']}", r["hosts"], f"{r['bytes']:,}", f"{r['gbs']:.3g}")
        console.print(table)
    console.print("stragglers (slowdown against the median rank): " + ", ".join(
        f"rank {s['rank']} {s['score']:.2f}" for s in report.stragglers))
    numerics = f"differ on ranks {report.mismatched}" if report.mismatched else "identical on every rank"
    console.print(f"numerics: {numerics}; memory: {report.memory}")
