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
killed between two log steps loses none of it. An account belongs to one run (its token): a fresh start in the same
directory begins its own, and a start refused before its first step takes back what it wrote (`take_back_if_refused`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hlat import HlatError
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
    def __init__(self, run_dir: Path, write: bool, started: float, token: str):
        """`started`: when this process began its work (start-up runs from there to the first step); `token`: the
        run's (`hlat.checkpoint.start.run_token`: a fresh start makes a new one), whose account this continues: an
        account of another token (an earlier run given up in this directory, or one refused before its first step)
        is not this run's. The start is counted (and written) at once, so a process killed before its first step
        still counts; a start refused before its first step takes it back (`take_back_if_refused`). A start after an
        attempt that did not end cleanly recovers from its failure (hlat.train.recovery), appended to `failures`."""
        self.run_dir, self.write, self.started, self.token = Path(run_dir), write, started, token
        self.path = self.run_dir / "goodput.json"
        self.before = self.path.read_bytes() if write and self.path.is_file() else None  # for a refused start
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
        self.progress: ProgressFile | None = None  # opened at the first step: until then the last attempt's stays
        self.steps_run = 0
        self.save()

    def _last_account(self) -> tuple[dict, dict | None]:
        """goodput.json as the last attempt of this run left it, brought up to its last step by progress.json where
        that is newer; and that attempt's last progress record (None: it ended no step). Another run's is none."""
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):
            saved = {}
        if saved.get("run_token") != self.token:
            return {}, None
        progress = read_progress(self.run_dir)
        if not progress or progress.get("attempt_started") != saved.get("attempt_started"):
            return saved, None
        if progress["at"] > saved.get("saved_at", 0.0):
            saved = {**saved, **progress["account"]}
            if progress["failure"] is not None:  # the same failure, with its re-run steps since
                saved["failures"] = [*saved["failures"][:-1], progress["failure"]]
        return saved, progress

    @property
    def stepped(self) -> bool:
        """Whether this start has run a step."""
        return self.steps_run > 0

    def refused(self, error: BaseException | None) -> bool:
        """Whether `error` ends a start refused before its first step: an `HlatError`, a user's mistake such as a
        mistyped tokenizer path (exit code 2), which is no failure of the run."""
        return isinstance(error, HlatError) and not self.stepped

    def take_back_if_refused(self, kind, error, traceback) -> None:
        """An exit callback: a refused start leaves goodput.json as it found it, so that the next start neither counts
        it nor sees a failure in it."""
        if self.write and self.refused(error):
            if self.before is None:
                self.path.unlink(missing_ok=True)
            else:
                write_text(self.path, self.before.decode(), self.run_dir)

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
        self.steps_run += 1
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
        if self.write:  # the last sign of progress, should this process die before its next save
            self.progress = self.progress or ProgressFile(self.run_dir)
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

    def stalled(self, seconds: float) -> None:
        """Training stalled `seconds` for a save or a snapshot."""
        self.account["checkpoint_s"] += seconds

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
            "run_token": self.token,
            "attempt_started": self.started,
            "attempt_ended": self.ended,
            "saved_at": now,
            "failures": [{k: round(v, 3) if isinstance(v, float) else v for k, v in f.items()} for f in self.failures],
            "failure_totals": self.recovery(),
        }
        write_text(self.path, json.dumps(record, indent=1) + "\n", self.run_dir)
