"""Fault handling in the training loop: the bad-step check and policy, the fault a test injects to exercise them
(train.debug_nan_step), the hang watchdog, what a rank does when a lease runs out, and stop signals
(docs/fault-tolerance.md)."""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Literal

import torch

from hlat import HANG_EXIT, LOST_EXIT, HlatError
from hlat.config.job import TrainConfig
from hlat.files import WriteFailed, record_seen, report_and_exit, write_text, writing
from hlat.parallel import Topology
from hlat.parallel.lease import Expired, Lease


class BadSteps:
    """Decides whether a step is bad: a non-finite loss or gradient norm, or (spike_sigmas > 0) a loss that
    far above the running mean of the good steps. Every rank sees the same all-reduced loss and global gradient
    norm, so every rank decides alike without another collective."""

    WARMUP = 10  # good steps before spike detection starts: the running deviation needs a history
    DECAY = 0.05  # weight of the newest loss in the running mean and variance

    def __init__(self, spike_sigmas: float, max_in_a_row: int):
        self.spike_sigmas, self.max_in_a_row = spike_sigmas, max_in_a_row
        self.mean = self.var = 0.0
        self.good = self.in_a_row = self.total = 0

    def check(self, loss: float, grad_norm: float) -> str | None:
        """The reason the step is bad, or None (then it joins the running statistics)."""
        if not math.isfinite(loss):
            reason = f"loss is {loss}"
        elif not math.isfinite(grad_norm):
            reason = f"gradient norm is {grad_norm}"
        elif (
            self.spike_sigmas
            and self.good >= self.WARMUP
            and loss > self.mean + self.spike_sigmas * math.sqrt(self.var)
        ):
            reason = f"loss spike: {loss:.4g} against a running mean of {self.mean:.4g} (sd {math.sqrt(self.var):.3g})"
        else:
            self._observe(loss)
            return None
        self.in_a_row += 1
        self.total += 1
        return reason

    def _observe(self, loss: float) -> None:
        self.in_a_row = 0
        self.good += 1
        if self.good == 1:
            self.mean = loss
            return
        delta = loss - self.mean
        self.mean += self.DECAY * delta
        self.var = (1 - self.DECAY) * (self.var + self.DECAY * delta * delta)


def bad_step_action(
    train: TrainConfig, bad: BadSteps, reason: str, step: int, last: Path | None
) -> Literal["skip", "rollback"]:
    """What train.on_bad_step does with bad step `step` (its update already dropped): skip it, or roll back to
    checkpoint `last`; a one-line HlatError where the run stops (the policy says so, too many bad steps in a row,
    or nothing to roll back to)."""
    if train.on_bad_step == "stop" or bad.in_a_row >= train.max_bad_steps:
        why = (
            "train.on_bad_step = 'stop'"
            if train.on_bad_step == "stop"
            else f"{bad.in_a_row} bad steps in a row, train.max_bad_steps = {train.max_bad_steps}"
        )
        raise HlatError(f"step {step}: {reason}; stopped ({why}); last good checkpoint: {last or 'none'}")
    if train.on_bad_step == "rollback" and last is None:
        raise HlatError(
            f"step {step}: {reason}; no checkpoint to roll back to yet (train.on_bad_step = "
            "'rollback'; save one earlier with train.ckpt_every)"
        )
    return train.on_bad_step


