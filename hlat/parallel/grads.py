"""Global gradient-norm clipping across every mesh dimension."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hlat.dtensor import full


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None
                   ) -> torch.Tensor:
    """Clip to `max_norm` (0: only measure) and return the total norm over the whole model.

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
    total = total.sqrt()
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
