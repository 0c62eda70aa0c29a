"""Expert parallelism (docs/moe.md): each mixture-of-experts layer's experts spread over the ep ranks of the experts'
mesh (`hlat.parallel.mesh`), in order, and each rank's tokens sent to their experts' ranks and back by all-to-all
(`hlat.models.moe.ExpertDispatch`); with tensor parallelism, each expert's ffn_dim split over tp like a SwiGLU's
(w1 and w3 by rows, w2 by columns). The weights stay one tensor per matrix, [n_experts, out, in], sharded as
DTensors, so checkpoints hold every expert under its parameter's name and load at any expert-parallel size.

FSDP then shards each rank's experts over the ep_shard ranks that hold the same ones (`expert_data_parallel`): by
experts where they divide evenly, else by rows. Each expert's gradient sums the tokens every ep rank sent it, each
rank's loss already a mean over its own tokens: it is the single process's once averaged over every data-parallel
rank, dp_replicate x dp_shard x cp, where FSDP averages over the dp_replicate x ep_shard ranks holding the expert.
The experts divide their gradients by ep for the rest (`GroupedExperts.grad_scale`; FSDP's own divide factor
divides twice over a group of one rank in torch 2.13)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from hlat.dtensor import local
from hlat.models.moe import ExpertDispatch
from hlat.parallel.mesh import Topology


def apply_expert_parallel(model: nn.Module, topo: Topology) -> None:
    """Spread the experts of every mixture-of-experts layer of `model` (a whole model or a pipeline stage of one)
    over ep (and tp: `Topology.expert_weights_mesh`), and send their tokens to them. Before tensor parallelism,
    which splits the experts over tp itself where there is no expert parallelism (`split_experts`)."""
    mesh = topo.expert_weights_mesh
    for block in model.layers.values():
        experts = block.feed_forward.experts
        split_experts(experts, mesh)
        block.feed_forward.dispatch = ExpertDispatch(topo.experts.get_group("ep"), topo.cfg.ep)
        experts.grad_scale = 1 / topo.cfg.ep


def split_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """The experts' weights as DTensors over `mesh`: by expert over its ep dimension, each expert's ffn_dim over
    its tp dimension (w1 and w3 by rows, w2 by columns)."""
    for name, param in list(experts.named_parameters()):
        placements = [Shard(0) if dim == "ep" else Shard(2 if name == "w2" else 1) for dim in mesh.mesh_dim_names]
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements)))


def expert_data_parallel(experts: nn.Module, mesh: DeviceMesh, keep_gathered: bool) -> None:
    """`fully_shard` a layer's experts over the ranks holding the same ones (`mesh`: ep_shard, with dp_replicate)."""
    fully_shard(
        experts, mesh=mesh, reshard_after_forward=not keep_gathered, shard_placement_fn=even_placement(mesh.size(-1))
    )


def even_placement(shards: int) -> Callable[[nn.Parameter], Shard]:
    """FSDP's placement of a parameter over `shards` ranks: by rows where they divide evenly, else by columns where
    those do (FSDP pads rows that do not divide, so that every rank stores as many: a router's few rows over many
    ranks, or fewer experts on a rank than ranks holding them, would waste most of their shards)."""

    def placement(param: nn.Parameter) -> Shard:
        shape = local(param).shape
        return Shard(1) if shape[0] % shards and len(shape) > 1 and shape[1] % shards == 0 else Shard(0)

    return placement
