"""Step time and tokens/s of each parallel layout on this machine (CPU/gloo here; GPUs/NCCL where present).

Every layout trains the same model on the same global batch with torchrun; the first steps (warm-up, data
pool fill) are left out. On a 2-core CPU box, 4 processes share 2 cores: the table shows the overheads of
each layout's communication, not the speed-ups a cluster would see.

    .venv/bin/python benchmarks/parallel_layouts.py [--steps 12] [--preset tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from results_io import markdown_table, write_results

LAYOUTS = {  # name: (processes, [parallel] overrides)
    "single": (1, {}),
    "ddp2": (2, {"dp_replicate": 2, "dp_shard": 1}),
    "fsdp2": (2, {"dp_shard": 2}),
    "zero1_2": (2, {"dp_shard": 2, "zero1": True}),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2_1f1b": (2, {"pp": 2}),
    "pp2_interleaved": (2, {"pp": 2, "pp_schedule": "interleaved_1f1b"}),
    "tp2_fsdp2": (4, {"tp": 2, "dp_shard": 2}),
    "pp2_tp2": (4, {"pp": 2, "tp": 2, "dp_shard": 1}),
    "pp2_fsdp2": (4, {"pp": 2, "dp_shard": 2}),
}


def run(name: str, nproc: int, parallel: dict, args, workdir: Path) -> dict:
    run_dir = workdir / name
    overrides = [a for k, v in parallel.items() for a in (f"--parallel.{k}", str(v).lower())]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "hlat",
        "train",
        "--config",
        "configs/tiny.toml",
        "--model.preset",
        args.preset,
        "--train.run_dir",
        str(run_dir),
        "--train.steps",
        str(args.steps),
        "--train.log_every",
        "1",
        "--train.global_batch",
        "16",
        "--train.micro_batch",
        "4",
        "--train.seq_len",
        "128",
        "--train.ckpt_every",
        "0",
        "--data.paths",
        os.path.join(os.path.dirname(json.__file__), "*.py"),
        *overrides,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        return {"layout": name, "processes": nproc, "error": done.stderr.strip().splitlines()[-1][:200]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][args.warmup :]
    step_time = sum(r["step_time_s"] for r in records) / len(records)
    return {
        "layout": name,
        "processes": nproc,
        "step_time_s": round(step_time, 4),
        "tokens_per_s": round(16 * 128 / step_time, 1),
        "final_loss": round(records[-1]["loss"], 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of the timing")
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nproc, parallel) in LAYOUTS.items():
            rows.append(run(name, nproc, parallel, args, Path(tmp)))
            r = rows[-1]
            print(
                f"{name:>16}  {nproc} proc  "
                + (
                    f"{r['step_time_s']:.3f} s/step  {r['tokens_per_s']:9.1f} tok/s"
                    if "error" not in r
                    else f"failed: {r['error']}"
                ),
                flush=True,
            )
    meta = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "preset": args.preset,
        "global_batch": 16,
        "seq_len": 128,
        "micro_batch": 4,
        "steps": args.steps,
        "timed_steps": args.steps - args.warmup,
    }
    table = markdown_table(
        ["layout", "processes", "s/step", "tokens/s", "final loss"],
        [
            [
                r["layout"],
                r["processes"],
                r.get("step_time_s", "failed"),
                r.get("tokens_per_s", ""),
                r.get("final_loss", ""),
            ]
            for r in rows
        ],
    )
    write_results(
        "parallel_layouts",
        meta,
        rows,
        f"`{args.preset}` model, global batch 16 x 128 tokens, micro-batch 4, on {meta['cpus']} CPU cores "
        f"with gloo (every process shares them); mean over steps {args.warmup + 1}-{args.steps}.",
        table,
    )


if __name__ == "__main__":
    main()
