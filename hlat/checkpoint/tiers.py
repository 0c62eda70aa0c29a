"""The run's saved state in both tiers, the one object the trainer asks to save and restore (`Tiers`): when to save
(a durable checkpoint every `train.ckpt_every` steps, which replica groups take in turns, at the last step, on a
stop signal and, eval.keep_best, at a validation with the lowest loss so far; a memory snapshot at its cadence),
committing background writes once every rank has written its part, what to restore at the start (where the ranks
agreed to start, or train.init_from's weights) and on a rollback (the newest checkpoint that still verifies). The
state is the trainer's `TrainState`; each save's stall and commit are told to a `SaveLog` (the run's goodput).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from rich.console import Console

from hlat import HlatError
from hlat.checkpoint.background import BackgroundWriter
from hlat.checkpoint.best import BestCheckpoint
from hlat.checkpoint.cadence import STALL_SHARE, SnapshotCadence
from hlat.checkpoint.durable import DurableTier, newest_good_checkpoint, set_aside
from hlat.checkpoint.memory import MemoryTier
from hlat.checkpoint.memory_restore import fetch, files_to_read
from hlat.checkpoint.room import Rotation, check_memory
from hlat.checkpoint.start import Start
from hlat.checkpoint.state import TrainState, load_weights
from hlat.config.job import Config
from hlat.dtensor import local
from hlat.files import size_text
from hlat.groups import side_group
from hlat.paths import checkpoint_step, latest_checkpoint, resolve_checkpoint, snapshot_root


class SaveLog(Protocol):
    """Who is told what saving costs and what is safe (the run's goodput: `hlat.train.goodput.Goodput`)."""

    def saving(self, step: int) -> None:
        """A checkpoint of `step` is about to be written."""

    def stalled(self, seconds: float) -> None:
        """Training stalled `seconds` for a save or a snapshot."""

    def committed(self, step: int) -> None:
        """The durable checkpoint of `step` is complete."""


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


class Tiers:
    """A run's saved state in both tiers (see the module's docstring). `saved` is the newest committed durable
    checkpoint of this process."""

    def __init__(
        self,
        cfg: Config,
        topo,
        device: torch.device,
        state: TrainState,
        log: SaveLog,
        console: Console,
        start: Start,
        takes_turn: Callable[[int], bool] | None = None,
    ):
        """`topo`: where this rank sits (`hlat.parallel.Topology`); `start`: where the ranks agreed to start
        (`hlat.checkpoint.start.decide_start`); `takes_turn(k)`: whether this process writes the k-th periodic
        checkpoint (replica groups take them in turns: `ReplicaGroups.takes_turn`), None: every one."""
        settings, pinned = cfg.train, device.type == "cuda"
        self.state, self.log, self.console, self.start = state, log, console, start
        self.takes_turn = takes_turn or (lambda _: True)
        self.rank, self.is_main, self.init_from = topo.rank, topo.is_main, settings.init_from
        self.run_dir, self.config_toml = Path(settings.run_dir), cfg.to_toml()
        self.rotation = Rotation(
            self.run_dir, settings.keep_checkpoints, settings.ckpt_every, settings.steps, bool(cfg.eval.keep_best)
        )
        # asynchronous checkpoints write on a CPU group of their own, never interleaved with the training's
        timeout_s = settings.collective_timeout_s
        writer = (
            BackgroundWriter(pinned, side_group(timeout_s), timeout_s, dcp_format=True)
            if settings.async_checkpoint
            else None
        )
        self.durable = DurableTier(self.run_dir, settings.keep_checkpoints, topo.rank, self.config_toml, writer)
        self.memory = (
            MemoryTier(
                snapshot_root(settings.snapshot_dir, settings.run_dir),
                str(self.run_dir.resolve()),
                start.token,
                topo.rank,
                start.node,
                BackgroundWriter(pinned, start.group, timeout_s),
                self.config_toml,
                SnapshotCadence(settings.snapshot_every),
            )
            if settings.snapshot_every
            else None
        )
        self.best = BestCheckpoint(cfg.eval.keep_best, self.run_dir, topo.rank, device) if cfg.eval.keep_best else None
        self.saved: Path | None = None

    # --- saving ---------------------------------------------------------------------------------------------

    def due(self, step: int, stopping: bool) -> bool:
        every = self.rotation.every
        periodic = bool(every and step % every == 0) and self.takes_turn(step // every)
        return periodic or step == self.rotation.last or stopping

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
        self.log.saving(step)
        saved = self.durable.save(step, self.state.state_dict(), started)
        self.log.stalled(time.perf_counter() - started)
        if saved is not None:
            self.committed(saved)
        elif commit_now:
            self.commit()

    def snapshot_due(self, step: int) -> bool:
        return self.memory is not None and self.memory.cadence.due(step)

    def snapshot(self) -> None:
        """The memory tier's snapshot of the state at its step: training stalls for the copy to host memory."""
        started = time.perf_counter()
        self.memory.save(self.state.step, self.state.state_dict(packed=True), started)
        self.log.stalled(time.perf_counter() - started)

    def writes(self) -> Writes:
        """This rank's part of the background writes in flight: done or not."""
        memory = self.memory
        return Writes(
            self.durable.written(), memory is not None and memory.written(), memory is not None and memory.failed()
        )

    def commit_written(self, agreed: Writes, step_s: float) -> None:
        """After a step (of `step_s` seconds), commit what every rank has written (a collective: every rank at the
        same step). A failed snapshot turns the memory tier off for the rest of this process; the durable tier
        goes on."""
        if self.memory is not None:
            self.memory.cadence.stepped(step_s)
        if agreed.checkpoint:
            self.commit()
        if agreed.snapshot:
            self.memory_failed(self.memory.commit(agreed.snapshot_failed))
        elif self.memory is not None and self.memory.writer.in_flight is not None:  # not all written: wait for them
            started = time.perf_counter()
            self.memory_failed(self.memory.settle())
            self.log.stalled(time.perf_counter() - started)
        if self.memory is not None and self.memory.cadence.tune_due():
            self.tune_snapshots()

    def tune_snapshots(self) -> None:
        """train.snapshot_every = -1: the snapshots' measured cost sets their cadence, said where it changes."""
        cadence = self.memory.cadence
        before = cadence.every
        every, cost, step_s = cadence.tune()
        if every != before:
            self.console.print(
                f"memory tier: a snapshot every {every} step{'s' if every > 1 else ''} "
                f"(train.snapshot_every = -1: one costs {cost * 1e3:.0f} ms, {cost / step_s:.1%} of a "
                f"{step_s * 1e3:.0f} ms step; the goal is under {STALL_SHARE:.0%})",
                highlight=False,
            )

    def memory_failed(self, failure: str | None) -> bool:
        """Turn the memory tier off after a failed snapshot write (`failure`, on every rank alike); True if so."""
        if failure:
            self.memory_off(f"a snapshot write failed ({failure})")
        return bool(failure)

    def room_for_memory(self, mode: str) -> str | None:
        """Before the first step (on every rank): what the memory tier costs per rank, for the log, where every node
        has room for it (`hlat.checkpoint.room.check_memory`). Where a node has not, a fresh start is refused in one
        line; a restart (whose tier may have turned itself off in the attempt before) goes on from the state it
        resumed without the tier, in one warning: refusing it would end the job for good."""
        if self.memory is None:
            return None
        cost, shortfall = check_memory(self.memory, self.state, mode)
        if shortfall is None:
            return cost
        if not self.start.resuming:
            raise HlatError(shortfall)
        self.memory_off(shortfall)
        return None

    def memory_off(self, reason: str) -> None:
        """Turn the memory tier off for the rest of this process (on every rank alike), saying why in one line, and
        free the node's memory it held."""
        self.console.print(
            f"warning: the memory tier is off for the rest of this process: {reason}; checkpoints go on every "
            "train.ckpt_every steps",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )
        self.memory.drop()
        self.memory.close()
        self.memory = None

    def metric_fields(self) -> dict:
        """For a metrics record: the memory tier's cadence and the measured cost of its newest snapshot."""
        return self.memory.cadence.metric_fields() if self.memory is not None else {}

    def keep_best(self, figures: dict) -> None:
        """After a validation (on every rank): eval.keep_best's checkpoint of the state, if `figures` hold the
        lowest loss so far. Written synchronously, apart from any asynchronous save in flight."""
        started = time.perf_counter()
        if self.best is not None and self.best.offer(self.state, figures, self.config_toml) is not None:
            self.log.stalled(time.perf_counter() - started)

    def finish(self) -> None:
        """The run's end, its last checkpoint saved: commit it; the memory tier's snapshots, older, are dropped."""
        self.commit()
        if self.memory is not None:
            self.memory.drop()

    def commit(self) -> None:
        """Commit the asynchronous save in flight, if any (a collective: every rank at the same step)."""
        saved = self.durable.finish()
        if saved is not None:
            self.committed(saved)

    def committed(self, path: Path) -> None:
        self.saved = path
        self.log.committed(checkpoint_step(path))

    # --- restoring ----------------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Load where the ranks agreed to start (a durable checkpoint, or the memory tier's snapshot once this
        node holds the files its ranks read), or a fresh run's initial weights (train.init_from); a resume with
        nothing to load says so."""
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
        if start.path is None and start.resuming:  # --resume auto, or a restarted worker, with nothing to go on from
            self.console.print(
                f"nothing complete to resume from in {self.run_dir} (no checkpoint, no snapshot): starting at step 0",
                soft_wrap=True,
                highlight=False,
            )

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
        self.durable.close()
        if self.memory is not None:
            self.memory.close()


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
