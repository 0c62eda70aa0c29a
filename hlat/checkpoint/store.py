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
import threading
import warnings
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.torch_version import TorchVersion

from hlat import HlatError
from hlat.files import refused_write
from hlat.parallel.mesh import gather_objects
from hlat.paths import (
    CONFIG_FILE,
    MANIFEST,
    checkpoint_root,
    checkpoint_step,
    complete_checkpoints,
    latest_checkpoint,
    resolve_checkpoint,
)

if TYPE_CHECKING:
    from rich.console import Console

STAGER_KEEPS_BUFFERS = TorchVersion(torch.__version__) >= "2.13"

# DCP warns on every call that no process group exists; single-process saving is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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
        raise DamagedCheckpoint(path, f"damaged checkpoint: unreadable {MANIFEST} ({_reason(e)})") from None
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


def _reason(e: BaseException) -> str:
    """The first line of the root cause of an error: a refused write wherever it surfaces (a full disk reaches
    torch.save's caller as a RuntimeError with the ENOSPC in its context), else what DCP's CheckpointException wraps
    (each rank's error)."""
    e = refused_write(e) or e
    if isinstance(e, (HlatError, RankWriteFailed)):  # a rank's reason, already in words
        return str(e)
    while isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}{f' ({e.filename})' if e.filename else ''}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__  # a KeyError's text is a key


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


def _partial(final: Path) -> Path:
    return final.with_name(final.name + ".partial")


class RankWriteFailed(Exception):
    """A rank's failed checkpoint write, gathered at the commit: its reason, and whether the file system refused
    it (a full disk, no permission) or the failure may pass (an I/O error, a stale NFS handle)."""

    def __init__(self, reason: str, refused: bool):
        super().__init__(reason)
        self.reason, self.refused = reason, refused

    @classmethod
    def of(cls, e: BaseException) -> RankWriteFailed:
        return cls(_reason(e), refused_write(e) is not None)

    def __reduce__(self):  # gathered across ranks: pickled with both fields
        return RankWriteFailed, (self.reason, self.refused)


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
            f"cannot write checkpoint {partial}: {_reason(e)}"
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


@dataclass
class _InFlight:
    final: Path
    config_toml: str
    stager: DefaultStager | None  # this save's own, closed once written
    written: threading.Event = field(default_factory=threading.Event)
    result: dict | RankWriteFailed | None = None  # this rank's digests once written, or its failure


class Checkpointer:
    """Writes a run's checkpoints and rotates them (`keep` newest, 0 keeps all).

    Asynchronous (train.async_checkpoint): `save` stalls training only to copy the state to host memory
    (pinned on CUDA), DCP writes it in a background thread, and this rank checksums its files there too.
    `finish` commits it (manifest, rename, rotation): a collective, so the loop calls it on every rank at the
    same step, once all ranks report `written` (riding on the step's all-reduce), or before the next save and
    at the end. At most one save is in flight; until committed it is only a `.partial` directory."""

    def __init__(
        self, run_dir: str | Path, keep: int, rank: int, asynchronous: bool, pinned: bool, timeout_s: float = 600.0
    ):
        """`timeout_s`: how long a collective of the background write may wait (train.collective_timeout_s)."""
        self.root, self.keep, self.rank = checkpoint_root(run_dir), keep, rank
        self.staging = (
            StagingOptions(
                use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=pinned
            )
            if asynchronous
            else None
        )
        # one stager for the run keeps its host buffers, so a save stalls only for the copy; torch < 2.13 empties
        # a stager's copy tables after each stage (the next stage on it fails), so there each save gets its own
        self.stager = DefaultStager(self.staging) if asynchronous and STAGER_KEEPS_BUFFERS else None
        self.in_flight: _InFlight | None = None
        # the background write runs collectives of its own: on a group of its own, never interleaved with the
        # training loop's collectives on the default group
        self.group = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            if asynchronous and dist.is_initialized()
            else None
        )

    def save(self, step: int, state: dict, config_toml: str) -> Path | None:
        """Save `state` (a state dict) as step `step`'s checkpoint. Returns it, or None while an asynchronous save
        is still being written."""
        final = self.root / f"step_{step:08d}"
        if self.staging is None:
            write_checkpoint(final, state, config_toml, self.rank)
            self._rotate(step)
            return final
        self.finish()
        stager = self.stager or DefaultStager(self.staging)
        with _writing(final, self.rank):
            _begin(_partial(final), self.rank)
            future = dcp.async_save(state, checkpoint_id=_partial(final), async_stager=stager, process_group=self.group)
        flight = self.in_flight = _InFlight(final, config_toml, None if self.stager else stager)
        future.add_done_callback(lambda f: self._written(f, flight))
        return None

    def _written(self, future, flight: _InFlight) -> None:  # in DCP's writer thread
        try:
            future.result()
            flight.result = _own_digests(_partial(flight.final), self.rank)
        except BaseException as e:  # reported by finish, on every rank
            flight.result = RankWriteFailed.of(e)
        if flight.stager is not None:
            flight.stager.close()
        flight.written.set()

    def written(self) -> bool:
        return self.in_flight is not None and self.in_flight.written.is_set()

    def finish(self) -> Path | None:
        """Wait for the save in flight and commit it; None if there is none."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return None
        flight.written.wait()
        with _writing(flight.final, self.rank):
            _commit(flight.final, flight.result, flight.config_toml, self.rank)
        self._rotate(checkpoint_step(flight.final))
        return flight.final

    def close(self) -> None:
        """Release the run's stager and its host memory (a save still in flight is left uncommitted: `.partial`)."""
        if self.stager is not None:
            self.stager.close()

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
    """Load checkpoint `path` into `state` (a state dict of the entries to read, as `TrainState.state_dict` makes
    them) in place, resharding to this layout whatever layout saved it; an unreadable one raises DamagedCheckpoint."""
    try:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as e:
        raise DamagedCheckpoint(path, f"cannot read its .metadata: {_reason(e)}") from None
    for key in state:
        if key.startswith("trainer") and key not in saved:
            raise HlatError(
                f"{path}: has no trainer state {key!r}: it was saved by a different number of ranks "
                "with per-rank data positions (parallel.data_sharding = 'files')"
            )
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # DCP's errors are long and nested (and BaseExceptions)
        raise DamagedCheckpoint(path, f"cannot load checkpoint: {_reason(e)}") from None
