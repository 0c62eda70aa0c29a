"""Llama: RMSNorm pre-norm, SwiGLU, rotary embeddings over the whole head, grouped-query attention."""

from __future__ import annotations

from torch import nn

from hlat.models.config import ModelConfig
from hlat.models.layers import SwiGLU, Transformer


class Llama(Transformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, norm=nn.RMSNorm, mlp=SwiGLU, parallel_residual=False)
