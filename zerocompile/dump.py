"""Dumps: every graph piece before and after each of our passes, plus its ledger, per rank.

On when `ZeroConfig(dump_dir=...)`, `options={"dump_dir": ...}` or `ZEROCOMPILE_DUMP=DIR` is set.
Files go to DIR/rank{R}/{compile id}-{piece}-{before|after}-{pass}.py and
DIR/rank{R}/{compile id}-{piece}-ledger.json, where a compile id is Dynamo's "frame/attempt" (one
per graph-break fragment) and a piece is dynamo, joint, forward, backward or inference; and an
optimizer's step (zerocompile.optim's, which exchanges slices of whole matrices) as
DIR/rank{R}/optimizer-{class}@{its first parameter's FQN}-ledger.json; an optimizer whose state
is offloaded, what it holds where and moves per step, as ...-offload.json beside it. The same
artifacts always go to torch's structured trace (TORCH_TRACE / tlparse), beside Dynamo's own.
`zerocompile dump DIR` reads them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.fx as fx
from torch._guards import CompileContext
from torch._logging._internal import trace_structured_artifact

ENV_VAR = "ZEROCOMPILE_DUMP"


def dump_dir(configured: str | None) -> str | None:
    return configured if configured is not None else os.environ.get(ENV_VAR) or None


def compile_id() -> str:
    current = CompileContext.current_compile_id()
    return str(current).replace("/", "_") if current is not None else "outside-dynamo"


def graph_text(graph: fx.Graph) -> str:
    """The graph as readable Python, with the recompute tags our joint pass sets."""
    code = graph.python_code("self").src
    tagged = [f"{node.name}={node.meta['recompute'].name}" for node in graph.nodes if "recompute" in node.meta]
    if tagged:
        code += "\n# recompute tags: " + ", ".join(tagged) + "\n"
    return code


def emit(
    directory: str | None, piece: str, label: str, text: Callable[[], str], suffix: str = "py", origin: str | None = None
) -> None:
    """One artifact to the structured trace and, if dumping, to DIR/rank{R}/; `text` is called
    only if one of them wants it (rendering a graph takes a while). `origin` names what made it
    where that is not a compile (an optimizer's step)."""
    name = f"{origin or compile_id()}-{piece}-{label}"
    trace_structured_artifact(f"zerocompile_{name}", "string", payload_fn=text)
    if directory is None:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    folder = Path(directory, f"rank{rank}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.{suffix}").write_text(text())


def emit_graph(directory: str | None, piece: str, when: str, pass_name: str, graph: fx.Graph) -> None:
    emit(directory, piece, f"{when}-{pass_name}", lambda: graph_text(graph))


def emit_ledger(directory: str | None, piece: str, ledger: Callable[[], dict], origin: str | None = None) -> None:
    emit(directory, piece, "ledger", lambda: json.dumps(ledger(), indent=1), suffix="json", origin=origin)


def emit_offload(directory: str | None, piece: str, traffic: Callable[[], dict]) -> None:
    """An offloaded optimizer's store: where its state is and what a step moves (`OffloadedState.traffic`)."""
    emit(directory, piece, "offload", lambda: json.dumps(traffic(), indent=1), suffix="json", origin="optimizer")
