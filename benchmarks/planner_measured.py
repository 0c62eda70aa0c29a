"""Predicted against measured step time of hlat's own runs on this machine, from `hlat preflight` run on this
machine: preflight writes a measured hardware profile, the layouts train back to back, and the planner predicts
each run from its own config.toml (the layout the trainer resolved) with that profile.

Preflight runs as the training run will: with as many processes, so that on a CPU host, where processes share
the memory system, a block is timed under whatever contention the run sees, and with the run's precision and
recomputation, so that the run's blocks are timed as it runs them. On the CPU it times the blocks under
FSDP, ZeRO-1 and DDP over its two processes too (`--dp`), which price the data-parallel layouts.

The machine may be shared and noisy, and its load drifts within minutes: each run is bracketed by a preflight
just before it and one just after (a run's "after" is the next run's "before" when their process counts,
precision and recomputation agree). The table gives the prediction from each and from their geometric mean (the
load during the run lies between the two), so drift is visible and no preflight is chosen after the fact.

    .venv/bin/python benchmarks/planner_measured.py                      # CPU: six layouts of `small`, 2 processes
    .venv/bin/python benchmarks/planner_measured.py --gpu                # one GPU: a few single-device runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_io import RESULTS, markdown_table, write_results

from hlat.planner.cli import run_sample
from hlat.planner.timing import step_time
from hlat.profiles import load_profile

CPU_LAYOUTS = {  # name: (processes, overrides)
    "single": (1, {}),
    "ddp2": (2, {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}),
    "fsdp2": (2, {"parallel.dp_shard": 2}),
    "zero1_2": (2, {"parallel.dp_shard": 2, "parallel.zero1": True}),
    "tp2": (2, {"parallel.tp": 2}),
    "pp2": (2, {"parallel.pp": 2}),
}
GPU_RUNS = {  # one device: micro-batch, recomputation and precision vary what the planner must compose
    "mb1_fp32": (1, {"train.micro_batch": 1, "precision.mode": "fp32"}),
    "mb4_fp32": (1, {"train.micro_batch": 4, "precision.mode": "fp32"}),
    "mb4_bf16": (1, {"train.micro_batch": 4, "precision.mode": "bf16_mixed"}),
    "mb4_bf16_full_ac": (
        1,
        {"train.micro_batch": 4, "precision.mode": "bf16_mixed", "parallel.activation_checkpoint": "full"},
    ),
}
BLOCK_SETTINGS = ("precision.mode", "parallel.activation_checkpoint")  # of a run's, its preflights' too
# Tokenize in the training process: on a host whose cores the training processes fill (the 2-core CPU host runs
# two), background tokenizer workers take compute from the steps being timed. In the process, tokenizing a round
# shows as "waiting for data" in the step it falls in, which the fastest step leaves out.
DATA_IN_PROCESS = {"data.workers": 0}
ROOT = Path(__file__).resolve().parents[1]
REPLAYED = ("gpu", "preset", "steps", "warmup", "seq_len", "global_batch", "micro_batch", "layouts")  # --replan


def torchrun(nproc: int, args: list[str], env: dict) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "hlat",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)


def flags(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def preflight(args, nproc: int, timed_as: dict, out: Path, env: dict) -> None:
    done = torchrun(
        nproc,
        [
            "preflight",
            "--model",
            args.preset,
            *flags(args.model_overrides),
            *flags(timed_as),
            "--train.seq_len",
            str(args.seq_len),
            "--micro-batches",
            args.micro_batches,
            "--tp",
            args.tp,
            "--dp",
            args.dp,
            "--dtypes",
            args.dtypes,
            "--repeats",
            str(args.repeats),
            "--threshold",
            "0.05",
            "--out",
            str(out),
        ],
        env,
    )
    if not out.is_file():
        sys.exit(f"preflight failed:\n{done.stderr[-3000:]}")


def train(name: str, nproc: int, overrides: dict, args, workdir: Path, env: dict) -> Path | str:
    run_dir = workdir / name
    base = {
        "model.preset": args.preset,
        **args.model_overrides,
        "train.run_dir": run_dir,
        "train.steps": args.steps,
        "train.log_every": 1,
        "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch,
        "train.seq_len": args.seq_len,
        "train.ckpt_every": 0,
        "data.paths": os.path.join(os.path.dirname(json.__file__), "*.py"),
        **DATA_IN_PROCESS,
        **overrides,
    }
    done = torchrun(nproc, ["train", "--config", "configs/tiny.toml", *flags(base)], env)
    if done.returncode:
        return done.stderr.strip().splitlines()[-1][:200]
    return run_dir


def bracketed_runs(layouts: dict, args, workdir: Path, env: dict) -> dict:
    """Train each layout between two preflights with its own process count, precision and recomputation (so
    that preflight times its blocks as it runs them), the one after a run serving as the next run's before where
    those agree. Returns, and writes to workdir/brackets.json (what --replan reads),
    {name: {processes, run (its directory), error, before, after (profiles)}}."""
    runs, last = {}, None  # last: (processes, what the blocks are timed as, the newest preflight's profile)
    for i, (name, (nproc, overrides)) in enumerate(layouts.items()):
        timed_as = {k: v for k, v in overrides.items() if k in BLOCK_SETTINGS}
        if last is None or last[:2] != (nproc, timed_as):
            last = (nproc, timed_as, workdir / f"preflight{i}_before.toml")
            preflight(args, nproc, timed_as, last[2], env)
        done = train(name, nproc, overrides, args, workdir, env)
        print(f"{name}: {'done' if isinstance(done, Path) else done}", flush=True)
        after = workdir / f"preflight{i}_after.toml"
        preflight(args, nproc, timed_as, after, env)
        runs[name] = {
            "processes": nproc,
            "run": str(done) if isinstance(done, Path) else "",
            "error": "" if isinstance(done, Path) else done,
            "before": str(last[2]),
            "after": str(after),
        }
        last = (nproc, timed_as, after)
    (workdir / "brackets.json").write_text(
        json.dumps({"args": {k: getattr(args, k) for k in REPLAYED}, "runs": runs}, indent=1)
    )
    return runs


def measured_step(run_dir: Path, warmup: int) -> tuple[float, float, float]:
    """Fastest and median step time, and the fastest step's time waiting for data (which the planner does not
    model). Preflight reports the fastest of its repeats too: on a shared host the least disturbed figures are
    the comparable ones."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    fastest = min(records, key=lambda r: r["step_time_s"])
    return fastest["step_time_s"], statistics.median(r["step_time_s"] for r in records), fastest["data_wait_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="one GPU: the single-device runs of GPU_RUNS")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="first steps left out of the timing (on the 2-core "
        "CPU host the first ran up to twice as long as later ones)",
    )
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="preflight repetitions per measurement")
    ap.add_argument("--layouts", default="", help="comma-separated subset of the layouts to run (default: all)")
    ap.add_argument(
        "--workdir",
        type=Path,
        help="keep the runs and every preflight's profile here (default: a temporary directory, removed)",
    )
    ap.add_argument(
        "--replan",
        type=Path,
        metavar="WORKDIR",
        help="predict again the runs kept in WORKDIR by --workdir, running nothing (after a planner change)",
    )
    args = ap.parse_args()
    if args.replan:
        vars(args).update(json.loads((args.replan / "brackets.json").read_text())["args"])
    if args.gpu:
        layouts, args.tp, args.dp, args.dtypes, args.micro_batches = GPU_RUNS, "1", "none", "fp32,bf16", "1,4"
        args.seq_len, args.global_batch = args.seq_len or 1024, args.global_batch or 16
        args.steps, args.warmup = max(args.steps, 12), max(args.warmup, 4)
    else:
        layouts, args.tp, args.dp, args.dtypes = CPU_LAYOUTS, "1,2", "fsdp,zero1,ddp", "fp32"
        args.micro_batches = str(args.micro_batch)
        args.seq_len, args.global_batch = args.seq_len or 128, args.global_batch or 4
    if args.layouts:
        unknown = set(args.layouts.split(",")) - set(layouts)
        if unknown:
            sys.exit(f"--layouts: unknown {', '.join(sorted(unknown))} (known: {', '.join(layouts)})")
        layouts = {k: v for k, v in layouts.items() if k in args.layouts.split(",")}
    args.model_overrides = {"model.tie_embeddings": False}  # pipeline stages cannot share the embedding
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # one core per process on a CPU host
    # another preset or a subset of the layouts is kept apart from the full table
    tag = "_".join(
        [
            "gpu" if args.gpu else "cpu",
            *([args.preset] if args.preset != "small" else []),
            *(layouts if args.layouts else []),
        ]
    )
    RESULTS.mkdir(exist_ok=True)
    rows = []
    with contextlib.ExitStack() as stack:
        if args.replan:
            runs = json.loads((args.replan / "brackets.json").read_text())["runs"]
        else:
            workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
            workdir.mkdir(parents=True, exist_ok=True)
            runs = bracketed_runs(layouts, args, workdir.resolve(), env)
        kept = []
        for n in sorted({r["processes"] for r in runs.values()}):  # the first and last preflight of each count
            brackets = [r for r in runs.values() if r["processes"] == n]
            for when, path in (("before", brackets[0]["before"]), ("after", brackets[-1]["after"])):
                kept.append(f"planner_measured_{tag}_profile_{n}p_{when}.toml")
                shutil.copy(path, RESULTS / kept[-1])
        for name, r in runs.items():
            nproc, run_dir = r["processes"], r["run"]
            if r["error"]:
                rows.append({"layout": name, "processes": nproc, "error": r["error"]})
                continue
            before, after = load_profile(r["before"]), load_profile(r["after"])
            sample = run_sample(run_dir, before)
            measured, median, data_wait = measured_step(Path(run_dir), args.warmup)
            predicted = [step_time(sample.workload, sample.layout, hw) for hw in (before, after)]
            mean = math.sqrt(predicted[0].total * predicted[1].total)
            rows.append(
                {
                    "layout": name,
                    "processes": nproc,
                    "planner_layout": sample.layout.describe(),
                    "measured_s": round(measured, 4),
                    "median_s": round(median, 4),
                    "data_wait_s": round(data_wait, 4),
                    "predicted_before_s": round(predicted[0].total, 4),
                    "predicted_after_s": round(predicted[1].total, 4),
                    "error_before": round(predicted[0].total / measured - 1, 4),
                    "error_after": round(predicted[1].total / measured - 1, 4),
                    "predicted_mean_s": round(mean, 4),
                    "error_mean": round(mean / measured - 1, 4),
                    "breakdown_before": {
                        k: round(v, 4) for k, v in predicted[0].__dict__.items() if isinstance(v, float)
                    },
                    "priced_from": ", ".join(
                        filter(
                            None,
                            [predicted[0].layer, predicted[0].data_parallel and f"DP {predicted[0].data_parallel}"],
                        )
                    ),
                }
            )
    meta = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "preset": args.preset,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "timed_steps": args.steps - args.warmup,
        "profiles": kept,
        "figures": before.sources(),
    }
    table = markdown_table(
        [
            "layout",
            "processes",
            "planner's reading",
            "priced from",
            "measured s/step (fastest)",
            "median",
            "waiting for data",
            "predicted (preflight before)",
            "error",
            "predicted (preflight after)",
            "error",
            "predicted (geometric mean)",
            "error",
        ],
        [
            [
                r["layout"],
                r["processes"],
                r.get("planner_layout", "failed: " + r.get("error", "")),
                r.get("priced_from", ""),
                r.get("measured_s", ""),
                r.get("median_s", ""),
                r.get("data_wait_s", ""),
                r.get("predicted_before_s", ""),
                f"{r['error_before']:+.1%}" if "error_before" in r else "",
                r.get("predicted_after_s", ""),
                f"{r['error_after']:+.1%}" if "error_after" in r else "",
                r.get("predicted_mean_s", ""),
                f"{r['error_mean']:+.1%}" if "error_mean" in r else "",
            ]
            for r in rows
        ],
    )
    write_results(
        f"planner_measured_{tag}",
        meta,
        rows,
        f"`{args.preset}` (untied embeddings), seq {args.seq_len}, global batch {args.global_batch}, "
        f"micro-batch {args.micro_batch}; fastest (and median) step of steps {args.warmup + 1}-{args.steps} "
        f"(data tokenized in the training process); "
        f"predicted from the `hlat preflight` run just before and the one just after each training run "
        f"(each with the run's own process count{'' if args.gpu else ', one thread per process'}). "
        f"{before.sources()}.",
        table,
    )


if __name__ == "__main__":
    main()
