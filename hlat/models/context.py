"""Context parallelism as the model runs it: each rank of a context-parallel group holds a part of every sequence
(`hlat.parallel.context` chooses the parts and gives each rank its tokens with their true positions). Attention
takes every rank's keys and values (`SequenceSplit.gather`), the mask which of them each query sees (from the
gathered positions and document ids), and the loss is normalised by the counted tokens of the whole sequences."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


@dataclass(frozen=True, eq=False)
class SequenceSplit:
    """The context-parallel ranks a sequence is split over: a 1-D mesh."""

    mesh: DeviceMesh

    @property
    def size(self) -> int:
        return self.mesh.size()

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim` in rank order (an all-gather). Each rank's queries use all of
        it, so its gradient is each rank's partial sum: declared so, DTensor's backward reduce-scatters it and
        every rank gets the whole gradient of its own part."""
        gathered = DTensor.from_local(t, self.mesh, [Shard(dim)], run_check=False).redistribute(
            self.mesh, [Replicate()]
        )
        return gathered.to_local(grad_placements=[Partial()])

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over the ranks (no gradient)."""
        t = t.detach().clone()
        dist.all_reduce(t, group=self.mesh.get_group())
        return t
