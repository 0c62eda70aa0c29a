"""Room for what the run will keep, checked once before its first step (docs/fault-tolerance.md): the durable
tier's checkpoints on the run directory's disk (`check_disk`), and the memory tier's snapshots in node-local memory
(`check_memory`). Each decides on every rank alike (one gather): a checkpoint that would not fit is refused, since
refusing now costs nothing and a write that fails later costs the steps since the last good state; a memory tier
that would not fit is refused at a fresh start, and turned off at a restart, which goes on from the state it resumed
(`hlat.checkpoint.tiers.Tiers.room_for_memory`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hlat import HlatError
from hlat.checkpoint.memory import MemoryTier, kept_snapshots, tree_bytes
from hlat.checkpoint.state import TrainState
from hlat.files import free_bytes, size_text
from hlat.groups import gather_objects
from hlat.optim.modes import MODES
from hlat.paths import MANIFEST, checkpoint_root, complete_checkpoints


@dataclass(frozen=True)
class Rotation:
    """Which checkpoints a run keeps: the newest `keep` (0: all) of those saved every `every` steps up to step
    `last`, and the best one (eval.keep_best)."""

    run_dir: Path
    keep: int
    every: int
    last: int
    best: bool

    def slots(self, step: int) -> tuple[int, int]:
        """How many more checkpoints the disk must hold at once from `step` on (the rotation, less those already
        there; with eval.keep_best, the best and its successor while it is written, less a best already there), and
        how many the run will have written by its end when it keeps them all."""
        best = 2 - len(list(checkpoint_root(self.run_dir).glob("best_step_*"))) if self.best else 0
        if self.keep:
            return max(1, self.keep + 1 - len(complete_checkpoints(self.run_dir))) + best, 0
        ahead = self.last // self.every - step // self.every + (self.last % self.every > 0) if self.every else 1
        return 1 + best, max(1, ahead)

    def text(self) -> str:
        return (
            f"train.keep_checkpoints = {self.keep}, and the one being written"
            if self.keep
            else "train.keep_checkpoints = 0 keeps every checkpoint"
        ) + ("; the best" if self.best else "")


def checkpoint_bytes(resume_from: Path | None, n_params: int, mode: str) -> int:
    """The size of one of the run's checkpoints: the checkpoint it resumes from (its manifest's sizes), else the
    model's weights and optimizer states in its precision mode (the files' headers, the optimizer's settings and
    the trainer state add about 20 KB per parameter tensor: a few MB for a 7B model, a few percent of a tiny one)."""
    if resume_from is not None:
        return sum(size for size, _ in json.loads((resume_from / MANIFEST).read_text()).values())
    mode_bytes = MODES[mode]
    return n_params * (mode_bytes.weight_bytes + mode_bytes.optimizer_bytes)


def check_disk(rotation: Rotation, step: int, size: int, local_params: int) -> str | None:
    """Refuse a run whose checkpoints of `size` bytes do not fit: the rotation (plus the one being written; one save
    when all are kept) in the free space of rank 0's file system, and each rank's share of it (its `local_params` of
    all ranks') in its own. Returns a warning for the log when checkpoints kept all will outgrow the disk later."""
    slots, wanted = rotation.slots(step)
    gathered = gather_objects((local_params, free_bytes(checkpoint_root(rotation.run_dir))))
    everyone = sum(params for params, _ in gathered)
    for rank, (params, free) in enumerate(gathered):
        share = size if rank == 0 else size * params / max(everyone, 1)
        if free is not None and free < slots * share:
            raise HlatError(
                f"not enough free space for the checkpoints of {rotation.run_dir}"
                f"{f' (rank {rank})' if rank else ''}: {size_text(free)} free, {slots} x "
                f"{size_text(share)} needed ({rotation.text()}); free some space or lower "
                "train.keep_checkpoints"
            )
    free = gathered[0][1]
    if free is not None and free < wanted * size:
        return (
            f"warning: {rotation.run_dir} has room for {int(free // size)} of the {wanted} checkpoints of "
            f"{size_text(size)} this run will keep ({rotation.text()}); move or delete old ones as it runs"
        )
    return None


def check_memory(memory: MemoryTier, state: TrainState, mode: str) -> tuple[str, str | None]:
    """Whether every node has room for the memory tier: the newest complete snapshot and the one being written, each
    of this rank's own state and (on several nodes) of its ward's copy, in node-local memory, against the free space
    there and what this run's own snapshots already hold (a restart's newest snapshot is one of the two). Returns
    what the tier costs each rank, for the log (with the copy of the state in host memory that each snapshot is
    written from), and where a node lacks room, why (naming the other runs' snapshots there), else None."""
    node, root, mode_bytes = memory.node, memory.root, MODES[mode]
    # the weights as they are, the optimizer's states in proportion (none exist before the first step)
    scale = 1 + mode_bytes.optimizer_bytes / mode_bytes.weight_bytes
    size = {k: v * scale for k, v in state.nbytes(False).items()}
    kept = size["written_share"] * (4 if node.count > 1 else 2)
    try:
        root.mkdir(parents=True, exist_ok=True)
        unwritable = None
    except OSError as e:
        unwritable = f"cannot write {e.filename or root}: {e.strerror}"
    room = (free_bytes(root), tree_bytes(root)) if node.leader else None
    gathered = gather_objects((node.index, room, kept, unwritable, others_text(root) if node.leader else ""))
    if problem := next((p for *_, p, _ in gathered if p), None):
        raise HlatError(
            f"train.snapshot_dir: {problem}; point it at a directory of yours in node-local memory "
            "(a tmpfs), or set train.snapshot_every = 0 (off)"
        )
    copies = "2 snapshots of its state" + (" and 2 of its buddy's" if node.count > 1 else "")
    cost = (
        f"memory tier: {size_text(kept)} per rank in {root.parent} ({copies}), and {size_text(size['held'])} "
        "of host memory for the copy each snapshot is written from"
    )
    for index, (free, own), _, _, others in (g for g in gathered if g[1] is not None):  # each node's leader
        needed = sum(k for i, _, k, *_ in gathered if i == index)
        if free is not None and free + own < needed:
            held = f" (and this run's own snapshots {size_text(own)})" if own else ""
            return cost, (
                f"train.snapshot_dir: {root.parent} on node {index} has {size_text(free)} free{held}; the memory "
                f"tier needs {size_text(needed)} there{others}; free some (hlat snapshots --clear removes those no "
                "live job writes), point train.snapshot_dir at a larger tmpfs, or set train.snapshot_every = 0 (off)"
            )
    return cost, None


def others_text(root: Path) -> str:
    """The other runs' snapshots beside this run's directory of the tier (`root`), for the refusal: each with its size
    and whether a live job writes its run directory (`hlat snapshots`' lines)."""
    others = [k.text() for k in kept_snapshots(root.parent) if k.root != root]
    return f"; other runs' snapshots there: {'; '.join(others)}" if others else ""
