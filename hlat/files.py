"""A run directory's files: its metrics.jsonl read back (`read_metrics`, for the trainer,
`hlat compare` and `hlat plan --calibrate`), and the one way they are written (docs/fault-tolerance.md, "Failed
writes"), a failure's moment as its observer saw it (`record_seen`), and the record of the job that writes it
(`live_holder`: `writer.lock`, which `hlat.jobs.writer` keeps; `hlat snapshots` and the memory tier's room check read
it). Torch-free: the supervisor and the planner import it.

Checkpoints, metrics.jsonl, TensorBoard events, goodput.json and progress.json, restarts.jsonl, hang stamps,
config.toml and the tokenizer are all written inside `writing`: a write refused because the disk is full, the quota
is spent, the file system is read-only or the directory is not writable ends the run with one line naming the path,
the cause and the checkpoint the run can resume from (`WriteFailed`, exit code 2: `--max-restarts` does not retry
it, since the same start would fail the same way). The cause is found wherever it surfaces: torch.save reports a
full disk as `RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos`, with the ENOSPC only in its
context. Other I/O errors (EIO, a stale NFS handle) may be transient and keep their traceback and exit code 1:
retried.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hlat import ERROR_EXIT, HlatError
from hlat.paths import latest_checkpoint

# errors a restart cannot cure: the same write fails again until a person frees space or fixes permissions
REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
# the Rust `tokenizers` library reports an I/O error as a plain Exception ending in "(os error N)"
LOCK_FILE = "writer.lock"  # the job that writes a run directory (hlat.jobs.writer)
STALE_S = 300.0  # a record from another host not rewritten for this long is a dead job's
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def read_metrics(path: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, in order (blank lines skipped); a line that is not a JSON record with
    a step is a one-line HlatError naming the file and the line."""
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record["step"] = int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise HlatError(f"{path}:{n}: not a metrics record") from None
        records.append(record)
    return records


class WriteFailed(HlatError):
    """A run-directory write refused by the file system, in one line."""

    def __init__(self, path: Path, cause: OSError, run_dir: Path, what: str = ""):
        previous = latest_checkpoint(run_dir)
        super().__init__(
            f"cannot write {what}{path}: {cause.strerror}"
            + (f"; the previous checkpoint {previous} is intact" if previous else "; no checkpoint written yet")
        )
        self.cause = cause


def refused_write(e: BaseException | None) -> OSError | None:
    """The OSError of a refused write (REFUSED) behind `e`: `e` itself, its cause or context, or a rank's failure
    that torch's CheckpointException wraps (`failures`: {rank: (error, traceback)}), at any depth; else None."""
    seen, todo = set(), [e]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in REFUSED:
            return e
        if not isinstance(e, OSError) and (code := _RUST_OS_ERROR.search(str(e))) and int(code[1]) in REFUSED:
            return OSError(int(code[1]), os.strerror(int(code[1])))
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # duck-typed: the supervisor imports this module without torch
        if isinstance(failures, dict):
            todo += [failure[0] for failure in failures.values() if isinstance(failure, tuple)]
    return None


@contextlib.contextmanager
def writing(path: Path, run_dir: Path, what: str = ""):
    """Write `path` (a file of `run_dir`, or a directory of them) inside this: a refused write ends in WriteFailed."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException; an interrupt has no refused write
        cause = refused_write(e)
        if cause is None or isinstance(e, WriteFailed):
            raise
        raise WriteFailed(path, cause, run_dir, what) from None


def write_text(path: Path, text: str, run_dir: Path) -> None:
    """Replace `path` with `text` atomically (a reader never sees half of it; a failed write leaves the old one)."""
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, run_dir):
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def append_text(path: Path, text: str, run_dir: Path) -> None:
    """Append `text` to `path`, or nothing: a failed append is cut off again, so no half line stays behind."""
    with writing(path, run_dir):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start, data = os.lseek(fd, 0, os.SEEK_END), memoryview(text.encode())
            try:
                while data:
                    data = data[os.write(fd, data) :]
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)


SEEN_DIR = "failures"  # a run's failure records: `seen_<who>.json`, each observer's latest (hlat.train.recovery)


def record_seen(run_dir: Path, who: str, what: str) -> None:
    """`who` (rank<R>, the supervisor) saw the run's attempt fail now, as `what`. Best effort: the failure itself is
    the news, so a refused write here is passed over."""
    directory = Path(run_dir) / SEEN_DIR
    with contextlib.suppress(OSError, HlatError):
        directory.mkdir(parents=True, exist_ok=True)
        write_text(
            directory / f"seen_{who}.json",
            json.dumps({"at": round(time.time(), 3), "by": f"{who}: {what}"}),
            Path(run_dir),
        )


def free_bytes(directory: Path) -> int | None:
    """Bytes a user may still write on `directory`'s file system (its nearest existing parent's), or None where
    the file system does not report its size (some FUSE mounts say 0 of 0)."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    usage = shutil.disk_usage(directory)
    return usage.free if usage.total else None


def size_text(n: float) -> str:
    units, i = ("B", "KB", "MB", "GB", "TB"), 0
    while n >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


class _QuietRefusedWrites:
    """threading.excepthook, less the tracebacks of refused writes."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, args) -> None:
        if refused_write(args.exc_value) is None:
            self.previous(args)


def quiet_refused_writes_in_threads() -> None:
    """A writer thread (TensorBoard's) that dies of a refused write prints no traceback: the main thread meets the
    same error at its next flush and reports it in one line. Every other thread error prints as before."""
    if not isinstance(threading.excepthook, _QuietRefusedWrites):
        threading.excepthook = _QuietRefusedWrites(threading.excepthook)


def report_and_exit(error: WriteFailed) -> None:
    """From a background thread, which cannot raise into the run: the one line, then hlat's error exit."""
    print(f"hlat: error: {error}", file=sys.stderr, flush=True)
    os._exit(ERROR_EXIT)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@dataclass
class Holder:
    """A record in the lock file: who writes the run directory."""

    job: str
    host: str
    pid: int
    started: float
    heartbeat: float
    attempt: str = ""  # the attempt's namespace at the hlat service ('' elsewhere)

    def fresh(self) -> bool:
        """Alive, as far as the record can tell: a live process on this host, or a heartbeat within STALE_S."""
        if self.host == socket.gethostname():
            return pid_alive(self.pid)
        return time.time() - self.heartbeat < STALE_S

    def describe(self) -> str:
        job = f"job {self.job}, " if self.job else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (
            f"{job}pid {self.pid} on {self.host}, started {since}, last heard from "
            f"{max(0.0, time.time() - self.heartbeat):.0f} s ago"
        )


def live_holder(run_dir: str | Path) -> Holder | None:
    """The job writing `run_dir` by its record, if it is alive (a live process on this host, a heartbeat within
    STALE_S from another): read without taking the lock, so that looking never refuses a job that is starting."""
    try:
        holder = Holder(**json.loads((Path(run_dir) / LOCK_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return holder if holder.fresh() else None
