"""One live writer per run directory (hlat/jobs/writer.py, docs/fault-tolerance.md): a second job is refused in one
line and writes nothing; a killed job (one process, or every process of a 2-rank torchrun job) blocks nothing; the
ranks of one job, and the restarts of one job, never refuse each other."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults import alive, children, stat_of, write_config
from test_train import config

from hlat import HlatError
from hlat.jobs import writer
from hlat.jobs.writer import LOCK_FILE, RunDirLock, writing_run_dir

ROOT = Path(__file__).resolve().parents[1]
# a job that holds the run directory until its stdin closes
HOLDER = (
    "import sys; from hlat.jobs.writer import RunDirLock; lock = RunDirLock(sys.argv[1]); lock.acquire(); "
    "print('held', flush=True); sys.stdin.read()"
)


def holder(run_dir: Path, **env) -> subprocess.Popen:
    job = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
    )
    assert job.stdout.readline() == "held\n"
    return job


def test_a_held_run_dir_is_refused_naming_the_holder_and_a_dead_holder_blocks_nothing(tmp_path):
    job = holder(tmp_path / "run")
    with pytest.raises(HlatError) as refused:
        RunDirLock(tmp_path / "run").acquire()
    assert f"{tmp_path / 'run'} is in use by another job (pid {job.pid} on {socket.gethostname()}" in str(refused.value)
    os.kill(job.pid, signal.SIGKILL)  # no release: the kernel drops the lock of a dead process
    job.wait()
    lock = RunDirLock(tmp_path / "run")
    lock.acquire()
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""  # a clean end leaves no holder behind


def test_a_restart_of_the_same_job_waits_for_its_earlier_lock(tmp_path, monkeypatch, capsys):
    """A lost node's lock outlives its job until the file server notices: a restart of that job (the same SLURM
    job here) waits for it rather than failing, while another job is refused at once."""
    job = holder(tmp_path / "run", SLURM_JOB_ID="41")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with pytest.raises(HlatError, match="job slurm 41, pid"):
        RunDirLock(tmp_path / "run").acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setattr(writer, "OWN_WAIT_S", 0.0)
    with pytest.raises(HlatError, match="still held by an earlier start of this job .job slurm 41, pid"):
        RunDirLock(tmp_path / "run").acquire()  # it lives on: a requeue while the old job lingers
    monkeypatch.setattr(writer, "OWN_WAIT_S", 60.0)
    monkeypatch.setattr(writer.time, "sleep", lambda s: job.stdin.close() or job.wait())  # it lapses while waiting
    lock = RunDirLock(tmp_path / "run")
    lock.acquire()
    lock.release()
    assert "still locked by this job's earlier start (job slurm 41" in capsys.readouterr().err


def test_an_attempt_at_the_service_does_not_wait_for_an_earlier_attempts_lock(tmp_path, monkeypatch, capsys):
    """At the hlat service each attempt has a namespace of its own and its ranks hold leases: a later attempt of the
    job goes on at once (its record written) while the earlier attempt's lock lives on, as a lost first host's does
    until the file server notices; without leases, or within one attempt, it waits as before."""
    job = holder(tmp_path / "run", SLURM_JOB_ID="51", HLAT_SERVICE_NAMESPACE="hlat/51/first")
    monkeypatch.setenv("SLURM_JOB_ID", "51")
    monkeypatch.setattr(writer, "OWN_WAIT_S", 0.0)
    for namespace, fenced in (("hlat/51/first", True), ("hlat/51/second", False)):
        monkeypatch.setenv("HLAT_SERVICE_NAMESPACE", namespace)
        with pytest.raises(HlatError, match="still held by an earlier start of this job"):
            RunDirLock(tmp_path / "run", fenced).acquire()
    lock = RunDirLock(tmp_path / "run", fenced=True)
    lock.acquire()
    assert "still locked by this job's earlier attempt (job slurm 51, pid" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["attempt"] == "hlat/51/second"
    assert not lock.locked
    job.stdin.close()
    job.wait()  # the lock lapses: the next heartbeat takes it
    beats = iter([False, True])  # one heartbeat, then released
    monkeypatch.setattr(lock.stop, "wait", lambda s: next(beats))
    lock._beat()
    assert lock.locked
    lock.release()


def test_where_locks_are_node_local_the_record_decides(tmp_path, monkeypatch):
    """Lustre mounted localflock (or NFS with local locks, or no flock at all): the lock is granted whoever holds it
    on another host, so a fresh record of another host's job refuses, and a stale one (a dead job's) does not."""
    run = tmp_path / "run"
    run.mkdir()
    record = {"job": "slurm 7", "host": "another-node", "pid": 1, "started": time.time(), "heartbeat": time.time()}
    (run / LOCK_FILE).write_text(json.dumps(record))
    monkeypatch.setattr(writer, "node_local_locks", lambda path: "/fsx is Lustre mounted localflock")
    with pytest.raises(HlatError, match="another-node.*localflock: the holder's record decides"):
        RunDirLock(run).acquire()
    (run / LOCK_FILE).write_text(json.dumps(record | {"heartbeat": time.time() - writer.STALE_S - 1}))
    RunDirLock(run).acquire()


def test_without_flock_a_live_pid_on_this_host_refuses_and_a_dead_one_does_not(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    run = tmp_path / "run"
    run.mkdir()
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    now = time.time()
    for pid, refused in ((os.getppid(), True), (int(done.stdout), False)):  # pytest's parent lives; that one is gone
        record = {"job": "", "host": socket.gethostname(), "pid": pid, "started": now, "heartbeat": now}
        (run / LOCK_FILE).write_text(json.dumps(record))
        monkeypatch.setattr(writer.fcntl, "flock", no_flock)
        lock = RunDirLock(run)
        if refused:
            with pytest.raises(HlatError, match="no file locks"):
                lock.acquire()
        else:
            lock.acquire()
            lock.release()


def test_a_start_refused_before_writing_leaves_no_directory_behind(tmp_path):
    with pytest.raises(HlatError, match="refused"):
        with writing_run_dir(tmp_path / "new" / "run"):
            raise HlatError("its inputs were refused")
    assert not (tmp_path / "new" / "run").exists()
    (tmp_path / "old").mkdir()
    with writing_run_dir(tmp_path / "old"):
        (tmp_path / "old" / "config.toml").write_text("")
    assert {p.name for p in (tmp_path / "old").iterdir()} == {"config.toml", LOCK_FILE}


def test_ranks_other_than_0_leave_the_run_dir_to_rank_0(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with writing_run_dir(tmp_path / "run"):
        assert not (tmp_path / "run").exists()


def test_node_local_locks_read_from_the_mount_table(tmp_path, monkeypatch):
    table = tmp_path / "mounts"
    table.write_text(
        "fsx@tcp:/abc /fsx lustre rw,localflock 0 0\nnfs:/x /home nfs4 rw,local_lock=flock 0 0\n"
        "fsx@tcp:/d /data lustre rw,flock 0 0\n/dev/sda1 / ext4 rw 0 0\n"
    )
    real = Path

    def reading(path):
        return real(table) if str(path) == "/proc/self/mounts" else real(path)

    monkeypatch.setattr(writer, "Path", reading)
    assert "Lustre mounted localflock" in writer.node_local_locks(Path("/fsx/runs/a"))
    assert "NFS mounted with local locks" in writer.node_local_locks(Path("/home/u/runs"))
    assert writer.node_local_locks(Path("/data/runs")) == "" == writer.node_local_locks(Path("/tmp/x"))


def tree(directory: Path) -> dict:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


def wait_for_checkpoint(run_dir: Path, job: subprocess.Popen) -> None:
    deadline = time.time() + 240
    while not list((run_dir / "checkpoints").glob("step_*[0-9]")) and job.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert job.poll() is None, job.communicate()[0]


def stopped(pid: int, timeout: float = 30) -> None:
    """Wait until every thread of the process is stopped: kill() returns before a SIGSTOP takes effect, and a
    thread still running (TensorBoard's writer) may write after it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = [fields[0] for task in Path(f"/proc/{pid}/task").iterdir() if (fields := stat_of(task))]
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} not stopped after {timeout} s")


