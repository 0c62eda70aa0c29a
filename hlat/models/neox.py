"""GPT-NeoX / Pythia: LayerNorm, GELU MLP, biases on every linear, partial rotary, parallel residual."""

from __future__ import annotations

from torch import nn

from hlat.models.config import ModelConfig
from hlat.models.layers import GeluMLP, Transformer


class GPTNeoX(Transformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, norm=nn.LayerNorm, mlp=GeluMLP, parallel_residual=cfg.parallel_residual)
