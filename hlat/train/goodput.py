"""Where a run's wall time went, kept in `<run>/goodput.json` across restarts (docs/fault-tolerance.md).

Productive time is the step time the newest checkpoint holds: at the end of the run, the time of the steps the
final model contains, each counted once, from whichever run of it made it in. The steps since that checkpoint
are pending; when a process dies (or rolls back), the next one resumes from a checkpoint and the step time after
it becomes lost. To know what a checkpoint holds even when a process dies between writing it and recording it,
each save records the step time up to its step before it is written (`saves`). A step run again after a restart
counts as productive like any other (or is lost again); `recomputed_s` tells how much of the time was such re-runs.
The effective training time ratio (ETTR) is productive time over the wall time since the run first started, so
restarts, downtime between them, start-up, checkpoint stalls and data waits all lower it.

Each failure (a start after an attempt that did not end cleanly) is split into detection, restart, state load and
recomputed steps (`failures`, summed in `failure_totals`: hlat.train.recovery says where each moment comes from).
Between saves of goodput.json, rank 0 leaves the account after each step in progress.json, so that a process
killed between two log steps loses none of it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hlat.files import write_text
from hlat.train.recovery import ProgressFile, metric_fields, new_failure, read_progress, totals

FIELDS = (
    "productive_s",
    "pending_s",
    "lost_s",
    "recomputed_s",
    "startup_s",
    "checkpoint_s",
    "data_wait_s",
    "bad_step_s",
)
SAVES_KEPT = 64  # the saves remembered; a run resumed from an older checkpoint keeps its productive time as it was


class Goodput:
    def __init__(self, run_dir: Path, write: bool, started: float):
        """`started`: when this process began its work (start-up runs from there to the first step). The start is
        counted (and written) at once, so a process killed before its first step still counts. A start after an
        attempt that did not end cleanly recovers from its failure (hlat.train.recovery), appended to `failures`."""
        self.run_dir, self.write, self.started = Path(run_dir), write, started
        self.path = self.run_dir / "goodput.json"
        saved, progress = self._last_account()
        self.account = {
            "first_start": saved.get("first_start", self.started),
            "starts": saved.get("starts", 0) + 1,
            "high_water_step": saved.get("high_water_step", 0),
            **{k: saved.get(k, 0.0) for k in FIELDS},
        }
        self.saves = {int(step): t for step, t in saved.get("saves", {}).items()}  # step -> step time up to it
        self.failures: list[dict] = saved.get("failures", [])
        self.failure = None  # the failure this start recovers from; its re-run steps are counted while `recovering`
        if saved.get("attempt_started") is not None and saved.get("attempt_ended") is None:
            self.failure = new_failure(self.run_dir, saved, progress, self.account["high_water_step"], started)
            self.failures.append(self.failure)
        self.recovering = self.failure is not None
        self.ended: float | None = None
        self.progress = ProgressFile(self.run_dir) if write else None
        self.save()

    def _last_account(self) -> tuple[dict, dict | None]:
        """goodput.json as the last attempt left it, brought up to its last step by progress.json where that is
        newer; and that attempt's last progress record (None: it ended no step)."""
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):
            saved = {}
        progress = read_progress(self.run_dir)
        if not progress or progress.get("attempt_started") != saved.get("attempt_started"):
            return saved, None
        if progress["at"] > saved.get("saved_at", 0.0):
            saved = {**saved, **progress["account"]}
            if progress["failure"] is not None:  # the same failure, with its re-run steps since
                saved["failures"] = [*saved["failures"][:-1], progress["failure"]]
        return saved, progress

    def __getitem__(self, key: str) -> float:
        return self.account[key]

    @property
    def timeline_s(self) -> float:
        """The step time of the steps this run now stands on: up to the last step, from the run's beginning."""
        return self.account["productive_s"] + self.account["pending_s"]

    def resumed(self, step: int) -> None:
        """The run goes on from the checkpoint of `step` (0: from scratch), after a restart or a rollback: the step
        time it holds is productive, the step time after it is lost."""
        a, failure = self.account, self.failure
        if failure is not None and failure["resumed_step"] is None:
            failure["resumed_step"] = step
            failure["recomputed_steps"] = max(0, failure["high_water_step"] - step)
        else:  # a rollback: the steps it runs again are its own
            self.recovering = False
        held = self.saves.get(step, 0.0 if step == 0 else a["productive_s"])
        a["lost_s"] += max(0.0, self.timeline_s - held)
        a["productive_s"], a["pending_s"] = held, 0.0
        self.saves = {s: t for s, t in self.saves.items() if s <= step}
        self.save()

    def start_up_done(self) -> None:
        self.account["startup_s"] += time.time() - self.started
        if self.failure is not None:
            self.failure["load_s"] = round(time.time() - self.started, 3)

    def step(self, step: int, seconds: float, data_wait_s: float, bad: bool) -> None:
        a = self.account
        a["data_wait_s"] += data_wait_s
        if bad:
            a["bad_step_s"] += seconds - data_wait_s
        else:
            a["pending_s"] += seconds - data_wait_s
            if step <= a["high_water_step"]:
                a["recomputed_s"] += seconds - data_wait_s
            if self.recovering and step <= self.failure["high_water_step"]:
                self.failure["recomputed_s"] += seconds - data_wait_s
            a["high_water_step"] = max(a["high_water_step"], step)
        if self.progress is not None:  # the last sign of progress, should this process die before its next save
            self.progress.write(
                {
                    "attempt_started": self.started,
                    "at": time.time(),
                    "step": step,
                    "account": {k: a[k] for k in (*FIELDS, "high_water_step")},
                    "failure": self.failure,
                }
            )

    def saving(self, step: int) -> None:
        """A checkpoint of `step` is about to be written: what it will hold is recorded (and written) first."""
        self.saves[step] = self.timeline_s
        self.saves = dict(sorted(self.saves.items())[-SAVES_KEPT:])
        self.save()

    def checkpointed(self, stall_s: float) -> None:
        """Training stalled `stall_s` for a save."""
        self.account["checkpoint_s"] += stall_s

    def committed(self, step: int) -> None:
        """The checkpoint of `step` is complete: the step time it holds is productive."""
        a, timeline = self.account, self.timeline_s
        a["productive_s"] = self.saves.get(step, timeline)
        a["pending_s"] = timeline - a["productive_s"]
        self.save()

    def finished(self) -> None:
        """This attempt ended cleanly (done, or stopped after its checkpoint): the next start is no failure's."""
        self.ended = time.time()
        self.save()
        if self.progress is not None:
            self.progress.close()

    def recovery(self) -> dict:
        """The failures' parts in total (hlat.train.recovery.totals)."""
        return totals(self.failures)

    def metric_fields(self) -> dict:
        """For a metrics record: the ETTR so far and the failures' totals."""
        return {"ettr": round(self.ettr(), 4), **metric_fields(self.recovery())}

    def ettr(self) -> float:
        wall = time.time() - self.account["first_start"]
        return self.account["productive_s"] / wall if wall > 0 else 0.0

    def save(self) -> None:
        if not self.write:
            return
        now = time.time()
        record = {
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in self.account.items()},
            "wall_s": round(now - self.account["first_start"], 3),
            "ettr": round(self.ettr(), 4),
            "saves": {str(step): round(t, 6) for step, t in self.saves.items()},
            "attempt_started": self.started,
            "attempt_ended": self.ended,
            "saved_at": now,
            "failures": [{k: round(v, 3) if isinstance(v, float) else v for k, v in f.items()} for f in self.failures],
            "failure_totals": self.recovery(),
        }
        write_text(self.path, json.dumps(record, indent=1) + "\n", self.run_dir)
