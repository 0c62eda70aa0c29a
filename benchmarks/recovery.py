"""Recovery under a seeded fault schedule: what failures cost, per recovery path (docs/fault-tolerance.md, "Goodput").

The tiny model (configs/tiny.toml) trains as a 2-rank job under `hlat torchrun --max-restarts <many>` (restarts in
place; a restarted worker resumes by itself) for a fixed wall time, while one trainer process, drawn at random, is
killed with SIGKILL at exponentially distributed intervals (seeded; mean --mean-s). At the end the job is stopped
with SIGTERM (it checkpoints and exits 0) and its goodput.json gives the ETTR and each failure's split: detection,
restart, state load, recomputed steps. A path is a set of config overrides (PATHS): `durable` restarts and reloads
from the checkpoint directory; `memory` adds the node-local in-memory snapshot tier, a snapshot every step;
`memory_auto` snapshots as the default does (train.snapshot_every = -1: as often as keeps the snapshot's measured
cost under 5% of the steps' time). A path whose overrides the config does not know is reported in one line and
left out. Without faults, each memory path's snapshot cost is the training's stall for it (goodput.json) and the
slowdown of the steps (mean step times of metrics.jsonl, one record per step), against the durable path, in rounds
that run every path in turn; `--baseline DIR` measures the memory paths with another checkout of hlat too, in the
same rounds (what a change costs or saves, on a machine whose other work comes and goes).

    python benchmarks/recovery.py                  # 10 minutes per path, mean 90 s between faults
    python benchmarks/recovery.py --quick --paths durable
    python benchmarks/recovery.py --paths ''        # the snapshot's cost alone, no faults
    git archive e440614 | tar -x -C /tmp/base    # the memory tier's writer thread, before its process
    python benchmarks/recovery.py --paths '' --rounds 3 --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks")]
from results_io import markdown_table, write_results  # noqa: E402

# each recovery path: its config overrides ({node_local}: a directory on this node, {ckpt_every}: --ckpt-every)
PATHS = {
    "durable": ["--train.ckpt_every", "{ckpt_every}", "--train.snapshot_every", "0"],
    "memory": [
        "--train.ckpt_every",
        "{ckpt_every}",
        "--train.snapshot_every",
        "1",
        "--train.snapshot_dir",
        "{node_local}",
    ],
    # the default: a snapshot every K steps, K the fewest that keep its measured cost under 5% of their time
    "memory_auto": [
        "--train.ckpt_every",
        "{ckpt_every}",
        "--train.snapshot_every",
        "-1",
        "--train.snapshot_dir",
        "{node_local}",
    ],
}
MEMORY_PATHS = ("memory", "memory_auto")
PARTS = ("detection_s", "restart_s", "downtime_s", "load_s", "recomputed_steps", "recomputed_s")


def overrides(path: str, run_dir: Path, ckpt_every: int, *extra: str) -> list[str]:
    """The path's `hlat train` arguments (micro-batches of 8: the tiny config's global batch of 16 over 2 ranks)."""
    fill = {"node_local": str(run_dir.parent / "node_local"), "ckpt_every": str(ckpt_every)}
    return [
        "--config",
        str(ROOT / "configs" / "tiny.toml"),
        "--train.run_dir",
        str(run_dir),
        "--train.steps",
        "1000000",
        "--train.micro_batch",
        "8",
        *(o.format(**fill) for o in PATHS[path]),
        *extra,
    ]


def config_refusal(args: list[str]) -> str:
    """'' if `hlat train` accepts these overrides, else its one-line error."""
    done = subprocess.run(
        [sys.executable, "-m", "hlat", "train", *args, "--print-config"], capture_output=True, text=True, timeout=120
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("hlat: error:")]
    return "" if done.returncode == 0 else (errors[-1] if errors else done.stderr.strip()[-300:])


def start_job(args: list[str], log: Path, tree: Path = ROOT) -> subprocess.Popen:
    """`hlat torchrun` of 2 ranks, with hlat from `tree`."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hlat",
                "torchrun",
                "--standalone",
                "--nproc-per-node=2",
                "--max-restarts=1000",
                "-m",
                "hlat",
                "train",
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(tree)},
        )


