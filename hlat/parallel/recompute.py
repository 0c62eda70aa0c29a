"""Recomputation (activation checkpointing) per block: `full` recomputes the whole block in backward;
`selective` keeps the outputs of the matrix multiplications (and of tensor-parallel collectives, so no
communication is repeated) and recomputes the rest: the attention core (scaled dot-product attention), as HLAT
did (after Korthikanti et al. 2022), and the cheap elementwise work around it. Parameter names are unchanged, so
checkpoints do not depend on this setting.

A mixture-of-experts block under `selective` recomputes its attention alone, as above, and keeps what its experts'
half computes: under expert parallelism the experts are an FSDP unit of their own, whose gathers inside a selectively
recomputed region would run otherwise in recomputation than in the forward (torch's selective checkpointing replays
the forward's operations in their order)."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hlat.torch_private import FUNCTIONAL_COLLECTIVES

_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    *FUNCTIONAL_COLLECTIVES,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, selective: bool, *args, **kwargs):
    context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls) if selective else None
    extra = {"context_fn": context} if context else {}
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


def apply_recomputation(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    for block in model.layers.values():
        # wrapping the bound forward (not the module) keeps the block's parameter names
        region = block.attention if mode == "selective" and model.cfg.moe else block
        region.forward = functools.partial(_checkpointed, region.forward, mode == "selective")
