"""The console every command prints through, and the progress lines of long commands."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable

from rich.console import Console

# Columns when output is not a terminal (a log file, a pipe): rich would wrap at 80 and split a checkpoint path
# that someone greps for; tables take only the width they need.
UNWRAPPED_WIDTH = 100_000
EVERY_S = 10.0  # a long command says what it is doing when it has said nothing for this long


def make_console(quiet: bool = False) -> Console:
    """A rich console that, when its output is not a terminal, never wraps a line."""
    console = Console(quiet=quiet)
    if not console.is_terminal:
        console.soft_wrap = True
        console.width = UNWRAPPED_WIDTH
    return console


class Ticker:
    """Progress lines of a long command on stderr (its results stay whole on stdout), each with the time since it
    began, so that a slow command is not taken for a stuck one: what it says, and while `beating`, what it is doing
    (`doing`: a line, or a function that makes one) whenever it has said nothing for EVERY_S seconds."""

    def __init__(self, prefix: str):
        self.prefix, self.began = prefix, time.monotonic()
        self.last = self.began
        self.doing: str | Callable[[], str] = ""

    def say(self, what: str) -> None:
        self.last = time.monotonic()
        print(f"{self.prefix}: {what} ({self.last - self.began:.0f} s)", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def beating(self):
        """Within it, a thread says `doing` after EVERY_S seconds of silence: it speaks during one long operation (a
        checkpoint's load, an optimizer update) too, which no line between operations would."""
        stop, began = threading.Event(), time.monotonic()

        def quiet_s() -> float:  # since the last line, or since `beating` began
            return time.monotonic() - max(self.last, began)

        def beat() -> None:
            while not stop.wait(max(EVERY_S - quiet_s(), 0.0)):
                if quiet_s() >= EVERY_S:
                    self.say(self.doing() if callable(self.doing) else self.doing)

        thread = threading.Thread(target=beat, name="hlat-progress", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
