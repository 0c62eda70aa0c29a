"""The `hlat` command: train, eval, generate, compare, describe, plan, import-hf, export-hf, launch, data,
preflight, torchrun.

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
    from hlat.train.elastic import mark_finished
    from hlat.train.loop import train

    if args.max_restarts:
        return supervised_train(args, overrides)
    if args.nproc_per_node != 1:
        raise HlatError("--nproc-per-node goes with --max-restarts (otherwise launch with torchrun)")
    if args.resume is not None:
        overrides = overrides + ["--train.resume", args.resume]
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    console = Console()
    s = train(cfg, console)
    mark_finished()
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 speaks for the job
        return 0
    table = Table(title="run summary", show_header=False)
    for name, value in (("run directory", s.run_dir), ("steps", f"{s.steps:,}"),
                        ("tokens seen", f"{s.tokens_seen:,}"), ("tokens/s", f"{s.tokens_per_s:,.0f}"),
                        ("first loss", f"{s.first_loss:.4f}"), ("last loss", f"{s.last_loss:.4f}"),
                        ("checkpoint", s.checkpoint), ("bad steps skipped", f"{s.bad_steps:,}"),
                        ("goodput (ETTR)", f"{s.ettr:.1%} of the wall time since the run began (goodput.json)")):
        table.add_row(name, value)
    console.print(table)
    return 0


def supervised_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.train.config import load_config
    from hlat.train.supervise import supervise

    if args.max_restarts < 0 or args.nproc_per_node < 1:
        raise HlatError(f"--max-restarts must be >= 0 and --nproc-per-node >= 1, got {args.max_restarts} and "
                        f"{args.nproc_per_node}")
    if args.resume not in (None, "auto"):
        raise HlatError(f"--resume {args.resume}: a supervised job always resumes with --resume auto")
    cfg = load_config(args.config, overrides)  # a bad config fails here, once, not on every restart
    train_args = [a for config in args.config or [] for a in ("--config", config)] + overrides
    return supervise(train_args, Path(cfg.train.run_dir), args.max_restarts, args.nproc_per_node)


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


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise HlatError("--device cuda: no CUDA device is available")
    return torch.device(name)


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from hlat.train.inference import evaluate, load_trained, validation_batches, validation_documents

    for name in ("max_batches", "batch_size", "seq_len"):
        if (getattr(args, name) or 0) < 0:
            raise HlatError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(args, name)}")
    device = _device(args.device)
    cfg, model, tokenizer = load_trained(args.checkpoint, device, args.dtype, args.tokenizer)
    if not args.data and not cfg.eval.paths and not cfg.eval.holdout:
        raise HlatError("--data: give the files to evaluate on (the run has no [eval] paths or holdout)")
    seq_len = args.seq_len or cfg.train.seq_len
    if seq_len > cfg.model.max_seq_len:
        raise HlatError(f"--seq-len: {seq_len} exceeds the model's max_seq_len {cfg.model.max_seq_len}")
    batch_size = args.batch_size or cfg.train.micro_batch
    batches = validation_batches(validation_documents(cfg, args.data), tokenizer, seq_len, batch_size,
                                 args.max_batches or 2**62, cfg.model.doc_mask)
    result = evaluate(model, batches, device)
    figures = {"loss": result.loss, "perplexity": result.perplexity, "tokens": result.tokens}
    print(json.dumps(figures) if args.json else
          f"loss {result.loss:.4f}  perplexity {result.perplexity:.2f}  tokens {result.tokens:,}")
    return 0


def cmd_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.train.inference import load_trained, sample_text

    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.max_new_tokens < 1:
        raise HlatError("--temperature must be >= 0, --top-p in (0, 1] and --max-new-tokens >= 1")
    _, model, tokenizer = load_trained(args.checkpoint, _device(args.device), args.dtype, args.tokenizer)
    for i in range(args.samples):
        text = sample_text(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_p,
                           args.seed + i)
        print(args.prompt + text)
    return 0


def cmd_compare(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.train.compare import run as compare_run

    return compare_run(args)


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
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="supervise the job: start it again (with --resume auto) after up to N failures")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="K",
                   help="with --max-restarts: run a single-node torchrun job of K processes")
    p.set_defaults(func=cmd_train, overrides=True)

    sub.add_parser("torchrun", help="torchrun (same arguments), exiting 0 when a stop signal found every trainer "
                                    "checkpointed (torchrun itself exits 1)", add_help=False)

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

    p = sub.add_parser("eval", help="validation loss and perplexity of a checkpoint on held-out text")
    p.add_argument("checkpoint", help="checkpoint directory, or a run directory (its latest checkpoint)")
    p.add_argument("--data", nargs="+", help="files, directories or globs (default: the run's [eval] data)")
    p.add_argument("--max-batches", type=int, default=0, help="evaluate at most this many batches (0: all the data)")
    p.add_argument("--batch-size", type=int, help="sequences per batch (default: train.micro_batch)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: train.seq_len)")
    _add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_eval, overrides=False)

    p = sub.add_parser("generate", help="continue a prompt with a trained model (KV cache)")
    p.add_argument("checkpoint", help="checkpoint directory, or a run directory (its latest checkpoint)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--samples", type=int, default=1, help="how many continuations to print")
    p.add_argument("--seed", type=int, default=0)
    _add_model_arguments(p)
    p.set_defaults(func=cmd_generate, overrides=False)

    p = sub.add_parser("compare", help="overlay the loss and gradient-norm curves of runs; their deviations")
    from hlat.train.compare import add_arguments as add_compare_arguments

    add_compare_arguments(p)
    p.set_defaults(func=cmd_compare, overrides=False)

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


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", help="tokenizer file or directory (default: the one saved in the run)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["torchrun"]:  # every later argument is torchrun's
        from hlat.train.elastic import torchrun

        return torchrun(argv[1:])
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
