"""One rank's training run: its state in one object, its step (`hlat.train.step.TrainStep`: forward and backward
over this rank's micro-batches, one all-reduce, clipping, one read, the update) and `after_step()`, where each of
the run's services acts at its own cadence: the asynchronous save committed, the bad-step policy, the metrics
report (with validation and the ranks' health), checkpoints and the watchdog.

`hlat.train.loop.train` builds a Trainer and drives it; the order of work inside a step is docs/architecture.md's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from hlat import HlatError
from hlat.config.job import Config
from hlat.train.checkpoint import Snapshot, load_checkpoint, newest_good_checkpoint, resolve_checkpoint, set_aside
from hlat.train.faults import Watchdog, bad_step_action
from hlat.train.goodput import Goodput
from hlat.train.metrics import StepReport
from hlat.train.saving import Checkpoints
from hlat.train.step import Batches, ModelParts, StepResult, TrainStep, set_rng_state
from hlat.train.validation import Validation


@dataclass
class Trainer:
    """The run's services around its step: each step is `train_step(trainer.step, ...)`, then `after_step`."""

    cfg: Config
    console: Console
    train_step: TrainStep
    goodput: Goodput
    checkpoints: Checkpoints
    report: StepReport
    validation: Validation
    watchdog: Watchdog
    step: int = 0  # optimizer steps done
    start: int = 0  # the step this process started at

    @property
    def model(self) -> ModelParts:
        return self.train_step.parts

    @property
    def batches(self) -> Batches:
        return self.train_step.batches

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

    # --- after a step --------------------------------------------------------------------------------------

    def after_step(self, result: StepResult) -> None:
        """Let each service act on the step: the asynchronous save every rank has written is committed (a
        collective: every rank learnt it from the step's all-reduce), goodput accounts for the step, the bad-step
        policy (which may roll back), the metrics report and validation, checkpoints, the watchdog."""
        if result.save_written:
            self.checkpoints.commit()
        self.goodput.step(self.step + 1, result.seconds, result.data_wait_s, bad=result.bad is not None)
        if result.bad is not None and self.handle_bad_step(result.bad):
            return
        self.step += 1
        self.report.add(result.loss, result.grad_norm, result.seconds)
        validate = self.validation.due(self.step)
        if self.report.due(self.step, result.stopping) or validate:
            self.report.log(self.step, result.lr, self.train_step.bad_steps.total,
                            self.validate if validate else None,
                            {**self.train_step.health.check(), **self.goodput.metric_fields()})
            self.goodput.save()
        if validate:
            self.checkpoints.keep_best(self.step, self.validation.latest, self.snapshot)
        if self.checkpoints.due(self.step, result.stopping):
            self.checkpoints.save(self.step, self.snapshot(), commit_now=result.stopping)
        self.watchdog.beat(self.step)

    def handle_bad_step(self, reason: str) -> bool:
        """Apply train.on_bad_step to a step whose update was dropped; True when it rolled the run back."""
        self.checkpoints.commit()  # a save in flight holds good weights from before this step
        last, bad_steps = self.checkpoints.latest(), self.train_step.bad_steps
        if bad_step_action(self.cfg.train, bad_steps, reason, self.step + 1, last) == "skip":
            self.console.print(f"step {self.step + 1}: {reason}: update skipped ({bad_steps.total} skipped so "
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
        set_aside(passed_over, self.train_step.topo.is_main, self.console)
        if last is None:
            raise HlatError(f"step {self.step + 1}: {reason}; every checkpoint to roll back to is damaged")
        return last

    def validate(self) -> dict:
        return self.validation.run(self.model.parts[0], self.train_step.device, self.model.autocast,
                                   self.model.loss_context)

    def snapshot(self) -> Snapshot:
        return self.train_step.snapshot(self.step)
