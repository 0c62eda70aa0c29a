"""Checkpoints with torch.distributed.checkpoint, committed atomically.

A checkpoint is written into `<run>/checkpoints/step_XXXXXXXX.partial` and renamed to `step_XXXXXXXX` only
once every file is on disk, so a directory without the suffix is always complete; a crash mid-save leaves
a `.partial` directory that is ignored and cleaned up by the next save.

Before the rename, a manifest (`manifest.json`: every file's size and CRC-32, each rank checksumming the files
it wrote) is written last; `verify_checkpoint` checks it, so a checkpoint damaged after it was written (a
flipped byte, a truncated, emptied or missing file, an edited trainer state) is never loaded silently.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hlat import HlatError
from hlat.checkpoint.background import BackgroundWriter, RankWriteFailed, failure_reason
from hlat.checkpoint.raw import Reader
from hlat.files import refused_write
from hlat.groups import gather_objects
from hlat.paths import (
    CONFIG_FILE,
    MANIFEST,
    checkpoint_root,
    checkpoint_step,
    complete_checkpoints,
    latest_checkpoint,
    resolve_checkpoint,
    step_name,
)

if TYPE_CHECKING:
    from rich.console import Console


class DamagedCheckpoint(HlatError):
    """A checkpoint whose files do not match its manifest (or cannot be read)."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


def quarantine(path: Path) -> Path:
    """Rename a damaged checkpoint to `<name>.damaged`: kept for inspection, never loaded or rotated."""
    target = path.with_name(path.name + ".damaged")
    shutil.rmtree(target, ignore_errors=True)
    path.rename(target)
    return target


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def digests(directory: Path, names: list[str]) -> dict:
    return {name: [(directory / name).stat().st_size, _crc32(directory / name)] for name in names}


def verify_checkpoint(path: Path) -> None:
    """Raise DamagedCheckpoint (one line naming the checkpoint and the first problem) unless every file the
    manifest lists is present with its recorded size and checksum."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(path, f"damaged checkpoint: unreadable {MANIFEST} ({failure_reason(e)})") from None
    for name, (size, crc) in sorted(manifest.items()):
        file = path / name
        if not file.is_file():
            problem = "is missing"
        elif file.stat().st_size != size:
            problem = f"has {file.stat().st_size} bytes, {size} were written"
        elif _crc32(file) != crc:
            problem = "does not match its checksum"
        else:
            continue
        raise DamagedCheckpoint(path, f"damaged checkpoint: {name} {problem}")


def newest_good_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[DamagedCheckpoint]]:
    """The newest `step_N` checkpoint of a run that verifies against its manifest (None if none does), and the
    damaged ones newer than it, passed over to find it."""
    passed_over = []
    for _, path in reversed(complete_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path, passed_over
        except DamagedCheckpoint as e:
            passed_over.append(e)
    return None, passed_over


def set_aside(damaged: list[DamagedCheckpoint], is_main: bool, console: Console) -> None:
    """Report each damaged checkpoint passed over and quarantine it (so that rotation counts only good ones and a
    re-save of its step starts clean), once every rank has verified it."""
    for e in damaged:
        console.print(f"{e}; falling back to the previous checkpoint", soft_wrap=True, highlight=False, markup=False)
    _barrier()
    if is_main:
        for e in damaged:
            quarantine(e.path)


def verified_checkpoint(path: str | Path) -> Path:
    """`resolve_checkpoint(path)` once it matches its manifest: what every reader of a checkpoint loads (a damaged
    one raises DamagedCheckpoint, one line)."""
    checkpoint = resolve_checkpoint(path)
    verify_checkpoint(checkpoint)
    return checkpoint


def write_checkpoint(final: Path, state: dict, config_toml: str, rank: int = 0) -> Path:
    """Write `state` with DCP into `<final>.partial`, add the manifest, then rename it to `final` (rank 0
    commits). A failed write (a full disk, an unwritable directory) raises a one-line HlatError naming the path
    and the cause; the `.partial` directory is removed and every earlier checkpoint is left as it was."""
    partial = _partial(final)
    with _writing(final, rank):
        _begin(partial, rank)
        dcp.save(state, checkpoint_id=partial)
        _commit(final, _own_digests(partial, rank), config_toml, rank)
    return final


PARTIAL = ".partial"


def _partial(final: Path) -> Path:
    return final.with_name(final.name + PARTIAL)


@contextlib.contextmanager
def _writing(final: Path, rank: int):
    """A failed write removes the `.partial` directory. A refused one ends the run in one line, exit code 2 (the
    same start would fail the same way); any other keeps its traceback and exit code 1, which restarts retry."""
    partial = _partial(final)
    try:
        yield
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        refused = e.refused if isinstance(e, RankWriteFailed) else refused_write(e) is not None
        if not refused:
            raise
        previous = latest_checkpoint(final.parent.parent) if final.parent.name == "checkpoints" else None
        raise HlatError(
            f"cannot write checkpoint {partial}: {failure_reason(e)}"
            f"{f'; the previous checkpoint {previous} is intact' if previous else ''}"
        ) from None


def _begin(partial: Path, rank: int) -> None:
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()


def _own_digests(partial: Path, rank: int) -> dict:
    return digests(partial, sorted(p.name for p in partial.glob(f"__{rank}_*")))  # the files this rank wrote


def _commit(final: Path, own: dict | RankWriteFailed, config_toml: str, rank: int) -> None:
    """Gather every rank's digests (or its failure), write the manifest last and rename (rank 0)."""
    partial = _partial(final)
    gathered = gather_objects(own)
    if failures := [g for g in gathered if isinstance(g, RankWriteFailed)]:
        raise failures[0]
    if rank == 0:
        (partial / CONFIG_FILE).write_text(config_toml)
        manifest = {k: v for d in gathered for k, v in d.items()} | digests(partial, [".metadata", CONFIG_FILE])
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=0, sort_keys=True))
        if final.exists():  # re-saving the same step (a resumed run's final save): replace it
            shutil.rmtree(final)
        partial.rename(final)
    _barrier()


