"""The `hlat` command. Each package that adds commands registers them from its own `cli.py` (`register`): running a
job (`hlat.jobs`: train, torchrun, launch), configs and models (`hlat.config`: config fields, describe), data
(`hlat.data`), hardware measurement (`hlat.measure`: preflight, rehearse), planning (`hlat.planner`: plan) and
post-run tools (`hlat.tools`: eval, generate, compare, import-hf, export-hf, checkpoint verify).

Heavy imports (torch) happen inside the commands, so `hlat describe` and `hlat plan` start instantly. User mistakes
raise HlatError, printed here as one line with a non-zero exit and no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hlat import ERROR_EXIT, HlatError, __version__

COMMAND_MODULES = (
    "hlat.jobs.cli",
    "hlat.config.cli",
    "hlat.tools.cli",
    "hlat.data.cli",
    "hlat.measure.cli",
    "hlat.planner.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hlat", description="Pretrain large language models at low cost per token.")
    parser.add_argument("--version", action="version", version=f"hlat {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["torchrun"]:  # every later argument is torchrun's, not argparse's
            from hlat.jobs.cli import run_torchrun

            return run_torchrun(argv[1:])
        parser = build_parser()
        args, rest = parser.parse_known_args(argv)
        if rest and not args.overrides:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return args.func(args, rest)
    except HlatError as e:
        print(f"hlat: error: {e}", file=sys.stderr)
        return ERROR_EXIT
    except KeyboardInterrupt:
        print("hlat: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
