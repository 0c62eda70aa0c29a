"""`hlat preflight` on the command line (torch is imported only when it runs), and the package's registration of its
commands: `hlat preflight` here, `hlat rehearse` from hlat.measure.rehearse_cli."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hlat import HlatError
from hlat.measure import rehearse_cli
from hlat.optim.config import FP8_RECIPES

if TYPE_CHECKING:
    from hlat.config.job import Config
    from hlat.measure.options import Options
    from hlat.parallel.config import ParallelConfig


def register(commands) -> None:
    parser = commands.add_parser(
        "preflight",
        help="burn-in: measure compute, links and numerics on every rank; "
        "write a measured hardware profile for the planner",
        description="Run alone or under torchrun (every rank). Config overrides (--section.key value) are accepted.",
    )
    add_preflight_arguments(parser)
    parser.set_defaults(func=run_preflight_command, overrides=True)
    rehearse_cli.register(commands)


def add_preflight_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="TOML config: its model, seq_len, micro_batch, precision, tp, sequence "
        "parallelism, recomputation and optimizer are measured",
    )
    parser.add_argument("--model", help="preset name instead of the config's model")
    parser.add_argument(
        "--tp",
        default="",
        help="tensor-parallel degrees whose matmul shapes to measure, e.g. 1,2 (default: 1 and the config's tp)",
    )
    parser.add_argument(
        "--micro-batches",
        default="",
        help="micro-batch sizes whose matmul shapes to measure, e.g. 1,4 (default: the config's micro_batch)",
    )
    parser.add_argument(
        "--dp",
        default="",
        help="data-parallel arrangements to time whole blocks under too, over "
        "the ranks tensor parallelism leaves: fsdp, zero1, ddp, or none "
        "(default: the config's)",
    )
    parser.add_argument("--dtypes", default="", help="fp32,bf16 (default: the precision mode's compute dtype)")
    parser.add_argument(
        "--fp8",
        default=",".join(FP8_RECIPES),
        help="precision.fp8 recipes to time a torchao Float8Linear in (forward + backward) at each "
        "block linear's shape, where the device has FP8 tensor cores (CUDA compute capability "
        f">= 8.9) and torchao is installed: {', '.join(FP8_RECIPES)} (default: all), or none",
    )
    parser.add_argument(
        "--sizes",
        default="",
        help="collective sizes in bytes, comma-separated (default 4 KiB to 16 MiB and the model's own messages)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repetitions per measurement (the fastest is kept)"
    )
    parser.add_argument(
        "--threshold", type=float, default=0.8, help="a rank or link below this share of the median fails (default 0.8)"
    )
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="of free device memory to allocate")
    parser.add_argument(
        "--hardware",
        help="profile whose public figures --out starts from (default: cpu, or the closest known accelerator)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", help="write a hardware profile with the measurements, for hlat plan --hardware")
    parser.add_argument("--debug-delay", default="", metavar="RANK:MS", help=argparse.SUPPRESS)
    parser.add_argument("--debug-perturb", type=int, default=-1, metavar="RANK", help=argparse.SUPPRESS)


def preflight_options(args: argparse.Namespace, overrides: list[str]) -> Options:
    """The config (with overrides) and the flags as `Options`; a bad flag is a one-line `HlatError`."""
    from hlat.config.job import load_config
    from hlat.measure.options import Options, default_sizes

    if args.model:
        overrides = ["--model.preset", args.model] + overrides
    config = load_config(args.config, overrides)
    if not 0 < args.threshold <= 1 or not 0 < args.memory_fraction <= 1:
        raise HlatError(
            f"--threshold and --memory-fraction must be in (0, 1], got {args.threshold} and {args.memory_fraction}"
        )
    if args.repeats < 1:
        raise HlatError(f"--repeats: must be >= 1, got {args.repeats}")
    delay_rank, delay_ms = debug_delay(args.debug_delay)
    micro_batches = comma_ints(args.micro_batches, "--micro-batches") or (config.train.micro_batch,)
    return Options(
        model=config.model,
        seq_len=config.train.seq_len,
        micro_batch=max(micro_batches),
        other_micro_batches=micro_batches,
        tps=tensor_parallel_degrees(args.tp, config),
        dtypes=compute_dtypes(args.dtypes, config),
        fp8=fp8_recipes(args.fp8),
        repeats=args.repeats,
        threshold=args.threshold,
        memory_fraction=args.memory_fraction,
        delay_rank=delay_rank,
        delay_ms=delay_ms,
        perturb_rank=args.debug_perturb,
        precision=config.precision.mode,
        sequence_parallel=config.parallel.sequence_parallel,
        recompute=config.parallel.activation_checkpoint,
        compile=config.parallel.compile,
        compile_backend=config.parallel.compile_backend,
        data_parallel=data_parallel_arrangements(args.dp, config.parallel),
        sizes=comma_ints(args.sizes, "--sizes") or default_sizes(config.model),
        optim=config.optim,
        device=config.train.device,
    )


def comma_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise HlatError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise HlatError(f"{flag}: values must be >= 1, got {text!r}")
    return values


def compute_dtypes(text: str, config: Config) -> tuple[str, ...]:
    """--dtypes, by default the precision mode's compute dtype."""
    dtypes = tuple(d for d in text.split(",") if d) or (("fp32",) if config.precision.mode == "fp32" else ("bf16",))
    if set(dtypes) - {"fp32", "bf16"}:
        raise HlatError(f"--dtypes: expected fp32 and/or bf16, got {text!r}")
    return dtypes


