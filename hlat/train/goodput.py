"""Where a run's wall time went, kept in `<run>/goodput.json` across restarts (docs/fault-tolerance.md).

Time is productive once the checkpoint after it is written: a step's time sits in `pending_s` until then and
becomes `lost_s` if the process dies (or rolls back) first; a step run again after a restart counts as
`recomputed_s`. The effective training time ratio (ETTR) is productive time over the wall time since the run
first started, so restarts, downtime between them, start-up, checkpoint stalls and data waits all lower it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FIELDS = ("productive_s", "pending_s", "lost_s", "recomputed_s", "startup_s", "checkpoint_s", "data_wait_s",
          "bad_step_s")


class Goodput:
    def __init__(self, run_dir: Path, write: bool, started: float):
        """`started`: when this process began its work (start-up runs from there to the first step)."""
        self.path, self.write, self.started = Path(run_dir) / "goodput.json", write, started
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):
            saved = {}
        self.account = {"first_start": saved.get("first_start", self.started), "starts": saved.get("starts", 0) + 1,
                        "high_water_step": saved.get("high_water_step", 0),
                        **{k: saved.get(k, 0.0) for k in FIELDS}}
        self.covered = 0.0  # pending time the save in flight will make productive
        self.lose_pending()  # the previous process died before checkpointing those steps

    def __getitem__(self, key: str) -> float:
        return self.account[key]

    def start_up_done(self) -> None:
        self.account["startup_s"] += time.time() - self.started

    def step(self, step: int, seconds: float, data_wait_s: float, bad: bool) -> None:
        a = self.account
        a["data_wait_s"] += data_wait_s
        if bad:
            a["bad_step_s"] += seconds
        elif step <= a["high_water_step"]:
            a["recomputed_s"] += seconds
        else:
            a["pending_s"] += seconds - data_wait_s
        a["high_water_step"] = max(a["high_water_step"], step)

    def checkpointed(self, stall_s: float) -> None:
        """A save began (training stalled `stall_s` for it): the steps so far become productive when it commits."""
        self.account["checkpoint_s"] += stall_s
        self.covered = self.account["pending_s"]

    def committed(self) -> None:
        a = self.account
        a["productive_s"] += self.covered
        a["pending_s"] -= self.covered
        self.covered = 0.0
        self.save()

    def lose_pending(self) -> None:
        self.account["lost_s"] += self.account["pending_s"]
        self.account["pending_s"] = self.covered = 0.0

    def ettr(self) -> float:
        wall = time.time() - self.account["first_start"]
        return self.account["productive_s"] / wall if wall > 0 else 0.0

    def save(self) -> None:
        if not self.write:
            return
        record = {**{k: round(v, 3) if isinstance(v, float) else v for k, v in self.account.items()},
                  "wall_s": round(time.time() - self.account["first_start"], 3), "ettr": round(self.ettr(), 4)}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, self.path)
