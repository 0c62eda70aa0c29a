"""A run's checkpoints, the one object the trainer asks to save and restore: when to save (every
`train.ckpt_every` steps, at the last step, on a stop signal and, eval.keep_best, at a validation with the lowest
loss so far), each save accounted in the run's goodput; what to restore at the start (the checkpoint to resume from,
or train.init_from's weights) and on a rollback (the newest checkpoint that still verifies); and, before the first
step, whether the checkpoints the run keeps fit on its disk. The state saved and restored is `TrainState`'s, the
writing `hlat.checkpoint.store.Checkpointer`'s, the best checkpoint `hlat.checkpoint.best`'s."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from hlat import HlatError
from hlat.checkpoint.best import BestCheckpoint
from hlat.checkpoint.memory import STALL_SHARE, MemoryTier, fetch, files_to_read, snapshot_root
from hlat.checkpoint.start import Start
from hlat.checkpoint.state import TrainState, load_weights
from hlat.checkpoint.store import Checkpointer, newest_good_checkpoint, resolve_checkpoint, set_aside
from hlat.config.job import Config
from hlat.dtensor import local
from hlat.files import free_bytes, size_text
from hlat.optim.modes import MODES
from hlat.parallel import Topology
from hlat.parallel.mesh import gather_objects
from hlat.paths import MANIFEST, checkpoint_step, complete_checkpoints, latest_checkpoint


@dataclass(frozen=True)
class Writes:
    """The background writes in flight: this rank's part done or not, or (`agreed`, after the step's all-reduce)
    whether every rank is done, and whether any rank's snapshot write failed."""

    checkpoint: bool = False  # the asynchronous checkpoint (durable tier)
    snapshot: bool = False  # the memory tier's snapshot
    snapshot_failed: bool = False

    def flags(self) -> tuple[bool, bool, bool]:
        return self.checkpoint, self.snapshot, self.snapshot_failed

    @classmethod
    def agreed(cls, counts: list[float], world: int) -> Writes:
        """From the number of ranks that raised each flag."""
        return cls(counts[0] == world, counts[1] == world, counts[2] > 0)


