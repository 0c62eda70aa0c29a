"""The training loss: token cross-entropy in fp32, whatever the logits' dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Token loss of [batch, seq, vocab] logits against [batch, seq] targets (-100: ignored), in fp32; the logits
    may be a vocabulary-sharded DTensor (under `loss_parallel`)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
