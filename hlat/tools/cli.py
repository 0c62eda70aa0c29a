"""Post-run tools: `hlat eval`, `hlat generate`, `hlat compare`, `hlat import-hf`, `hlat export-hf` and
`hlat checkpoint verify`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from hlat import ERROR_EXIT, HlatError
from hlat.console import Ticker


def register(commands) -> None:
    p = commands.add_parser("import-hf", help="convert a transformers Llama/GPT-NeoX directory into an hlat checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.set_defaults(func=run_import_hf, overrides=False)

    p = commands.add_parser("export-hf", help="convert an hlat checkpoint (or run dir) into a transformers directory")
    p.add_argument("ckpt_dir")
    p.add_argument(
        "--out",
        required=True,
        help="directory for config.json, generation_config.json, model.safetensors and the tokenizer files",
    )
    p.set_defaults(func=run_export_hf, overrides=False)
    register_eval(commands)
    register_generate(commands)
    register_checkpoint(commands)

    p = commands.add_parser("compare", help="overlay the loss and gradient-norm curves of runs; their deviations")
    p.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files); the first is the reference")
    p.add_argument("--out", help="PNG file for the overlaid curves")
    p.add_argument("--labels", help="comma-separated names for the runs (default: their directory names)")
    p.add_argument("--json", action="store_true", help="print the deviations as JSON")
    p.set_defaults(func=run_compare, overrides=False)


def register_eval(commands) -> None:
    p = commands.add_parser("eval", help="validation loss and perplexity of checkpoints on held-out text")
    p.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CHECKPOINT",
        help="checkpoint directories, or run directories (each its latest checkpoint; with --all, every one)",
    )
    p.add_argument("--all", action="store_true", help="evaluate every checkpoint of each run directory, oldest first")
    p.add_argument(
        "--data",
        nargs="+",
        help="files, directories or globs (default: each validation set of the run's "
        "[eval]: eval.paths or eval.holdout, and each named one of eval.sets)",
    )
    p.add_argument("--max-batches", type=int, default=0, help="evaluate at most this many batches (0: all the data)")
    p.add_argument("--batch-size", type=int, help="sequences per batch (default: train.micro_batch)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: train.seq_len)")
    add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per checkpoint, one per line")
    p.set_defaults(func=run_eval, overrides=False)


def register_generate(commands) -> None:
    p = commands.add_parser("generate", help="continue a prompt with a trained model (KV cache)")
    p.add_argument("checkpoint", help="checkpoint directory, or a run directory (its latest checkpoint)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--samples", type=int, default=1, help="how many continuations to print")
    p.add_argument("--seed", type=int, default=0)
    add_model_arguments(p)
    p.set_defaults(func=run_generate, overrides=False)


def register_checkpoint(commands) -> None:
    p = commands.add_parser("checkpoint", help="check checkpoints against their manifests")
    sub = p.add_subparsers(dest="checkpoint_command", required=True)
    verify = sub.add_parser(
        "verify",
        help="check every file of each checkpoint (or each checkpoint of a run "
        "directory) against its manifest; exit code 1 if any is damaged",
    )
    verify.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint or run directories")
    verify.add_argument("--json", action="store_true", help="print one JSON object per checkpoint, one per line")
    p.set_defaults(func=run_checkpoint_verify, overrides=False)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", help="tokenizer file or directory (default: the one saved in the run)")
    p.add_argument(
        "--device",
        default="auto",
        help="auto (the available accelerator, else cpu), cpu, or an accelerator type such as cuda",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32")


def run_import_hf(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.tools.interop import import_hf

    checkpoint, tokenizer_note = import_hf(args.hf_dir, args.out)
    print(f"wrote {checkpoint} ({tokenizer_note})")
    return 0


def run_export_hf(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.tools.interop import export_hf

    out, tokenizer_note = export_hf(args.ckpt_dir, args.out)
    print(f"wrote {out} ({tokenizer_note})")
    return 0


def run_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.checkpoint.durable import DamagedCheckpoint
    from hlat.parallel.device import pick_device
    from hlat.paths import checkpoints_in, resolve_checkpoint

    for name in ("max_batches", "batch_size", "seq_len"):
        if (getattr(args, name) or 0) < 0:
            raise HlatError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(args, name)}")
    device = pick_device(args.device, "--device")
    checkpoints = [
        c for path in args.checkpoints for c in (checkpoints_in(path) if args.all else [resolve_checkpoint(path)])
    ]
    header = f"{'step':>10}  {'loss':>8}  {'perplexity':>10}  {'tokens':>12}  {'set':<10}  checkpoint"
    made: dict = {}  # the evaluation batches, made once for the checkpoints that share their data and tokenizer
    damaged, progress = 0, Ticker("hlat eval")
    with progress.beating():
        for checkpoint in checkpoints:  # each printed once evaluated: a long list shows its progress
            try:
                rows = evaluate_checkpoint(checkpoint, args, device, made, progress)
            except DamagedCheckpoint as e:  # refused in its line; a curve over many checkpoints still gets the others
                print(f"hlat: error: {e}", file=sys.stderr, flush=True)
                damaged += 1
                continue
            for row in rows:
                if header and not args.json:  # with the first row: an error before any comes alone
                    print(header)
                    header = ""
                step = "-" if row["step"] is None else row["step"]
                print(
                    json.dumps(row)
                    if args.json
                    else f"{step:>10}  {row['loss']:>8.4f}  {row['perplexity']:>10.2f}  "
                    f"{row['tokens']:>12,}  {row['set'] or '-':<10}  {checkpoint}",
                    flush=True,
                )
    if damaged and len(checkpoints) > 1:
        print(f"hlat eval: {damaged} of {len(checkpoints)} checkpoints damaged, not evaluated", file=sys.stderr)
    return ERROR_EXIT if damaged else 0


def evaluate_checkpoint(checkpoint: Path, args: argparse.Namespace, device, made: dict, progress: Ticker) -> list[dict]:
    """The validation figures of one checkpoint (verified first) on --data, or on each validation set of its run's
    [eval] (its default set of eval.paths or eval.holdout, and each named one of eval.sets), a row each; the
    batches taken from `made` when an earlier checkpoint made the same. What it is doing goes to `progress`."""
    from dataclasses import asdict

    from hlat.data.tokenizer import tokenizer_digest
    from hlat.paths import checkpoint_step
    from hlat.tools.inference import load_trained
    from hlat.train.validation import evaluate, validation_batches, validation_documents, validation_sets

    progress.doing = f"{checkpoint}: verifying and loading it"
    cfg, model, tokenizer = load_trained(checkpoint, device, args.dtype, args.tokenizer)
    if not args.data and not cfg.eval.paths and not cfg.eval.holdout and not cfg.eval.sets:
        raise HlatError(
            f"--data: give the files to evaluate {checkpoint} on (its run has no [eval] paths, sets or holdout)"
        )
    seq_len = args.seq_len or cfg.train.seq_len
    if seq_len > cfg.model.max_seq_len:
        raise HlatError(f"--seq-len: {seq_len} exceeds the model's max_seq_len {cfg.model.max_seq_len}")
    batch_size = args.batch_size or cfg.train.micro_batch
    sets = {"": validation_documents(cfg, paths=args.data)} if args.data else validation_sets(cfg, [])
    rows = []
    for name, documents in sets.items():
        key = json.dumps(
            [
                name,
                args.data,
                asdict(cfg.data),
                asdict(cfg.eval),
                tokenizer_digest(tokenizer),
                seq_len,
                batch_size,
                cfg.model.doc_mask,
            ],
            default=str,
        )
        what = f"{checkpoint}: {f'set {name!r}' if name else 'the validation set'}"
        if key not in made:
            made[key] = validation_batches(
                counted(documents, progress, f"{what}: reading and tokenizing", "documents"),
                tokenizer,
                seq_len,
                batch_size,
                args.max_batches or 2**62,
                cfg.model.doc_mask,
            )
        result = evaluate(model, counted(made[key], progress, f"{what}: evaluating", "batches", len(made[key])), device)
        rows.append(
            {
                "checkpoint": str(checkpoint),
                "step": checkpoint_step(checkpoint),
                "set": name,
                "loss": result.loss,
                "perplexity": result.perplexity,
                "tokens": result.tokens,
            }
        )
    return rows


def counted(items: Iterable, progress: Ticker, what: str, unit: str, total: int = 0) -> Iterator:
    """`items`, telling `progress` how many `unit` have been taken (of `total`, when known)."""
    done = 0
    progress.doing = lambda: f"{what} ({unit}: {done:,}{f' of {total:,}' if total else ''})"
    for item in items:
        yield item
        done += 1


def run_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.parallel.device import pick_device
    from hlat.tools.inference import load_trained, sample_text

    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.max_new_tokens < 1:
        raise HlatError("--temperature must be >= 0, --top-p in (0, 1] and --max-new-tokens >= 1")
    device = pick_device(args.device, "--device")
    _, model, tokenizer = load_trained(args.checkpoint, device, args.dtype, args.tokenizer)
    for i in range(args.samples):
        text = sample_text(
            model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed + i
        )
        if args.samples > 1:  # a sample may span lines: each starts with a line of its own
            print(f"--- sample {i + 1} of {args.samples} (seed {args.seed + i})")
        print(args.prompt + text)
    return 0


def run_checkpoint_verify(args: argparse.Namespace, overrides: list[str]) -> int:
    """Each checkpoint named, or each of a run directory, checked against its manifest: 1 if any is damaged."""
    from hlat.checkpoint.durable import DamagedCheckpoint, verify_checkpoint
    from hlat.paths import checkpoint_step, checkpoints_in

    damaged = 0
    for checkpoint in [c for path in args.paths for c in checkpoints_in(path)]:
        try:
            verify_checkpoint(checkpoint)
            problem = None
        except DamagedCheckpoint as e:
            problem, damaged = e.problem, damaged + 1
        row = {
            "checkpoint": str(checkpoint),
            "step": checkpoint_step(checkpoint),
            "ok": problem is None,
            "problem": problem,
        }
        print(
            json.dumps(row)
            if args.json
            else f"{'ok' if problem is None else 'DAMAGED':<8} {checkpoint}{f': {problem}' if problem else ''}",
            flush=True,
        )
    return 1 if damaged else 0


def run_compare(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.tools.compare import deviations, metrics, plot, read_run

    labels = args.labels.split(",") if args.labels else [Path(r).name or str(r) for r in args.runs]
    if len(labels) != len(args.runs):
        raise HlatError(f"--labels: {len(labels)} names for {len(args.runs)} runs")
    runs = [read_run(path, label) for path, label in zip(args.runs, labels)]
    if args.out:
        if Path(args.out).suffix.lower() != ".png":
            raise HlatError(f"--out: {args.out} should be a .png file")
        plot(runs, Path(args.out))
    table = [{"run": r.label, "reference": runs[0].label, **deviations(runs[0], r)} for r in runs[1:]]
    if args.json:
        print(json.dumps({"runs": labels, "deviations": table, "figure": args.out}, indent=2))
        return 0
    from rich.table import Table

    from hlat.console import make_console

    shown = metrics(runs)  # the training metrics and every validation set the runs logged
    out = Table(title=f"relative deviation from {runs[0].label} over the steps both logged")
    out.add_column("run")
    for metric in shown:
        out.add_column(f"{metric} max", justify="right")
        out.add_column(f"{metric} mean", justify="right")
    out.add_column("steps", justify="right")
    for row in table:
        cells = [f"{row[m]['max']:.2%}" if m in row else "-" for m in shown]
        means = [f"{row[m]['mean']:.2%}" if m in row else "-" for m in shown]
        steps = row["loss"]["steps"] if "loss" in row else 0
        out.add_row(row["run"], *[c for pair in zip(cells, means) for c in pair], str(steps))
    console = make_console()
    console.print(out)
    if len(runs) == 1:
        console.print("one run: nothing to compare it with")
    if args.out:
        console.print(f"wrote {args.out}")
    return 0
