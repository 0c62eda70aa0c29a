"""Where a run's files are and what they are called, the one module that knows: its checkpoints,
`<run>/checkpoints/step_XXXXXXXX` (complete: renamed from `.partial` only once committed) and `best_step_XXXXXXXX`
(eval.keep_best), each holding the job's config and a manifest; the run's token beside them; and its memory tier's
directory in node-local memory, whose snapshots are named as checkpoints are. Torch-free."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from hlat import HlatError

CONFIG_FILE = "config.toml"  # the job's config, written into every checkpoint so it is self-describing
MANIFEST = "manifest.json"  # {file name: [size, crc32]} of every other file; its presence marks a finished write
TOKEN_FILE = "run_token"  # in <run>/checkpoints: the run's identity, which its memory snapshots carry
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_ANY_STEP_DIR = re.compile(r"^(?:best_)?step_(\d{8})$")  # the best checkpoint (eval.keep_best) too


def step_name(step: int, best: bool = False) -> str:
    """The directory name of a checkpoint or snapshot of `step` (`best`: eval.keep_best's)."""
    return f"{'best_' if best else ''}step_{step:08d}"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The `step_N` directories directly under `root`, by step."""
    return (
        sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))) if root.is_dir() else []
    )


def snapshot_root(snapshot_dir: str | Path, run_dir: str | Path) -> Path:
    """A run's directory in node-local memory (train.snapshot_dir): one per run directory (its name and a hash of its
    path)."""
    run = Path(run_dir).resolve()
    return Path(snapshot_dir) / f"{run.name}-{hashlib.sha1(str(run).encode()).hexdigest()[:12]}"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    return step_dirs(checkpoint_root(run_dir))


def checkpoint_step(path: Path) -> int | None:
    """The step a run's checkpoint was saved at (from its name, step_N or best_step_N); None for another (an
    import)."""
    match = _ANY_STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1][1] if done else None


def _is_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file() or (path / MANIFEST).is_file()


def _holds_none(run_dir: Path) -> HlatError:
    return HlatError(f"{run_dir}: holds no complete checkpoint (looked for {checkpoint_root(run_dir)}/step_*)")


def checkpoints_in(path: str | Path) -> list[Path]:
    """[path] for a checkpoint directory, or every checkpoint of a run directory by step: its `step_N` ones and
    its best one (`best_step_N`, eval.keep_best), which follows the `step_N` of the same step."""
    path = Path(path)
    if _is_checkpoint(path):
        return [path]
    best = sorted(checkpoint_root(path).glob("best_step_" + "[0-9]" * 8))
    found = sorted(
        [*(p for _, p in complete_checkpoints(path)), *best],
        key=lambda p: (checkpoint_step(p), p.name.startswith("best_")),
    )
    if not found:
        raise _holds_none(path)
    return found


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint path or a run directory (its latest `step_N` checkpoint)."""
    path = Path(path)
    if _is_checkpoint(path):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise _holds_none(path)
    return latest
