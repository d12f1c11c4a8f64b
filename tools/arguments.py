"""Argument types shared by the command-line tools and benchmarks (argparse `type=` callables)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer of at least 1 (ranks, steps, rounds), refused by argparse otherwise."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
