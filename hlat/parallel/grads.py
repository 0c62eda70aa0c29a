"""The global gradient norm across every mesh dimension, and clipping by it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hlat.dtensor import full


def global_grad_norm(params: list[torch.Tensor], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The total norm of the gradients over the whole model, a 0-d fp32 tensor on their device (no host read).

    Gradients sharded alike (same mesh and placements) are reduced together: their DTensor norm is already
    global over data and tensor parallelism. Pipeline stages hold disjoint parameters, so their squared norms
    are summed over the pipeline group."""
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    squares = []
    for group in groups.values():
        # accumulated in fp32 even for bf16 gradients, whose own norm would be off by up to 2**-8
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in group])
        norm = torch.linalg.vector_norm(norms)
        squares.append(full(norm) ** 2)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping to `max_norm` multiplies every gradient by, min(1, max_norm / (norm + 1e-6)) (the formula
    of torch's clip_grads_with_norm_), as a 0-d tensor on the norm's device: an optimizer that reads each gradient
    anyway (BF16AdamW's `grad_scale`) applies it there instead of in a pass of its own (`clip_in_place`)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_in_place(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Every gradient of `params` multiplied in place by clip_coefficient(norm, max_norm), for the optimizers
    that take the gradients as they are (torch's AdamW): one call per device mesh the gradients are on (DTensor
    multiplies them by one coefficient on one mesh; the experts' weights have a mesh of their own)."""
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
