"""Arguments shared by the command-line tools and benchmarks: argparse `type=` callables and flags
more than one tool takes."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path


def positive_int(text: str) -> int:
    """An integer of at least 1 (ranks, steps, rounds), refused by argparse otherwise."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def names_from(valid: Sequence[str], what: str = "") -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of `valid` (GPT sizes, modes), at least
    one; `what` names them in the error ("mode(s)": "unknown mode(s) ['x']; valid: ...")."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in valid]
        if unknown or not names:
            label = f"{what} " if what else ""
            raise argparse.ArgumentTypeError(f"unknown {label}{unknown}; valid: {','.join(valid)}")
        return names

    return parse


def add_offload_arguments(parser: argparse.ArgumentParser, disk_help: str, cpu_help: str) -> None:
    """--offload-dir DIR (the optimizer state on disk there, offload='disk') and --offload-cpu (in host
    memory, the update on the CPU, offload='cpu'), which exclude each other; each tool says what it
    does with them in `disk_help` and `cpu_help`."""
    offload = parser.add_mutually_exclusive_group()
    offload.add_argument("--offload-dir", type=Path, default=None, help=disk_help)
    offload.add_argument("--offload-cpu", action="store_true", help=cpu_help)
