"""Pipeline parallelism: the model is cut into stages of consecutive blocks (embedding on the first, final
norm and output projection on the last) and run by torch.distributed.pipelining's schedules."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from hlat.parallel.config import stage_layers
from hlat.parallel.mesh import Topology


def split_model(model: nn.Module, topo: Topology) -> list[tuple[int, nn.Module]]:
    """(stage id, stage module) for this rank, cut from a model on the meta device (copies are free)."""
    n_stages = topo.cfg.stages()
    ranges = stage_layers(model.cfg.n_layers, n_stages)
    parts = []
    for sid in topo.cfg.rank_stages(topo.pp_rank):
        part = copy.deepcopy(model)
        for name in [n for n in part.layers if int(n) not in ranges[sid]]:
            del part.layers[name]
        if sid > 0:
            part.tok_embeddings = None
        if sid < n_stages - 1:
            part.norm = part.output = None
        parts.append((sid, part))
    return parts


@dataclass(frozen=True)
class StageShapes:
    """What crosses the stage boundaries for one micro-batch, given to the stages so that they need not infer it
    by communicating (`hlat rehearse`: a fake process group carries no shapes). The first stage takes tokens
    [micro_batch, seq_len / cp]; every later one hidden states [micro_batch, seq_len / cp, dim] in the parameters'
    dtype, the sequence split over tp under sequence parallelism; the last, given the targets, returns the micro-batch's
    loss, a plain fp32 scalar (hlat.models.layers.Transformer.loss)."""

    micro_batch: int
    seq_len: int
    hidden_dtype: torch.dtype


def stage_examples(topo: Topology, model_cfg, sid: int, shapes: StageShapes) -> dict:
    """PipelineStage's input_args and output_args for stage `sid` (meta tensors: shapes only)."""
    cfg, last = topo.cfg, sid == topo.cfg.stages() - 1
    held = shapes.seq_len // cfg.cp  # the tokens of each sequence this rank holds
    seq = held // cfg.tp if cfg.sequence_parallel and cfg.tp > 1 else held
    hidden = torch.empty(
        shapes.micro_batch, seq, model_cfg.dim, dtype=shapes.hidden_dtype, device="meta", requires_grad=True
    )
    tokens = torch.empty(shapes.micro_batch, held, dtype=torch.long, device="meta")
    loss = torch.empty((), dtype=torch.float32, device="meta")
    return {"input_args": tokens if sid == 0 else hidden, "output_args": loss if last else hidden}


def stage_loss(loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedules' loss_fn: the last stage's forward already returns its micro-batch's loss (the stage is given
    the targets as a keyword argument), and a schedule runs backward from what its loss_fn returns."""
    return loss


def build_schedule(
    parts: list[tuple[int, nn.Module]],
    topo: Topology,
    device: torch.device,
    n_microbatches: int,
    shapes: StageShapes | None = None,
):
    """The layout's schedule over this rank's stages (the last computing the loss: `stage_loss`); with `shapes`
    the stages are given their boundaries instead of inferring them from the first micro-batch."""
    cfg = topo.cfg
    stages = [
        PipelineStage(
            module,
            sid,
            cfg.stages(),
            device,
            group=topo.group("pp"),
            **(stage_examples(topo, module.cfg, sid, shapes) if shapes else {}),
        )
        for sid, module in parts
    ]
    if cfg.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=stage_loss)
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.pp_schedule]
    return schedule(stages[0], n_microbatches=n_microbatches, loss_fn=stage_loss)
