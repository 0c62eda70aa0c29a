"""Data parallelism with FSDP2 (`fully_shard`): FSDP over dp_shard, DDP over dp_replicate, HSDP over both,
and ZeRO-1-style sharding (parameters gathered once per step and kept through backward)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh, zero1: bool, pipelined: bool) -> None:
    """Shard each block, then the rest of the model. `dp_mesh` is 2-D (dp_replicate, dp_shard): a shard
    dimension of size 1 makes it plain replication, with gradients all-reduced as in DDP.

    With zero1 (or under a pipeline, where each micro-batch would otherwise gather the weights again) the
    parameters stay gathered from forward through backward: only optimizer states and gradients are
    sharded, which trades memory for one all-gather per step instead of two per micro-batch."""
    keep_gathered = zero1 or pipelined
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=not keep_gathered)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=not keep_gathered)
