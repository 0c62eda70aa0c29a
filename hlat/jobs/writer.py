"""One live writer per run directory (docs/fault-tolerance.md, "One job per run directory").

`hlat train` claims `<run>/writer.lock` before it writes anything in the run directory: rank 0 of the job (the
only process without torchrun) takes an exclusive `fcntl.flock` on it, holds it open for the process's lifetime
and keeps a record in it (job, host, pid, start, heartbeat). The kernel, or the file server, drops the lock of
a process that dies however it dies (kill -9 included), so a crashed job never blocks its restart; the record
names the holder in the refusal, and across hosts it says whether the holder is still alive where the file
system's locks cannot be trusted (Lustre mounted `localflock` or `noflock`, NFS mounted with local locks).

A job is what all its ranks and restarts share (`job_id`): the other ranks of a job never take the lock, and a
restart of the same job whose earlier start's lock has not lapsed yet (a lost node's lock lives until the file
server notices: NFSv4's lease, Lustre's eviction) waits for it instead of being refused. At the hlat service, where
each attempt of a job has a namespace of its own and its ranks hold leases (a rank that cannot renew its lease ends:
hlat.parallel.lease), a later attempt does not wait for an earlier attempt's lock: that attempt's ranks have all ended
or fenced themselves, so the lost first host costs no more than another; it writes its record, and takes the lock
when the file server lets go of it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from hlat import SERVICE_NAMESPACE_ENV, HlatError
from hlat.files import LOCK_FILE, STALE_S, Holder, writing

HEARTBEAT_S = 30.0  # how often the holder rewrites its record
OWN_WAIT_S = 300.0  # how long a restart waits for its own job's earlier lock to lapse (NFSv4's lease is 90 s)
POLL_S = 0.5
NO_LOCKS = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK}  # a file system without flock (Lustre `noflock`)


def job_id() -> str:
    """What every rank and every restart of one job share: the SLURM job (a requeued job keeps it), else torchrun's
    run id (its --rdzv-id; `--standalone` draws one per launch, which its own restarts keep); '' for a process
    started alone."""
    if slurm := os.environ.get("SLURM_JOB_ID"):
        return f"slurm {slurm}"
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun {run}" if run and run != "none" else ""  # torchrun's default rdzv id is "none"


def node_local_locks(path: Path) -> str:
    """Why flock on `path` reaches only this host ('' where it reaches every host that mounts it: local disks, NFS
    and Lustre mounted `flock`, as FSx for Lustre's guide mounts it): Lustre mounted `localflock`, NFS mounted
    with `local_lock=flock|all` or `nolock` (from /proc/self/mounts; '' where it cannot be read)."""
    try:
        mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return ""
    target = os.path.realpath(path)
    under = [m for m in mounts if len(m) >= 4 and (target == m[1] or target.startswith(m[1].rstrip("/") + "/"))]
    if not under:
        return ""
    point, kind, options = max(under, key=lambda m: len(m[1]))[1:4]
    options = set(options.split(","))
    if kind == "lustre" and "localflock" in options:
        return f"{point} is Lustre mounted localflock: file locks reach only this node"
    if kind.startswith("nfs") and options & {"local_lock=flock", "local_lock=all", "nolock"}:
        return f"{point} is NFS mounted with local locks: file locks reach only this node"
    return ""


class RunDirLock:
    """The claim on a run directory, held from `acquire` to `release` (or the process's end); `fenced`: the job's
    ranks hold leases (train.lease_s > 0), so an earlier attempt at the service has ended when a later one starts."""

    def __init__(self, run_dir: str | Path, fenced: bool = False):
        self.run_dir, self.fd, self.fenced, self.locked = Path(run_dir), -1, fenced, True
        attempt = os.environ.get(SERVICE_NAMESPACE_ENV, "")
        self.me = Holder(job_id(), socket.gethostname(), os.getpid(), time.time(), time.time(), attempt)
        self.stop = threading.Event()
        self.beating = threading.Thread(target=self._beat, name="hlat-writer-heartbeat", daemon=True)

    def acquire(self) -> None:
        self.created = not self.run_dir.exists()  # a start that fails its checks then leaves no directory behind
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise HlatError(f"train.run_dir: cannot write {e.filename or self.run_dir}: {e.strerror}") from None
        try:
            self._claim()
            with writing(self.run_dir / LOCK_FILE, self.run_dir):  # a full disk: one line
                self._write()
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise
        self.beating.start()

    def _claim(self) -> None:
        """Take the lock, or refuse in one line naming the job that holds it."""
        locked, holder = self._try_lock(), self._read()
        same_job = bool(holder and self.me.job and holder.job == self.me.job)
        if locked is False and same_job and self._fenced(holder):
            return
        if locked is False and same_job:
            if not self._wait_for_own(holder):  # this job's earlier start, dead, its lock not yet lapsed...
                raise HlatError(
                    f"train.run_dir: {self.run_dir} is still held by an earlier start of this job "
                    f"({holder.describe()}) after {OWN_WAIT_S:.0f} s: it lives on; stop it, then start "
                    "again"
                )  # ...or alive after all (a requeue while the old job lingers)
            return
        if locked is False:
            silent = holder and time.time() - holder.heartbeat > 2 * HEARTBEAT_S
            raise self._refusal(holder, "; a lost node's lock lapses when the file server notices" if silent else "")
        local = "" if locked is None else node_local_locks(self.run_dir)
        if locked and not local:
            return  # the kernel or the file server decided, for every host
        # no locks here, or node-local ones: the record decides (on this host, by the holder's pid)
        if holder and not same_job and (locked is None or holder.host != self.me.host) and holder.fresh():
            raise self._refusal(
                holder,
                f" ({local or 'this file system has no file locks'}: the holder's record "
                f"decides until it is {STALE_S:.0f} s old)",
            )

    def _fenced(self, holder: Holder) -> bool:
        """Whether `holder` is an earlier attempt of this job at the service whose ranks have all ended or fenced
        themselves (then this start goes on, taking the lock once the file system lets go of it)."""
        if not (self.fenced and holder.attempt and self.me.attempt and holder.attempt != self.me.attempt):
            return False
        self.locked = False
        print(
            f"hlat: {self.run_dir} is still locked by this job's earlier attempt ({holder.describe()}), whose ranks "
            "ended or fenced themselves (their leases ran out): going on, taking the lock when the file system "
            "lets go of it",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _try_lock(self) -> bool | None:
        """True: locked; False: another process holds it; None: the file system has no flock."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno in NO_LOCKS:
                return None
            raise

    def _wait_for_own(self, holder: Holder) -> bool:
        print(
            f"hlat: {self.run_dir} is still locked by this job's earlier start ({holder.describe()}); waiting up "
            f"to {OWN_WAIT_S:.0f} s for the file system to release a dead process's lock",
            file=sys.stderr,
            flush=True,
        )
        deadline = time.monotonic() + OWN_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            if self._try_lock():
                return True
        return False

    def _refusal(self, holder: Holder | None, how: str) -> HlatError:
        who = holder.describe() if holder else "a process that has not written its record yet"
        return HlatError(
            f"train.run_dir: {self.run_dir} is in use by another job ({who}){how}; one job writes a run "
            "directory at a time: wait for it to end or stop it, or choose another --train.run_dir"
        )

    def _read(self) -> Holder | None:
        """The record in the lock file (None: empty, as a clean release leaves it); one being rewritten is read
        again."""
        for _ in range(20):
            text = os.pread(self.fd, 4096, 0).decode(errors="replace")
            if not text.strip():
                return None
            with contextlib.suppress(ValueError, TypeError):
                return Holder(**json.loads(text))
            time.sleep(0.05)
        return None

    def _write(self) -> None:
        data = json.dumps(asdict(self.me)).encode() + b"\n"
        os.pwrite(self.fd, data, 0)  # then cut: a reader never finds it empty (a longer tail fails to parse: reread)
        os.ftruncate(self.fd, len(data))

    def _beat(self) -> None:
        """Rewrite the record's heartbeat until released; a failed write (a full disk) is the run's to report."""
        while not self.stop.wait(HEARTBEAT_S):
            self.me.heartbeat = time.time()
            with contextlib.suppress(OSError):
                self.locked = self.locked or self._try_lock() is not False
                self._write()

    def release(self) -> None:
        """Empty the record (a clean end leaves no holder behind) and drop the lock; remove a directory this claim
        made if the run wrote nothing else in it (its inputs were refused)."""
        if self.fd < 0:
            return
        self.stop.set()
        self.beating.join()  # its last write done before the descriptor closes (and its number is reused)
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
            if self.created and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
                (self.run_dir / LOCK_FILE).unlink()
                self.run_dir.rmdir()
        os.close(self.fd)  # closing drops the flock
        self.fd = -1


@contextlib.contextmanager
def writing_run_dir(run_dir: str | Path, fenced: bool = False):
    """Hold the run directory for this job while the body runs: rank 0 claims it, the job's other ranks leave it to
    rank 0 (all of one job are one writer); `fenced`: as RunDirLock's."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    lock = RunDirLock(run_dir, fenced)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()