class InjectedNaN:
    """train.debug_nan_step, a fault injected to test the bad-step policy: that step's gradients and loss become
    NaN, once per process (a rollback that runs the step number again trains on); 0 injects nothing."""

    def __init__(self, step: int):
        self.step, self.fired = step, False

    def __call__(self, step: int, local_loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """`local_loss` of step `step` (1-based), poisoned with the gradients of `params` if this is the step."""
        if step != self.step or self.fired:
            return local_loss
        self.fired = True
        for p in params:
            if p.grad is not None:
                p.grad.fill_(float("nan"))
        return local_loss * float("nan")


class Watchdog:
    """A heartbeat thread: if no step finishes within `timeout_s`, it writes every thread's stack to
    `<run>/hang/rank<R>.txt`, names the ranks that stopped answering, and ends the process with exit code 3 so
    the job restarts. Each rank's thread also stamps `<run>/hang/alive_rank<R>` every second: a rank whose stamp
    is stale is stopped or dead (its threads do not run), which is how a waiting rank names the hung one. A stopped
    rank on the same node, under the same torchrun, is killed too: it cannot act on torchrun's SIGTERM, and torchrun
    would wait 30 s before killing it, so the job ends now and `hlat torchrun` exits with code 3.

    The watch starts with the first step's beat: start-up and the first step (compilation, the data pool filling)
    are not timed, so the timeout can be suited to a step; a hang before it ends at the collective timeout."""

    EXIT_CODE = HANG_EXIT

    def __init__(self, timeout_s: float, run_dir: Path, rank: int, world_size: int):
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.run_dir, self.dir = Path(run_dir), Path(run_dir) / "hang"
        self.step = 0
        self.last_beat: float | None = None  # armed by the first beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hlat-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if self.timeout_s:
            with writing(self.dir, self.run_dir):
                self.dir.mkdir(parents=True, exist_ok=True)
            write_text(self.stamp, self.alive(), self.run_dir)  # at once: a rank stopped from now on has a stamp
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self, step: int) -> None:
        self.step, self.last_beat = step, time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            self._stamp()
            if self.last_beat is not None and time.monotonic() - self.last_beat > self.timeout_s:
                self._report()
                os._exit(self.EXIT_CODE)

    @property
    def stamp(self) -> Path:
        return self.dir / f"alive_rank{self.rank}"

    def alive(self) -> str:
        return json.dumps({"time": time.time(), "step": self.step, "host": socket.gethostname(), "pid": os.getpid()})

    def _stamp(self) -> None:
        try:  # replaced whole: a rank stopped while stamping leaves its last stamp readable
            write_text(self.stamp, self.alive(), self.run_dir)
        except WriteFailed as e:  # this thread cannot raise into the run
            report_and_exit(e)

    def _silent_ranks(self) -> dict[int, dict]:
        """The ranks whose stamps are stale (or missing: {}), with their last stamp."""
        silent = {}
        for r in range(self.world_size):
            try:
                seen = json.loads((self.dir / f"alive_rank{r}").read_text())
            except (OSError, ValueError):
                seen = {}
            if time.time() - seen.get("time", 0.0) > max(3.0, self.timeout_s / 2):
                silent[r] = seen
        return silent

    def _report(self) -> None:
        stacks = self.dir / f"rank{self.rank}.txt"
        silent = self._silent_ranks() if self.world_size > 1 else {}
        killed = [r for r, seen in silent.items() if kill_stopped_sibling(seen)]
        line = (
            f"hlat: error: hang: rank {self.rank} on {socket.gethostname()}: no step finished for "
            f"{self.timeout_s:g} s (train.hang_timeout_s) after step {self.step}"
            + (f"; ranks not responding: {', '.join(map(str, silent))}" if silent else "")
            + (f" (killed on this node: {', '.join(map(str, killed))})" if killed else "")
            + f"; stacks in {stacks}"
        )
        with contextlib.suppress(OSError), stacks.open("w") as f:  # the hang is the news, even on a full disk
            f.write(line + "\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(line, file=sys.stderr, flush=True)
        record_seen(self.run_dir, f"rank{self.rank}", f"watchdog: no step finished for {self.timeout_s:g} s")


def kill_stopped_sibling(seen: dict) -> bool:
    """SIGKILL the process of a silent rank's last stamp if it runs on this host under the same parent (the same
    torchrun), so never an unrelated process that reused its pid; whether it was killed."""
    pid = seen.get("pid")
    if seen.get("host") != socket.gethostname() or not pid or pid == os.getpid():
        return False
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if parent != os.getppid():
            return False
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError, IndexError):  # gone already, or no /proc (not Linux)
        return False
    return True


