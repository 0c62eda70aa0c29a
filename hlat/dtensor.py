"""A tensor's two views under DTensor, written once: this rank's local part (`local`) and the whole tensor (`full`,
gathered from the ranks for a sharded one: a collective); a plain tensor is both."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_elements(params: list[torch.Tensor]) -> int:
    """The parameter elements this rank holds (its shards of sharded ones)."""
    return sum(local(p).numel() for p in params)
