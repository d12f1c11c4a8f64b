"""Argument types shared by the command-line tools and benchmarks (argparse `type=` callables)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


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
