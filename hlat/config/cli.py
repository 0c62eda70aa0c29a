"""`hlat config fields` (every config field, its type, default and meaning) and `hlat describe` (a model's parameters,
FLOPs and memory per precision mode, without building it): commands that read configs alone, torch-free. And the
cluster flags `hlat plan` and `hlat launch` share (`add_cluster_arguments`)."""

from __future__ import annotations

import argparse

from hlat import HlatError
from hlat.fields import OVERRIDES_HELP
from hlat.profiles import load_profile, profile_names


def register(commands) -> None:
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


def run_config(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.config.job import Config
    from hlat.fields import describe_fields

    rows = [r for r in describe_fields(Config()) if not args.section or r[0].startswith(f"{args.section}.")]
    if not rows:
        raise HlatError(f"config fields: no section {args.section!r} (sections: {', '.join(Config.__annotations__)})")
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for name, tp, default, comment in rows:
        print(f"{name:<{width[0]}}  {tp:<{width[1]}}  {default:<{width[2]}}  {comment}".rstrip())
    return 0


def run_describe(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.table import Table

    from hlat.config.job import figures_seq_len, load_config
    from hlat.console import make_console
    from hlat.fields import parse_overrides
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
        f"({m.kv_heads} kv), ffn {m.ffn_dim}, vocab {m.vocab_size}"
        + (f", {m.n_experts} experts ({m.experts_per_token} per token)" if m.moe else ""),
        show_header=False,
    )
    table.add_row("parameters", f"{total:,}")
    if m.moe:
        table.add_row("  active per token", f"{m.active_params():,}")
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


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster flags of `hlat plan` and `hlat launch`, one definition for both: what each sets of the config's
    [cluster] (`cluster_overrides`)."""
    group = parser.add_argument_group("the cluster (default: the config's [cluster])")
    group.add_argument(
        "--hardware",
        help=f"hardware profile ({', '.join(profile_names())}) or a profile TOML path: cluster.hardware, its nodes "
        "used whole (one process per device) unless --nproc-per-node says otherwise",
    )
    group.add_argument("--nodes", type=int, help="number of nodes: cluster.nodes (default: the config's, else 1)")
    group.add_argument(
        "--nproc-per-node",
        type=int,
        help="processes per node, one per device: cluster.nproc_per_node (default: the profile's devices per node "
        "with --hardware, else the config's)",
    )


def cluster_overrides(args: argparse.Namespace) -> list[str]:
    """The cluster flags as the `--cluster.key value` overrides they stand for: --hardware names the profile and,
    unless --nproc-per-node is given, one process per device of its nodes."""
    per_node = args.nproc_per_node
    if args.hardware and per_node is None:
        per_node = load_profile(args.hardware).devices_per_node
    flags = {"hardware": args.hardware, "nodes": args.nodes, "nproc_per_node": per_node}
    return [arg for key, value in flags.items() if value is not None for arg in (f"--cluster.{key}", str(value))]
