"""Keep at most one collective in flight: each one's waits move up to just before the next issue.

For process groups on gloo. torch builds a group's gloo backend with two worker threads, and two
collectives running at once corrupt its heap or hang it (pytorch/pytorch#65231, "something is
wrong with gloo allgather coalesced"). Measured with torch 2.13 on 2 CPU ranks (2026-11-28,
`benchmarks/gloo_concurrency.py`, ten coalesced all-gathers of 8 uneven tensors in flight per
iteration): on two worker threads a rank died with glibc's "malloc(): unaligned tcache chunk
detected" in 4 of 4 runs, within 7-37 s; on one worker thread 3 of 3 runs of 2000 iterations
passed with every value right; torch 2.15.0 still dies the same way (1 of 2 runs). Ten per-tensor all-gathers in flight hung instead, a worker thread
spinning in gloo's `UnboundBuffer` destructor. One all-gather next to one all-to-all survived 3
runs of 4000 iterations, but that pair is exactly what a stage-3 backward keeps in flight (a
re-gather issued a bucket ahead, a reduce-scatter left running until the next one), and stage-3
ranks died mid-backward in about 1 of 20 eager launches.

Serialising the collectives costs their overlap with each other, never their overlap with
compute: a collective still runs from its issue until the next collective's issue (or its own
first use, if that comes first), while the kernels in between run.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .analysis import waits_of

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def is_collective(node: fx.Node) -> bool:
    """A functional collective's issue (any `_c10d_functional` op but `wait_tensor`)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "_c10d_functional"
        and target is not _WAIT
    )


def wait_before_each_collective(graph: fx.Graph) -> int:
    """Move the waits of every collective still in flight to just before the next collective's
    issue, in place, in one walk over the graph; returns how many waits moved.

    A wait only ever moves up, and never above its collective (or the getitem it reads, which
    moves along if it sat lower): every reader of the waited tensor stays below it.
    """
    in_flight: dict[fx.Node, None] = {}  # waits not reached yet, in issue order
    seen: set[fx.Node] = set()
    moved = 0
    for node in list(graph.nodes):
        seen.add(node)
        if node.target is _WAIT:
            in_flight.pop(node, None)
            continue
        if not is_collective(node):
            continue
        for wait in in_flight:
            source = wait.args[0]
            if source not in seen:  # a getitem of a coalesced collective's output list
                node.prepend(source)
                seen.add(source)
            node.prepend(wait)
            seen.add(wait)
            moved += 1
        in_flight = dict.fromkeys(waits_of(node))
    return moved
