"""Whether a configuration may run: its peak per rank predicted (by formula, or from measured runs
through least-squares lines), and whether N of it fit the machine's free memory."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import zerocompile as zc
from zerocompile.tools.gpt import GPT, GPTConfig

from .measure import MB, GiB

BUDGET_BYTES = 8 * GiB  # "the largest GPT that would train in 8 GiB per rank"

# The prediction that decides whether a configuration may run (see `predicted_peak`).
BASELINE_BYTES = 500 * MB  # interpreter, torch, gloo: 0.34 GB measured per rank when a job starts
SAFETY = 1.15  # predicted total times this must fit in MemAvailable less RESERVE_BYTES
RESERVE_BYTES = 1.5 * GiB  # left to the machine's other users; the watchdog kills below it


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the memory bounds and predictions need of a GPT size, read off a meta-device build."""

    phi: int  # parameters, the tied embedding once
    largest_tensor_bytes: int  # the largest parameter in full
    largest_module_bytes: int  # the largest module's own (not its children's) full parameters


def model_facts(config: GPTConfig) -> ModelFacts:
    with torch.device("meta"):
        model = GPT(config)
    params = {id(p): p for p in model.parameters()}.values()
    module_bytes = [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()]
    return ModelFacts(
        phi=zc.full_numel(model),
        largest_tensor_bytes=max(p.numel() * p.element_size() for p in params),
        largest_module_bytes=max(module_bytes),
    )


def predicted_peak(mode: str, facts: ModelFacts, ranks: int) -> float:
    """The peak RSS one rank is expected to reach, in bytes, generously (it guards the machine),
    before any size of this mode has been measured (`calibrated_peak` takes over after).

    fp32 AdamW holds 16 bytes per parameter (parameters, gradients, two moments): whole for DDP
    (plus its 4Φ of gradient buckets), 1/N for the sharded modes. On top, per parameter, what a
    step keeps alive in full (stage 1 all parameters and gradients, stage 2 all parameters) and
    what the allocator keeps: calibrated on the 50m GPT (2 cores, glibc malloc, 2026-11-25), where
    the peaks above start-up were 23 B/param (DDP), 16/N + 15 (FSDP2), 16/N + 10.5 (stage 1),
    16/N + 8.5 (stage 2) and 16/N + 5 (stage 3) at N = 2 and 4; and a few modules in full. FSDP2's
    15 was mostly glibc's retained heap at that size (0.85 instead of 1.49 GB with RSS following
    live tensors) and fell to 16/N + 2.6 at 400m, so 8 stands for it here.
    """
    phi, n = facts.phi, ranks
    per_param = {
        "ddp": 25.0,
        "fsdp2": 16.0 / n + 8.0,
        "zero1": 16.0 / n + 12.0,
        "zero2": 16.0 / n + 10.0,
        "zero3": 16.0 / n + 6.0,
    }[mode]
    return BASELINE_BYTES + per_param * phi + 4 * facts.largest_module_bytes


def _state_per_param(mode: str, ranks: int) -> float:
    """Bytes of fp32 AdamW state per parameter per rank: 16, divided over the ranks but for DDP."""
    return 16.0 if mode == "ddp" else 16.0 / ranks


def calibrated_peak(mode: str, facts: ModelFacts, ranks: int, measured: list[dict[str, Any]]) -> float | None:
    """The peak predicted from this mode's measured runs (None if none ran).

    Where some N has two or more sizes measured, from their lines peak = a + b·Φ: the slope less
    the state (`_state_per_param`) is what a step needs beyond it per parameter (the rest). The
    prediction is the largest a plus, per parameter, the state at `ranks` and the rest at `ranks`:
    with lines at two or more N, the rest is fitted as r0 + r1/N (a part that scales with the whole
    model and one that scales with a rank's shard), else it is the one line's. With one size
    only, start-up RSS plus, per parameter, the state at `ranks` and the rest the largest measured
    size needed beyond its own state: fixed costs (compile state) then count per parameter, which
    errs high for a larger model, the safe side.
    """
    runs = [row for row in measured if row["mode"] == mode and row["status"] == "ok"]
    if not runs:
        return None
    lines = [(entry, entry["b_bytes_per_param"] - _state_per_param(mode, entry["ranks"]))
             for entry in fits_per_mode(runs) if entry["a_bytes"] is not None]
    if lines:
        # The lines' rests already hold the gathered window of the sizes measured, scaled by Φ.
        fixed = max(entry["a_bytes"] for entry, _ in lines)
        over_n = linear_fit([(1.0 / entry["ranks"], rest) for entry, rest in lines])
        rest = over_n[0] + over_n[1] / ranks if over_n is not None else max(rest for _, rest in lines)
        return fixed + (_state_per_param(mode, ranks) + max(rest, 0.0)) * facts.phi
    else:
        largest = max(row["phi"] for row in runs)
        fixed = max(m["marks"][0]["rss"] for row in runs for m in row["per_rank"])
        rest = max(
            (row["peak_rss_bytes"] - fixed) / row["phi"] - _state_per_param(mode, row["ranks"])
            for row in runs
            if row["phi"] == largest
        )
    return fixed + (_state_per_param(mode, ranks) + max(rest, 0.0)) * facts.phi + 4 * facts.largest_module_bytes


def fits(needed_total: float, available: int) -> bool:
    return needed_total * SAFETY <= available - RESERVE_BYTES


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (a, b) of y = a + b·x through two or more points of distinct x; else None."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - b * mean_x, b


def fits_per_mode(rows: list[dict[str, Any]], budget: float = BUDGET_BYTES) -> list[dict[str, Any]]:
    """Per (mode, N): the line peak = a + b·Φ through the measured sizes and the Φ it allows in `budget`."""
    fitted = []
    for mode, ranks in dict.fromkeys((row["mode"], row["ranks"]) for row in rows):
        points = [(row["phi"], row["peak_rss_bytes"]) for row in rows
                  if row["mode"] == mode and row["ranks"] == ranks and row["status"] == "ok"]
        line = linear_fit(points)
        entry: dict[str, Any] = {"mode": mode, "ranks": ranks, "points": len(points), "a_bytes": None,
                                 "b_bytes_per_param": None, "largest_phi_in_budget": None}
        if line is not None:
            a, b = line
            entry.update(a_bytes=a, b_bytes_per_param=b)
            entry["largest_phi_in_budget"] = (budget - a) / b if b > 0 and budget > a else None
        fitted.append(entry)
    return fitted
