"""`passes.recording.record_ops`: the op recorder `lower_markers` splices collectives with."""

from __future__ import annotations

import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fx_helpers import call_targets
from zerocompile.passes.recording import record_ops

aten = torch.ops.aten
funcol = torch.ops._c10d_functional

pytestmark = pytest.mark.usefixtures("group_name")


def test_records_each_op_with_its_value_and_make_fx_names(group_name: str) -> None:
    def gather_two(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        outputs = funcol.all_gather_into_tensor_coalesced([a, b], 4, group_name)
        return [funcol.wait_tensor(outputs[0])[:10].view(2, 5), funcol.wait_tensor(outputs[1])]

    with FakeTensorMode():
        a, b = torch.empty(3), torch.empty(2, 2)
        graph = record_ops(gather_two, [a, b])
    graph.lint()
    assert call_targets(graph) == [
        funcol.all_gather_into_tensor_coalesced.default,
        operator.getitem,
        operator.getitem,
        funcol.wait_tensor.default,
        aten.slice.Tensor,
        aten.view.default,
        funcol.wait_tensor.default,
    ]
    names = [n.name for n in graph.nodes]
    assert names[:3] == ["input_0", "input_1", "all_gather_into_tensor_coalesced"] and "wait_tensor" in names
    for node in graph.nodes:
        if node.op == "call_function" and node.target is not funcol.all_gather_into_tensor_coalesced.default:
            assert isinstance(node.meta["val"], FakeTensor) and node.meta["tensor_meta"].shape == node.meta["val"].shape
    (first, second) = graph.output_node().args[0]
    assert tuple(first.meta["val"].shape) == (2, 5) and tuple(second.meta["val"].shape) == (8, 2)
    assert first.target is aten.view.default and second.target is funcol.wait_tensor.default


def test_an_input_returned_as_it_is_is_the_placeholder_and_constants_are_not_recorded() -> None:
    with FakeTensorMode():
        x = torch.empty(4)
        graph = record_ops(lambda t: [t, t.to(t.device) * 2], [x])
    placeholder = graph.find_nodes(op="placeholder")[0]
    assert graph.output_node().args[0][0] is placeholder
    assert call_targets(graph) == [aten.mul.Tensor]


def test_decomposed_ops_are_recorded_as_their_decomposition() -> None:
    def double(t: torch.Tensor) -> torch.Tensor:
        return aten.add.Tensor(t, t)

    with FakeTensorMode():
        x = torch.empty(4)
        plain = record_ops(lambda t: [torch.add(t, 1)], [x])
        decomposed = record_ops(lambda t: [torch.mul(t, 2)], [x], {aten.mul.Tensor: lambda t, _other: double(t)})
    assert call_targets(plain) == [aten.add.Tensor]
    assert call_targets(decomposed) == [aten.add.Tensor]
    assert decomposed.output_node().args[0][0].args == (decomposed.find_nodes(op="placeholder")[0],) * 2
