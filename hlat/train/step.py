"""One optimizer step on every rank, as an object of its own (`TrainStep`): the model parts this rank runs and
their optimizers (`ModelParts`), its micro-batches (`Batches`), its health timing (`Health`), the bad-step check
(`BadSteps`) with the fault a test may inject (`InjectedNaN`), and where the rank sits (`Topology`).
`hlat.train.loop.train` builds it for the trainer, and `hlat rehearse` for one rank of a full-size job, each with
what it has; what happens after a step (metrics, checkpoints, the bad-step policy) is the trainer's.

A step reads from the device once: after the gradient norm, one transfer brings the global loss, the gradient norm
and the flags agreed in the step's all-reduce (a stop requested, the background writes done), which the host needs
to decide whether the optimizers update. The update clips the gradients by that norm (`clipped_update`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hlat.checkpoint.tiers import Writes
from hlat.config.job import Config
from hlat.data.packing import IGNORE, DataStream
from hlat.optim.bf16 import BF16AdamW
from hlat.parallel import Topology
from hlat.parallel.context import split_batch
from hlat.parallel.data import sync_gradients
from hlat.parallel.grads import clip_coefficient, clip_in_place, global_grad_norm
from hlat.train.faults import BadSteps, InjectedNaN
from hlat.train.health import Health


@dataclass
class StepResult:
    """What one step produced, as the host read it."""

    loss: float  # the global batch's mean loss
    grad_norm: float  # the global gradient norm before clipping
    lr: float
    bad: str | None  # why the update was dropped (train.on_bad_step), or None
    stopping: bool  # a stop signal reached some rank: checkpoint and stop after this step
    written: Writes  # the background writes every rank has finished (any rank's failure): commit them
    seconds: float  # the step's wall time
    data_wait_s: float  # of which waiting for data
    redo: bool = False  # replica groups: some rank's cross-replica all-reduce failed; nothing was updated


@dataclass
class ModelParts:
    """The model parts (pipeline stages) this rank holds, their optimizers, and how a step runs them."""

    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedule: object | None  # the pipeline schedule, if pp > 1
    first_stage: bool
    last_stage: bool
    sharded_grads: bool  # FSDP keeps only its shard of the gradients
    autocast: contextlib.AbstractContextManager  # the precision mode's forward context
    loss_context: Callable  # loss_parallel under tensor parallelism (model.loss_chunk = 0: sharded logits), else null

    @functools.cached_property
    def params(self) -> list[nn.Parameter]:  # the parts do not change after `assemble`
        return [p for part in self.parts for p in part.parameters()]


@dataclass
class Share:
    """A replica group's place in a step (parallel.replica_groups): its position among the live groups and their
    number; (0, 1) without replica groups."""

    position: int = 0
    live: int = 1


class Batches:
    """This rank's micro-batches for each step, which its stream gives it (docs/data.md).

    `global` data sharding: every rank's stream is a part of the one global stream, so that each rank trains on
    micro-batches dp_rank, dp_rank + dp, ... of each step's global batch (those a single process would run) and
    the data state is the same on all ranks: one copy in the checkpoint, which resumes under any layout.
    `files`: each data-parallel rank reads its own files, for storage that cannot serve every rank all the data;
    the data states are per rank and a resume needs the same data-parallel size. Context-parallel peers share a
    data-parallel rank, and each keeps its own chunks of the sequences (`split_batch`).

    Under replica groups (`keep`) each group's stream is the whole global stream shared by its own ranks, and a rank
    holds every micro-batch it could be given at any membership: with `dp` ranks a group, micro-batches dp_rank,
    dp_rank + dp, ... of the step. It trains on every `live`-th of those from its group's `position` (`share`),
    and keeps them until the step is committed, so that a step run again among other groups needs no new data."""

    def __init__(self, stream: DataStream, topo: Topology, per_rank: int):
        self.stream, self.rank, self.per_rank = stream, topo.rank, per_rank
        self.keep = bool(topo.cfg.replica_groups)
        self.shared = topo.cfg.data_sharding == "global"
        self.cp, self.cp_rank = topo.cfg.cp, topo.cp_rank
        self.share = Share()
        self.held: list[dict] | None = None  # the step's micro-batches, while kept
        self.before: dict | None = None  # the stream's state before them

    def next_step(self, device: torch.device) -> list[dict]:
        if self.held is None:
            self.before = self.stream.state_dict() if self.keep else None
            self.held = [split_batch(next(self.stream), self.cp, self.cp_rank) for _ in range(self.per_rank)]
        micro = self.held[self.share.position :: self.share.live]
        if not self.keep:
            self.held = None
        return [{k: to_device(t, device) for k, t in batch.items()} for batch in micro]

    def trained(self, dp: int, dp_rank: int) -> dict:
        """Which of the step's micro-batches this rank trains on under replica groups (their indices in the step,
        of `dp` ranks a group) and the tokens they train on (targets that are not padding)."""
        indices = range(self.share.position, self.per_rank, self.share.live)
        tokens = sum(int((self.held[j]["targets"] != IGNORE).sum()) for j in indices)
        return {"micro_batches": [j * dp + dp_rank for j in indices], "tokens": tokens}

    def committed(self) -> None:
        """The step these micro-batches were for is done: the next step takes new ones."""
        self.held = None

    def handover(self) -> dict:
        """What a group that heals from this one takes of the data: the stream's state at the start of the step not
        yet committed, and the rounds the stream holds (`DataStream.rounds_in_hand`)."""
        state = self.before if self.held is not None else self.stream.state_dict()
        return {"state": state, "rounds": self.stream.rounds_in_hand()}

    def take_over(self, handed: dict) -> None:
        """Continue from a healthy peer's `handover` (a heal), dropping the micro-batches held: its rounds are not
        made again (`DataStream.adopt`)."""
        self.held = None
        self.stream.adopt(handed["state"], handed["rounds"])

    @property
    def state_key(self) -> str:
        """The checkpoint key of the trainer state (which holds the data position): one for all ranks, or one per
        rank when each reads its own files."""
        return "trainer" if self.shared else f"trainer_rank{self.rank}"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on `device`; from pinned host memory off the CPU, so the copy does not wait for the
    device's queued work (a copy from pageable memory would)."""
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


