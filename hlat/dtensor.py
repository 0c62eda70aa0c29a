"""A tensor's two views under DTensor, written once: this rank's local part (`local`) and the whole tensor (`full`,
gathered from the ranks for a sharded one: a collective); a plain tensor is both. `held`: the plain tensor whose
storage holds the local part."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hlat.torch_private import wrapped_tensor


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def held(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds this rank's data of `t`: its local part, taken out of a tensor subclass that wraps
    tensors of its own (torchao's FP8 weights under FSDP: a wrapper has no storage of its own)."""
    t = local(t)
    while (inner := wrapped_tensor(t)) is not None:
        t = inner
    return t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_elements(params: list[torch.Tensor]) -> int:
    """The parameter elements this rank holds (its shards of sharded ones)."""
    return sum(local(p).numel() for p in params)
