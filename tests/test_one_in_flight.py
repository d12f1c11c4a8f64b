"""`wait_before_each_collective` on hand-built graphs: no process group, nothing sent.

The graphs are the shape a stage-3 backward takes after `lower_markers` with prefetch: a
parameter's re-gather issued a bucket ahead, a gradient's all-to-all started while it is in
flight, and a later gather started before that all-to-all's wait.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from zerocompile.passes.one_in_flight import is_collective, wait_before_each_collective

pytestmark = pytest.mark.fast

aten = torch.ops.aten
funcol = torch.ops._c10d_functional
GATHER = funcol.all_gather_into_tensor_coalesced.default
ALL_TO_ALL = funcol.all_to_all_single.default
WAIT = funcol.wait_tensor.default


def most_in_flight(graph: fx.Graph) -> int:
    """The most collectives issued and not yet waited on at any point of the graph's order."""
    in_flight: set[fx.Node] = set()
    most = 0
    for node in graph.nodes:
        if is_collective(node):
            in_flight.add(node)
            most = max(most, len(in_flight))
        elif node.target is WAIT:
            source = node.args[0]
            in_flight.discard(source.args[0] if source.target is operator.getitem else source)
    return most


def overlapping_backward() -> tuple[fx.Graph, dict[str, fx.Node]]:
    graph = fx.Graph()
    shard_a, shard_b, grad = (graph.placeholder(name) for name in ("shard_a", "shard_b", "grad"))
    n = {}
    n["gather_a"] = graph.call_function(GATHER, ([shard_a], 2, "0"))
    n["full_a"] = graph.call_function(operator.getitem, (n["gather_a"], 0))
    n["compute"] = graph.call_function(aten.mul.Tensor, (grad, grad))
    n["reduce"] = graph.call_function(ALL_TO_ALL, (n["compute"], [4, 4], [4, 4], "0"))
    n["gather_b"] = graph.call_function(GATHER, ([shard_b], 2, "0"))
    n["full_b"] = graph.call_function(operator.getitem, (n["gather_b"], 0))
    n["wait_a"] = graph.call_function(WAIT, (n["full_a"],))
    n["use_a"] = graph.call_function(aten.add.Tensor, (n["wait_a"], grad))
    n["wait_reduce"] = graph.call_function(WAIT, (n["reduce"],))
    n["wait_b"] = graph.call_function(WAIT, (n["full_b"],))
    graph.output((n["use_a"], n["wait_reduce"], n["wait_b"]))
    graph.lint()
    return graph, n


def test_each_collective_waits_for_the_one_before_it() -> None:
    graph, n = overlapping_backward()
    assert most_in_flight(graph) == 3

    assert wait_before_each_collective(graph) == 2

    graph.lint()
    assert most_in_flight(graph) == 1
    order = list(graph.nodes)
    # gather_a's wait moves above the all-to-all, the all-to-all's above gather_b; the compute
    # between a collective and the next issue still runs while it is in flight.
    assert order.index(n["compute"]) < order.index(n["wait_a"]) < order.index(n["reduce"])
    assert order.index(n["reduce"]) < order.index(n["wait_reduce"]) < order.index(n["gather_b"])
    assert order.index(n["gather_b"]) < order.index(n["full_b"]) < order.index(n["wait_b"])
    assert [node.op for node in order].count("call_function") == 10  # nothing added or lost


def test_a_getitem_below_the_next_issue_moves_up_with_its_wait() -> None:
    graph = fx.Graph()
    shard_a, shard_b = graph.placeholder("shard_a"), graph.placeholder("shard_b")
    gather_a = graph.call_function(GATHER, ([shard_a], 2, "0"))
    gather_b = graph.call_function(GATHER, ([shard_b], 2, "0"))
    full_a = graph.call_function(operator.getitem, (gather_a, 0))
    full_b = graph.call_function(operator.getitem, (gather_b, 0))
    waits = [graph.call_function(WAIT, (full,)) for full in (full_a, full_b)]
    graph.output(tuple(waits))

    assert wait_before_each_collective(graph) == 1

    graph.lint()
    assert list(graph.nodes)[2:7] == [gather_a, full_a, waits[0], gather_b, full_b]
    assert most_in_flight(graph) == 1


def test_a_graph_already_serial_is_left_as_it_is() -> None:
    graph, _ = overlapping_backward()
    wait_before_each_collective(graph)
    before = list(graph.nodes)

    assert wait_before_each_collective(graph) == 0
    assert list(graph.nodes) == before
