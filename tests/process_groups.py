"""For the tests' own multi-process workers (under mp.spawn or torchrun)."""

from __future__ import annotations

import torch.distributed as dist


def end_process_group() -> None:
    """Destroy the default group once every rank's work on it is done. Some collectives leave gloo work behind
    their result: DTensor's full_tensor() (a functional all-gather, its result already waited), sequence
    parallelism's gathers in a forward pass with no backward. A rank that destroyed the group then could abort at
    exit ('terminate called without an active exception'; 4 of 20 two-rank runs of a full_tensor() here, none of
    20 with this barrier); a gloo barrier completes only after all earlier work on the group."""
    dist.barrier()
    dist.destroy_process_group()