def trainers(torchrun: int) -> list[int]:
    """torchrun's worker processes (its children running `hlat train`)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == torchrun
                and b"train" in (entry / "cmdline").read_bytes()
            ):
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def stop(job: subprocess.Popen) -> int:
    """SIGTERM: the trainers checkpoint and return, and `hlat torchrun` exits 0."""
    job.send_signal(signal.SIGTERM)
    try:
        return job.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        return job.wait()


def faulted_run(path: str, root: Path, seconds: float, mean_s: float, ckpt_every: int, seed: int) -> dict:
    """One path for `seconds` of wall time, one trainer killed at each of the schedule's moments."""
    run_dir = root / path / "run"
    run_dir.parent.mkdir(parents=True)
    rng = random.Random(seed)
    job = start_job(overrides(path, run_dir, ckpt_every), root / path / "job.log")
    begun, kills = time.time(), []
    at = begun + rng.expovariate(1 / mean_s)
    while at < begun + seconds and job.poll() is None:
        time.sleep(max(0.0, at - time.time()))
        workers = trainers(job.pid)
        if len(workers) == 2:  # else torchrun is between attempts: this fault falls on nothing
            os.kill(rng.choice(sorted(workers)), signal.SIGKILL)
            kills.append(round(time.time() - begun, 1))
        at += rng.expovariate(1 / mean_s)
    while job.poll() is None and time.time() < begun + seconds:
        time.sleep(0.5)
    if job.poll() is not None:
        raise SystemExit(f"path {path}: the job ended early with exit code {job.returncode}: see {root / path}/job.log")
    code = stop(job)
    goodput = json.loads((run_dir / "goodput.json").read_text())
    return {
        "path": path,
        "snapshots": cadence(path, root / path / "job.log"),
        "exit": code,
        "wall_s": goodput["wall_s"],
        "ettr": goodput["ettr"],
        "steps": goodput["high_water_step"],
        "kills": kills,
        "failures": goodput["failures"],
        "totals": goodput["failure_totals"],
    }


