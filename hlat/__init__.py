"""hlat: pretrain large language models at low cost per token."""

__version__ = "0.1.0"


class HlatError(Exception):
    """A user-facing error: the CLI prints it as one line and exits non-zero, without a traceback."""
