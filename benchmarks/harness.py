"""The command line of a benchmarks/ harness: `python -m benchmarks.NAME` from the repository root."""

from __future__ import annotations

import argparse
import importlib


def main(module_name: str, argv: list[str] | None = None) -> int:
    """Parse `argv` with the module's `add_arguments` and return its `run`'s exit code. The module
    is imported by its name, not run as __main__, because the ranks it spawns import their
    functions by that name."""
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(
        prog=f"python -m {module_name}", description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))
