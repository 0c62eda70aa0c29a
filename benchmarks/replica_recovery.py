"""Recovery with replica groups as fault domains (parallel.replica_groups; docs/fault-tolerance.md, "Replica
groups"): the tiny model (configs/tiny.toml) as 2 replica groups of 2 ranks, each its own `hlat torchrun` at an
`hlat service` on this machine, for a fixed wall time, while one trainer process of either group, drawn at random,
is killed with SIGKILL at exponentially distributed intervals (seeded; mean --mean-s), as benchmarks/recovery.py
does to today's paths. Every rank's `replicas_rank<R>.jsonl` (each committed step: when, in which epoch, how many
groups live, by which process) gives the job's progress and each failure's split: until the survivors committed
their first step alone (the failure found, the roll call, the step run again), the survivors' steps while the
failed group is out, and until the failed group, restarted and healed, commits with them again; and whether any
survivor's process changed. ETTR: the job's steps times the fault-free step time, over the wall time from the first
step.

    python benchmarks/replica_recovery.py                  # 10 minutes, mean 90 s between faults
    python benchmarks/replica_recovery.py --minutes 2 --mean-s 30
    python benchmarks/replica_recovery.py --async-checkpoint   # checkpoints by the background writer
    python benchmarks/replica_recovery.py --round-bytes 262144  # smaller tokenizer rounds: a restart redoes one
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

PORT = 29833
SAMPLE_S = 0.5  # how often the restarting groups' CPU time is sampled


def start(argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def group_command(run_dir: Path, group: int, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "hlat", "torchrun", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1000"),
        *("--rdzv-backend=hlat", f"--rdzv-id=bench-replica{group}", f"--rdzv-endpoint=127.0.0.1:{PORT}"),
        *("-m", "hlat", "train", "--config", str(ROOT / "configs" / "tiny.toml"), "--train.run_dir", str(run_dir)),
        *("--train.steps", "1000000", "--train.micro_batch", "4", "--train.ckpt_every", "20"),
        *("--train.snapshot_every", "0", "--parallel.replica_groups", "2", "--parallel.replica_group", str(group)),
        *extra,
    ]


def stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (state first: ppid at 1, utime/stime at 11/12, starttime
    at 19); [] where the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def processes() -> dict[int, list[str]]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat(int(entry.name))):
            found[int(entry.name)] = fields
    return found


def trainers(agent: int) -> list[int]:
    """An agent's worker processes (its children running `hlat train`)."""
    return [pid for pid, fields in processes().items() if int(fields[1]) == agent]


