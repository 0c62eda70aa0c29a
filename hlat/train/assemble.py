"""A model assembled for training, in the one order that works (`assemble`): cast to the precision mode's dtype on
the meta device, the blocks' linear layers swapped for FP8 ones (precision.fp8), split into this rank's pipeline
stages and parallelised (tensor, context, recomputation, compile, FSDP/DDP), only then allocated and initialised,
and one optimizer per part; the pipeline schedule that runs them, if any. The trainer, the rehearsal and the
benchmarks all assemble their models here, each with the `Recipe` it has.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from hlat.config.job import Config
from hlat.optim import OptimConfig, build_optimizer
from hlat.optim.fp8 import convert_blocks, precompute_scales_after_step
from hlat.optim.precision import autocast, dtypes, prepare_model
from hlat.parallel import Topology, parallelize
from hlat.parallel.pipeline import StageShapes, build_schedule
from hlat.train.step import ModelParts


@dataclass(frozen=True)
class Recipe:
    """How a model trains, as far as its assembly goes."""

    mode: str  # the precision mode (precision.mode)
    optim: OptimConfig
    seed: int = 0  # of the initial weights and of the optimizer's rounding
    fp8: str = "none"  # precision.fp8's scaling recipe for the blocks' linear layers
    fp8_emulated: bool = False  # FP8 emulated where the device has no FP8 matmuls (hlat.optim.fp8.fp8_support)
    microbatches: int = 1  # this rank's micro-batches per step (a pipeline schedule runs them)

    @classmethod
    def of(cls, cfg: Config, fp8_support: str, microbatches: int) -> Recipe:
        """The recipe of a run's config; `fp8_support`: "native" or "emulated" on the run's device."""
        return cls(
            cfg.precision.mode, cfg.optim, cfg.train.seed, cfg.precision.fp8, fp8_support == "emulated", microbatches
        )


def assemble(
    model: nn.Module,
    topo: Topology,
    device: torch.device,
    recipe: Recipe,
    weights: str = "drawn",
    shapes: StageShapes | None = None,
) -> ModelParts:
    """This rank's parts of the meta-device `model`, assembled for training by `recipe` in the module docstring's
    order, initialised as `weights` says (`hlat.models.materialize`); the pipeline schedule's stages given their
    boundaries' `shapes`, or inferring them from the first micro-batch."""
    torch.manual_seed(recipe.seed)
    layout, n_stages = topo.cfg, topo.cfg.stages()
    model = prepare_model(model, recipe.mode)
    fp8_all_gather = recipe.fp8 == "tensorwise" and layout.shards > 1
    if recipe.fp8 != "none":
        convert_blocks(model, recipe.fp8, recipe.fp8_emulated, fp8_all_gather)
    stages = parallelize(model, topo, device, recipe.seed, weights)
    parts = [module for _, module in stages]
    optimizers = [build_optimizer(part, recipe.optim, recipe.mode, recipe.seed) for part in parts]
    if fp8_all_gather:
        for optimizer, part in zip(optimizers, parts):
            precompute_scales_after_step(optimizer, part)
    return ModelParts(
        parts=parts,
        optimizers=optimizers,
        schedule=build_schedule(stages, topo, device, recipe.microbatches, shapes) if layout.pp > 1 else None,
        first_stage=any(sid == 0 for sid, _ in stages),
        last_stage=any(sid == n_stages - 1 for sid, _ in stages),
        sharded_grads=layout.shards > 1 and not layout.zero1,
        autocast=autocast(recipe.mode, device),
        loss_context=loss_parallel if layout.tp > 1 else contextlib.nullcontext,
    )


def stage_shapes(cfg: Config) -> StageShapes:
    """The shapes at a run's pipeline stage boundaries (a micro-batch of hidden states in the mode's compute dtype), so
    that its stages need no shape-inference pass."""
    hidden, _ = dtypes(cfg.precision.mode)
    return StageShapes(cfg.train.micro_batch, cfg.train.seq_len, hidden)