def hold_lease(train: TrainConfig, topo: Topology) -> contextlib.AbstractContextManager:
    """This rank's lease (hlat.parallel.lease) while the run holds its process group, acted on by `lease_expired`;
    none with train.lease_s = 0, or where this process did not form the group (one process; a group made before)."""
    if not train.lease_s or topo.store is None:
        return contextlib.nullcontext()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", topo.world_size))
    act = functools.partial(lease_expired, Path(train.run_dir), topo.rank)
    return Lease(topo.store, topo.rank, topo.world_size, per_node, train.lease_s, act)


def lease_expired(run_dir: Path, rank: int, expired: Expired, replica_group: int | None = None) -> None:
    """What a rank does when a lease runs out: the one place that acts on a peer declared lost, on this rank's own
    lease that it could not renew, and (parallel.replica_groups, `replica_group` this rank's) on a replica group the
    service's membership dropped. A dropped group other than this rank's leaves this one a survivor: it goes on
    (its wait on the dropped group is abandoned, `hlat.train.replicas`). Otherwise the rank ends (the failure
    recorded for goodput's split, one line, exit code 4), so that torchrun re-forms the job (or, under replica
    groups, this group alone, which then rejoins by healing) from the hosts that are live and the ranks resume, as
    after a dead process, rather than wait in a collective until train.collective_timeout_s; a silent peer on this
    node under the same torchrun (stopped: it cannot act on torchrun's SIGTERM) is killed first. Called from the
    lease's thread (or the membership's), while the training thread may be waiting in that collective."""
    if expired.kind == "replica" and expired.rank != replica_group:
        print(
            f"hlat: rank {rank} of replica group {replica_group}: replica group {expired.rank} was dropped from the "
            f"job ({expired.cause}); this group goes on without it",
            file=sys.stderr,
            flush=True,
        )
        return
    line = lease_line(rank, expired)
    killed = expired.kind == "peer" and kill_stopped_sibling(expired.who)
    record_seen(run_dir, f"rank{rank}", line.removeprefix("hlat: error: "))
    killed_text = f"; killed it on this node (pid {expired.who['pid']})" if killed else ""
    print(line + killed_text, file=sys.stderr, flush=True)
    os._exit(LOST_EXIT)


def lease_line(rank: int, expired: Expired) -> str:
    me = f"rank {rank} on {socket.gethostname()}"
    if expired.kind == "replica":
        return (
            f"hlat: error: {me}: its replica group {expired.rank} was dropped from the job ({expired.cause}: a rank "
            "of it failed or went silent); this rank ends, torchrun starts the group again and it rejoins by healing"
        )
    if expired.kind == "store":
        return (
            f"hlat: error: {me}: cannot renew its lease at {expired.where} for {expired.silent_s:.1f} s "
            f"({expired.cause[:160]}): the service is lost or this host is cut off; this rank ends"
        )
    who = expired.who
    silent = f"rank {expired.rank}" + (f" (pid {who['pid']} on {who['host']})" if who else "")
    by = "" if expired.declared_by == rank else f" by rank {expired.declared_by}"
    return (
        f"hlat: error: {me}: {silent} has not renewed its lease for {expired.silent_s:.1f} s (train.lease_s): "
        f"declared lost{by}; this rank ends so that the job goes on without it"
    )


class StopRequest:
    """SIGTERM/SIGINT ask the loop to checkpoint and stop after the current step instead of dying mid-step;
    ranks agree on it each step (with the loss: `hlat.train.step.reduce_step`), so they all save the same step."""

    def __init__(self):
        self.requested = False

    @contextlib.contextmanager
    def installed(self):
        def handler(signum, frame):
            self.requested = True

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
