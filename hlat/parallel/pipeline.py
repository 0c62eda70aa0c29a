"""Pipeline parallelism: the model is cut into stages of consecutive blocks (embedding on the first, final
norm and output projection on the last) and run by torch.distributed.pipelining's schedules."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from hlat.parallel.mesh import Topology


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Consecutive blocks per stage, as even as possible; the first and last stages, which also hold the
    embedding and the output projection, get the smaller share when the split is uneven."""
    base, extra = divmod(n_layers, n_stages)
    sizes = [base] * n_stages
    middle_first = list(range(1, n_stages - 1)) + [0, n_stages - 1]
    for i in middle_first[:extra]:
        sizes[i] += 1
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def stage_ids(topo: Topology) -> list[int]:
    """The stages this pipeline rank runs: one, or under interleaved_1f1b one per virtual stage (looped:
    rank r holds stages r, r + pp, r + 2 pp, ...)."""
    cfg = topo.cfg
    return [topo.pp_rank + k * cfg.pp for k in range(cfg.stages() // cfg.pp)]


def split_model(model: nn.Module, topo: Topology) -> list[tuple[int, nn.Module]]:
    """(stage id, stage module) for this rank, cut from a model on the meta device (copies are free)."""
    n_stages = topo.cfg.stages()
    ranges = stage_layers(model.cfg.n_layers, n_stages)
    parts = []
    for sid in stage_ids(topo):
        part = copy.deepcopy(model)
        for name in [n for n in part.layers if int(n) not in ranges[sid]]:
            del part.layers[name]
        if sid > 0:
            part.tok_embeddings = None
        if sid < n_stages - 1:
            part.norm = part.output = None
        parts.append((sid, part))
    return parts


def build_schedule(parts: list[tuple[int, nn.Module]], topo: Topology, device: torch.device,
                   n_microbatches: int, loss_fn: Callable):
    cfg = topo.cfg
    stages = [PipelineStage(module, sid, cfg.stages(), device, group=topo.group("pp")) for sid, module in parts]
    if cfg.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.pp_schedule]
    return schedule(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
