"""When a run checkpoints and commits: every `train.ckpt_every` steps, at the last step and on a stop signal, and
(eval.keep_best) at a validation with the lowest loss so far; each save accounted in the run's goodput. The
writing itself is `hlat.train.checkpoint.Checkpointer`'s, the best checkpoint's `hlat.train.best`'s."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from hlat import HlatError
from hlat.parallel import Topology
from hlat.train.best import BestCheckpoint
from hlat.train.checkpoint import Checkpointer, Snapshot, latest_checkpoint
from hlat.train.config import Config
from hlat.train.faults import weights_finite
from hlat.train.goodput import Goodput


class Checkpoints:
    """A run's checkpoints: when to save, and committing asynchronous saves once every rank has written its part
    (which the trainer learns from the step's all-reduce: `written`, then `commit` on every rank at that step).
    `saved` is the newest committed checkpoint of this process."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device, goodput: Goodput):
        settings = cfg.train
        self.every, self.last, self.run_dir = settings.ckpt_every, settings.steps, Path(settings.run_dir)
        self.goodput, self.config_toml = goodput, cfg.to_toml()
        self.writer = Checkpointer(self.run_dir, settings.keep_checkpoints, topo.rank, settings.async_checkpoint,
                                   pinned=device.type == "cuda")
        self.saved: Path | None = None
        self.best = BestCheckpoint(cfg.eval.keep_best, self.run_dir, topo.rank, device) if cfg.eval.keep_best else None

    def due(self, step: int, stopping: bool) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.last or stopping

    def save(self, step: int, snapshot: Snapshot, commit_now: bool) -> None:
        """Checkpoint `snapshot` at `step`: training stalls for the whole write, or (asynchronous) for the copy to
        host memory; `commit_now` waits for an asynchronous write too. Never from non-finite weights (they would
        replace a good checkpoint)."""
        started = time.perf_counter()
        if not weights_finite([p for part in snapshot.parts for p in part.parameters()]):
            raise HlatError(f"step {step}: the weights are not finite; not checkpointing them; last good checkpoint: "
                            f"{self.latest() or 'none'}")
        saved = self.writer.save(step, snapshot, self.config_toml)
        self.goodput.checkpointed(time.perf_counter() - started)
        if saved is not None:
            self.committed(saved)
        elif commit_now:
            self.commit()

    def keep_best(self, step: int, figures: dict, snapshot: Callable[[], Snapshot]) -> None:
        """After a validation (on every rank): eval.keep_best's checkpoint of `snapshot()`, if `figures` hold the
        lowest loss so far. Written synchronously, apart from any asynchronous save in flight."""
        started = time.perf_counter()
        if self.best is not None and self.best.offer(step, figures, snapshot, self.config_toml) is not None:
            self.goodput.checkpointed(time.perf_counter() - started)

    def written(self) -> bool:
        """Whether this rank has written its part of the asynchronous save in flight."""
        return self.writer.written()

    def commit(self) -> None:
        """Commit the asynchronous save in flight, if any (a collective: every rank at the same step)."""
        saved = self.writer.finish()
        if saved is not None:
            self.committed(saved)

    def committed(self, path: Path) -> None:
        self.saved = path
        self.goodput.committed()

    def latest(self) -> Path | None:
        """The newest complete checkpoint of the run (of any process)."""
        return latest_checkpoint(self.run_dir)

    def close(self) -> None:
        self.writer.close()
