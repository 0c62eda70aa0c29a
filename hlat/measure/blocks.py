"""Whole blocks of the real model timed as the trainer runs them (`hlat.measure.timed_model`), plain and under
each data-parallel arrangement, and the trainer's update over their parameters; each timing recorded under the
shape the planner looks it up by (`hlat.planner.costs.block_shape`, `dp_block_shape`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hlat.dtensor import local_elements
from hlat.measure.options import Options
from hlat.measure.report import ComputeRow
from hlat.measure.timed_model import (
    TimedModel,
    block_mesh,
    block_step,
    build_timed_model,
    embedding_step,
    ends_step,
    settle,
    time_steps,
)
from hlat.measure.timing import timed_on_every_rank
from hlat.optim import build_optimizer
from hlat.optim.modes import MODES
from hlat.parallel.grads import global_grad_norm
from hlat.planner.costs import block_shape, dp_block_shape, optimizer_bytes
from hlat.train.step import clipped_update


@dataclass
class BlockTiming:
    """One timing of a block and the rest of a micro-batch, at one shape."""

    shape: str  # the profile's key: `block_shape`, or `dp_block_shape` under data parallelism
    layout: str  # how the report names the shape
    size: str  # micro-batch x sequence
    block_s: float  # per block, forward + backward
    ends_s: float  # embedding, final norm, output layer and loss, forward + backward
    embedding_s: float = 0.0  # of which the embedding; 0: not timed apart

    def rows(self) -> list[ComputeRow]:
        rows = [
            ComputeRow(f"block (fwd+bwd) {self.layout}", self.size, self.block_s),
            ComputeRow(f"embedding, output layer, loss (fwd+bwd) {self.layout}", self.size, self.ends_s),
        ]
        if self.embedding_s:
            rows.append(ComputeRow(f"of which the embedding (fwd+bwd) {self.layout}", self.size, self.embedding_s))
        return rows


@dataclass
class UpdateTiming:
    """The trainer's update (clipping and its optimizer) over the timed parameters."""

    optimizer: str
    precision: str
    params: int
    seconds: float
    gbs: float  # of the precision mode's nominal AdamW bytes

    def row(self) -> ComputeRow:
        return ComputeRow(
            f"update (clip, {self.optimizer}) {self.precision}",
            f"{self.params} params",
            self.seconds,
            f"{self.gbs:.3g} GB/s",
        )


def block_rows(timings: list[BlockTiming], update: UpdateTiming | None) -> list[ComputeRow]:
    """The report's rows of the timings, the update's last."""
    return [row for timing in timings for row in timing.rows()] + ([update.row()] if update else [])


def block_fields(timings: list[BlockTiming], update: UpdateTiming | None) -> dict:
    """The `Measured` fields of the timings: one entry per shape, in the order they were taken."""
    fields = {
        "block_shapes": [t.shape for t in timings],
        "block_s": [t.block_s for t in timings],
        "ends_s": [t.ends_s for t in timings],
        "embedding_s": [t.embedding_s for t in timings],
    }
    if update is None:
        return fields
    return {**fields, "bf16_optimizer_gbs" if update.optimizer == "BF16AdamW" else "optimizer_gbs": update.gbs}


def measure_blocks(options: Options, device: torch.device, world: int) -> tuple[list[BlockTiming], UpdateTiming | None]:
    """Whole blocks of the real model, forward + backward, and the rest of a micro-batch (embedding, final
    norm, output layer and loss), run as the trainer runs them (`build_timed_model`), for each tensor-parallel
    degree that divides the ranks (over groups of neighbouring ranks, as the trainer's mesh puts tp innermost) and
    each micro-batch. After the first of these, the trainer's update over the same parameters (`measure_update`;
    None where no tensor-parallel degree divides the ranks).

    With ranks left over by tensor parallelism (dp = world / tp > 1), the same again under each data-parallel
    arrangement of `options.data_parallel`, wrapped in `fully_shard` by the trainer's own code over those ranks:
    as the last micro-batch of a step runs (gradients reduced) and, for ZeRO-1 and DDP, as the others run
    (gradients accumulated, no reduction). Their excess over the plain timing is what the layout's data
    parallelism costs on this hardware, copies and contention included."""
    timings, update = [], None
    for tp in (tp for tp in options.tps if world % tp == 0):
        for arrangement in (None, *(options.data_parallel if world > tp else ())):
            mesh = block_mesh(device, world, tp, arrangement)
            for micro_batch in options.micro_batches():
                timed_model = build_timed_model(options, device, mesh, micro_batch, arrangement)
                if arrangement is not None:
                    timings += data_parallel_timings(options, timed_model, arrangement, world)
                    continue
                timings.append(plain_timing(options, timed_model, world))
                if update is None:  # the first plain timing: its gradients are a backward's, as the update finds them
                    update = measure_update(options, timed_model)
            settle(mesh)
    return timings, update


