"""Loss parity of the precision modes: fp32, bf16_mixed, bf16_sr (and bf16_kahan) against plain bf16 that rounds
updates to nearest, trained on the same batches from the same initial weights with hlat's model and data path.
`fp8_tensorwise` is bf16_mixed with the blocks' linear layers in FP8 (torchao's tensorwise recipe, emulated on the
CPU: the same FP8 rounding of every input and weight, the products summed in higher precision).

Writes the per-step loss and gradient-norm curves to docs/precision_parity.png and the numbers to
benchmarks/results/precision_parity.{json,md}.

    .venv/bin/python benchmarks/precision_parity.py [--steps 400] [--seeds 0,1,2] [--dim 128] [--lr 1e-3] [--modes ...]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from hlat.data.config import DataConfig
from hlat.data.packing import build_stream
from hlat.data.sources import default_corpus, one_source
from hlat.data.tokenizer import get_tokenizer
from hlat.models import build_model, materialize
from hlat.models.config import model_config
from hlat.optim import OptimConfig, lr_at, param_groups
from hlat.optim.bf16 import BF16AdamW
from hlat.optim.modes import MODES
from hlat.optim.precision import autocast
from hlat.parallel import ParallelConfig, Topology
from hlat.parallel.grads import global_grad_norm
from hlat.train.assemble import Recipe, assemble
from hlat.train.step import clipped_update

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PLAIN = "bf16_nearest"  # the baseline, not a training mode: pure bf16 rounding every write to nearest
FP8 = "fp8_tensorwise"  # bf16_mixed with FP8 linears (precision.fp8 = "tensorwise"), not a mode
LABELS = {
    "fp32": "fp32",
    "bf16_mixed": "bf16 mixed (fp32 master)",
    "bf16_sr": "bf16 + stochastic rounding",
    "bf16_kahan": "bf16 + Kahan summation",
    PLAIN: "bf16, round to nearest",
    FP8: "bf16 mixed, FP8 tensorwise linears",
}
BYTES_PER_PARAM = {
    **{name: mode.bytes_per_param for name, mode in MODES.items()},
    PLAIN: MODES["bf16_sr"].bytes_per_param,
    FP8: MODES["bf16_mixed"].bytes_per_param,
}


def build(mode: str, model_cfg, optim_cfg: OptimConfig, seed: int):
    """The model and optimizer of a mode, from identical initial weights in every mode (the pure-bf16 modes round the
    same draws; a Float8Linear keeps its weight's name, from which the weight is drawn): assembled as the trainer
    assembles them, but for the plain-rounding baseline, which is no training mode."""
    if mode == PLAIN:
        model = materialize(build_model(model_cfg), "cpu", seed).to(torch.bfloat16)
        opt = BF16AdamW(
            param_groups(model, optim_cfg),
            lr=optim_cfg.lr,
            betas=(optim_cfg.beta1, optim_cfg.beta2),
            eps=optim_cfg.eps,
            rounding="nearest",
            seed=seed,
        )
        return model, opt
    fp8 = "tensorwise" if mode == FP8 else "none"
    recipe = Recipe("bf16_mixed" if mode == FP8 else mode, optim_cfg, seed, fp8, fp8_emulated=True)
    parts = assemble(build_model(model_cfg), Topology(ParallelConfig().resolved(1), None), torch.device("cpu"), recipe)
    return parts.parts[0], parts.optimizers[0]


def forward_backward(mode: str, model, batch: dict) -> tuple[float, torch.Tensor]:
    """The trainer's forward and backward (autocast, fp32 loss); the loss and the global gradient norm."""
    with autocast({PLAIN: "fp32", FP8: "bf16_mixed"}.get(mode, mode), "cpu"):
        loss = model(batch["inputs"], targets=batch["targets"])
    loss.backward()
    return loss.item(), global_grad_norm(list(model.parameters()))


def train(mode: str, batches: list[dict], model_cfg, optim_cfg: OptimConfig, seed: int) -> dict:
    """The trainer's step (autocast, fp32 loss, clipping, schedule) in a minimal loop; per-step loss and grad norm."""
    model, opt = build(mode, model_cfg, optim_cfg, seed)
    losses, norms = [], []
    start = time.perf_counter()
    for step, batch in enumerate(batches):
        lr = lr_at(step, optim_cfg.lr, optim_cfg.min_lr, optim_cfg.warmup_steps, len(batches))
        for group in opt.param_groups:
            group["lr"] = lr
        loss, norm = forward_backward(mode, model, batch)
        clipped_update([opt], norm, optim_cfg.clip_grad_norm)
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
        norms.append(norm.item())
        if (step + 1) % 50 == 0:
            print(f"  {mode:>12} step {step + 1:>5}  loss {sum(losses[-50:]) / 50:.4f}", flush=True)
    return {"loss": losses, "grad_norm": norms, "seconds": time.perf_counter() - start}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean, so every point only uses steps up to it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(runs: dict, summary: dict, path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    reference = smooth(runs["bf16_mixed"]["loss"], window) if "bf16_mixed" in runs else None
    for mode, run in runs.items():
        loss, steps = smooth(run["loss"], window), range(1, len(run["loss"]) + 1)
        label = f"{LABELS[mode]}: {summary[mode]['final_loss']:.4f}"
        axes[0].plot(steps, loss, label=label, lw=1.2)
        axes[1].plot(steps, smooth(run["grad_norm"], window), label=LABELS[mode], lw=1.2)
        if reference is not None:
            axes[2].plot(steps, [100 * (a / b - 1) for a, b in zip(loss, reference)], label=LABELS[mode], lw=1.2)
    axes[0].set(title=f"training loss (mean of the last {window} steps)", xlabel="step")
    axes[1].set(title=f"gradient norm before clipping (mean of {window})", xlabel="step", yscale="log")
    axes[2].set(title="loss vs bf16 mixed (%)", xlabel="step")
    axes[2].axhline(0, color="grey", lw=0.6)
    axes[0].legend(fontsize=8, title="final loss", title_fontsize=8)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--modes",
        default=f"fp32,bf16_mixed,bf16_sr,{PLAIN}",
        help=f"comma-separated: {', '.join(MODES)}, {PLAIN}, {FP8}",
    )
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument(
        "--seeds",
        default="0,1,2",
        help="comma-separated: each seed draws its own initial weights, batches and rounding bits",
    )
    ap.add_argument("--final-window", type=int, default=50, help="the final loss is the mean of this many last steps")
    ap.add_argument("--note", default="", help="a sentence for the results' caption")
    ap.add_argument("--out", default="precision_parity", help="results name under benchmarks/results")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "precision_parity.png"), help="'': no figure")
    args = ap.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    for mode in args.modes.split(","):
        if mode not in BYTES_PER_PARAM:
            ap.error(f"unknown mode {mode!r}")
    return args


