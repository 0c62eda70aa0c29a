"""`hlat torchrun`: torchrun, except that a job stopped by a signal exits 0 once its trainers have checkpointed, and
a job that failed with one of hlat's own exit codes exits with it.

torchrun passes a SIGTERM (a scheduler's stop, a pod's deletion) to its workers, waits for them
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and then always exits 1, so a job that stopped cleanly, with its checkpoint
written, looks like a crash to SLURM, Kubernetes and the supervisor. Here each trainer process leaves a mark in
a per-launch directory when `hlat train` returns; a stop is clean when every local trainer left one. A failed job
also exits 1 under torchrun, whatever its trainers said; here it exits 2 when a trainer did (an hlat error such as
a full disk: retrying cannot help) and 3 when one's watchdog found a hang. Each start of the workers meets in a
store of its own (`OWN_STORE_PER_ATTEMPT`), or, at the hlat service (`--rdzv-backend=hlat`: hlat.jobs.service), in a
namespace of its own there; a job that loses the service ends in one line naming it, with exit code 4 (`LOST_EXIT`:
its restart resumes it). Under torchrun's own c10d rendezvous, whose store a training host's agent hosts, a job that
loses that host ends on the others in one line naming what each holds and the command that resumes it there, with
exit code 5 (`LOST_RENDEZVOUS_EXIT`). `hlat torchrun` checks an `hlat train` job before torchrun starts a process
(`hlat.jobs.cli.check_training`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from hlat import ERROR_EXIT, HANG_EXIT, LOST_RENDEZVOUS_EXIT

FINISHED_DIR = "HLAT_FINISHED_DIR"  # set for the workers; they mark their return in it
KEPT_EXIT_CODES = (ERROR_EXIT, HANG_EXIT)  # in this order: an hlat error (not retried), then a hang named
# Each start of the workers gets a fresh store, hosted by its rank 0, instead of sharing the store the agents keep
# for the whole job: a restart then finds no key of a dead attempt (at the hlat service, where no training host hosts
# a store, the workers meet in a namespace of the attempt's own instead, and this keeps node 0's agent from hosting
# one it would never use). hlat's workers used to keep each attempt apart
# in the shared store by TORCHELASTIC_RESTART_COUNT, but each node counts only its own failures (a node restarted
# for another node's failure keeps its count: pytorch/pytorch#108158), so after a failure on one of several nodes
# the ranks looked for each other in different namespaces (found by tests/test_hosts.py).
OWN_STORE_PER_ATTEMPT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
C10D_PORT = 29400  # torchrun's c10d rendezvous's port where --rdzv-endpoint names none


def mark_finished() -> None:
    """Called by a trainer process when training returned (done, or stopped after its checkpoint)."""
    if directory := os.environ.get(FINISHED_DIR):
        Path(directory, f"rank{os.environ.get('RANK', '0')}").write_text(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def all_finished(directory: Path) -> bool:
    marks = list(directory.iterdir())
    return bool(marks) and len(marks) == int(marks[0].read_text())


def torchrun(
    argv: list[str], check: Callable[[argparse.Namespace], None], held: Callable[[argparse.Namespace], str]
) -> int:
    """Run torchrun with `argv`, after `check` has seen its parsed arguments (and raised, for a job that must not
    start); 0 after a signal if every local trainer finished, a trainer's own hlat exit code if one failed with it
    (`KEPT_EXIT_CODES`), 4 (one line) when the rendezvous lost the hlat service, 5 (one line, naming what this node
    holds: `held`) when torchrun's own c10d rendezvous lost the host of its store, else torchrun's own exit."""
    from torch.distributed import DistError, DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousError
    from torch.distributed.run import get_args_parser, run

    from hlat.jobs.service import SERVICE_BACKEND, lost_service, register_backend

    register_backend()
    parser = get_args_parser()
    parser.prog = "hlat torchrun"  # its --help and usage errors name this command, not `hlat`
    args = parser.parse_args(argv)
    check(args)
    service = args.rdzv_endpoint if args.rdzv_backend == SERVICE_BACKEND else None
    with tempfile.TemporaryDirectory(prefix="hlat-finished-") as directory:
        os.environ[FINISHED_DIR] = directory
        os.environ.setdefault(OWN_STORE_PER_ATTEMPT, "1")
        try:
            record(run)(args)  # as torchrun's own main does
        except (RendezvousError, DistError) as e:
            if service is not None:
                return lost_service(service, first_line(e))
            if not isinstance(e, (RendezvousConnectionError, DistNetworkError)) or args.standalone:
                raise
            return lost_rendezvous_host(args.rdzv_endpoint, first_line(e.__cause__ or e), held(args), argv)
        except SignalException as e:
            if not all_finished(Path(directory)):
                raise
            print(f"hlat: stopped by {e.sigval.name}: every trainer checkpointed and returned", file=sys.stderr)
        except ChildFailedError as e:
            codes = {failure.exitcode for failure in e.failures.values()}
            kept = next((code for code in KEPT_EXIT_CODES if code in codes), None)
            if kept is None:
                raise
            print(f"hlat: a trainer exited with code {kept}; so does the job", file=sys.stderr)
            return kept
    return 0


def lost_rendezvous_host(endpoint: str, cause: str, held: str, argv: list[str]) -> int:
    """Say in one line that this agent lost the host of torchrun's c10d rendezvous store at `endpoint` (a training
    host: its agent hosted the store), what this node holds (`held`), and the command that resumes the job with the
    rendezvous on this host; the exit code that says so."""
    _, colon, port = endpoint.rpartition(":")
    here = f"{socket.gethostname()}:{port if colon else C10D_PORT}"
    print(
        f"hlat: error: lost {endpoint}, the host of this job's rendezvous store ({cause[:200]}): this host's part of "
        f"the job ends (exit code {LOST_RENDEZVOUS_EXIT}); {held}; to resume with the rendezvous on this host, run on "
        f"every host: {shlex.join(['hlat', 'torchrun', *with_endpoint(argv, here)])}",
        file=sys.stderr,
        flush=True,
    )
    return LOST_RENDEZVOUS_EXIT


def with_endpoint(argv: list[str], endpoint: str) -> list[str]:
    """torchrun's `argv` with its --rdzv-endpoint (either spelling, `=` or a separate word) set to `endpoint`."""
    names = ("--rdzv-endpoint", "--rdzv_endpoint")
    out, skip = [], False
    for word in argv:
        if skip:
            out.append(endpoint)
            skip = False
        elif word in names:
            out.append(word)
            skip = True
        else:
            out.append(
                f"{word.partition('=')[0]}={endpoint}" if word.startswith(tuple(f"{n}=" for n in names)) else word
            )
    return out


def first_line(e: BaseException) -> str:
    """The first line that says something of `e`, its cause or its context (torch's rendezvous errors wrap the
    store's)."""
    lines = (line for err in (e, e.__cause__, e.__context__) if err for line in str(err).splitlines() if line.strip())
    return next(lines, type(e).__name__)