@pytest.mark.slow
def test_a_second_train_is_refused_writing_nothing_and_resumes_once_the_first_is_killed(tmp_path):
    """Refused alone or supervised (--max-restarts), a second job leaves the running job's directory byte-identical."""
    cfg = config(tmp_path / "run", steps=10_000, decay_steps=10_000, ckpt_every=2)
    cfg.data.workers = 0
    cfg.train.snapshot_every = 0  # the durable tier's resume: a newer memory snapshot would race the kill below
    c = write_config(tmp_path / "c.toml", cfg)
    first = subprocess.Popen(
        [sys.executable, "-m", "hlat", "train", "--config", str(c)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_checkpoint(tmp_path / "run", first)
        os.kill(first.pid, signal.SIGSTOP)  # alive, holding the run directory, writing nothing while we look
        stopped(first.pid)
        before = tree(tmp_path / "run")
        second = subprocess.run(
            [sys.executable, "-m", "hlat", "train", "--config", str(c), "--resume", "auto"],
            capture_output=True,
            text=True,
        )
        assert second.returncode == 2 and tree(tmp_path / "run") == before
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith(
            f"hlat: error: train.run_dir: {tmp_path / 'run'} is in use by another job (pid {first.pid} on "
        )
        # supervised, the refused job records no failure there either (it is not the running job's)
        supervised = subprocess.run(
            [sys.executable, "-m", "hlat", "train", "--config", str(c), "--max-restarts", "2"],
            capture_output=True,
            text=True,
        )
        assert supervised.returncode == 2 and tree(tmp_path / "run") == before, supervised.stderr
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    step = max(int(p.name[5:]) for p in (tmp_path / "run" / "checkpoints").glob("step_*[0-9]"))
    resumed = subprocess.run(
        [sys.executable, "-m", "hlat", "train", "--config", str(c), "--resume", "auto", "--train.steps", str(step + 1)],
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/step_{step:08d} at step {step}" in resumed.stdout


@pytest.mark.slow
def test_a_killed_torchrun_job_blocks_nothing_and_two_ranks_are_one_writer(tmp_path, warm_torchrun):
    """kill -9 of every process of a 2-rank `hlat torchrun` job (a lost node: torchrun's workers run in sessions of
    their own, and outlive a kill of torchrun alone, holding the run directory): a 2-rank job resumes at once, its
    two ranks one writer."""
    cfg = config(tmp_path / "run", steps=10_000, decay_steps=10_000, ckpt_every=2)
    cfg.data.workers = 0
    cfg.train.snapshot_every = 0  # the durable tier's resume: a newer memory snapshot would race the kill below
    c = write_config(tmp_path / "c.toml", cfg)
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hlat",
            "torchrun",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "hlat",
            "train",
            "--config",
            str(c),
        ],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_checkpoint(tmp_path / "run", job)
        record = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
        workers = children(job.pid)
        assert record["job"].startswith("torchrun ") and record["pid"] in workers  # rank 0 holds it for the job
    finally:
        for pid in [job.pid, *children(job.pid)]:
            os.kill(pid, signal.SIGKILL)
        job.wait()
    deadline = time.time() + 30
    while any(alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in workers)
    step = max(int(p.name[5:]) for p in (tmp_path / "run" / "checkpoints").glob("step_*[0-9]"))
    done = warm_torchrun.run(2, ["train", "--config", str(c), "--resume", "auto", "--train.steps", str(step + 1)])
    assert done.returncode == 0, done.stderr
    assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/step_{step:08d} at step {step}" in done.stdout
