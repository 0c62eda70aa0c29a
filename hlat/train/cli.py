"""`hlat train` (alone, under torchrun, or supervised with --max-restarts), `hlat config fields` (every config
field, its type, default and meaning) and `hlat describe` (a model's parameters, FLOPs and memory per precision
mode, without building it)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hlat import HlatError
from hlat.config import OVERRIDES_HELP


def register(commands) -> None:
    p = commands.add_parser(
        "train", help="train a model from a config", description=f"Train from a TOML config. {OVERRIDES_HELP}"
    )
    p.add_argument(
        "--config",
        action="append",
        help="TOML config file or recipe name (default: the built-in "
        "defaults); repeat it to lay later files over earlier ones",
    )
    p.add_argument("--resume", help="'auto' (latest complete checkpoint of the run dir, if any) or a checkpoint path")
    p.add_argument("--print-config", action="store_true", help="print the resolved config, every field, and exit")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="supervise the job: start it again (with --resume auto) after up to N failures",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="K",
        help="with --max-restarts: run a single-node torchrun job of K processes",
    )
    p.set_defaults(func=run_train, overrides=True)

    p = commands.add_parser("config", help="list config sections, fields, types and defaults")
    p.add_argument("what", choices=["fields"])
    p.add_argument("section", nargs="?", help="only this section, e.g. train")
    p.set_defaults(func=run_config, overrides=False)

    p = commands.add_parser(
        "describe",
        help="parameter counts, FLOPs and memory of a model, without building it",
        description=f"Parameter counts, FLOPs and memory of a model, without building it. {OVERRIDES_HELP}",
    )
    p.add_argument("--model", help="preset name, e.g. llama2-70b")
    p.add_argument("--config", action="append", help="TOML config or recipe name (repeatable, merged in order)")
    p.add_argument(
        "--seq-len",
        type=int,
        help="sequence length for FLOPs per token (default: the config's "
        "train.seq_len, else the model's max_seq_len, as `hlat plan`)",
    )
    p.set_defaults(func=run_describe, overrides=True)


def run_train(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.max_restarts:  # the supervisor only starts processes: no torch in it
        return run_supervised(args, overrides)
    from rich.table import Table

    from hlat.config.job import load_config
    from hlat.console import make_console
    from hlat.jobs.torchrun import mark_finished
    from hlat.jobs.writer import writing_run_dir
    from hlat.train.loop import train

    if args.nproc_per_node != 1:
        raise HlatError("--nproc-per-node goes with --max-restarts (otherwise launch with torchrun)")
    if args.resume is not None:
        overrides = overrides + ["--train.resume", args.resume]
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    console = make_console()
    if (rank := os.environ.get("RANK", "0")) == "0" and (line := seen_cluster_advice(cfg)):
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    with writing_run_dir(cfg.train.run_dir):  # before anything is written there: one job per run directory
        s = train(cfg, console)
    mark_finished()
    if rank != "0":  # under torchrun, rank 0 speaks for the job
        return 0
    table = Table(title="run summary", show_header=False)
    for name, value in (
        ("run directory", s.run_dir),
        ("steps", f"{s.steps:,}"),
        ("tokens seen", f"{s.tokens_seen:,}"),
        ("tokens/s", f"{s.tokens_per_s:,.0f}"),
        ("first loss", f"{s.first_loss:.4f}"),
        ("last loss", f"{s.last_loss:.4f}"),
        ("checkpoint", s.checkpoint),
        ("bad steps skipped", f"{s.bad_steps:,}"),
        ("goodput (ETTR)", f"{s.ettr:.1%} of the wall time since the run began (goodput.json)"),
        ("failures", failures_text(s.recovery)),
    ):
        table.add_row(name, value)
    console.print(table)
    return 0


def failures_text(total: dict | None) -> str:
    """The run's failures in one cell: how many, and their parts in total (hlat.train.recovery)."""
    if not total or not total["failures"]:
        return "none"
    unseen = total["not_observed"]
    split = f"detection {total['detection_s']:.1f} s + restart {total['restart_s']:.1f} s" + (
        f" where observed ({unseen} not)" if unseen else ""
    )
    return (
        f"{total['failures']}: downtime {total['downtime_s']:.1f} s ({split}), state load {total['load_s']:.1f} s, "
        f"{total['recomputed_steps']} steps recomputed ({total['recomputed_s']:.1f} s)"
    )


def seen_cluster_advice(cfg) -> str | None:
    """The planner's line on the layout (a tensor-parallel group across nodes, needlessly slow links:
    hlat.planner.advice) on the cluster torchrun started this job on: WORLD_SIZE processes, LOCAL_WORLD_SIZE of them
    on each node, of the config's cluster.hardware."""
    from hlat.planner.advice import config_advice

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return config_advice(cfg, world // per_node, per_node) if world > 1 else None


def run_supervised(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.config.job import load_config
    from hlat.jobs.supervise import supervise

    if args.max_restarts < 0 or args.nproc_per_node < 1:
        raise HlatError(
            f"--max-restarts must be >= 0 and --nproc-per-node >= 1, got {args.max_restarts} and {args.nproc_per_node}"
        )
    if args.resume not in (None, "auto"):
        raise HlatError(f"--resume {args.resume}: a supervised job always resumes with --resume auto")
    cfg = load_config(args.config, overrides)  # a bad config fails here, once, not on every restart
    train_args = [a for config in args.config or [] for a in ("--config", config)] + overrides
    return supervise(train_args, Path(cfg.train.run_dir), args.max_restarts, args.nproc_per_node)


def run_config(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.config import describe_fields
    from hlat.config.job import Config

    rows = [r for r in describe_fields(Config()) if not args.section or r[0].startswith(f"{args.section}.")]
    if not rows:
        raise HlatError(f"config fields: no section {args.section!r} (sections: {', '.join(Config.__annotations__)})")
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for name, tp, default, comment in rows:
        print(f"{name:<{width[0]}}  {tp:<{width[1]}}  {default:<{width[2]}}  {comment}".rstrip())
    return 0


def run_describe(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.table import Table

    from hlat.config import parse_overrides
    from hlat.config.job import figures_seq_len, load_config
    from hlat.console import make_console
    from hlat.optim.modes import MODES

    configured = args.config or "train.seq_len" in dict(parse_overrides(overrides))  # else a bare preset
    if args.model:
        overrides = ["--model.preset", args.model] + overrides
    cfg = load_config(args.config, overrides)
    m = cfg.model
    seq_len, seq_from = figures_seq_len(args.seq_len, cfg.train.seq_len if configured else None, m)
    total = m.num_params()
    table = Table(
        title=f"{m.preset or m.family}: {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads "
        f"({m.kv_heads} kv), ffn {m.ffn_dim}, vocab {m.vocab_size}",
        show_header=False,
    )
    table.add_row("parameters", f"{total:,}")
    table.add_row("  embedding", f"{m.embedding_params():,}")
    table.add_row("  non-embedding", f"{m.num_params(embedding=False):,}")
    table.add_row(f"training FLOPs/token (seq {seq_len}: {seq_from})", f"{m.flops_per_token(seq_len):.4g}")
    for mode in MODES.values():
        table.add_row(
            f"{mode.name}: weights / grads / optimizer ({mode.bytes_per_param} B/param)",
            f"{gib(total, mode.weight_bytes)} / {gib(total, mode.grad_bytes)} / {gib(total, mode.optimizer_bytes)}",
        )
    make_console().print(table)
    return 0


def gib(params: int, bytes_per_param: int) -> str:
    return f"{params * bytes_per_param / 2**30:,.1f} GiB"