def no_faults(path: str, root: Path, steps: int, ckpt_every: int, name: str, tree: Path) -> dict:
    """`steps` steps without faults (in `<name>/`) with hlat from `tree`: the mean step time (one metrics record per
    step; the first, which carries the start-up, left out; a mean, so that the steps slowed by a write every K
    steps count), the training's stall for saves per step (goodput.json's checkpoint_s), the memory tier's own
    measure of its snapshots' parts (the medians of the metrics' snapshot_* fields) and the machine's load."""
    run_dir = root / name / "run"
    run_dir.parent.mkdir(parents=True)
    args = overrides(path, run_dir, ckpt_every, "--train.log_every", "1")
    args[args.index("--train.steps") + 1] = str(steps)
    load = os.getloadavg()[0]
    job = start_job(args, run_dir.parent / "job.log", tree)
    if job.wait(timeout=1800) != 0:
        raise SystemExit(f"{path} without faults failed: see {run_dir.parent / 'job.log'}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in records if "snapshot_stall_s" in r]
    return {
        "step_s": statistics.fmean(r["step_time_s"] for r in records[1:]),
        "stall_s": json.loads((run_dir / "goodput.json").read_text())["checkpoint_s"] / steps,
        **{
            f"tier_{part}": statistics.median(r[f"snapshot_{part}"] for r in measured) if measured else None
            for part in TIER_PARTS
        },
        "load": (load + os.getloadavg()[0]) / 2,
        "every": cadence(path, run_dir.parent / "job.log"),
    }


TIER_PARTS = ("stall_s", "slowdown_s", "settle_s")


def snapshot_cost(root: Path, steps: int, ckpt_every: int, paths: list[str], rounds: int, baseline: Path | None):
    """Each memory path's snapshots against the step time of the durable path (which saves as often), in two parts:
    the training's stall for them (the copy to the staging buffer and the waits for writes: the path's stall per
    step over the durable path's) and the steps' slowdown while they are written in the background (on a CPU-only
    machine the writes take cores the steps run on). `rounds` rounds, each running every path once (and each memory
    path again with hlat from `baseline`, another checkout, where given), in an order turned by one each round, so
    that the machine's drift and other work fall on all alike; the medians over the rounds. Returns the rows and a
    sentence for the caption."""
    trees = {"this": ROOT} | ({"baseline": baseline} if baseline else {})
    runs = [("durable", "this")] + [(path, tree) for path in paths for tree in trees]
    measured: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
    for r in range(rounds):
        for path, tree in runs[r % len(runs) :] + runs[: r % len(runs)]:
            name = f"{path}_{tree}_{r}"
            measured[path, tree].append(no_faults(path, root, steps, ckpt_every, name, trees[tree]))
    step_s, stall_s = (statistics.median(m[k] for m in measured["durable", "this"]) for k in ("step_s", "stall_s"))
    rows = []
    for (path, tree), ms in measured.items():
        median = {
            k: statistics.median(m[k] for m in ms) if ms[0][k] is not None else None for k in ms[0] if k != "every"
        }
        slowdown, stall = median["step_s"] / step_s - 1, (median["stall_s"] - stall_s) / step_s
        rows.append(
            {
                "path": path,
                "hlat": tree,
                "every": ms[-1]["every"],
                "runs": len(ms),
                **median,
                "slowdown": slowdown,
                "stall": stall,
                "stall_a_step_s": median["stall_s"] - stall_s,
                "total": slowdown + stall,
                "each_run": ms,
            }
        )
    loads = [m["load"] for ms in measured.values() for m in ms]
    return rows, f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores during the runs"


def cadence(path: str, log: Path) -> str:
    """How often the path's run snapshotted: the interval its log names last (train.snapshot_every = -1 tunes it
    as the run goes and names each change), else every step; none on the durable path."""
    if path not in MEMORY_PATHS:
        return "none"
    tuned = [line for line in log.read_text(errors="replace").splitlines() if "memory tier: a snapshot every" in line]
    return tuned[-1].split("memory tier: a snapshot ", 1)[1].split(" (", 1)[0] if tuned else "every step"


def row(result: dict) -> list:
    n, totals = len(result["failures"]), result["totals"]

    def mean(part: str, digits: int = 2) -> str:
        have = [f[part] for f in result["failures"] if f[part] is not None]
        return f"{sum(have) / len(have):.{digits}f}" if have else "-"

    return [
        result["path"],
        result["snapshots"],
        f"{result['wall_s']:.0f}",
        result["steps"],
        len(result["kills"]),
        f"{n} ({totals['not_observed']} not observed)",
        f"{result['ettr']:.3f}",
        mean("detection_s"),
        mean("restart_s"),
        mean("downtime_s"),
        mean("load_s"),
        mean("recomputed_steps", 1),
        mean("recomputed_s"),
    ]


def machine() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{platform.node()}: {os.cpu_count()} cores of {model}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="wall time per path")
    p.add_argument("--mean-s", type=float, default=90.0, help="mean time between faults")
    p.add_argument("--ckpt-every", type=int, default=20, help="train.ckpt_every of every path")
    p.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"comma-separated, of {', '.join(PATHS)}; empty: the snapshot's cost alone (results/recovery_cost.md)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost-steps", type=int, default=200, help="steps of each run without faults (snapshot cost)")
    p.add_argument("--rounds", type=int, default=1, help="runs of each path without faults, interleaved")
    p.add_argument("--cost-paths", default=",".join(MEMORY_PATHS), help="the memory paths whose cost is measured")
    p.add_argument(
        "--baseline",
        type=Path,
        help="another hlat checkout (`git archive` of a commit): its memory paths' cost measured beside this one's",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="3 minutes per path, a fault every 45 s on average, 60 steps for the snapshot's cost",
    )
    args = p.parse_args()
    if args.quick:
        args.minutes, args.mean_s, args.cost_steps = 3.0, 45.0, 60
    paths = [name for name in args.paths.split(",") if name]
    if unknown := [name for name in paths if name not in PATHS]:
        raise SystemExit(f"--paths: no path {', '.join(unknown)} (paths: {', '.join(PATHS)})")
    with tempfile.TemporaryDirectory(prefix="hlat-recovery-") as tmp:
        root = Path(tmp)
        refused = {name: config_refusal(overrides(name, root / name / "run", args.ckpt_every)) for name in PATHS}
        for name in paths:
            if refused[name]:
                print(f"path {name}: {refused[name]}", file=sys.stderr)
        results = [
            faulted_run(name, root, args.minutes * 60, args.mean_s, args.ckpt_every, args.seed)
            for name in paths
            if not refused[name]
        ]
        wanted = args.cost_paths.split(",")
        measured = [
            name for name in MEMORY_PATHS if not refused[name] and name in wanted and (name in paths or not paths)
        ]
        cost = (
            snapshot_cost(root, args.cost_steps, args.ckpt_every, measured, args.rounds, args.baseline)
            if measured
            else ([], "not measured")
        )
    report(args, results, *cost, refused)


