"""Llama: RMSNorm pre-norm, SwiGLU (or a mixture of SwiGLU experts: `hlat.models.moe`), rotary embeddings over the
whole head, grouped-query attention."""

from __future__ import annotations

import torch
from torch import nn

from hlat.models.config import ModelConfig
from hlat.models.layers import SwiGLU, Transformer
from hlat.models.moe import MoE


class Llama(Transformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, norm=nn.RMSNorm, mlp=MoE if cfg.moe else SwiGLU, parallel_residual=False)
        if cfg.moe:  # the load-balancing losses take the gradient this model's loss receives
            self.loss_grad = self.layers["0"].feed_forward.loss_grad
            for block in self.layers.values():
                block.feed_forward.loss_grad = self.loss_grad

    def loss(self, h: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        loss = super().loss(h, targets, reduction)
        return self.loss_grad.recorded(loss) if self.cfg.moe else loss
