"""One rank's training run: its state in one object, `train_step()` (forward and backward over this rank's
micro-batches, one all-reduce, clipping, the update) and `after_step()`, where each of the run's services acts at
its own cadence: the bad-step policy, the metrics report (with validation and the ranks' health), checkpoints and
the watchdog.

`hlat.train.loop.train` builds a Trainer and drives it; the order of work inside a step is docs/architecture.md's.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from hlat import HlatError
from hlat.data.packing import DataStream
from hlat.optim import lr_at
from hlat.parallel import Topology
from hlat.parallel.context import split_batch
from hlat.parallel.data import sync_gradients
from hlat.parallel.grads import clip_grad_norm
from hlat.train.checkpoint import (Snapshot, load_checkpoint, newest_good_checkpoint, resolve_checkpoint,
                                   set_aside)
from hlat.train.config import Config
from hlat.train.faults import BadSteps, Watchdog, bad_step_action, poison_gradients
from hlat.train.goodput import Goodput
from hlat.train.health import Health
from hlat.train.metrics import StepReport
from hlat.train.saving import Checkpoints
from hlat.train.validation import Validation


@dataclass
class StepResult:
    """What one step produced."""

    loss: torch.Tensor  # the global batch's mean loss, on the device
    grad_norm: torch.Tensor  # the global gradient norm before clipping
    lr: float
    bad: str | None  # why the update was dropped (train.on_bad_step), or None
    stopping: bool  # a stop signal reached some rank: checkpoint and stop after this step
    seconds: float  # the step's wall time
    data_wait_s: float  # of which waiting for data


class Batches:
    """This rank's micro-batches for each step, which its stream gives it (docs/data.md).

    `global` data sharding: every rank's stream is a part of the one global stream, so that each rank trains on
    micro-batches dp_rank, dp_rank + dp, ... of each step's global batch (those a single process would run) and
    the data state is the same on all ranks: one copy in the checkpoint, which resumes under any layout.
    `files`: each data-parallel rank reads its own files, for storage that cannot serve every rank all the data;
    the data states are per rank and a resume needs the same data-parallel size. Context-parallel peers share a
    data-parallel rank, and each keeps its own chunks of the sequences (`split_batch`)."""

    def __init__(self, stream: DataStream, topo: Topology, per_rank: int):
        self.stream, self.rank, self.per_rank = stream, topo.rank, per_rank
        self.shared = topo.cfg.data_sharding == "global"
        self.cp, self.cp_rank = topo.cfg.cp, topo.cp_rank

    def next_step(self, device: torch.device) -> list[dict]:
        micro = [split_batch(next(self.stream), self.cp, self.cp_rank) for _ in range(self.per_rank)]
        return [{k: to_device(t, device) for k, t in batch.items()} for batch in micro]

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
class Model:
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
    def params(self) -> list[nn.Parameter]:  # the parts do not change after build_parts
        return [p for part in self.parts for p in part.parameters()]


@dataclass
class Trainer:
    cfg: Config
    topo: Topology
    device: torch.device
    console: Console
    model: Model
    batches: Batches
    goodput: Goodput
    checkpoints: Checkpoints
    report: StepReport
    validation: Validation
    watchdog: Watchdog
    health: Health
    bad_steps: BadSteps = field(init=False)
    step: int = 0  # optimizer steps done
    start: int = 0  # the step this process started at

    def __post_init__(self):
        self.bad_steps = BadSteps(self.cfg.train.spike_sigmas, self.cfg.train.max_bad_steps)

    # --- start ---------------------------------------------------------------------------------------------

    def restore(self, resume_from: Path | None) -> None:
        """Load the checkpoint to resume from (or a fresh run's initial weights); metrics past its step are dropped
        and their step time is lost (goodput): those steps are about to be run again."""
        if resume_from is not None:
            state = load_checkpoint(resume_from, self.model.parts, self.model.optimizers, self.batches.state_key)
            self.batches.stream.load_state_dict(state["data"])
            set_rng_state(state["rng"])
            self.step = self.start = state["step"]
            self.console.print(f"resumed from {resume_from} at step {self.step}", soft_wrap=True, highlight=False)
        elif self.cfg.train.init_from:
            load_checkpoint(resolve_checkpoint(self.cfg.train.init_from), self.model.parts)
            self.console.print(f"initialised weights from {self.cfg.train.init_from}")
        self.goodput.resumed(self.step)
        self.report.begin(self.step, resume_from is not None, self.batches.stream)

    # --- a step --------------------------------------------------------------------------------------------

    def train_step(self, stop_requested: bool) -> StepResult:
        """One optimizer step on every rank: forward and backward, the loss averaged and the stop and save flags
        agreed in one all-reduce, the gradient norm clipped, and the update unless the step is bad."""
        started, waited = time.perf_counter(), self.batches.stream.wait_time_s
        lr = self.set_lr()
        micro = self.batches.next_step(self.device)
        with self.health.computing():
            local_loss = forward_backward(self.model, micro, self.device)
        if self.step + 1 == self.cfg.train.debug_nan_step and not self.bad_steps.injected:
            local_loss = self.inject_nan(local_loss)
        with self.health.at_collective():
            loss, stopping, save_written = reduce_step(self.topo, local_loss, stop_requested,
                                                       self.checkpoints.written())
        if save_written:  # an asynchronous save is on disk on every rank: commit it
            self.checkpoints.commit()
        grad_norm = clip_grad_norm(self.model.params, self.cfg.optim.clip_grad_norm, self.pp_group)
        # skipping the update is the host's decision: one transfer brings both figures (not two)
        bad = self.bad_steps.check(*torch.stack([loss.float(), grad_norm.float().to(loss.device)]).tolist())
        for optimizer in self.model.optimizers:
            if bad is None:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, grad_norm, lr, bad, stopping, time.perf_counter() - started,
                          self.batches.stream.wait_time_s - waited)

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline group, over which gradient norms sum (None without pipeline parallelism)."""
        return self.topo.group("pp") if self.topo.cfg.pp > 1 else None

    def set_lr(self) -> float:
        optim = self.cfg.optim
        lr = lr_at(self.step, optim.lr, optim.min_lr, optim.warmup_steps, optim.decay_steps or self.cfg.train.steps)
        for optimizer in self.model.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        return lr

    def inject_nan(self, local_loss: torch.Tensor) -> torch.Tensor:
        """train.debug_nan_step: this step's gradients and loss become NaN, once per process (a rollback that
        runs the step number again trains on)."""
        self.bad_steps.injected = True
        poison_gradients(self.model.params)
        return local_loss * float("nan")

    # --- after a step --------------------------------------------------------------------------------------

    def after_step(self, result: StepResult) -> None:
        """Account for the step and let each service act on it: the bad-step policy (which may roll back), the
        metrics report and validation, checkpoints, the watchdog."""
        self.goodput.step(self.step + 1, result.seconds, result.data_wait_s, bad=result.bad is not None)
        if result.bad is not None and self.handle_bad_step(result.bad):
            return
        self.step += 1
        self.report.add(result.loss, result.grad_norm, result.seconds)
        validate = self.validation.due(self.step)
        if self.report.due(self.step, result.stopping) or validate:
            self.report.log(self.step, result.lr, self.bad_steps.total, self.validate if validate else None,
                            self.health.check())
            self.goodput.save()
        if validate:
            self.checkpoints.keep_best(self.step, self.validation.latest, self.snapshot)
        if self.checkpoints.due(self.step, result.stopping):
            self.checkpoints.save(self.step, self.snapshot(), commit_now=result.stopping)
        self.watchdog.beat(self.step)

    def handle_bad_step(self, reason: str) -> bool:
        """Apply train.on_bad_step to a step whose update was dropped; True when it rolled the run back."""
        self.checkpoints.commit()  # a save in flight holds good weights from before this step
        last = self.checkpoints.latest()
        if bad_step_action(self.cfg.train, self.bad_steps, reason, self.step + 1, last) == "skip":
            self.console.print(f"step {self.step + 1}: {reason}: update skipped ({self.bad_steps.total} skipped so "
                               "far)", highlight=False)
            return False
        last = self.good_checkpoint(reason)
        at = load_checkpoint(last, self.model.parts, self.model.optimizers, self.batches.state_key)["step"]
        # the data stream and RNG go on: the batches since the checkpoint are skipped
        self.console.print(f"step {self.step + 1}: {reason}: rolled back to {last} (step {at}); the data since then "
                           "is skipped", soft_wrap=True, highlight=False)
        self.step = at
        self.report.rolled_back(at)
        self.goodput.resumed(at)
        self.watchdog.beat(at)
        return True

    def good_checkpoint(self, reason: str) -> Path:
        """The newest checkpoint that still verifies, to roll back to: one damaged since it was written (its
        bytes would load silently) is set aside, as a resume sets it aside."""
        last, passed_over = newest_good_checkpoint(self.cfg.train.run_dir)
        set_aside(passed_over, self.topo.is_main, self.console)
        if last is None:
            raise HlatError(f"step {self.step + 1}: {reason}; every checkpoint to roll back to is damaged")
        return last

    def validate(self) -> dict:
        return self.validation.run(self.model.parts[0], self.device, self.model.autocast, self.model.loss_context)

    def snapshot(self) -> Snapshot:
        """What a checkpoint at this step holds: model and optimizer states, the step, the data position, RNG."""
        trainer_state = {"step": self.step, "data": self.batches.stream.state_dict(), "rng": rng_state()}
        return Snapshot(self.model.parts, self.model.optimizers, trainer_state, self.batches.state_key)


def forward_backward(model: Model, micro: list[dict], device: torch.device) -> torch.Tensor:
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


def pipelined_forward_backward(model: Model, micro: list[dict], device: torch.device) -> torch.Tensor:
    """The micro-batches through the pipeline schedule: the first stage feeds the inputs, every stage is given the
    positions and document ids (for rotary embeddings and the mask), the last the targets, and it returns each
    micro-batch's loss (the schedule's loss_fn passes it on); the mean of those on the last stage, 0 on the
    others."""
    inputs = torch.cat([b["inputs"] for b in micro]) if model.first_stage else None
    targets = torch.cat([b["targets"] for b in micro]) if model.last_stage else None
    every_stage = {key: torch.cat([b[key] for b in micro]) for key in ("positions", "doc_ids") if key in micro[0]}
    microbatch_losses: list[torch.Tensor] = []
    with model.autocast, model.loss_context():
        model.schedule.step(*([inputs] if model.first_stage else []), target=targets, losses=microbatch_losses,
                            return_outputs=False, **every_stage, **({"targets": targets} if model.last_stage else {}))
    if not model.last_stage:
        return torch.zeros((), device=device)
    return torch.stack([loss.detach() for loss in microbatch_losses]).mean()


def reduce_step(topo: Topology, local_loss: torch.Tensor, stop_requested: bool, save_written: bool
                ) -> tuple[torch.Tensor, bool, bool]:
    """The loss over the global batch (the mean over data- and context-parallel ranks of the last stage's losses;
    tensor-parallel peers hold the same value), whether any rank was asked to stop, and whether every rank has
    written its part of the asynchronous save in flight: one all-reduce."""
    if not dist.is_initialized():
        return local_loss, stop_requested, save_written
    flags = torch.tensor([float(stop_requested), float(save_written)], device=local_loss.device)
    packed = torch.cat([local_loss.reshape(1), flags])
    dist.all_reduce(packed)
    stop, written = packed[1:].tolist()
    return packed[0] / (topo.cfg.dp * topo.cfg.cp * topo.cfg.tp), stop > 0, written == topo.world_size


def rng_state() -> dict:
    return {"cpu": torch.get_rng_state().tolist(),
            "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
