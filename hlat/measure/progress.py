"""What a long rehearsal prints while it runs (stderr: a --json report stays whole on stdout): its start-up, each
step, and within a step the micro-batch it is in with the time elapsed, at most every EVERY_S seconds, so that a
slow rehearsal is not mistaken for a stuck one."""

from __future__ import annotations

import contextlib
import sys
import time

from torch import nn

EVERY_S = 10.0


class Progress:
    def __init__(self, rank: int, world: int):
        self.name, self.began = f"rank {rank} of {world:,}", time.monotonic()
        self.last, self.at, self.micro = self.began, "", 0

    def say(self, what: str) -> None:
        self.last = time.monotonic()
        print(f"hlat rehearse: {self.name}: {what} ({self.last - self.began:.0f} s)", file=sys.stderr, flush=True)

    def step(self, step: int, steps: int) -> None:
        self.at, self.micro = f"step {step} of {steps}", 0
        self.say(self.at)

    @contextlib.contextmanager
    def watching(self, first_part: nn.Module, micro_batches: int):
        """Count the micro-batches entering this rank's first part (one forward each, pipelined or not)."""
        def entered(*_) -> None:
            self.micro += 1
            if time.monotonic() - self.last >= EVERY_S:
                self.say(f"{self.at}, micro-batch {self.micro} of {micro_batches}")

        handle = first_part.register_forward_pre_hook(entered)
        try:
            yield
        finally:
            handle.remove()
