"""Each failure of a run split into where its time went, for `<run>/goodput.json` (docs/fault-tolerance.md,
"Goodput"): detection, restart, state load and recomputed steps.

A failure is a start of the run's processes that follows an attempt which did not end cleanly (a crash, a kill, a
hang, a lost node). Its moments and where each is known from:
- progress: the failed attempt's last step end, from `<run>/progress.json`, which rank 0 rewrites in place after
  every step (one `pwrite` of a padded record into the page cache: microseconds, and it outlives a killed process;
  only a lost node loses what it had not written back). An attempt that ended no step: its start.
- seen: the earliest record in `<run>/failures/` written between the failed attempt's start and the new one's: a
  rank whose work raised (a collective that failed or timed out, its own crash), the watchdog that found a hang, the
  supervisor that saw its child exit. Where none was written (torchrun restarted a rank killed outright, with no
  survivor that noticed; a scheduler requeued a lost node), detection and restart are one figure, downtime, and the
  split is not observed.
- restart: the new attempt's start (rank 0 entering `hlat.train.loop.train`); load: from there to its first step.
Moments from different hosts carry their clocks' difference.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from hlat.files import SEEN_DIR, record_seen, writing

PROGRESS_FILE = "progress.json"
PARTS = ("detection_s", "restart_s", "downtime_s", "load_s", "recomputed_steps", "recomputed_s")


@contextlib.contextmanager
def seeing_failures(run_dir: Path, who: str, refused: Callable[[BaseException], bool]):
    """Record the moment an exception ends this process's work (a failed or timed-out collective on a surviving
    rank, or its own error), before any clean-up delays it; not a `refused` start's (a user's mistake)."""
    try:
        yield
    except Exception as e:
        if not refused(e):
            first_line = (str(e).strip().splitlines() or [""])[0]
            record_seen(run_dir, who, f"{type(e).__name__}: {first_line[:160]}")
        raise


def first_seen(run_dir: Path, after: float, before: float) -> dict | None:
    """The earliest failure record written in [after, before], or None."""
    found = []
    for path in (Path(run_dir) / SEEN_DIR).glob("seen_*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(path.read_text())
            if after <= float(record["at"]) <= before:
                found.append(record)
    return min(found, key=lambda r: r["at"]) if found else None


def new_failure(run_dir: Path, failed: dict, progress: dict | None, high_water_step: int, restart_at: float) -> dict:
    """The failure of the attempt `failed` (its goodput.json record) that this start, at `restart_at`, recovers from;
    `progress`: that attempt's last progress record (None: it ended no step). Load and recomputed steps are filled in
    as this start reaches its first step and resumes."""
    started = failed["attempt_started"]
    progress_at = progress["at"] if progress else started
    seen = first_seen(run_dir, started, restart_at)
    return {
        "after_step": progress["step"] if progress else None,
        "progress_at": round(progress_at, 3),
        "seen_at": seen and seen["at"],
        "seen_by": seen and seen["by"],
        "restart_at": round(restart_at, 3),
        "detection_s": seen and round(seen["at"] - progress_at, 3),
        "restart_s": seen and round(restart_at - seen["at"], 3),
        "downtime_s": round(restart_at - progress_at, 3),
        "load_s": None,
        "resumed_step": None,
        "high_water_step": high_water_step,
        "recomputed_steps": None,
        "recomputed_s": 0.0,
    }


def totals(failures: list[dict]) -> dict:
    """Each part summed over the failures that have it (a part not observed, or not reached, is left out), with
    the number of failures and of those whose split was not observed."""
    out = {"failures": len(failures), "not_observed": sum(f["seen_at"] is None for f in failures)}
    for part in PARTS:
        out[part] = round(sum(f[part] for f in failures if f[part] is not None), 3)
    return out


def metric_fields(total: dict) -> dict:
    """The totals as metrics.jsonl fields (`failures`, `failure_detection_s`, ...)."""
    return {
        "failures": total["failures"],
        "failures_not_observed": total["not_observed"],
        **{f"failure_{part}": total[part] for part in PARTS},
    }


def read_progress(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / PROGRESS_FILE).read_bytes())
    except (OSError, ValueError):
        return None


class ProgressFile:
    """`<run>/progress.json`, rewritten in place after each step: one pwrite of a record padded to the longest so far
    (so no older tail is left behind), without a rename or an fsync, so that it costs the step nothing measurable.
    A process killed however it dies leaves its last record; a reader tolerates a record not yet written."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.path, self.size = Path(run_dir), Path(run_dir) / PROGRESS_FILE, 0
        with writing(self.path, self.run_dir):
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # the last one read before

    def write(self, record: dict) -> None:
        data = json.dumps(record).encode()
        self.size = max(self.size, len(data) + 1)
        with writing(self.path, self.run_dir):
            os.pwrite(self.fd, data.ljust(self.size - 1) + b"\n", 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
