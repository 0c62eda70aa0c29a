"""What a resumed start saves by not drawing the initial weights it is about to overwrite (docs/fault-tolerance.md).

Every rank materialises its part of the model at each start. A fresh start draws every parameter's full value from
its own seeded generator, whatever the layout (hlat.models.layers.initial_value); a resume, or train.init_from,
loads a checkpoint's weights over them instead, so it only allocates. This times both on one CPU process for
llama2-7b's shapes at fewer layers (its embedding and output at full size), rounds alternating, and writes the
medians and the cost per billion parameters to benchmarks/results/resume_start.md.

    python benchmarks/resume_start.py               # llama2-7b at 2 layers, 3 rounds
    python benchmarks/resume_start.py --layers 1 --rounds 1
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from hlat.config.job import build_config
from hlat.models import build_model, count_params, materialize

RESULTS = Path(__file__).resolve().parent / "results" / "resume_start.md"


def materialise_s(cfg, weights: str) -> float:
    model = build_model(cfg.model)  # on the meta device, as the trainer builds it
    started = time.perf_counter()
    materialize(model, "cpu", weights=weights)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg = build_config({"model": {"preset": args.preset, "n_layers": args.layers}})
    billions = count_params(build_model(cfg.model)) / 1e9
    full_7b = count_params(build_model(build_config({"model": {"preset": "llama2-7b"}}).model)) / 1e9
    times = {"drawn": [], "loaded": []}
    for _ in range(args.rounds):
        for weights, seconds in times.items():
            seconds.append(materialise_s(cfg, weights))
    drawn, loaded = (statistics.median(seconds) for seconds in times.values())
    table = "\n".join(
        [
            f"# A resumed start's weights: allocated, not drawn ({args.preset} at {args.layers} layers, "
            f"{billions:.2f} B parameters)",
            "",
            f"One process on {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}; medians of {args.rounds} alternating rounds (`python benchmarks/resume_start.py`).",
            "",
            "| start | materialise (s) | per billion parameters (s) |",
            "|---|---|---|",
            f"| fresh: every weight drawn | {drawn:.2f} | {drawn / billions:.2f} |",
            f"| resume: weights left to the checkpoint's load | {loaded:.3f} | {loaded / billions:.3f} |",
            "",
            "A rank draws the full value of every parameter it holds a shard of: at this rate, a rank of a llama2-7b "
            f"job ({full_7b:.1f} B parameters) spent about {full_7b * drawn / billions:.0f} s of each restart on draws "
            "that the load then overwrote.",
        ]
    )
    RESULTS.write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
