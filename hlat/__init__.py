"""hlat: pretrain large language models at low cost per token."""

import importlib
from types import ModuleType

__version__ = "0.1.0"
ERROR_EXIT = 2  # a user's mistake or a full disk, in one line: a restart would fail the same way, so none retries it
HANG_EXIT = 3  # the hang watchdog named a stopped rank: restart the job
# a lease ran out (docs/fault-tolerance.md, "Leases"): a rank ends because a peer went silent or it lost the hlat
# service, and `hlat torchrun` ends a job that lost the service: resumable, the restart (or requeue) resumes it
LOST_EXIT = 4
# `hlat torchrun` under torchrun's own c10d rendezvous lost the training host whose agent hosted the job's store: the
# other hosts cannot meet again until the job is relaunched with its rendezvous elsewhere (docs/fault-tolerance.md)
LOST_RENDEZVOUS_EXIT = 5
# where `hlat torchrun` tells the workers of a rendezvous at the hlat service the namespace of their attempt there
SERVICE_NAMESPACE_ENV = "HLAT_SERVICE_NAMESPACE"
# the job-wide namespace at the hlat service where replica groups keep their membership (hlat.train.replicas)
REPLICAS_NAMESPACE = "hlat/replicas"


class HlatError(Exception):
    """A user-facing error: the CLI prints it as one line and exits non-zero, without a traceback."""


def optional_import(module: str, what: str, install: str = "'hlat[formats]'") -> ModuleType:
    """Import a package hlat does not require, or fail in one line saying what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise HlatError(f"{what} needs the optional package {module.split('.')[0]!r}: pip install {install}") from None
