"""`hlat train --max-restarts N`: run the training job as a child process and start it again when it fails.

Every start resumes with `--resume auto` (the newest good checkpoint), so a crash, a kill or a hang (the
watchdog exits non-zero) costs only the work since the last checkpoint. Each restart and its cause is appended
to `<run>/restarts.jsonl`. An hlat error (exit code 2: bad config, bad step under 'stop', full disk) is not
retried: the same start would fail the same way. With `--nproc-per-node K > 1` the child is a single-node
torchrun job; multi-node jobs use torchrun's own elastic restarts (hlat launch).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from hlat import ERROR_EXIT
from hlat.files import append_text, record_seen, writing


def child_command(train_args: list[str], nproc: int) -> list[str]:
    launcher = ["-m", "hlat", "torchrun", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return [sys.executable, *launcher, "-m", "hlat", "train", *train_args]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def supervise(train_args: list[str], run_dir: Path, max_restarts: int, nproc: int = 1) -> int:
    """Run `hlat train train_args` (which must not name --resume: every start adds --resume auto) until it
    succeeds, fails with an hlat error, or has been restarted `max_restarts` times; return its exit code."""
    stopping = False
    child: subprocess.Popen | None = None

    def forward(signum, frame):  # a scheduler's SIGTERM: the job checkpoints and stops, and is not restarted
        nonlocal stopping
        stopping = True
        if child is not None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(max_restarts + 1):
            started = time.time()
            child = subprocess.Popen(
                child_command([*train_args, "--resume", "auto"], nproc),
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
            )
            error = ""
            for line in child.stderr:  # shown as it comes; hlat's own error line (a hang, a crash) is the cause
                sys.stderr.write(line)
                if "hlat: error:" in line:
                    error = line.strip()
            code = child.wait()
            # the moment the failure was seen, for goodput's split of it; a refused job (exit code 2: a user's mistake,
            # such as a run directory another job holds) is no failure of the run, and writes nothing into it
            if code not in (0, ERROR_EXIT) and not stopping:
                record_seen(run_dir, "supervisor", describe_exit(code))
            if code == 0 or stopping or code == ERROR_EXIT or attempt == max_restarts:
                if code not in (0, ERROR_EXIT) and not stopping:
                    print(
                        f"hlat: error: gave up after {max_restarts} restarts ({describe_exit(code)})", file=sys.stderr
                    )
                return code
            record = {
                "restart": attempt + 1,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "ran_s": round(time.time() - started, 1),
                "exit": describe_exit(code),
                "error": error,
            }
            with writing(run_dir, run_dir):
                run_dir.mkdir(parents=True, exist_ok=True)
            append_text(run_dir / "restarts.jsonl", json.dumps(record) + "\n", run_dir)
            print(
                f"hlat: restart {attempt + 1}/{max_restarts} after {describe_exit(code)}"
                f"{f' ({error})' if error else ''}; resuming from the newest good checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
