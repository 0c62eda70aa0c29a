"""AdamW with HLAT's defaults, the learning-rate schedule and precision modes."""

from __future__ import annotations

import torch
from torch import nn

from hlat.optim.config import OptimConfig, PrecisionConfig
from hlat.optim.schedule import lr_at

__all__ = ["OptimConfig", "PrecisionConfig", "build_optimizer", "lr_at"]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the model's parameters; 1-D parameters (norms, biases) skip weight decay only when asked."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.decay_norms_and_biases:
        groups = [{"params": params, "weight_decay": cfg.weight_decay}]
    else:
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    # foreach on CPU and GPU alike; fused would differ between the two and is not available on every device.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
