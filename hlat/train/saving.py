"""When a run checkpoints and commits: every `train.ckpt_every` steps, at the last step and on a stop signal, and
(eval.keep_best) at a validation with the lowest loss so far; each save accounted in the run's goodput; and, before
the first step, whether the checkpoints the run keeps fit on its disk. The writing itself is
`hlat.train.checkpoint.Checkpointer`'s, the best checkpoint's `hlat.train.best`'s."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hlat import HlatError
from hlat.config.job import Config
from hlat.dtensor import local
from hlat.files import checkpoint_step, free_bytes, size_text
from hlat.optim.modes import MODES
from hlat.parallel import Topology
from hlat.parallel.mesh import gather_objects
from hlat.train.best import BestCheckpoint
from hlat.train.checkpoint import MANIFEST, Checkpointer, Snapshot, complete_checkpoints, latest_checkpoint
from hlat.train.faults import weights_finite
from hlat.train.goodput import Goodput


class Checkpoints:
    """A run's checkpoints: when to save, and committing asynchronous saves once every rank has written its part
    (which the trainer learns from the step's all-reduce: `written`, then `commit` on every rank at that step).
    `saved` is the newest committed checkpoint of this process."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device, goodput: Goodput):
        settings = cfg.train
        self.every, self.last, self.run_dir = settings.ckpt_every, settings.steps, Path(settings.run_dir)
        self.keep = settings.keep_checkpoints
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
        self.goodput.saving(step)
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
        self.goodput.committed(checkpoint_step(path))

    def latest(self) -> Path | None:
        """The newest complete checkpoint of the run (of any process)."""
        return latest_checkpoint(self.run_dir)

    def close(self) -> None:
        self.writer.close()

    # --- room on the disk, before the first step --------------------------------------------------------------

    def check_room(self, step: int, size: int, local_params: int) -> str | None:
        """Refuse, on every rank alike (one gather), a run whose checkpoints of `size` bytes do not fit: the rotation
        (train.keep_checkpoints, plus the one being written; one save when all are kept) in the free space of rank 0's
        file system, and each rank's share of it (its `local_params` of all ranks') in its own. Refusing now costs
        nothing; a save that fails later costs the steps since the last checkpoint. Returns a warning for the log
        when checkpoints kept all (keep_checkpoints = 0) will outgrow the disk later."""
        slots, wanted = self.slots(step)
        gathered = gather_objects((local_params, free_bytes(self.writer.root)))
        everyone = sum(params for params, _ in gathered)
        for rank, (params, free) in enumerate(gathered):
            share = size if rank == 0 else size * params / max(everyone, 1)
            if free is not None and free < slots * share:
                raise HlatError(f"not enough free space for the checkpoints of {self.run_dir}"
                                f"{f' (rank {rank})' if rank else ''}: {size_text(free)} free, {slots} x "
                                f"{size_text(share)} needed ({self.rotation_text()}); free some space or lower "
                                "train.keep_checkpoints")
        free = gathered[0][1]
        if free is not None and free < wanted * size:
            return (f"warning: {self.run_dir} has room for {int(free // size)} of the {wanted} checkpoints of "
                    f"{size_text(size)} this run will keep ({self.rotation_text()}); move or delete old ones as it runs")
        return None

    def slots(self, step: int) -> tuple[int, int]:
        """How many more checkpoints the disk must hold at once from `step` on (the rotation, less those already
        there; with eval.keep_best, the best and its successor while it is written, less a best already there), and
        how many the run will have written by its end when it keeps them all."""
        best = 2 - len(list(self.writer.root.glob("best_step_*"))) if self.best is not None else 0
        if self.keep:
            return max(1, self.keep + 1 - len(complete_checkpoints(self.run_dir))) + best, 0
        ahead = self.last // self.every - step // self.every + (self.last % self.every > 0) if self.every else 1
        return 1 + best, max(1, ahead)

    def rotation_text(self) -> str:
        return ((f"train.keep_checkpoints = {self.keep}, and the one being written" if self.keep else
                 "train.keep_checkpoints = 0 keeps every checkpoint") + ("; the best" if self.best is not None else ""))


def checkpoint_bytes(resume_from: Path | None, n_params: int, mode: str) -> int:
    """The size of one of the run's checkpoints: the checkpoint it resumes from (its manifest's sizes), else the
    model's weights and optimizer states in its precision mode (the files' headers, the optimizer's settings and
    the trainer state add about 20 KB per parameter tensor: a few MB for a 7B model, a few percent of a tiny one)."""
    if resume_from is not None:
        return sum(size for size, _ in json.loads((resume_from / MANIFEST).read_text()).values())
    mode_bytes = MODES[mode]
    return n_params * (mode_bytes.weight_bytes + mode_bytes.optimizer_bytes)


def local_elements(params: list[torch.Tensor]) -> int:
    """The parameter elements this rank holds (its shards of sharded ones)."""
    return sum(local(p).numel() for p in params)
