"""AdamW with HLAT's defaults, the learning-rate schedule and precision modes. Torch is imported lazily so
`hlat.optim.modes` and `hlat.optim.config` stay torch-free for `hlat describe` and the planner; the precision
helpers live in hlat.optim.precision (prepare_model, autocast) and hlat.optim.bf16 (BF16AdamW, stochastic_round)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hlat.optim.config import OptimConfig, PrecisionConfig
from hlat.optim.schedule import lr_at

if TYPE_CHECKING:
    import torch
    from torch import nn

FUSED_ADAMW_DEVICES = ("cuda", "xpu")

__all__ = ["OptimConfig", "PrecisionConfig", "build_optimizer", "lr_at", "param_groups"]


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """The model's trainable parameters; 1-D ones (norms, biases) skip weight decay only when asked."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.decay_norms_and_biases:
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig, mode: str = "fp32", seed: int = 0) -> torch.optim.Optimizer:
    """AdamW for precision `mode`: torch's foreach AdamW on the fp32 weights of fp32 and bf16_mixed, BF16AdamW
    (rounding stochastically with `seed`) on the bf16 weights of the pure-bf16 modes (after prepare_model)."""
    import torch

    from hlat.optim.bf16 import BF16AdamW
    from hlat.optim.precision import PURE_BF16

    PrecisionConfig(mode).validate()
    hparams = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if mode in PURE_BF16:
        return BF16AdamW(param_groups(model, cfg), **hparams, rounding=PURE_BF16[mode], seed=seed)
    # fused (one kernel per step) where torch has it for the device; foreach elsewhere (the CPU keeps the
    # same kernels as ever, so CPU runs stay comparable with earlier ones)
    fused = next(model.parameters()).device.type in FUSED_ADAMW_DEVICES
    return torch.optim.AdamW(param_groups(model, cfg), **hparams, **({"fused": True} if fused else {"foreach": True}))