class Checkpoints:
    """A run's checkpoints in both tiers: when to save, and committing background writes once every rank has written
    its part (which the trainer learns from the step's all-reduce: `writes`, then `commit_written` on every rank at
    that step). `saved` is the newest committed durable checkpoint of this process."""

    def __init__(
        self,
        cfg: Config,
        topo: Topology,
        device: torch.device,
        state: TrainState,
        goodput,
        console: Console,
        start: Start,
    ):
        """`goodput`: the run's `hlat.train.goodput.Goodput`, told of each save's stall and commit; `start`: where
        the ranks agreed to start (`hlat.checkpoint.start.agree_on_start`)."""
        settings = cfg.train
        self.state, self.console, self.init_from, self.is_main = state, console, settings.init_from, topo.is_main
        self.start, self.rank, self.mode = start, topo.rank, cfg.precision.mode
        self.memory = (
            MemoryTier(
                snapshot_root(settings.snapshot_dir, settings.run_dir),
                settings.snapshot_every,
                start.token,
                topo.rank,
                start.node,
                start.group,
                cfg.to_toml(),
                device,
            )
            if settings.snapshot_every
            else None
        )
        self.every, self.last, self.run_dir = settings.ckpt_every, settings.steps, Path(settings.run_dir)
        self.keep = settings.keep_checkpoints
        self.goodput, self.config_toml = goodput, cfg.to_toml()
        self.writer = Checkpointer(
            self.run_dir,
            settings.keep_checkpoints,
            topo.rank,
            settings.async_checkpoint,
            pinned=device.type == "cuda",
            timeout_s=settings.collective_timeout_s,
        )
        self.saved: Path | None = None
        self.best = BestCheckpoint(cfg.eval.keep_best, self.run_dir, topo.rank, device) if cfg.eval.keep_best else None

    def due(self, step: int, stopping: bool) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.last or stopping

    def save(self, commit_now: bool) -> None:
        """Checkpoint the state at its step: training stalls for the whole write, or (asynchronous) for the copy to
        host memory; `commit_now` waits for an asynchronous write too. Never from non-finite weights (they would
        replace a good checkpoint)."""
        started, step = time.perf_counter(), self.state.step
        if not weights_finite([p for part in self.state.parts for p in part.parameters()]):
            raise HlatError(
                f"step {step}: the weights are not finite; not checkpointing them; last good checkpoint: "
                f"{self.latest() or 'none'}"
            )
        self.goodput.saving(step)
        saved = self.writer.save(step, self.state.state_dict(), self.config_toml)
        self.goodput.checkpointed(time.perf_counter() - started)
        if saved is not None:
            self.committed(saved)
        elif commit_now:
            self.commit()

    def snapshot_due(self, step: int) -> bool:
        return self.memory is not None and self.memory.due(step)

    def snapshot(self) -> None:
        """The memory tier's snapshot of the state at its step: training stalls for the copy to host memory."""
        started = time.perf_counter()
        self.memory.save(self.state.step, self.state.state_dict(packed=True), started)
        self.goodput.checkpointed(time.perf_counter() - started)

    def tune_snapshots(self) -> None:
        """train.snapshot_every = -1: the snapshots' measured cost sets their cadence (at some commits:
        `MemoryTier.tune_due`), said where it changes."""
        before = self.memory.every
        every, cost, step_s = self.memory.tune()
        if every != before:
            self.console.print(
                f"memory tier: a snapshot every {every} step{'s' if every > 1 else ''} "
                f"(train.snapshot_every = -1: one costs {cost * 1e3:.0f} ms, {cost / step_s:.1%} of a "
                f"{step_s * 1e3:.0f} ms step; the goal is under {STALL_SHARE:.0%})",
                highlight=False,
            )

    def writes(self) -> Writes:
        """This rank's part of the background writes in flight: done or not."""
        memory = self.memory
        return Writes(
            self.writer.written(),
            memory is not None and memory.written(),
            memory is not None and memory.written() and memory.in_flight.failure is not None,
        )

    def commit_written(self, agreed: Writes, step_s: float) -> None:
        """After a step (of `step_s` seconds), commit what every rank has written (a collective: every rank at the
        same step). A failed snapshot turns the memory tier off for the rest of this process; the durable tier
        goes on."""
        if self.memory is not None:
            self.memory.stepped(step_s)
        if agreed.checkpoint:
            self.commit()
        if agreed.snapshot:
            self.memory_failed(self.memory.commit(agreed.snapshot_failed))
        elif self.memory is not None and self.memory.in_flight is not None:  # not all written yet: wait for them
            started = time.perf_counter()
            self.memory_failed(self.memory.settle())
            self.goodput.checkpointed(time.perf_counter() - started)
        if self.memory is not None and self.memory.tune_due():
            self.tune_snapshots()

    def memory_failed(self, failure: str | None) -> bool:
        """Turn the memory tier off after a failed snapshot write (`failure`, on every rank alike); True if so."""
        if failure:
            self.console.print(
                f"warning: the memory tier is off for the rest of this process: a snapshot write "
                f"failed ({failure}); checkpoints go on every train.ckpt_every steps",
                soft_wrap=True,
                highlight=False,
                markup=False,
            )
            self.memory.close()
            self.memory = None
        return bool(failure)

    def keep_best(self, figures: dict) -> None:
        """After a validation (on every rank): eval.keep_best's checkpoint of the state, if `figures` hold the
        lowest loss so far. Written synchronously, apart from any asynchronous save in flight."""
        started = time.perf_counter()
        if self.best is not None and self.best.offer(self.state, figures, self.config_toml) is not None:
            self.goodput.checkpointed(time.perf_counter() - started)

    def finish(self) -> None:
        """The run's end, its last checkpoint saved: commit it; the memory tier's snapshots, older, are dropped."""
        self.commit()
        if self.memory is not None:
            self.memory.drop()

    def commit(self) -> None:
        """Commit the asynchronous save in flight, if any (a collective: every rank at the same step)."""
        saved = self.writer.finish()
        if saved is not None:
            self.committed(saved)

    def committed(self, path: Path) -> None:
        self.saved = path
        self.goodput.committed(checkpoint_step(path))

    # --- restoring ----------------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Load where the ranks agreed to start (a durable checkpoint, or the memory tier's snapshot once this
        node holds the files its ranks read), or a fresh run's initial weights (train.init_from)."""
        start = self.start
        if start.tier == "memory":
            wanted = files_to_read(start.path, self.state.state_dict(packed=True))
            _, fetched = fetch(start.path, start.held, wanted, start.node, self.rank, start.group)
            self.state.load(start.path, packed=True)
            self.console.print(
                f"resumed from the memory tier's snapshot {start.path} at step {self.state.step}"
                f"{f' ({size_text(fetched)} fetched from other nodes)' if fetched else ''}",
                soft_wrap=True,
                highlight=False,
            )
        elif start.path is not None:
            self.state.load(start.path)
            self.console.print(f"resumed from {start.path} at step {self.state.step}", soft_wrap=True, highlight=False)
        elif self.init_from:
            load_weights(resolve_checkpoint(self.init_from), self.state.parts)
            self.console.print(f"initialised weights from {self.init_from}")

    def rollback(self, step: int, reason: str) -> Path:
        """Go back to the newest checkpoint that still verifies (the weights and optimizer states and the step; the
        data stream and generators go on, so the batches since then are skipped), after bad step `step`. One damaged
        since it was written (its bytes would load silently) is set aside, as a resume sets it aside."""
        last, passed_over = newest_good_checkpoint(self.run_dir)
        set_aside(passed_over, self.is_main, self.console)
        if last is None:
            raise HlatError(f"step {step}: {reason}; every checkpoint to roll back to is damaged")
        self.state.load(last, data_and_rng=False)
        if self.memory is not None:
            self.memory.discard_after(self.state.step)
        return last

    def latest(self) -> Path | None:
        """The newest complete checkpoint of the run (of any process)."""
        return latest_checkpoint(self.run_dir)

    def close(self) -> None:
        self.writer.close()
        if self.memory is not None:
            self.memory.close()

    # --- room on the disk and in memory, before the first step -----------------------------------------------

    def check_memory(self) -> str | None:
        """What the memory tier costs each rank, for the log, once every node has room for it (refused in one line
        on every rank alike, one gather): the newest complete snapshot and the one being written, each of this
        rank's own state and (on several nodes) of its ward's copy, in node-local memory; and the copy of the state
        in host memory that each snapshot is written from."""
        if self.memory is None:
            return None
        node, root, mode = self.memory.node, self.memory.root, MODES[self.mode]
        # the weights as they are, the optimizer's states in proportion (none exist before the first step)
        size = {k: v * (1 + mode.optimizer_bytes / mode.weight_bytes) for k, v in self.state.nbytes(False).items()}
        kept = size["written_share"] * (4 if node.count > 1 else 2)
        try:
            root.mkdir(parents=True, exist_ok=True)
            unwritable = None
        except OSError as e:
            unwritable = f"cannot write {e.filename or root}: {e.strerror}"
        gathered = gather_objects((node.index, free_bytes(root), kept, unwritable))
        if problem := next((p for *_, p in gathered if p), None):
            raise HlatError(
                f"train.snapshot_dir: {problem}; point it at a directory of yours in node-local memory "
                "(a tmpfs), or set train.snapshot_every = 0 (off)"
            )
        for index in sorted({i for i, *_ in gathered}):
            free = next(f for i, f, *_ in gathered if i == index)
            needed = sum(k for i, _, k, _ in gathered if i == index)
            if free is not None and free < needed:
                raise HlatError(
                    f"train.snapshot_dir: {root.parent} on node {index} has {size_text(free)} free; the "
                    f"memory tier needs {size_text(needed)} there; free some, point train.snapshot_dir "
                    "at a larger tmpfs, or set train.snapshot_every = 0 (off)"
                )
        copies = "2 snapshots of its state" + (" and 2 of its buddy's" if node.count > 1 else "")
        return (
            f"memory tier: {size_text(kept)} per rank in {root.parent} ({copies}), and {size_text(size['held'])} "
            "of host memory for the copy each snapshot is written from"
        )

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
                raise HlatError(
                    f"not enough free space for the checkpoints of {self.run_dir}"
                    f"{f' (rank {rank})' if rank else ''}: {size_text(free)} free, {slots} x "
                    f"{size_text(share)} needed ({self.rotation_text()}); free some space or lower "
                    "train.keep_checkpoints"
                )
        free = gathered[0][1]
        if free is not None and free < wanted * size:
            return (
                f"warning: {self.run_dir} has room for {int(free // size)} of the {wanted} checkpoints of "
                f"{size_text(size)} this run will keep ({self.rotation_text()}); move or delete old ones as it runs"
            )
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
        return (
            f"train.keep_checkpoints = {self.keep}, and the one being written"
            if self.keep
            else "train.keep_checkpoints = 0 keeps every checkpoint"
        ) + ("; the best" if self.best is not None else "")


def checkpoint_bytes(resume_from: Path | None, n_params: int, mode: str) -> int:
    """The size of one of the run's checkpoints: the checkpoint it resumes from (its manifest's sizes), else the
    model's weights and optimizer states in its precision mode (the files' headers, the optimizer's settings and
    the trainer state add about 20 KB per parameter tensor: a few MB for a 7B model, a few percent of a tiny one)."""
    if resume_from is not None:
        return sum(size for size, _ in json.loads((resume_from / MANIFEST).read_text()).values())
    mode_bytes = MODES[mode]
    return n_params * (mode_bytes.weight_bytes + mode_bytes.optimizer_bytes)


def weights_finite(params: list[torch.Tensor]) -> bool:
    """Whether every rank's weights are finite (one all-reduce; run before each checkpoint). Each rank checks its
    own shards: a check of a sharded tensor as a whole would cost a collective per parameter."""
    flag = torch.tensor(
        float(all(bool(torch.isfinite(local(p).detach()).all()) for p in params)),
        device=params[0].device if params else "cpu",
    )
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
