"""The `zerocompile` command: one subcommand per job, each defined by a module of zerocompile.tools.

A subcommand module has a docstring (its first line is the one-line help), `add_arguments(parser)`
and `run(args) -> exit code`; adding a subcommand is importing its module and listing it in
SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from zerocompile.tools import bench, capacity, convert, dump, plan, soak, train

SUBCOMMANDS: dict[str, ModuleType] = {
    "train": train,
    "dump": dump,
    "plan": plan,
    "bench": bench,
    "convert": convert,
    "soak": soak,
    "capacity": capacity,
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of `zerocompile`, with one sub-parser per entry of SUBCOMMANDS."""
    parser = argparse.ArgumentParser(
        prog="zerocompile", description="ZeRO data parallelism (stages 0-3) inside torch.compile."
    )
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
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
    args = build_parser().parse_args(argv[: len(argv) - len(command) - (1 if "--" in argv else 0)])
    args.command = command
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