@dataclass
class TrainStep:
    """This rank's part of each optimizer step, called with the steps done so far (the module's docstring says what
    it holds and reads); the bad-step check and the injected fault keep their state from step to step."""

    cfg: Config
    topo: Topology
    device: torch.device
    parts: ModelParts
    batches: Batches
    health: Health
    # parallel.replica_groups: the gradients and loss averaged over the live groups (hlat.train.replicas), and
    # whether that completed
    cross_replica: Callable[[list, torch.Tensor], tuple[torch.Tensor, bool]] | None = None
    bad_steps: BadSteps = field(init=False)
    fault: InjectedNaN = field(init=False)

    def __post_init__(self):
        settings = self.cfg.train
        self.bad_steps = BadSteps(settings.spike_sigmas, settings.max_bad_steps)
        self.fault = InjectedNaN(settings.debug_nan_step)

    def __call__(self, step: int, stop_requested: bool, written: Writes = Writes()) -> StepResult:  # noqa: B008 (frozen)
        """Optimizer step `step` + 1 on every rank: forward and backward, the loss summed and the stop and save
        flags agreed in one all-reduce, the gradient norm, one read of those figures by the host, and the update
        (clipped by that norm) unless the step is bad. `written`: this rank's part of the background writes in
        flight is done."""
        started, waited = time.perf_counter(), self.batches.stream.wait_time_s
        lr = self.set_lr(step)
        micro = self.batches.next_step(self.device)
        with self.health.computing():
            local_loss = forward_backward(self.parts, micro, self.device)
        local_loss = self.fault(step + 1, local_loss, self.parts.params)
        with self.health.at_collective():
            crossed = True
            if self.cross_replica is not None:
                local_loss, crossed = self.cross_replica(self.parts.params, local_loss)
            reduced = reduce_step(local_loss, stop_requested, written, failed=not crossed)
        grad_norm = global_grad_norm(self.parts.params, self.pp_group)
        loss, norm, stopping, written, redo = read_figures(reduced, grad_norm, self.topo)  # the step's one read
        self.health.step_read()
        bad = None if redo else self.bad_steps.check(loss, norm)
        if bad is None and not redo:
            clipped_update(self.parts.optimizers, grad_norm, self.cfg.optim.clip_grad_norm)
        for optimizer in self.parts.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return StepResult(
            loss,
            norm,
            lr,
            bad,
            stopping,
            written,
            time.perf_counter() - started,
            self.batches.stream.wait_time_s - waited,
            redo,
        )

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline group, over which gradient norms sum (None without pipeline parallelism)."""
        return self.topo.group("pp") if self.topo.cfg.pp > 1 else None

    def set_lr(self, step: int) -> float:
        lr = self.cfg.lr_at(step)
        for optimizer in self.parts.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        return lr


def clipped_update(optimizers: list[torch.optim.Optimizer], grad_norm: torch.Tensor, max_norm: float) -> None:
    """Every optimizer's step, the gradients clipped to `max_norm` (0: not clipped) by their global norm
    `grad_norm` (a device tensor: nothing is read). BF16AdamW multiplies each gradient by the clip coefficient as
    its update reads it, in fp32 (`grad_scale`), which saves a pass over the gradients; the other optimizers'
    gradients are scaled in place first."""
    folding = [optimizer for optimizer in optimizers if isinstance(optimizer, BF16AdamW)]
    others = [optimizer for optimizer in optimizers if not isinstance(optimizer, BF16AdamW)]
    if max_norm and others:
        clip_in_place(
            [p for optimizer in others for group in optimizer.param_groups for p in group["params"]],
            max_norm,
            grad_norm,
        )
    for optimizer in others:
        optimizer.step()
    scale = clip_coefficient(grad_norm, max_norm) if max_norm and folding else None
    for optimizer in folding:
        optimizer.step(grad_scale=scale)


def forward_backward(model: ModelParts, micro: list[dict], device: torch.device) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches; the mean loss of those (0 off the last stage)."""
    if model.schedule is not None:
        return pipelined_forward_backward(model, micro, device)
    total = torch.zeros((), device=device)
    for i, batch in enumerate(micro):
        sync_gradients(model.parts[0], model.sharded_grads, last_micro_batch=i == len(micro) - 1)
        with model.loss_context():
            with model.autocast:  # the model computes the loss (extra keys, positions..., go to it too)
                loss = model.parts[0](batch.pop("inputs"), **batch) / len(micro)
            loss.backward()
        total += loss.detach()
    return total


