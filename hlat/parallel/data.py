"""Data parallelism with FSDP2 (`fully_shard`): FSDP over dp_shard, DDP over dp_replicate, HSDP over both,
and ZeRO-1-style sharding (parameters gathered once per step and kept through backward)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from hlat.models.moe import MoE
from hlat.parallel.experts import even_placement, expert_data_parallel


def apply_data_parallel(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    zero1: bool,
    pipelined: bool,
    experts: DeviceMesh | None = None,
) -> None:
    """Shard each block, then the rest of the model. `dp_mesh` is (dp_shard), or (dp_replicate, dp_shard) with
    replicas (`data_parallel_dims`): a shard dimension of size 1 there makes it plain replication, with gradients
    all-reduced as in DDP. Under expert parallelism each block's experts first, over the ranks that hold the same
    ones (`experts`, `expert_data_parallel`).

    With zero1 (or under a pipeline, where each micro-batch would otherwise gather the weights again) the
    parameters stay gathered from forward through backward: only optimizer states and gradients are
    sharded, which trades memory for one all-gather per step instead of two per micro-batch."""
    keep_gathered = zero1 or pipelined
    for block in model.layers.values():
        moe = isinstance(block.feed_forward, MoE)
        if experts is not None:
            expert_data_parallel(block.feed_forward.experts, experts, keep_gathered)
        # a mixture of experts' router has a row per expert: by columns where its rows do not divide
        placement = even_placement(dp_mesh.size(-1)) if moe else None
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=not keep_gathered, shard_placement_fn=placement)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=not keep_gathered)


def sync_gradients(model: nn.Module, sharded: bool, last_micro_batch: bool) -> None:
    """Under gradient accumulation, reduce across data-parallel ranks once per step rather than once per
    micro-batch (pipeline schedules do this for their stages themselves). Replicated and ZeRO-1 layouts keep full
    gradients anyway, so they skip every reduction until the last micro-batch; FSDP (`sharded`) reduce-scatters
    each micro-batch to hold only its shard of the gradients, and HSDP defers just the all-reduce across
    replicas."""
    if not isinstance(model, FSDPModule):
        return
    if sharded:
        model.set_requires_all_reduce(last_micro_batch)
    else:  # ZeRO-1 keeps the parameters gathered until the last backward: one all-gather per step, not per micro-batch
        model.set_requires_gradient_sync(last_micro_batch)
        model.set_reshard_after_backward(last_micro_batch)
