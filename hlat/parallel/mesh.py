"""Process group and device mesh: one mesh with dimensions (pp, dp_replicate, dp_shard, tp), tp innermost so
tensor-parallel peers are neighbouring ranks (the same node under torchrun's rank order)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hlat.parallel.config import ParallelConfig, world_size_from_env
from hlat.parallel.device import backend_for

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class Topology:
    """Where this process sits: its mesh (None in a single process) and its coordinates."""

    cfg: ParallelConfig
    mesh: DeviceMesh | None
    rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def world_size(self) -> int:
        return self.mesh.size() if self.mesh is not None else 1

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.mesh.get_group(dim)


def init_topology(cfg: ParallelConfig, device: torch.device, timeout_s: float = 600.0) -> Topology:
    """Start the process group when launched by torchrun (the backend of `device`'s type: gloo on CPU, NCCL on
    CUDA, ...), a collective failing after `timeout_s`, and build the mesh; a process group already started
    (`hlat rehearse`'s fake one) is used as it is."""
    if world_size_from_env() == 1 and not dist.is_initialized():
        return Topology(cfg, None)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s))
    shape = tuple(getattr(cfg, d) for d in MESH_DIMS)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
    coord = dict(zip(MESH_DIMS, mesh.get_coordinate()))
    return Topology(cfg, mesh, rank=dist.get_rank(), pp_rank=coord["pp"], tp_rank=coord["tp"],
                    dp_rank=coord["dp_replicate"] * cfg.dp_shard + coord["dp_shard"])


def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order, over the default group (a collective: every rank calls it);
    [obj] without a process group."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
