"""Parallelism applied from outside the model, one function per concern, in torchtitan's order: pipeline
split, expert parallelism, tensor parallelism, context parallelism, activation checkpointing, compilation, data
parallelism (over dp_shard x cp); then the (still meta) parts are allocated and initialised, identically to a single
process.

Torch is imported on first use, so `hlat.parallel.config` stays torch-free for `hlat describe` and the planner."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hlat import HlatError
from hlat.parallel.config import ParallelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hlat.parallel.mesh import Topology

__all__ = ["ParallelConfig", "Topology", "init_topology", "parallelize", "shard_parts"]


def __getattr__(name: str):
    if name in ("Topology", "init_topology"):
        from hlat.parallel import mesh

        return getattr(mesh, name)
    raise AttributeError(f"module 'hlat.parallel' has no attribute {name!r}")


def parallelize(
    model: nn.Module, topo: Topology, device: torch.device, seed: int, weights: str = "drawn"
) -> list[tuple[int, nn.Module]]:
    """(stage id, module) for the parts of a meta-device `model` this rank runs, parallelised and initialised
    (`hlat.models.materialize`). Without pipeline parallelism that is [(0, model)]; a single process (no mesh)
    still gets activation checkpointing and compilation."""
    from hlat.models import materialize

    parts = shard_parts(model, topo)
    for _, part in parts:
        materialize(part, device, seed, weights)
    return parts


def shard_parts(model: nn.Module, topo: Topology) -> list[tuple[int, nn.Module]]:
    """`parallelize` up to the allocation: the parts split, sharded and wrapped, still on the meta device (their
    tensors have this rank's shapes, so what the rank will hold can be counted before it is allocated)."""
    from hlat.parallel.context import apply_context_parallel
    from hlat.parallel.data import apply_data_parallel
    from hlat.parallel.experts import apply_expert_parallel
    from hlat.parallel.pipeline import split_model
    from hlat.parallel.recompute import apply_recomputation
    from hlat.parallel.tensor import apply_tensor_parallel

    cfg = topo.cfg
    parts = split_model(model, topo) if cfg.pp > 1 else [(0, model)]
    for _, part in parts:
        if cfg.ep > 1:
            apply_expert_parallel(part, topo)
        if cfg.tp > 1:
            apply_tensor_parallel(part, topo.tp_mesh, cfg.sequence_parallel)
        if cfg.cp > 1:
            apply_context_parallel(part, topo.mesh["cp"])
        apply_recomputation(part, cfg.activation_checkpoint)
        if cfg.compile:
            compile_blocks(part, cfg)
        if cfg.dp * cfg.cp > 1:
            experts = topo.expert_dp_mesh if cfg.ep > 1 else None
            apply_data_parallel(part, topo.dp_mesh, cfg.zero1, pipelined=cfg.pp > 1, experts=experts)
    return parts


def compile_blocks(part: nn.Module, cfg: ParallelConfig) -> None:
    """torch.compile each block of `part` with the configured backend."""
    # HLAT moved the compile cache to each node's local disk: a shared file system became the bottleneck
    if cfg.compile_cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cfg.compile_cache_dir
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/hlat-compile-cache")
    for block in part.layers.values():
        try:
            block.compile(backend=cfg.compile_backend)
        except Exception as e:  # torch checks the backend name here and says what it knows
            raise HlatError(f"parallel.compile_backend: {str(e).splitlines()[0]}") from None
    if cfg.tp > 1 and part.tok_embeddings is not None:
        # The vocabulary-parallel embedding finishes its collective asynchronously; a pending result
        # must not enter a compiled block (torch 2.13 then hands its backward a plain tensor).
        part.tok_embeddings.register_forward_hook(lambda module, args, output: output.clone())
