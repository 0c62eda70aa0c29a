"""Multi-rank jobs under one torchrun launch rather than a torchrun start each (tests only).

Each torchrun start costs seconds of CPU (Python and torch imports on every rank, rendezvous), and the tests run
dozens of small multi-rank jobs. `WarmTorchrun` starts one launch of RANKS workers on first use and hands them the
jobs one at a time through files in its directory: an `hlat` command (`run`) or a function of a test module
(`call`). A job of n ranks runs on ranks 0..n-1 as in a fresh torchrun job of world size n: WORLD_SIZE and
LOCAL_WORLD_SIZE say n, and a new default process group of n ranks (on the launch's store, under a prefix of its
own; hlat's default timeout of 10 minutes) exists when the job starts. hlat's trainer and preflight use a group
that already exists; the trainer destroys it at its end, as under torchrun; what a job leaves is ended after it.
Each rank's output goes to files, and a job's result reads like `subprocess.run`'s.

A job with a rank that does not report back (hung, crashed, or stuck after another rank failed) costs the launch:
it is ended, and the next job starts a new one. The workers exit when the pytest process that started them is gone.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANKS = 4  # the largest job the tests run
POLL_S = 0.05
AFTER_A_FAILURE_S = 60  # how long the other ranks may take to notice that one rank of the job failed


class WarmTorchrun:
    def __init__(self, root: Path):
        self.root = root
        self.launch: subprocess.Popen | None = None
        self.jobs = itertools.count()
        self.directory = root

    def run(
        self, nproc: int, argv: list[str], cwd: Path | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess:
        """`hlat <argv>` on `nproc` ranks, in `cwd`: its exit status (the first rank's that failed) and every
        rank's output, rank by rank."""
        return self.call(nproc, "hlat.cli:main", argv, cwd=cwd, timeout=timeout)

    def call(
        self, nproc: int, function: str, *args, cwd: Path | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess:
        """`module:function`(*args) (JSON arguments) on `nproc` ranks; it returns an exit status or None."""
        assert 1 <= nproc <= RANKS, nproc
        if self.launch is None or self.launch.poll() is not None:
            self.start()
        n = next(self.jobs)
        spec = {"nproc": nproc, "call": function, "args": args, "cwd": str(cwd or Path.cwd())}
        (self.directory / f"job{n}.tmp").write_text(json.dumps(spec))
        (self.directory / f"job{n}.tmp").rename(self.directory / f"job{n}.json")
        codes = self.wait(n, nproc, timeout)
        out, err = (
            "".join(read(self.directory / f"job{n}.rank{r}.{kind}") for r in range(nproc)) for kind in ("out", "err")
        )
        if None in codes:  # hung or crashed: the launch's own output says more
            self.close(wait_s=0)
            err += read(self.directory / "launch.log")[-3000:]
        code = next((c for c in codes if c != 0), 0)
        return subprocess.CompletedProcess([function, *map(str, args)], 1 if code is None else code, out, err)

    def start(self) -> None:
        self.close()
        self.directory = self.root / f"launch{len(list(self.root.glob('launch*')))}"
        self.directory.mkdir(parents=True)
        # this checkout's hlat, and one thread per rank (torchrun's default for several ranks)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1",
        }
        with open(self.directory / "launch.log", "w") as log:
            self.launch = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={RANKS}",
                    __file__,
                    str(self.directory),
                    str(os.getpid()),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.jobs = itertools.count()

    def wait(self, n: int, nproc: int, timeout: float) -> list[int | None]:
        """Each rank's exit status; None for those that did not finish."""
        deadline = time.monotonic() + timeout
        while True:
            codes = [read_code(self.directory / f"job{n}.rank{r}.rc") for r in range(nproc)]
            if None not in codes or self.launch.poll() is not None or time.monotonic() > deadline:
                return codes
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + AFTER_A_FAILURE_S)
            time.sleep(POLL_S)

    def close(self, wait_s: float = 30) -> None:
        """Stop the launch: its workers end once idle, and are killed after `wait_s`."""
        if self.launch is not None and self.launch.poll() is None:
            (self.directory / "stop.json").write_text("{}")
            try:
                self.launch.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.launch.pid, signal.SIGKILL)
                self.launch.wait()
        self.launch = None


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def read_code(path: Path) -> int | None:
    return int(path.read_text()) if path.exists() else None


def serve(directory: Path, parent: int) -> None:
    """A worker of the launch: each job in turn, on this rank if the job has it, until told to stop or the
    pytest process is gone."""
    import torch.distributed as dist

    import hlat.cli  # noqa: F401 (imported once here rather than in the first job)
    import hlat.train.loop  # noqa: F401

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(hours=2)
    )
    rank = int(os.environ["RANK"])
    for n in itertools.count():
        spec = next_job(directory / f"job{n}.json", parent)
        if spec is None:
            return
        if rank < spec["nproc"]:
            code = run_job(dist.PrefixStore(f"job{n}", store), rank, spec, directory / f"job{n}.rank{rank}")
            (directory / f"job{n}.rank{rank}.tmp").write_text(str(code))
            (directory / f"job{n}.rank{rank}.tmp").rename(directory / f"job{n}.rank{rank}.rc")


def next_job(path: Path, parent: int) -> dict | None:
    """The job at `path` once it is written; None once stopped or orphaned."""
    while not path.exists():
        if (path.parent / "stop.json").exists() or not alive(parent):
            return None
        time.sleep(POLL_S)
    return json.loads(path.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_job(store, rank: int, spec: dict, output: Path) -> int:
    """The job on this rank of a fresh group of spec["nproc"] ranks, its output in `output`.out and .err."""
    import torch.distributed as dist
    from process_groups import end_process_group
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    environ, cwd = dict(os.environ), os.getcwd()
    os.environ.update(WORLD_SIZE=str(spec["nproc"]), LOCAL_WORLD_SIZE=str(spec["nproc"]))
    os.chdir(spec["cwd"])
    with redirected(Path(f"{output}.out"), Path(f"{output}.err")):
        dist.init_process_group(store=store, rank=rank, world_size=spec["nproc"], timeout=timedelta(minutes=10))
        crashed = False
        try:
            module, name = spec["call"].split(":")
            code = getattr(importlib.import_module(module), name)(*spec["args"]) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 (reported as an uncaught exception would be)
            traceback.print_exc()
            code, crashed = 1, True
        if dist.is_initialized() and not crashed:  # every rank returned: a barrier first, so that the
            end_process_group()  # gloo work a job left behind completes
        elif dist.is_initialized():
            dist.destroy_process_group()
    # DTensor caches the shardings it works out by device mesh, and a mesh equals another of the same ranks and
    # dimensions whatever its groups: a later job's mesh would be given this job's meshes, over destroyed groups
    # (a private function: torch has no public one)
    _clear_sharding_prop_cache()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    return code


@contextlib.contextmanager
def redirected(out: Path, err: Path):
    """File descriptors 1 and 2 (so also what C++ code and child processes write) into two files."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    for fd, path in ((1, out), (2, err)):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    try:
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, kept in zip((1, 2), saved):
            os.dup2(kept, fd)
            os.close(kept)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # every job's files are written: skip the interpreter's teardown (a second or two with torch)
