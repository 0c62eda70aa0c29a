"""What each precision mode changes in the trainer: the parameters' dtype and the forward pass's autocast.
(The optimizer is hlat.optim.build_optimizer.)"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hlat.optim.modes import MODES

# Pure-bf16 modes and how BF16AdamW writes their updates back.
PURE_BF16 = {mode.name: mode.rounding for mode in MODES.values() if mode.rounding}


def prepare_model(model: nn.Module, mode: str) -> nn.Module:
    """Cast the parameters (and floating buffers such as the rope table, which the model casts to the activation
    dtype anyway) to bf16 for the pure-bf16 modes; leave fp32 and bf16_mixed models in fp32. In place, keeping
    tied parameters tied; the trainer calls it on the meta-device model, before any parallel wrapping and before
    materialising, so the parameters are allocated in their final dtype."""
    return model.to(torch.bfloat16) if mode in PURE_BF16 else model


def autocast(mode: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The forward pass's context: bf16 autocast for bf16_mixed (matmuls in bf16 from fp32 master weights,
    softmax and reductions kept in fp32 by autocast's op lists); nothing otherwise (pure bf16 computes in bf16
    because its weights are bf16)."""
    if mode == "bf16_mixed":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def dtypes(mode: str) -> tuple[torch.dtype, torch.dtype]:
    """(the parameters' dtype, the matmuls' dtype) under precision `mode`."""
    params = torch.bfloat16 if mode in PURE_BF16 else torch.float32
    return params, torch.float32 if mode == "fp32" else torch.bfloat16
