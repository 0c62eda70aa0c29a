"""One rank's training run: its state in one object (`TrainState`, which it hands to the tiers that save and
restore it), its step (`hlat.train.step.TrainStep`: forward and backward
over this rank's micro-batches, one all-reduce, clipping, one read, the update) and `after_step()`, where each of
the run's services acts at its own cadence: the background writes committed, the bad-step policy, the metrics
report (with validation and the ranks' health), checkpoints and the watchdog.

`hlat.train.loop.train` builds a Trainer and drives it; the order of work inside a step is docs/architecture.md's.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console

from hlat.checkpoint.state import TrainState
from hlat.checkpoint.tiers import Tiers
from hlat.config.job import Config
from hlat.train.faults import Watchdog, bad_step_action
from hlat.train.goodput import Goodput
from hlat.train.metrics import StepReport, routing_figures
from hlat.train.step import Batches, ModelParts, StepResult, TrainStep
from hlat.train.validation import Validation


@dataclass
class Trainer:
    """The run's services around its step: each step is `train_step(trainer.step, ...)`, then `after_step`."""

    cfg: Config
    console: Console
    state: TrainState
    train_step: TrainStep
    goodput: Goodput
    tiers: Tiers
    report: StepReport
    validation: Validation
    watchdog: Watchdog
    start: int = 0  # the step this process started at

    @property
    def step(self) -> int:
        """Optimizer steps done (the train state's, which a restore or a rollback sets)."""
        return self.state.step

    @property
    def model(self) -> ModelParts:
        return self.train_step.parts

    @property
    def batches(self) -> Batches:
        return self.train_step.batches

    # --- start ---------------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Restore the run's state where the ranks agreed to start (`Tiers.restore`); metrics past its step are
        dropped and their step time is lost (goodput): those steps are about to be run again."""
        self.tiers.restore()
        self.start = self.step
        self.goodput.resumed(self.step)
        self.report.begin(self.step, self.tiers.start.path is not None, self.batches.stream)

    # --- after a step --------------------------------------------------------------------------------------

    def after_step(self, result: StepResult) -> None:
        """Let each service act on the step: the background writes every rank has finished are committed (a
        collective: every rank learnt it from the step's all-reduce), goodput accounts for the step, the bad-step
        policy (which may roll back), the metrics report and validation, checkpoints and the memory tier's
        snapshots, the watchdog."""
        self.tiers.commit_written(result.written, result.seconds)
        self.goodput.step(self.step + 1, result.seconds, result.data_wait_s, bad=result.bad is not None)
        if result.bad is not None and self.handle_bad_step(result.bad):
            return
        self.state.step += 1
        self.report.add(result.loss, result.grad_norm, result.seconds)
        validate = self.validation.due(self.step)
        if self.report.due(self.step, result.stopping) or validate:
            self.report.log(
                self.step,
                result.lr,
                self.train_step.bad_steps.total,
                self.validate if validate else None,
                {
                    **self.train_step.health.check(),
                    **self.goodput.metric_fields(),
                    **self.tiers.metric_fields(),
                    **routing_figures(self.model.parts),
                },
            )
            self.goodput.save()
        if validate:
            self.tiers.keep_best(self.validation.latest)
        if self.tiers.due(self.step, result.stopping):
            self.tiers.save(commit_now=result.stopping)
        if self.tiers.snapshot_due(self.step):
            self.tiers.snapshot()
        self.watchdog.beat(self.step)

    def handle_bad_step(self, reason: str) -> bool:
        """Apply train.on_bad_step to a step whose update was dropped; True when it rolled the run back."""
        self.tiers.commit()  # a save in flight holds good weights from before this step
        last, bad_steps = self.tiers.latest(), self.train_step.bad_steps
        if bad_step_action(self.cfg.train, bad_steps, reason, self.step + 1, last) == "skip":
            self.console.print(
                f"step {self.step + 1}: {reason}: update skipped ({bad_steps.total} skipped so far)", highlight=False
            )
            return False
        bad = self.step + 1
        last = self.tiers.rollback(bad, reason)
        at = self.step
        self.console.print(
            f"step {bad}: {reason}: rolled back to {last} (step {at}); the data since then is skipped",
            soft_wrap=True,
            highlight=False,
        )
        self.report.rolled_back(at)
        self.goodput.resumed(at)
        self.watchdog.beat(at)
        return True

    def validate(self) -> dict:
        return self.validation.run(
            self.model.parts[0], self.train_step.device, self.model.autocast, self.model.loss_context
        )
