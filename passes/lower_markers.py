"""Replace the marker ops of a partitioned forward or backward graph with collectives, per stage.

Runs on each graph AOTAutograd hands to the compiler (after partitioning), so the rewrite sees the
forward and the backward separately. Each `unshard` becomes all-gather + wait + slice + view and
each `reduce_grad` pad + reduce-scatter (or all-reduce at stage 0) + wait, traced from the same
functions the markers run eagerly (`lowering.py`). Where they go depends on the stage:

- stage 0: `unshard` is dropped (the parameter is whole); `reduce_grad` all-reduces in place.
- stage 1: gathers move to the start of the forward; reductions move to the end of the backward,
  so full gradients live until then (the paper's full gradient buffer) and reduce-scatter there.
- stage 2: gathers at the start of the forward; each reduce-scatter right where its gradient is
  produced.
- stage 3: gathers stay just before their use (the backward's re-gathers too, placed by the
  partitioner at first use), reduce-scatters where the gradient is produced; values die after their
  last use, which Inductor's buffer reuse and FX's generated `del`s both honour.

Every inserted node carries `meta["val"]`, computed under the graph's own fake mode.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from .lowering import all_reduce_mean, gather_full, reduce_scatter_mean
from .markers import is_reduce_grad, is_unshard, reduce_grad_args, unshard_args


def lower_markers(graph: fx.Graph) -> dict[str, int]:
    """Rewrite every marker in `graph` in place; returns counts of what was lowered."""
    counts = {"gathers": 0, "reductions": 0, "identities": 0}
    _place_by_stage(graph)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
    for node in list(graph.nodes):
        if is_unshard(node):
            gather = unshard_args(node)
            if gather.stage == 0:
                _forward_whole_parameter(node)
                counts["identities"] += 1
            else:
                _splice(node, fake_mode, lambda s: gather_full(s, gather.shape, gather.group_name), gather.param)
                counts["gathers"] += 1
        elif is_reduce_grad(node):
            reduce = reduce_grad_args(node)
            if reduce.stage == 0:
                _splice(node, fake_mode, lambda g: all_reduce_mean(g, reduce.group_name), reduce.param)
            else:
                _splice(
                    node,
                    fake_mode,
                    lambda g: reduce_scatter_mean(g, reduce.shard_numel, reduce.group_name),
                    reduce.param,
                )
            counts["reductions"] += 1
    graph.lint()
    return counts


def _place_by_stage(graph: fx.Graph) -> None:
    placeholders = graph.find_nodes(op="placeholder")
    last_moved = placeholders[-1] if placeholders else None
    output = graph.output_node()
    for node in list(graph.nodes):
        if is_unshard(node) and unshard_args(node).stage in (1, 2) and unshard_args(node).shard.op == "placeholder":
            last_moved.append(node)  # behind the previous one: gathers keep program order
            last_moved = node
        elif is_reduce_grad(node) and reduce_grad_args(node).stage == 1 and set(node.users) == {output}:
            output.prepend(node)


def _forward_whole_parameter(node: fx.Node) -> None:
    """Stage 0: the marker's input already is the full parameter."""
    param = node.args[0]
    if any(user.op == "output" for user in node.users):
        # A graph output may not alias a graph input, so a parameter returned as such is copied.
        node.target = torch.ops.aten.clone.default
        node.args = (param,)
        return
    node.replace_all_uses_with(param)
    node.graph.erase_node(node)


def _splice(node: fx.Node, fake_mode, fn: Callable[[torch.Tensor], torch.Tensor], param: str) -> None:
    """Trace `fn(marker's tensor)` under the graph's fake mode and put the traced nodes in place of
    `node`; each new node's meta["zero_param"] names the parameter it serves (for the ledger)."""
    arg = node.args[0]
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        traced = make_fx(fn, tracing_mode="real")(arg.meta["val"])
    (placeholder,) = traced.graph.find_nodes(op="placeholder")
    for new_node in traced.graph.nodes:
        new_node.meta["zero_param"] = param
    with node.graph.inserting_before(node):
        result = node.graph.graph_copy(traced.graph, {placeholder: arg})
    node.replace_all_uses_with(result)
    node.graph.erase_node(node)