def plain_timing(options: Options, timed_model: TimedModel, world: int) -> BlockTiming:
    """Blocks, ends and embedding without data parallelism, under `block_shape`."""
    shape, layout, size = block_labels(options, timed_model)
    steps = (block_step, ends_step, embedding_step)
    return BlockTiming(shape, layout, size, *time_steps(timed_model, steps, world, options.repeats))


def data_parallel_timings(options: Options, timed_model: TimedModel, arrangement: str, world: int) -> list[BlockTiming]:
    """Blocks and ends under `arrangement` as a step's last micro-batch runs them and, for ZeRO-1 and DDP (whose
    other micro-batches reduce nothing), as the others do; under `dp_block_shape`."""
    shape, layout, size = block_labels(options, timed_model)
    timings = []
    for accumulate in (False,) if arrangement == "fsdp" else (False, True):
        timed_model.sync(accumulate)
        block_s, ends_s = time_steps(timed_model, (block_step, ends_step), world, options.repeats)
        dp_shape = dp_block_shape(shape, arrangement, world // timed_model.tp, accumulate)
        timings.append(BlockTiming(dp_shape, f"{layout} {dp_shape.split(' | ')[-1]}", size, block_s, ends_s))
    return timings


def block_labels(options: Options, timed_model: TimedModel) -> tuple[str, str, str]:
    """The block's shape (the profile's key), its layout as the report names it, and micro-batch x sequence."""
    tp, micro_batch = timed_model.tp, timed_model.micro_batch
    sequence_parallel = options.sequence_parallel and tp > 1
    compiled = options.compiled_blocks(tp)
    shape = block_shape(
        options.model,
        options.seq_len,
        micro_batch,
        options.precision,
        tp,
        sequence_parallel,
        options.recompute,
        compiled,
    )
    layout = (
        f"tp{tp}{' sp' if sequence_parallel else ''} ac:{options.recompute} {options.precision}"
        f"{' compiled' if compiled else ''}"
    )
    return shape, layout, f"{micro_batch}x{options.seq_len}"


def measure_update(options: Options, timed_model: TimedModel) -> UpdateTiming:
    """The end of the trainer's step over the timed blocks' and the rest's parameters, with the gradients their
    backward left: the global gradient norm, then the trainer's optimizer for the precision mode clipping by it
    (`build_optimizer`: fused AdamW on CUDA, foreach on the CPU, after scaling the gradients; BF16AdamW in the
    pure-bf16 modes, scaling them in its update). As GB/s of the mode's nominal AdamW bytes
    (`hlat.planner.costs.optimizer_bytes`), the figure the planner prices a device's parameters at. Taken over a
    few blocks' worth of tensors, not one: on the 2-core CPU host a lone layer-sized tensor's fastest AdamW step
    ran at 15 GB/s, five times its median, where the trainer's update over the whole `small` model ran at 6-7."""
    parts = nn.ModuleList([timed_model.blocks, timed_model.rest])
    params = [p for p in parts.parameters() if p.grad is not None]
    optimizer = build_optimizer(parts, options.optim, options.precision)
    seconds = timed_on_every_rank(
        lambda: update_step(params, optimizer, options.optim.clip_grad_norm), timed_model.device, options.repeats
    )
    count = local_elements(params)
    mode = MODES[options.precision]
    gbs = optimizer_bytes(count, mode.weight_bytes, mode.grad_bytes, mode.optimizer_bytes) / seconds / 1e9
    return UpdateTiming(type(optimizer).__name__, options.precision, count, seconds, gbs)


def update_step(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """The trainer's: the global gradient norm, then the update clipped by it (`clipped_update`)."""
    clipped_update([optimizer], global_grad_norm(params), max_norm)
