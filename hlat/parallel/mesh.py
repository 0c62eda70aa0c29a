"""Process group and device mesh: one mesh with dimensions (pp, dp_replicate, dp_shard, cp, tp), tp innermost so
tensor-parallel peers are neighbouring ranks (the same node under torchrun's rank order), context-parallel peers
next.

FSDP shards the parameters over dp_shard x cp together (the context-parallel ranks train on parts of the same
sequences, so they reduce the same gradients), and tensor parallelism inside each shard group: `fully_shard` needs
its mesh and the tensor-parallel one cut from one root mesh. With cp > 1 that root is a second mesh, (pp,
dp_replicate, dp_shard_cp, tp), made from the first mesh's groups and one new group per dp_shard x cp block through
torch's public `DeviceMesh.from_group`, not by flattening the first one (a private method).

Expert parallelism (ep > 1) adds a third mesh over the same ranks, (pp, dp_replicate, ep_shard, ep, tp): each
block of dp_shard x cp ranks split into ep_shard x ep, ep innermost. A mixture-of-experts layer's experts are spread
over ep (the ranks that send each other their tokens) and FSDP shards each rank's experts over ep_shard (the ranks
holding the same ones)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hlat.parallel.config import ParallelConfig, world_size_from_env
from hlat.parallel.store import AttemptStore, restart_attempt, start_process_group

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIMS = ("pp", "dp_replicate", "ep_shard", "ep", "tp")


@dataclass
class Topology:
    """Where this process sits: its mesh (None in a single process), the mesh FSDP and tensor parallelism shard
    over (`mesh` itself unless cp > 1), and its coordinates."""

    cfg: ParallelConfig
    mesh: DeviceMesh | None
    sharding: DeviceMesh | None = None
    rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    store: AttemptStore | None = None  # where this attempt's workers meet, when this process formed its group
    experts: DeviceMesh | None = None  # the experts' mesh (EXPERT_DIMS), with ep > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def world_size(self) -> int:
        return self.mesh.size() if self.mesh is not None else 1

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.mesh.get_group(dim)

    @property
    def dp_mesh(self) -> DeviceMesh:
        """What `fully_shard` shards and replicates over (`data_parallel_dims`)."""
        return self.sharding[data_parallel_dims(self.cfg.dp_replicate, self.cfg.fsdp_dim)]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.sharding["tp"]

    @property
    def expert_weights_mesh(self) -> DeviceMesh:
        """What the experts' weights are split over under expert parallelism besides data parallelism: ep (their
        experts), and with tensor parallelism tp (a slice of each expert's ffn_dim)."""
        return self.experts[("ep", "tp") if self.cfg.tp > 1 else "ep"]

    @property
    def expert_dp_mesh(self) -> DeviceMesh:
        """What `fully_shard` shards and replicates the experts over under expert parallelism (as `dp_mesh`)."""
        return self.experts[data_parallel_dims(self.cfg.dp_replicate, "ep_shard")]

    def dim_groups(self) -> dict[str, dist.ProcessGroup]:
        """{mesh dimension: this rank's group} of every mesh."""
        meshes = [self.mesh] + ([self.sharding] if self.sharding is not self.mesh else [])
        meshes += [self.experts] if self.experts is not None else []
        return {dim: mesh.get_group(dim) for mesh in meshes for dim in mesh.mesh_dim_names}


def data_parallel_dims(dp_replicate: int, shard_dim: str) -> tuple[str, ...]:
    """The mesh dimensions `fully_shard` spans: (dp_replicate, `shard_dim`), or `shard_dim` alone without replicas.
    A dimension of size 1 is not free: each DTensor op works out its placement on every dimension of its mesh
    (measured: FSDP over (1, 2) took 2.2x as long as over (2,) for the optimizer's step, 4x for the first
    forward and backward, whose shardings are not yet cached)."""
    return ("dp_replicate", shard_dim) if dp_replicate > 1 else (shard_dim,)


def init_topology(cfg: ParallelConfig, device: torch.device, timeout_s: float = 600.0) -> Topology:
    """Start the process group when launched by torchrun (the backend of `device`'s type: gloo on CPU, NCCL on
    CUDA, ...), a collective failing after `timeout_s`, and build the mesh; a process group already started
    (`hlat rehearse`'s fake one) is used as it is."""
    if world_size_from_env() == 1 and not dist.is_initialized():
        return Topology(cfg, None)
    store = None if dist.is_initialized() else start_process_group(device, timeout_s)
    shape = tuple(getattr(cfg, d) for d in MESH_DIMS)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
    coord = dict(zip(MESH_DIMS, mesh.get_coordinate()))
    return Topology(
        cfg,
        mesh,
        mesh if cfg.cp == 1 else sharding_mesh(mesh, cfg),
        rank=dist.get_rank(),
        pp_rank=coord["pp"],
        cp_rank=coord["cp"],
        tp_rank=coord["tp"],
        dp_rank=coord["dp_replicate"] * cfg.dp_shard + coord["dp_shard"],
        store=store,
        experts=expert_mesh(mesh, cfg) if cfg.ep > 1 else None,
    )


def continues_run() -> bool:
    """Whether this process is a worker of a torchrun job that restarts its workers (--max-restarts > 0): every
    attempt of such a job continues its run, as with --resume auto. Not only the restarted ones: the restart count
    is each node's own, and a node whose workers restart for another node's failure may keep 0 (#108158)."""
    return restart_attempt() > 0 or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def sharding_mesh(mesh: DeviceMesh, cfg: ParallelConfig) -> DeviceMesh:
    """(pp, dp_replicate, dp_shard_cp, tp) over the same ranks as `mesh`: its pp, dp_replicate and tp groups, and
    a group of each block of dp_shard x cp ranks (every rank creates every block's group, in the same order, as
    `new_group` requires)."""
    ranks = mesh.mesh.reshape(cfg.pp, cfg.dp_replicate, cfg.shards, cfg.tp)
    groups = [mesh.get_group("pp"), mesh.get_group("dp_replicate"), own_group(ranks, 2), mesh.get_group("tp")]
    return DeviceMesh.from_group(
        groups, mesh.device_type, mesh=ranks, mesh_dim_names=("pp", "dp_replicate", cfg.fsdp_dim, "tp")
    )


def expert_mesh(mesh: DeviceMesh, cfg: ParallelConfig) -> DeviceMesh:
    """(pp, dp_replicate, ep_shard, ep, tp) over the same ranks as `mesh`: its pp, dp_replicate and tp groups, and a
    group of each block of ep and of ep_shard ranks."""
    ranks = mesh.mesh.reshape(cfg.pp, cfg.dp_replicate, cfg.expert_shards, cfg.ep, cfg.tp)
    groups = [mesh.get_group("pp"), mesh.get_group("dp_replicate"), own_group(ranks, 2), own_group(ranks, 3)]
    return DeviceMesh.from_group(
        groups + [mesh.get_group("tp")], mesh.device_type, mesh=ranks, mesh_dim_names=EXPERT_DIMS
    )


def own_group(ranks: torch.Tensor, dim: int) -> dist.ProcessGroup:
    """This rank's group of the ranks along dimension `dim` of the rank grid `ranks`, making every such group (every
    rank makes every group, in the same order, as `new_group` requires)."""
    mine = None
    for block in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
        group = dist.new_group(block)
        if dist.get_rank() in block:
            mine = group
    return mine
