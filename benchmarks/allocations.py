"""Which large allocations one training step makes, and which ops make them: what churns a heap.

On CPU, glibc serves allocations of up to 32 MB from its heap once its dynamic mmap threshold has
risen, and a heap whose holes come back in another order each step fragments (README: Memory that
stays put). The census profiles one step with torch.profiler's memory events and counts every op
event whose own allocations (net of what it freed itself) reach `min_bytes`, under the op and its
two enclosing ops, e.g. `aten::empty <- c10d::allgather_into_tensor_coalesced_ <- ...`. Ops that
ran on a collective backend's own thread (gloo's copies) have no enclosing op: they show alone.

Allocations the profiler does not see (a backend's own `malloc`s, Python objects) are not counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from torch.profiler import ProfilerActivity, profile

MIN_BYTES = 64 * 1024
ENCLOSING_OPS = 2


def allocation_census(step: Callable[[], Any], min_bytes: int = MIN_BYTES) -> list[dict[str, Any]]:
    """Run `step` once under the profiler; one row per op chain that allocated at least
    `min_bytes` at a time: {"op", "allocations", "bytes"}, most bytes first."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        step()
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for event in profiled.events():
        if event.self_cpu_memory_usage < min_bytes:
            continue
        chain, parent = [event.name], event.cpu_parent
        while parent is not None and len(chain) <= ENCLOSING_OPS:
            chain.append(parent.name)
            parent = parent.cpu_parent
        op = " <- ".join(chain)
        counts[op] += 1
        sizes[op] += event.self_cpu_memory_usage
    return [{"op": op, "allocations": counts[op], "bytes": size} for op, size in sizes.most_common()]


def format_census(rows: list[dict[str, Any]], title: str, top: int = 12) -> list[str]:
    """Markdown lines: the total, then the `top` op chains by bytes."""
    total = sum(row["bytes"] for row in rows)
    lines = [
        f"{title}: {sum(row['allocations'] for row in rows)} allocations of >= {MIN_BYTES // 1024} KiB, "
        f"{total / 1e6:.1f} MB",
        "| MB | allocations | op <- enclosing ops |",
        "|---|---|---|",
    ]
    lines += [f"| {row['bytes'] / 1e6:.1f} | {row['allocations']} | {row['op']} |" for row in rows[:top]]
    if len(rows) > top:
        rest = rows[top:]
        lines.append(f"| {sum(r['bytes'] for r in rest) / 1e6:.1f} | {sum(r['allocations'] for r in rest)} | {len(rest)} more |")
    return lines
