"""The `hlat` command: train, describe, plan, import-hf, export-hf.

Heavy imports (torch) happen inside the subcommands, so `hlat describe` and `hlat plan` start instantly.
User mistakes raise HlatError, printed here as one line with a non-zero exit and no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hlat import HlatError, __version__


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from hlat.train.config import load_config
    from hlat.train.loop import train

    if args.resume is not None:
        overrides = overrides + ["--train.resume", args.resume]
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    console = Console()
    s = train(cfg, console)
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 speaks for the job
        return 0
    table = Table(title="run summary", show_header=False)
    for name, value in (("run directory", s.run_dir), ("steps", f"{s.steps:,}"),
                        ("tokens seen", f"{s.tokens_seen:,}"), ("tokens/s", f"{s.tokens_per_s:,.0f}"),
                        ("first loss", f"{s.first_loss:.4f}"), ("last loss", f"{s.last_loss:.4f}"),
                        ("checkpoint", s.checkpoint)):
        table.add_row(name, value)
    console.print(table)
    return 0


def cmd_describe(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from hlat.optim.modes import MODES
    from hlat.train.config import load_config

    if args.model:
        overrides = ["--model.preset", args.model] + overrides
    cfg = load_config(args.config, overrides)
    m, seq_len = cfg.model, args.seq_len or cfg.train.seq_len
    total = m.num_params()
    table = Table(title=f"{m.preset or m.family}: {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads "
                        f"({m.kv_heads} kv), ffn {m.ffn_dim}, vocab {m.vocab_size}", show_header=False)
    table.add_row("parameters", f"{total:,}")
    table.add_row("  embedding", f"{m.embedding_params():,}")
    table.add_row("  non-embedding", f"{m.num_params(embedding=False):,}")
    table.add_row(f"training FLOPs/token (seq {seq_len})", f"{m.flops_per_token(seq_len):.4g}")
    for mode in MODES.values():
        gb = lambda nbytes: f"{total * nbytes / 2**30:,.1f} GiB"  # noqa: E731
        table.add_row(f"{mode.name}: weights / grads / optimizer ({mode.bytes_per_param} B/param)",
                      f"{gb(mode.weight_bytes)} / {gb(mode.grad_bytes)} / {gb(mode.optimizer_bytes)}")
    Console().print(table)
    return 0


def cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.config import describe_fields
    from hlat.train.config import Config

    rows = [r for r in describe_fields(Config()) if not args.section or r[0].startswith(f"{args.section}.")]
    if not rows:
        raise HlatError(f"config fields: no section {args.section!r} (sections: {', '.join(Config.__annotations__)})")
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for name, tp, default, comment in rows:
        print(f"{name:<{width[0]}}  {tp:<{width[1]}}  {default:<{width[2]}}  {comment}".rstrip())
    return 0


def cmd_import_hf(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.train.interop import import_hf

    print(f"wrote {import_hf(args.hf_dir, args.out)}")
    return 0


def cmd_export_hf(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.train.interop import export_hf

    out, tokenizer_note = export_hf(args.ckpt_dir, args.out)
    print(f"wrote {out} ({tokenizer_note})")
    return 0


def cmd_launch(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.train.launch import render

    cluster = [*(["--cluster.nodes", str(args.nodes)] if args.nodes is not None else []),
               *(["--cluster.nproc_per_node", str(args.nproc_per_node)] if args.nproc_per_node is not None else []),
               *(["--cluster.accelerator", "cpu"] if args.cpu else [])]
    text = render(args.config, args.target, cluster + overrides, args.image)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


def cmd_data(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.data.cli import run

    return run(args)


def cmd_preflight(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.train.preflight_cli import run

    return run(args, overrides)


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.planner.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hlat", description="Pretrain large language models at low cost per token.")
    parser.add_argument("--version", action="version", version=f"hlat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a config",
                       description="Train from a TOML config; any field can be overridden, e.g. --optim.lr 1e-3.")
    p.add_argument("--config", action="append", help="TOML config file or recipe name (default: the built-in "
                                                      "defaults); repeat it to lay later files over earlier ones")
    p.add_argument("--resume", help="'auto' (latest complete checkpoint of the run dir, if any) or a checkpoint path")
    p.add_argument("--print-config", action="store_true", help="print the resolved config, every field, and exit")
    p.set_defaults(func=cmd_train, overrides=True)

    p = sub.add_parser("config", help="list config sections, fields, types and defaults")
    p.add_argument("what", choices=["fields"])
    p.add_argument("section", nargs="?", help="only this section, e.g. train")
    p.set_defaults(func=cmd_config, overrides=False)

    p = sub.add_parser("describe", help="parameter counts, FLOPs and memory of a model, without building it")
    p.add_argument("--model", help="preset name, e.g. llama2-70b")
    p.add_argument("--config", action="append", help="TOML config or recipe name (repeatable, merged in order)")
    p.add_argument("--seq-len", type=int, help="sequence length for FLOPs per token (default: train.seq_len)")
    p.set_defaults(func=cmd_describe, overrides=True)

    p = sub.add_parser("import-hf", help="convert a transformers Llama/GPT-NeoX directory into an hlat checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.set_defaults(func=cmd_import_hf, overrides=False)

    p = sub.add_parser("export-hf", help="convert an hlat checkpoint (or run dir) into a transformers directory")
    p.add_argument("ckpt_dir")
    p.add_argument("--out", required=True, help="directory for config.json, generation_config.json, "
                                                "model.safetensors and the tokenizer files")
    p.set_defaults(func=cmd_export_hf, overrides=False)

    p = sub.add_parser("launch", help="render a multi-node SLURM script or Kubernetes PyTorchJob for a config",
                       description="Render a multi-node job for the config's [cluster] table (time limit, stop "
                                   "signal, restarts, volumes: see hlat/train/config.py ClusterConfig); config "
                                   "overrides (--section.key value) are passed on.")
    p.add_argument("--config", action="append", required=True,
                   help="TOML config file or recipe name (repeatable, merged in order)")
    p.add_argument("--nodes", type=int, help="number of nodes (default: cluster.nodes)")
    p.add_argument("--nproc-per-node", type=int, help="processes (devices) per node (default: cluster.nproc_per_node)")
    p.add_argument("--target", choices=["slurm", "k8s"], required=True)
    p.add_argument("--image", default="hlat:latest", help="container image for k8s")
    p.add_argument("--cpu", action="store_true", help="CPU nodes: request no devices (cluster.accelerator = cpu)")
    p.add_argument("--out", help="file to write (default: print)")
    p.set_defaults(func=cmd_launch, overrides=True)

    p = sub.add_parser("data", help="inspect data files, or benchmark the loader against its tokenizer")
    from hlat.data.cli import add_arguments as add_data_arguments

    add_data_arguments(p)
    p.set_defaults(func=cmd_data, overrides=False)

    p = sub.add_parser("preflight", help="burn-in: measure compute, links and numerics on every rank; write a "
                                         "measured hardware profile for the planner",
                       description="Run alone or under torchrun (every rank). Config overrides (--section.key value) "
                                   "are accepted.")
    from hlat.train.preflight_cli import add_arguments as add_preflight_arguments

    add_preflight_arguments(p)
    p.set_defaults(func=cmd_preflight, overrides=True)

    p = sub.add_parser("plan", help="choose a parallel layout and predict memory, step time and cost")
    from hlat.planner.cli import add_arguments as add_plan_arguments

    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan, overrides=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not args.overrides:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args, rest)
    except HlatError as e:
        print(f"hlat: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hlat: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
