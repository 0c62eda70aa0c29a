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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

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


def model_state(parts: list[nn.Module]) -> dict:
    """The model's state dict by parameter name, merged over the parts (pipeline stages) this rank holds."""
    return {k: v for part in parts for k, v in get_model_state_dict(part).items()}


def optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    """Optimizer states keyed by parameter name (flattened), so they load into any other layout."""
    return {k: v for part, opt in zip(parts, optimizers)
            for k, v in get_optimizer_state_dict(part, opt, options=_FLAT).items()}


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def write_checkpoint(final: Path, state: dict, config_toml: str, rank: int = 0) -> Path:
    """Write `state` with DCP into `<final>.partial`, then rename it to `final` (rank 0 commits)."""
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    dcp.save(state, checkpoint_id=partial)
    if rank == 0:
        (partial / CONFIG_FILE).write_text(config_toml)
        if final.exists():  # re-saving the same step (a resumed run's final save): replace it
            shutil.rmtree(final)
        partial.rename(final)
    _barrier()
    return final


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(run_dir: str | Path, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                    trainer_state: dict, trainer_key: str, config_toml: str, keep: int = 0, rank: int = 0) -> Path:
    """Save model, optimizer and the JSON-serialisable trainer state (step, data position, RNG...) under
    `trainer_key` (one per rank when ranks hold different data positions, else one shared key)."""
    state = {"model": model_state(parts), "optim": optimizer_state(parts, optimizers),
             trainer_key: json.dumps(trainer_state)}
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


def load_checkpoint(path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer] | None = None,
                    trainer_key: str | None = None) -> dict:
    """Load into the model parts (and optimizers) in place, resharding to this layout whatever layout saved it;
    return the trainer state saved under `trainer_key` ({} if none)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if trainer_key and trainer_key not in saved:
        raise HlatError(f"{path}: has no trainer state {trainer_key!r}: it was saved by a different number of "
                        "ranks with per-rank data positions (parallel.data_sharding = 'files')")
    state: dict = {"model": model_state(parts)}
    if optimizers is not None:
        state["optim"] = optimizer_state(parts, optimizers)
    if trainer_key:
        state[trainer_key] = ""
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:  # DCP's errors are long and nested; the first line says what did not match
        raise HlatError(f"{path}: cannot load checkpoint: {str(e).strip().splitlines()[0]}") from None
    for i, part in enumerate(parts):
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        if optimizers is not None:
            set_optimizer_state_dict(part, optimizers[i], state["optim"], options=_FLAT)
    return json.loads(state[trainer_key]) if trainer_key else {}
