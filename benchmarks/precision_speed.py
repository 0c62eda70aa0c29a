"""Step time of the precision modes on the tiny config (configs/tiny.toml: its model, 16 x 128 tokens per step),
with the modes' steps interleaved so that the load of a shared machine falls on every mode alike; the update
(clipping and the optimizer step) is timed apart from the forward and backward. Times are the process's CPU
seconds (on one thread by default),
which other jobs on a shared machine change far less than wall time. Random tokens: the time does not depend on
the text.

Writes benchmarks/results/precision_speed.{json,md} (or --out NAME).

    .venv/bin/python benchmarks/precision_speed.py [--steps 20] [--threads 1] [--modes bf16_mixed,bf16_sr,fp32]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/precision_speed.py \
        --out precision_speed_avx2   # as on a CPU without native bf16
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from precision_parity import BYTES_PER_PARAM, build, forward_backward
from results_io import markdown_table, write_results

from hlat.config.job import load_config
from hlat.train.step import clipped_update


def timed_step(mode: str, model, opt, batch: dict, clip: float) -> tuple[float, float]:
    """CPU seconds of the forward and backward (with the gradient norm), and of the update (the trainer's: clipping
    and the optimizer step)."""
    start = time.process_time()
    _, norm = forward_backward(mode, model, batch)
    middle = time.process_time()
    clipped_update([opt], norm, clip)
    opt.zero_grad(set_to_none=True)
    return middle - start, time.process_time() - middle


def measure(modes: list[str], steps: int, warmup: int) -> dict[str, list[tuple[float, float]]]:
    """Per mode, (forward and backward, optimizer) seconds of `steps` steps after `warmup`, the modes taking turns
    (in a rotating order) at every step."""
    cfg = load_config("tiny")
    runs = {mode: build(mode, cfg.model, cfg.optim, seed=0) for mode in modes}
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for step in range(warmup + steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len + 1), generator=g)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        for mode in modes[step % len(modes) :] + modes[: step % len(modes)]:
            seconds = timed_step(mode, *runs[mode], batch, cfg.optim.clip_grad_norm)
            if step >= warmup:
                times[mode].append(seconds)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="bf16_mixed,bf16_sr,fp32", help=f"comma-separated: {', '.join(BYTES_PER_PARAM)}")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", default="precision_speed", help="results name under benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    times = measure(modes, args.steps, args.warmup)
    rows = []
    for mode, pairs in times.items():
        step = statistics.median(a + b for a, b in pairs)
        rows.append(
            {
                "mode": mode,
                "step_s": step,
                "forward_backward_s": statistics.median(a for a, _ in pairs),
                "optimizer_s": statistics.median(b for _, b in pairs),
            }
        )
    reference = next((r["step_s"] for r in rows if r["mode"] == "bf16_mixed"), None)
    for r in rows:
        r["vs_bf16_mixed"] = r["step_s"] / reference if reference else None
    # ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 stand in for a CPU without native bf16 instructions
    limits = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ}
    meta = {
        **vars(args),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_limits": limits,
    }
    caption = (
        f"Median CPU seconds per step over {args.steps} steps of the tiny config (7.4M parameters, 16 x 128 "
        f"tokens), after {args.warmup} warm-up steps, the modes interleaved; torch {torch.__version__} on "
        f"{args.threads} thread(s), CPU capability {meta['cpu_capability']}"
        f"{f', instruction sets limited by {limits}' if limits else ''}."
    )
    table = markdown_table(
        ["mode", "step (s)", "forward + backward (s)", "optimizer (s)", "vs bf16_mixed"],
        [
            [
                r["mode"],
                f"{r['step_s']:.3f}",
                f"{r['forward_backward_s']:.3f}",
                f"{r['optimizer_s']:.3f}",
                f"{r['vs_bf16_mixed']:.2f}x" if r["vs_bf16_mixed"] else "n/a",
            ]
            for r in rows
        ],
    )
    write_results(args.out, meta, rows, caption, table)


if __name__ == "__main__":
    main()