class RestartCpu:
    """The CPU time of the processes a failed group starts after a kill (its trainers, their tokenizer workers and
    writer processes), sampled as they run: on this machine it is taken from the survivors' 2 cores."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, agent: int):
        self.agent, self.since = agent, float(Path("/proc/uptime").read_text().split()[0]) * self.TICK
        self.cpu: dict[int, int] = {}  # pid: CPU ticks, the last seen (a process killed since keeps its count)
        self.samples: list[tuple[float, float]] = []  # (time, CPU seconds so far)

    def sample(self, table: dict[int, list[str]]) -> None:
        """Add a sample from `table` (`processes()`)."""
        tree, grew = {self.agent}, True
        while grew:  # the agent's descendants
            grown = tree | {pid for pid, fields in table.items() if int(fields[1]) in tree}
            grew, tree = len(grown) > len(tree), grown
        for pid in tree - {self.agent}:
            fields = table[pid]
            if int(fields[19]) >= self.since:
                self.cpu[pid] = int(fields[11]) + int(fields[12])
        self.samples.append((time.time(), sum(self.cpu.values()) / self.TICK))

    def until(self, moment: float) -> float | None:
        """CPU seconds used by `moment`."""
        before = [cpu for t, cpu in self.samples if t <= moment]
        return round(before[-1], 1) if before else None


def records(run_dir: Path) -> list[dict]:
    out = []
    for group in (0, 1):
        for path in (run_dir / f"replica{group}").glob("replicas_rank*.jsonl"):
            rank = int(path.stem.removeprefix("replicas_rank"))
            out += [json.loads(line) | {"group": group, "rank": rank} for line in path.read_text().splitlines()]
    return sorted(out, key=lambda r: r["time"])


def run(root: Path, seconds: float, mean_s: float, seed: int, extra: list[str]) -> tuple[list[dict], list, float]:
    run_dir = root / "run"
    service = start([sys.executable, "-m", "hlat", "service", "--port", str(PORT)], root / "service.log")
    time.sleep(3)
    agents = [start(group_command(run_dir, g, *extra), root / f"group{g}.log") for g in (0, 1)]
    draw, faults, next_sample = random.Random(seed), [], 0.0
    try:
        while not records(run_dir):  # the clock starts at the first step
            assert all(a.poll() is None for a in agents), (root / "group0.log").read_text()[-3000:]
            time.sleep(0.2)
        began = time.time()
        next_fault = began + draw.expovariate(1 / mean_s)
        while time.time() < began + seconds:
            time.sleep(0.1)
            if time.time() >= next_fault:
                group = draw.randrange(2)
                victims = trainers(agents[group].pid)
                if victims:
                    watch = RestartCpu(agents[group].pid)
                    os.kill(draw.choice(sorted(victims)), signal.SIGKILL)
                    faults.append((time.time(), group, watch))
                next_fault = time.time() + draw.expovariate(1 / mean_s)
            if faults and time.time() >= next_sample:  # the failures that may still be restarting
                table, next_sample = processes(), time.time() + SAMPLE_S
                for _, _, watch in faults[-3:]:
                    watch.sample(table)
    finally:
        for process in (*agents, service):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return [r for r in records(run_dir) if r["time"] <= began + seconds], faults, began


def split(recs: list[dict], faults: list[tuple[float, int, RestartCpu]]) -> list[dict]:
    """Each failure: the survivors' first step alone and their steps alone, the failed group's first step back with
    them, whether a survivor's process changed, each from the kill, and the CPU time the failed group's new
    processes used until it was back."""
    out = []
    for k, (at, failed, watch) in enumerate(faults):
        until = faults[k + 1][0] if k + 1 < len(faults) else float("inf")
        survivor = [r for r in recs if r["group"] != failed]
        alone = [r for r in survivor if at < r["time"] < until and r["live"] == 1]
        back = [r for r in recs if r["group"] == failed and at < r["time"] < until]
        before = {r["pid"] for r in survivor if r["time"] < at}
        after = {r["pid"] for r in survivor if at < r["time"] < until}
        out.append(
            {
                "first_alone_s": round(alone[0]["time"] - at, 2) if alone else None,
                "steps_alone": len({r["step"] for r in alone}),
                "back_s": round(back[0]["time"] - at, 2) if back else None,
                "survivor_restarts": len(after - before),
                "restart_cpu_s": watch.until(back[0]["time"]) if back else None,
            }
        )
    return out


def summary(recs: list[dict], faults, began: float, seconds: float) -> dict:
    steps = {r["step"] for r in recs}
    quiet = []  # fault-free step intervals of group 0's rank 0, both groups live
    mine = [r for r in recs if r["group"] == 0 and r["rank"] == 0]
    for a, b in zip(mine, mine[1:]):
        if (
            a["live"] == b["live"] == 2
            and b["step"] == a["step"] + 1
            and not any(a["time"] <= t <= b["time"] + 5 for t, *_ in faults)
        ):
            quiet.append(b["time"] - a["time"])
    step_s = statistics.median(quiet)
    progress = max(steps) - min(steps) + 1
    return {
        "wall_s": round(seconds),
        "steps": progress,
        "step_s": round(step_s, 3),
        "ettr": round(progress * step_s / seconds, 3),
        "faults": len(faults),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--mean-s", type=float, default=90)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="replica_recovery", help="the results' name in benchmarks/results/")
    ap.add_argument(
        "--async-checkpoint", action="store_true", help="checkpoints written in the background (train.async_checkpoint)"
    )
    ap.add_argument("--round-bytes", type=int, help="data.round_bytes (the tokenizer's unit of work; default 4 MiB)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:  # a writer may still be ending
        extra = ["--train.async_checkpoint", "true"] if args.async_checkpoint else []
        extra += ["--data.round_bytes", str(args.round_bytes)] if args.round_bytes else []
        recs, faults, began = run(Path(tmp), args.minutes * 60, args.mean_s, args.seed, extra)
    whole = summary(recs, faults, began, args.minutes * 60)
    failures = split(recs, faults)
    load = os.getloadavg()[0]
    header = (
        "Recovery of the tiny model (configs/tiny.toml, micro-batches of 4, a checkpoint every 20 steps for a job "
        "whose groups all fail, the groups taking them in turns, "
        f"{'written in the background' if args.async_checkpoint else 'synchronous'}; "
        f"data.round_bytes {args.round_bytes or 'the default, 4 MiB'}) as 2 replica groups of 2 ranks "
        f"(parallel.replica_groups = 2), {args.minutes:g} min, one trainer SIGKILLed at exponential intervals (mean "
        f"{args.mean_s:g} s, seed {args.seed}). Machine: {platform.node()}: {os.cpu_count()} cores, shared (load "
        f"average {load:.1f} at the end). ETTR: the job's steps x the median fault-free step ({whole['step_s']} s) / "
        f"the wall time. Per failure, from the kill: the survivors' first step alone, their steps alone, the failed "
        f"group's first step back (restarted, healed), survivor processes restarted, and the CPU time the failed "
        f"group's new processes (trainers, tokenizer workers, writers) used until it was back, which on this "
        f"machine comes out of the survivors' {os.cpu_count()} cores."
    )
    rows = [[k + 1, *f.values()] for k, f in enumerate(failures)]
    table = "\n\n".join(
        [
            markdown_table(list(whole), [list(whole.values())]),
            markdown_table(
                ["failure", "first step alone s", "steps alone", "back s", "survivor restarts", "restart CPU s"], rows
            ),
        ]
    )
    meta = {"summary": whole, "load": load, "minutes": args.minutes, "mean_s": args.mean_s, "seed": args.seed}
    meta |= {"async_checkpoint": args.async_checkpoint, "round_bytes": args.round_bytes}
    write_results(args.name, meta, failures, header, table)


if __name__ == "__main__":
    main()
