"""What a long rehearsal prints while it runs (stderr: a --json report stays whole on stdout): its start-up, each
step, and while a step runs, every EVERY_S seconds of silence (`hlat.console.Ticker`), what it is doing: the
micro-batches whose forward and whose backward have begun, or the optimizer's update, so that a slow rehearsal is
not mistaken for a stuck one."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hlat.console import Ticker


class Progress:
    def __init__(self, rank: int, world: int):
        self.ticker = Ticker(f"hlat rehearse: rank {rank} of {world:,}")
        self.at, self.forwards, self.backwards, self.micro_batches, self.updating = "", 0, 0, 0, False

    def say(self, what: str) -> None:
        self.ticker.say(what)

    def step(self, step: int, steps: int) -> None:
        self.at, self.forwards, self.backwards, self.updating = f"step {step} of {steps}", 0, 0, False
        self.say(self.at)

    def doing(self) -> str:
        if self.updating:
            return f"{self.at}: optimizer update"
        return f"{self.at}: micro-batch {self.forwards} of {self.micro_batches} forward, {self.backwards} backward"

    @contextlib.contextmanager
    def watching(self, first_part: nn.Module, micro_batches: int):
        """Count the micro-batches through this rank's first part (pipelined or not, one forward each, and one
        backward, which begins when its output's gradient arrives), and note the optimizers' updates (every
        optimizer's in this process: the rank's own)."""
        self.micro_batches = micro_batches

        def forward(*_) -> None:
            self.forwards += 1

        def backward(grad):
            self.backwards += 1
            return grad

        def output(_module, _inputs, out) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(backward)

        def updating(flag: bool):
            return lambda *_: setattr(self, "updating", flag)

        handles = [
            first_part.register_forward_pre_hook(forward),
            first_part.register_forward_hook(output),
            register_optimizer_step_pre_hook(updating(True)),
            register_optimizer_step_post_hook(updating(False)),
        ]
        self.ticker.doing = self.doing
        try:
            with self.ticker.beating():
                yield
        finally:
            for handle in handles:
                handle.remove()
