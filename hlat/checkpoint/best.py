"""The best checkpoint by validation loss (eval.keep_best): kept apart from the rotation of `step_N` checkpoints.

At a validation where the chosen loss is the lowest so far, the run checkpoints its weights as
`checkpoints/best_step_N` (written and verified like any checkpoint: resume from it, evaluate or export it), then
`checkpoints/best.json` ({"step", "metric", "value", "checkpoint"}) names it, and the previous best goes.
`best_step_N` never matches the rotation's or `--resume auto`'s `step_N`, so neither touches or picks it. A
resumed run compares against best.json's value (a changed eval.keep_best starts the comparison afresh).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from hlat.checkpoint.durable import write_checkpoint
from hlat.checkpoint.state import TrainState
from hlat.files import write_text
from hlat.paths import checkpoint_root, step_name

BEST_FILE = "best.json"


class BestCheckpoint:
    def __init__(self, metric: str, run_dir: Path, rank: int, device: torch.device):
        self.metric, self.root, self.rank, self.device = metric, checkpoint_root(run_dir), rank, device
        self.value = best_so_far(self.root, metric)

    def offer(self, state: TrainState, figures: dict, config_toml: str) -> Path | None:
        """Checkpoint `state` as the best if `figures[metric]` is below the best so far (on every rank: a
        collective); the checkpoint written, or None."""
        step = state.step
        value = agreed(figures[self.metric], self.device)
        if not value < self.value:  # NaN is never the best
            return None
        final = self.root / step_name(step, best=True)
        write_checkpoint(final, state.state_dict(), config_toml, self.rank)
        if self.rank == 0:
            record = {"step": step, "metric": self.metric, "value": value, "checkpoint": final.name}
            # best.json names the new best before the old one goes
            write_text(self.root / BEST_FILE, json.dumps(record, indent=1) + "\n", self.root.parent)
            for old in self.root.glob("best_step_*"):
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        self.value = value
        return final


def best_so_far(root: Path, metric: str) -> float:
    """best.json's value, if it was kept by `metric`; else infinity."""
    try:
        record = json.loads((root / BEST_FILE).read_text())
    except (OSError, ValueError):
        return math.inf
    return float(record["value"]) if record.get("metric") == metric else math.inf


def agreed(value: float, device: torch.device) -> float:
    """The same value on every rank (each evaluates the same batches; a rounding apart must not split the
    decision to save, which is a collective)."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()