def summarise(runs: dict, window: int) -> dict:
    """Each mode's final loss (the mean of the last `window` steps), seconds and bytes per parameter, and its final
    loss against bf16_mixed's."""
    summary = {
        mode: {
            "final_loss": sum(r["loss"][-window:]) / window,
            "seconds": round(r["seconds"], 1),
            "bytes_per_param": BYTES_PER_PARAM[mode],
        }
        for mode, r in runs.items()
    }
    if "bf16_mixed" in summary:
        for s in summary.values():
            s["vs_bf16_mixed_pct"] = 100 * (s["final_loss"] / summary["bf16_mixed"]["final_loss"] - 1)
    return summary


def seed_runs(args: argparse.Namespace, seed: int, model_cfg, tokenizer) -> dict:
    """Every mode trained from the same initial weights on the same batches, both drawn from `seed`."""
    optim_cfg = OptimConfig(lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup).validate()
    stream = build_stream(DataConfig(seed=seed), tokenizer, one_source(default_corpus()), args.seq_len, args.batch)
    batches = [next(stream) for _ in range(args.steps)]  # the same batches for every mode
    return {mode: train(mode, batches, model_cfg, optim_cfg, seed) for mode in args.modes.split(",")}


def table(summaries: dict[int, dict]) -> str:
    """Per mode: the final loss and its difference from bf16_mixed for each seed, and the mean and standard
    deviation of that difference over the seeds."""
    seeds = list(summaries)
    rows = [
        f"| mode | final loss (seed {', '.join(map(str, seeds))}) | vs bf16_mixed (each seed) | vs bf16_mixed "
        "(mean ± sd) | bytes/param (weights+grads+optimizer) | seconds (each seed) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, first in summaries[seeds[0]].items():
        each = [summaries[s][mode] for s in seeds]
        vs = [e["vs_bf16_mixed_pct"] for e in each if "vs_bf16_mixed_pct" in e]
        spread = f"{statistics.mean(vs):+.2f}% ± {statistics.stdev(vs):.2f}%" if len(vs) > 1 else "n/a"
        losses = " / ".join(f"{e['final_loss']:.4f}" for e in each)
        seconds = " / ".join(f"{e['seconds']:.0f}" for e in each)
        differences = " / ".join(f"{v:+.2f}%" for v in vs) or "n/a"
        rows.append(
            f"| {LABELS[mode]} (`{mode}`) | {losses} | {differences} | {spread} | {first['bytes_per_param']} "
            f"| {seconds} |"
        )
    return "\n".join(rows)


def main() -> None:
    args = parse_args()
    model_cfg = model_config(
        "tiny",
        dim=args.dim,
        n_layers=args.layers,
        n_heads=max(1, args.dim // 64),
        ffn_dim=args.dim * 8 // 3 // 16 * 16,
        vocab_size=args.vocab,
        max_seq_len=args.seq_len,
    )
    tokenizer = get_tokenizer(
        DataConfig(tokenizer_sample_bytes=1_000_000),
        default_corpus(),
        args.vocab,
        ROOT / "runs" / f"{args.out}-tokenizer-{args.vocab}",
    )
    print(
        f"{model_cfg.num_params():,} parameters, {args.steps} steps of {args.batch}x{args.seq_len} tokens, "
        f"torch {torch.__version__} on {torch.get_num_threads()} threads",
        flush=True,
    )
    started, window = time.perf_counter(), args.final_window
    setup = {
        **{k: v for k, v in vars(args).items() if k not in ("out", "plot", "note")},
        "params": model_cfg.num_params(),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    results, summaries = {}, {}
    for seed in args.seeds:  # results written after each seed: a long run stopped early keeps what it finished
        runs = seed_runs(args, seed, model_cfg, tokenizer)
        summaries[seed] = summarise(runs, window)
        results[seed] = {"summary": summaries[seed], "runs": runs}
        setup["total_seconds"] = round(time.perf_counter() - started, 1)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.out}.json").write_text(json.dumps({"setup": setup, "seeds": results}) + "\n")
        text = table(summaries)
        caption = f"{args.note + ' ' if args.note else ''}Setup: `{json.dumps(setup)}`"
        (RESULTS / f"{args.out}.md").write_text(f"{caption}\n\n{text}\n")
        print(text, flush=True)
    first = results[args.seeds[0]]
    if args.plot:
        plot(first["runs"], first["summary"], Path(args.plot), window=max(1, min(window, args.steps // 10)))
    print(f"total {time.perf_counter() - started:.0f} s; wrote {RESULTS / args.out}.json, .md {args.plot}")
    if not all(math.isfinite(s["final_loss"]) for summary in summaries.values() for s in summary.values()):
        raise SystemExit("a run diverged (non-finite loss)")


if __name__ == "__main__":
    main()
