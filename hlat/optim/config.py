"""Optimizer and schedule settings (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args, get_type_hints

from hlat.fields import ConfigError
from hlat.optim.modes import MODES


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5  # cosine decay ends here
    warmup_steps: int = 2000
    decay_steps: int = 0  # cosine horizon in steps (including warmup); 0 = the run's train.steps
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms_and_biases: bool = True  # HLAT decays every parameter, norms included
    clip_grad_norm: float = 1.0  # 0 disables clipping

    def validate(self) -> OptimConfig:
        for field in ("lr", "eps"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"optim.{field}: must be positive, got {getattr(self, field)}")
        for field in ("min_lr", "weight_decay", "clip_grad_norm", "warmup_steps", "decay_steps"):
            if getattr(self, field) < 0:
                raise ConfigError(f"optim.{field}: must be >= 0, got {getattr(self, field)}")
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr: {self.min_lr} is larger than optim.lr {self.lr}")
        for field in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ConfigError(f"optim.{field}: must be in [0, 1), got {getattr(self, field)}")
        return self


Mode = Literal[tuple(MODES)]  # the precision modes' names, as the config's choices


@dataclass
class PrecisionConfig:
    # what weights, gradients, optimizer states and compute are kept in (docs/precision.md): fp32; bf16_mixed (bf16
    # compute, fp32 master weights and states); bf16_sr (pure bf16, stochastic rounding on update); bf16_kahan (pure
    # bf16, a Kahan compensation buffer)
    mode: Mode = "fp32"
    # FP8 matmuls in the transformer blocks' linear layers (torchao float8 training, docs/precision.md), on top of
    # a bf16 mode: "none", "tensorwise" or "rowwise" (the scaling granularity); emulated on a CPU
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"

    def validate(self) -> PrecisionConfig:
        if self.mode not in MODES:
            raise ConfigError(f"precision.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.fp8 != "none" and self.mode == "fp32":
            raise ConfigError(
                "precision.fp8: FP8 matmuls need a bf16 mode (bf16_mixed, bf16_sr or bf16_kahan); "
                "precision.mode is fp32"
            )
        return self


FP8_RECIPES = tuple(r for r in get_args(get_type_hints(PrecisionConfig)["fp8"]) if r != "none")  # torchao's scalings
