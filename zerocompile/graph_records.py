"""`record_graphs()`: the records of the graphs the "zero" backend lowers, kept only on request.

    with zerocompile.record_graphs() as graphs:
        compiled(batch).backward()      # compiles: the forward and the backward graph
    [g.kind for g in graphs]            # ["forward", "backward"]; g.ledger, g.code, ...

The backend appends a `CompiledGraph` to the list of every block open where the compile started
(blocks nest: each gets them). A Dynamo compile started inside a block keeps feeding it after the
block has closed: AOTAutograd lowers the backward at the first backward call, which on CUDA runs
on one of autograd's device threads, outside the caller's context. Outside any block nothing is
kept: a long-running job that recompiles does not pile up records.

Kept in a `ContextVar`, not in the module, so that what one caller (a test, a rank of the test
pool, a thread) records never reaches another. Light on purpose: importing `zerocompile` does not
import the backend (and Dynamo with it).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from zerocompile.backend import CompiledGraph

# The lists of the blocks open in this context, outermost first.
_OPEN: contextvars.ContextVar[tuple[list[CompiledGraph], ...]] = contextvars.ContextVar(
    "zerocompile_graph_records", default=()
)


@contextlib.contextmanager
def record_graphs() -> Iterator[list[CompiledGraph]]:
    """A list that receives the record of each graph the "zero" backend lowers for a compile
    started inside the block (see the module docstring)."""
    graphs: list[CompiledGraph] = []
    token = _OPEN.set((*_OPEN.get(), graphs))
    try:
        yield graphs
    finally:
        _OPEN.reset(token)


def open_records() -> tuple[list[CompiledGraph], ...]:
    """The lists of the blocks open here: a compile binds them when it starts (the backend)."""
    return _OPEN.get()
