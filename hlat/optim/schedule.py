"""Linear warmup then cosine decay to a minimum learning rate."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based). Warmup reaches `lr` at step warmup_steps - 1 (so the
    first step never runs at 0); cosine then falls to `min_lr` at `decay_steps` and stays there."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