def pipelined_forward_backward(model: ModelParts, micro: list[dict], device: torch.device) -> torch.Tensor:
    """The micro-batches through the pipeline schedule: the first stage feeds the inputs, every stage is given the
    positions and document ids (for rotary embeddings and the mask), the last the targets, and it returns each
    micro-batch's loss (the schedule's loss_fn passes it on); the mean of those on the last stage, 0 on the
    others."""
    inputs = torch.cat([b["inputs"] for b in micro]) if model.first_stage else None
    targets = torch.cat([b["targets"] for b in micro]) if model.last_stage else None
    every_stage = {key: torch.cat([b[key] for b in micro]) for key in ("positions", "doc_ids") if key in micro[0]}
    microbatch_losses: list[torch.Tensor] = []
    with model.autocast, model.loss_context():
        model.schedule.step(
            *([inputs] if model.first_stage else []),
            target=targets,
            losses=microbatch_losses,
            return_outputs=False,
            **every_stage,
            **({"targets": targets} if model.last_stage else {}),
        )
    if not model.last_stage:
        return torch.zeros((), device=device)
    return torch.stack([loss.detach() for loss in microbatch_losses]).mean()


def reduce_step(local_loss: torch.Tensor, stop_requested: bool, written: Writes, failed: bool = False) -> torch.Tensor:
    """[the losses, the ranks asked to stop, the ranks whose cross-replica all-reduce failed, the ranks done with each
    background write (`Writes`)], each summed over every rank by one all-reduce and left on the device
    (`read_figures` reads them)."""
    flags = torch.tensor([float(stop_requested), float(failed), *map(float, written.flags())], device=local_loss.device)
    packed = torch.cat([local_loss.float().reshape(1), flags])
    if dist.is_initialized():
        dist.all_reduce(packed)
    return packed


def read_figures(
    reduced: torch.Tensor, grad_norm: torch.Tensor, topo: Topology
) -> tuple[float, float, bool, Writes, bool]:
    """The step's one read from the device, in one transfer: the loss over the global batch (the mean over data- and
    context-parallel ranks of the last stage's losses; tensor-parallel peers hold the same value), the gradient norm,
    whether any rank was asked to stop, the background writes every rank is done with, and whether any rank's
    cross-replica all-reduce failed (the step is run again)."""
    both = torch.cat([reduced, grad_norm.float().reshape(1).to(reduced.device)])
    loss_sum, stops, failed, *written, norm = both.tolist()
    return (
        loss_sum / (topo.cfg.dp * topo.cfg.cp * topo.cfg.tp),
        norm,
        stops > 0,
        Writes.agreed(written, topo.world_size),
        failed > 0,
    )
