"""The plain-text pieces of every plan's report: decimal byte sizes, bound marks, aligned tables."""

from __future__ import annotations

DECIMAL_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def format_bytes(count: float) -> str:
    """Decimal units with one decimal, e.g. 31406250000 -> '31.4 GB' (1 GB = 10^9 bytes)."""
    value = float(count)
    for unit in DECIMAL_UNITS[:-1]:
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} {DECIMAL_UNITS[-1]}"


def bounded(count: float, lower: bool = False, upper: bool = False) -> str:
    """`count` in decimal units, marked ≥ where it is a lower bound and ≤ where an upper one."""
    return ("≥ " if lower else "≤ " if upper else "") + format_bytes(count)


def table(header: list[str], rows: list[list[str]]) -> str:
    """`header` and `rows` in columns as wide as their widest cell, two spaces apart."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *rows]]
    return "\n".join(lines)
