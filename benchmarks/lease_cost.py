"""What the leases cost (docs/fault-tolerance.md, "Leases"): the CPU of the beats, and the step time with and without.

1. The beats alone: 4 ranks' leases (2 per node, a beat a second) against a store this process hosts, for --seconds;
   the process's CPU time over that time, less that of the same time idle, is what the beats and the store that
   answers them take.
2. The step: the tiny model (configs/tiny.toml) as a 2-rank `hlat torchrun --standalone` job, --steps steps, with
   leases (train.lease_s = 10, the default) and without (0), the runs alternated --rounds times; the median step time
   of each run's metrics.jsonl (one record per step, the first 5 left out: compilation of the data pool, warm-up).

    python benchmarks/lease_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from results_io import markdown_table, write_results  # noqa: E402

from hlat.parallel.lease import Lease  # noqa: E402
from hlat.parallel.store import AttemptStore  # noqa: E402


def beats_cpu_ms_per_s(seconds: float, ranks: int = 4) -> float:
    """CPU milliseconds a second that `ranks` leases and their store take, beyond this process idle."""
    idle0 = time.process_time()
    time.sleep(seconds)
    idle = time.process_time() - idle0
    master = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    where = AttemptStore("localhost", master.port, "bench", service=True)
    leases = [Lease(where, r, ranks, 2, 10.0, print).__enter__() for r in range(ranks)]
    busy0 = time.process_time()
    time.sleep(seconds)
    busy = time.process_time() - busy0
    for lease in leases:
        lease.__exit__(None, None, None)
    return 1e3 * (busy - idle) / seconds


def step_time_s(lease_s: float, steps: int, root: Path) -> float:
    run = root / f"lease{lease_s:g}-{time.monotonic_ns()}"
    command = [
        *(sys.executable, "-m", "hlat", "torchrun", "--standalone", "--nproc-per-node=2"),
        *("-m", "hlat", "train", "--config", str(ROOT / "configs" / "tiny.toml")),
        *("--train.run_dir", str(run), "--train.steps", str(steps), "--train.log_every", "1"),
        *("--train.micro_batch", "8"),  # the recipe's global batch of 16 over 2 ranks
        *("--train.lease_s", str(lease_s), "--train.snapshot_every", "0", "--train.ckpt_every", "0"),
        *("--train.snapshot_dir", str(root / "shm")),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=root)
    if done.returncode:
        sys.exit(f"lease_cost: the run failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records[5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cpu = beats_cpu_ms_per_s(args.seconds)
    runs: dict[float, list[float]] = {10.0: [], 0.0: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for lease_s in runs:
                runs[lease_s].append(step_time_s(lease_s, args.steps, Path(tmp)))
    rows = [
        {"leases": "on (10 s)" if lease_s else "off", "median_step_s": [round(t, 4) for t in times]}
        for lease_s, times in runs.items()
    ]
    on, off = (statistics.median(runs[k]) for k in (10.0, 0.0))
    spread = max(max(t) / min(t) - 1 for t in runs.values())
    caption = (
        f"Leases' cost (benchmarks/lease_cost.py; {platform.node()}: {os.cpu_count()} cores, torch "
        f"{torch.__version__}, load average {os.getloadavg()[0]:.1f} at the end). The beats of 4 ranks and the store "
        f"answering them: {cpu:.2f} ms of CPU a second ({cpu / 4:.2f} ms per rank, {cpu / 40:.3f}% of a core, over "
        f"{args.seconds:g} s, less the same time idle). The tiny model's step, 2 ranks, {args.steps} steps a run "
        f"(the first 5 left out), runs alternated: median {on * 1e3:.1f} ms with leases, {off * 1e3:.1f} ms without "
        f"({100 * (on / off - 1):+.1f}%), where runs of one setting differ by up to {100 * spread:.0f}% between "
        "themselves: no difference is measurable at that spread."
    )
    table = markdown_table(["leases", "median step time (s) of each run"], [list(r.values()) for r in rows])
    meta = {"cpu_ms_per_s": round(cpu, 3), "seconds": args.seconds, "steps": args.steps, "torch": torch.__version__}
    write_results("lease_cost", meta, rows, caption, table)


if __name__ == "__main__":
    main()
