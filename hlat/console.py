"""The console every command prints through."""

from __future__ import annotations

from rich.console import Console

# Columns when output is not a terminal (a log file, a pipe): rich would wrap at 80 and split a checkpoint path
# that someone greps for; tables take only the width they need.
UNWRAPPED_WIDTH = 100_000


def make_console(quiet: bool = False) -> Console:
    """A rich console that, when its output is not a terminal, never wraps a line."""
    console = Console(quiet=quiet)
    if not console.is_terminal:
        console.soft_wrap = True
        console.width = UNWRAPPED_WIDTH
    return console
