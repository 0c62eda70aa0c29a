"""`hlat torchrun`: torchrun, except that a job stopped by a signal exits 0 once its trainers have checkpointed.

torchrun passes a SIGTERM (a scheduler's stop, a pod's deletion) to its workers, waits for them
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and then always exits 1, so a job that stopped cleanly, with its checkpoint
written, looks like a crash to SLURM, Kubernetes and the supervisor. Here each trainer process leaves a mark in
a per-launch directory when `hlat train` returns; a stop is clean when every local trainer left one.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

FINISHED_DIR = "HLAT_FINISHED_DIR"  # set for the workers; they mark their return in it


def mark_finished() -> None:
    """Called by a trainer process when training returned (done, or stopped after its checkpoint)."""
    if directory := os.environ.get(FINISHED_DIR):
        Path(directory, f"rank{os.environ.get('RANK', '0')}").write_text(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def all_finished(directory: Path) -> bool:
    marks = list(directory.iterdir())
    return bool(marks) and len(marks) == int(marks[0].read_text())


def torchrun(argv: list[str]) -> int:
    """Run torchrun with `argv`; 0 after a signal if every local trainer finished, else torchrun's own exit."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    with tempfile.TemporaryDirectory(prefix="hlat-finished-") as directory:
        os.environ[FINISHED_DIR] = directory
        try:
            main(argv)
        except SignalException as e:
            if not all_finished(Path(directory)):
                raise
            print(f"hlat: stopped by {e.sigval.name}: every trainer checkpointed and returned", file=sys.stderr)
    return 0