FAULT_HEADER = [
    "path",
    "snapshots",
    "wall s",
    "steps",
    "faults",
    "failures",
    "ETTR",
    "detection s",
    "restart s",
    "downtime s",
    "load s",
    "recomputed steps",
    "recomputed s",
]
COST_HEADER = [
    "path",
    "hlat",
    "snapshots",
    "runs",
    "step ms",
    "steps slower",
    "stall ms a step",
    "stall",
    "cost in all",
    "tier's measure: stall / slowdown / settle ms",
]


def cost_row(r: dict) -> list:
    tier = " / ".join("-" if r[f"tier_{k}"] is None else f"{r[f'tier_{k}'] * 1e3:.1f}" for k in TIER_PARTS)
    return [
        r["path"],
        r["hlat"],
        r["every"],
        r["runs"],
        f"{r['step_s'] * 1e3:.1f}",
        f"{r['slowdown']:+.1%}",
        f"{r['stall_a_step_s'] * 1e3:.1f}",
        f"{r['stall']:+.1%}",
        f"{r['total']:+.1%}",
        tier,
    ]


def report(args: argparse.Namespace, results: list[dict], costs: list[dict], load: str, refused: dict) -> None:
    left_out = "; ".join(f"{name}: {why}" for name, why in refused.items() if why)
    faults = (
        f"{args.minutes:g} min per path, one trainer SIGKILLed at exponential intervals (mean {args.mean_s:g} "
        f"s, seed {args.seed}), train.ckpt_every = {args.ckpt_every}; per failure means (goodput.json; a fault "
        f"that lands on a start before its rank 0 began its work, during the interpreter's imports, is no "
        f"failure of its own: its time is in the previous failure's restart). "
        if results
        else f"no faults (the snapshot's cost alone), train.ckpt_every = {args.ckpt_every}. "
    )
    baseline = f", and each memory path with hlat from {args.baseline} ('baseline')" if args.baseline else ""
    caption = (
        f"Recovery of the tiny model (configs/tiny.toml), 2 ranks under `hlat torchrun --max-restarts`, "
        f"{faults}Machine: {machine()}; torch {torch_version()}. Snapshots' cost (the second table): "
        f"{args.rounds} round(s) of {args.cost_steps} steps without faults, each round running every path in "
        f"turn{baseline}, the order turned by one each round; the medians over the rounds of the mean step time "
        f"and of goodput's stall for saves per step, each memory path against the durable one (which checkpoints "
        f"as often): the steps' slowdown while snapshots are written, the stall, and the two in all; beside them, "
        f"the tier's own measure of a snapshot (the medians of metrics.jsonl's snapshot_stall_s, "
        f"snapshot_slowdown_s and snapshot_settle_s); {load}." + (f" Paths left out: {left_out}." if left_out else "")
    )
    tables = [markdown_table(FAULT_HEADER, [row(r) for r in results])] if results else []
    tables += [markdown_table(COST_HEADER, [cost_row(r) for r in costs])] if costs else []
    name = "recovery_quick" if args.quick else "recovery" if results else "recovery_cost"
    meta = {
        "machine": machine(),
        "minutes": args.minutes,
        "mean_s": args.mean_s,
        "ckpt_every": args.ckpt_every,
        "seed": args.seed,
        "cost_steps": args.cost_steps,
        "rounds": args.rounds,
        "baseline": str(args.baseline or ""),
        "snapshot_cost": costs,
        "load": load,
        "left_out": {k: v for k, v in refused.items() if v},
    }
    write_results(name, meta, results, caption, "\n\n".join(tables))


def torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