def fp8_recipes(text: str) -> tuple[str, ...]:
    """--fp8: recipes of precision.fp8, comma-separated, or none."""
    if text == "none":
        return ()
    recipes = tuple(r for r in text.split(",") if r)
    if not recipes or set(recipes) - set(FP8_RECIPES):
        raise HlatError(f"--fp8: expected {', '.join(FP8_RECIPES)} or none, got {text!r}")
    return recipes


def tensor_parallel_degrees(text: str, config: Config) -> tuple[int, ...]:
    """--tp, by default 1 and the config's; each must divide the model's heads, ffn_dim and vocabulary."""
    tps = comma_ints(text, "--tp") or tuple(sorted({1, config.parallel.tp}))
    for tp in tps:
        if config.model.n_heads % tp or config.model.ffn_dim % tp or config.model.vocab_size % tp:
            raise HlatError(f"--tp: {tp} does not divide the model's heads, ffn_dim or vocab_size")
    return tps


def data_parallel_arrangements(text: str, parallel: ParallelConfig) -> tuple[str, ...]:
    """--dp, by default the config's own arrangement; `none` for no data-parallel timing."""
    from hlat.measure.options import DATA_PARALLEL

    arrangements = tuple(a for a in text.split(",") if a) or (
        ("zero1" if parallel.zero1 else "ddp" if parallel.dp_shard == 1 else "fsdp"),
    )
    arrangements = () if arrangements == ("none",) else arrangements
    if set(arrangements) - set(DATA_PARALLEL):
        raise HlatError(f"--dp: expected {', '.join(DATA_PARALLEL)} or none, got {text!r}")
    return arrangements


def debug_delay(text: str) -> tuple[int, float]:
    """--debug-delay RANK:MS as (rank, milliseconds); (-1, 0.0) when not given."""
    if not text:
        return -1, 0.0
    try:
        rank, ms = text.split(":")
        return int(rank), float(ms)
    except ValueError:
        raise HlatError(f"--debug-delay: expected RANK:MS, got {text!r}") from None


def run_preflight_command(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.measure.preflight import run_preflight
    from hlat.measure.report import base_profile, measured_profile, report_json, show
    from hlat.parallel.device import pick_device

    options = preflight_options(args, overrides)
    report = run_preflight(options)
    main = os.environ.get("RANK", "0") == "0"
    if main:
        if args.json:
            print(report_json(report))
        else:
            show(report)
        if args.out:
            profile = measured_profile(
                report,
                base_profile(args.hardware, pick_device(options.device)),
                int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            )
            Path(args.out).write_text(profile.to_toml())
            print(f"wrote {args.out}", file=sys.stderr if args.json else sys.stdout)
        for line in report.problems:
            print(f"hlat preflight: {line}", file=sys.stderr)
    # rank 0 speaks for the job: torchrun would stop it mid-report if another rank exited non-zero first
    return 1 if report.problems and main else 0
