"""What a long rehearsal prints while it runs (stderr: a --json report stays whole on stdout): its start-up, each
step, and within a step the micro-batches whose forward and whose backward have begun, with the time elapsed, at
most every EVERY_S seconds, so that a slow rehearsal is not mistaken for a stuck one."""

from __future__ import annotations

import contextlib
import sys
import time

import torch
from torch import nn

EVERY_S = 10.0


class Progress:
    def __init__(self, rank: int, world: int):
        self.name, self.began = f"rank {rank} of {world:,}", time.monotonic()
        self.last, self.at, self.forwards, self.backwards = self.began, "", 0, 0

    def say(self, what: str) -> None:
        self.last = time.monotonic()
        print(f"hlat rehearse: {self.name}: {what} ({self.last - self.began:.0f} s)", file=sys.stderr, flush=True)

    def step(self, step: int, steps: int) -> None:
        self.at, self.forwards, self.backwards = f"step {step} of {steps}", 0, 0
        self.say(self.at)

    @contextlib.contextmanager
    def watching(self, first_part: nn.Module, micro_batches: int):
        """Count the micro-batches through this rank's first part (pipelined or not, one forward each, and one
        backward, which begins when its output's gradient arrives)."""

        def due() -> None:
            if time.monotonic() - self.last >= EVERY_S:
                self.say(
                    f"{self.at}: micro-batch {self.forwards} of {micro_batches} forward, {self.backwards} backward"
                )

        def forward(*_) -> None:
            self.forwards += 1
            due()

        def backward(grad):
            self.backwards += 1
            due()
            return grad

        def output(_module, _inputs, out) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(backward)

        handles = [first_part.register_forward_pre_hook(forward), first_part.register_forward_hook(output)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
