"""Checkpoints with torch.distributed.checkpoint, committed atomically.

A checkpoint is written into `<run>/checkpoints/step_XXXXXXXX.partial` and renamed to `step_XXXXXXXX` only
once every file is on disk, so a directory without the suffix is always complete; a crash mid-save leaves
a `.partial` directory that is ignored and cleaned up by the next save.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hlat import HlatError

CONFIG_FILE = "config.toml"  # the job's config, written into every checkpoint so it is self-describing
_STEP_DIR = re.compile(r"^step_(\d{8})$")

# DCP warns on every call that no process group exists; single-process saving is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(run_dir)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))] if root.is_dir() else []
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1][1] if done else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint path or a run directory (its latest complete checkpoint)."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise HlatError(f"{path}: holds no complete checkpoint (looked for {checkpoint_root(path)}/step_*)")
    return latest


def _rank_key(rank: int) -> str:
    return f"trainer_rank{rank}"


def write_checkpoint(final: Path, state: dict, config_toml: str, rank: int = 0) -> Path:
    """Write `state` with DCP into `<final>.partial`, then rename it to `final` (rank 0 commits)."""
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dcp.save(state, checkpoint_id=partial)
    if rank == 0:
        (partial / CONFIG_FILE).write_text(config_toml)
        if final.exists():  # re-saving the same step (a resumed run's final save): replace it
            shutil.rmtree(final)
        partial.rename(final)
    return final


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    trainer_state: dict, config_toml: str, keep: int = 0, rank: int = 0) -> Path:
    """Save model, optimizer and this rank's JSON-serialisable trainer state (step, data position, RNG...)."""
    state: dict = {_rank_key(rank): json.dumps(trainer_state)}
    if optimizer is None:
        state["model"] = model.state_dict()
    else:
        state["model"], state["optim"] = get_state_dict(model, optimizer)
    root = checkpoint_root(run_dir)
    final = write_checkpoint(root / f"step_{step:08d}", state, config_toml, rank)
    if rank == 0:
        _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    for stale in root.glob("*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    done = complete_checkpoints(root.parent)
    for _, path in done[: max(0, len(done) - keep)] if keep else []:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    rank: int = 0) -> dict:
    """Load into `model` (and `optimizer`) in place; return this rank's trainer state ({} if none saved)."""
    state: dict = {}
    if optimizer is None:
        state["model"] = model.state_dict()
    else:
        state["model"], state["optim"] = get_state_dict(model, optimizer)
    has_trainer_state = _rank_key(rank) in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if has_trainer_state:
        state[_rank_key(rank)] = ""
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:  # DCP's errors are long and nested; the first line says what did not match
        raise HlatError(f"{path}: cannot load checkpoint: {str(e).strip().splitlines()[0]}") from None
    if optimizer is None:
        model.load_state_dict(state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads(state[_rank_key(rank)]) if has_trainer_state else {}
