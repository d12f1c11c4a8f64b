"""The `zerocompile` command: one subcommand per job, each defined by a module of zerocompile.tools.

A subcommand module has a docstring (its first line is the one-line help), `add_arguments(parser)`
and `run(args) -> exit code`; adding a subcommand is listing its module's name in SUBCOMMANDS.

A command imports only its own module: the modules import what their jobs need (FSDP, the
benchmark's chart, spawning ranks), and importing all of them cost every command 4.5 s of CPU
where `dump` or `plan` alone need 2 (2026-11-26, 2 cores). `zerocompile --help` imports them all.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

SUBCOMMANDS = ("check", "train", "dump", "plan", "bench", "convert")


def subcommand(name: str) -> ModuleType:
    """The module that defines subcommand `name`: zerocompile.tools.<name>."""
    return importlib.import_module(f"zerocompile.tools.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of `zerocompile`, with one sub-parser per entry of SUBCOMMANDS (or only `only`'s)."""
    parser = argparse.ArgumentParser(
        prog="zerocompile", description="ZeRO data parallelism (stages 0-3) inside torch.compile."
    )
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS if only is None else [only]:
        module = subcommand(name)
        subparser = subcommands.add_parser(
            name,
            help=module.__doc__.splitlines()[0],
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(subparser)
        subparser.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the subcommand's exit code."""
    argv = sys.argv[1:] if argv is None else argv
    # Everything after "--" is a command for the subcommand to run (`zerocompile dump DIR -- python x.py`).
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: len(argv) - len(command) - (1 if "--" in argv else 0)]
    # The top level has no options but --help, so a known command comes first.
    parser = build_parser(own[0] if own and own[0] in SUBCOMMANDS else None)
    args = parser.parse_args(own)
    args.command = command
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