class DurableTier:
    """Writes a run's checkpoints and rotates them (`keep` newest, 0 keeps all).

    With a background writer (train.async_checkpoint), `save` stalls training only to copy the state to host
    memory; the writer process writes it, checksumming this rank's files as it writes them. `finish` commits it
    (manifest, rename, rotation): a collective, so the run calls it on every rank at the same step, once all ranks
    report `written` (riding on the step's all-reduce), or before the next save and at the end. At most one save is in
    flight; until committed it is only a `.partial` directory."""

    def __init__(self, run_dir: str | Path, keep: int, rank: int, config_toml: str, writer: BackgroundWriter | None):
        self.root, self.keep, self.rank, self.config_toml = checkpoint_root(run_dir), keep, rank, config_toml
        self.writer = writer

    def save(self, step: int, state: dict, started: float) -> Path | None:
        """Save `state` (a state dict, taken since `started`) as step `step`'s checkpoint. Returns it, or None while
        it is written in the background."""
        final = self.root / step_name(step)
        if self.writer is None:
            write_checkpoint(final, state, self.config_toml, self.rank)
            self._rotate(step)
            return final
        self.finish()
        partial = _partial(final)
        with _writing(final, self.rank):
            _begin(partial, self.rank)
            self.writer.start(state, partial, lambda _, digests: digests, started)
        return None

    def written(self) -> bool:
        return self.writer is not None and self.writer.written()

    def finish(self) -> Path | None:
        """Wait for the save in flight and commit it; None if there is none."""
        flight = self.writer.take() if self.writer is not None else None
        if flight is None:
            return None
        final = flight.target.with_name(flight.target.name.removesuffix(PARTIAL))
        with _writing(final, self.rank):
            _commit(final, flight.failure or flight.result, self.config_toml, self.rank)
        self._rotate(checkpoint_step(final))
        return final

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _rotate(self, newest: int) -> None:
        if self.rank == 0:
            _prune(self.root, self.keep, newest)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _prune(root: Path, keep: int, newest: int) -> None:
    """Keep the `keep` newest checkpoints up to step `newest` (just written, so known good); later ones are
    from a timeline the run abandoned (damaged, or rolled back from) and go too."""
    for stale in root.glob("*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    done = complete_checkpoints(root.parent)
    good = [(s, p) for s, p in done if s <= newest]
    for _, path in [(s, p) for s, p in done if s > newest] + (good[: max(0, len(good) - keep)] if keep else []):
        shutil.rmtree(path, ignore_errors=True)


def read_checkpoint(path: Path, state: dict) -> None:
    """Load checkpoint `path` (or a memory snapshot) into `state` (a state dict of the entries to read, as
    `TrainState.state_dict` makes them) in place, resharding to this layout whatever layout saved it; an unreadable
    one raises DamagedCheckpoint."""
    try:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as e:
        raise DamagedCheckpoint(path, f"cannot read its .metadata: {failure_reason(e)}") from None
    for key in state:
        if key.startswith("trainer") and key not in saved:
            raise HlatError(
                f"{path}: has no trainer state {key!r}: it was saved by a different number of ranks "
                "with per-rank data positions (parallel.data_sharding = 'files')"
            )
    try:
        dcp.load(state, storage_reader=Reader(path))
    except (Exception, CheckpointException) as e:  # DCP's errors are long and nested (and BaseExceptions)
        raise DamagedCheckpoint(path, f"cannot load checkpoint: {failure_reason(e)}") from None
