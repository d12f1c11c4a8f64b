"""`passes.recording.record_ops`: the op recorder `lower_markers` splices collectives with."""

from __future__ import annotations

import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import tree_leaves

from fx_helpers import call_targets
from zerocompile.passes.recording import record_ops

aten = torch.ops.aten
funcol = torch.ops._c10d_functional

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("group_name")]


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


def test_composite_ops_a_decomposition_calls_are_decomposed_too() -> None:
    """A decomposition's own `x.to(dtype)` reaches the recorder as aten.to.dtype, which Inductor
    cannot lower: it called it eagerly between two kernels (seen in the int8 quantisation's code)."""

    def to_float_and_back(t: torch.Tensor, low: float, high: float) -> torch.Tensor:
        return t.to(torch.float32).clamp_min(low).clamp_max(high).to(t.dtype)

    with FakeTensorMode():
        x = torch.empty(4, dtype=torch.bfloat16)
        graph = record_ops(lambda t: [torch.clamp(t, -1, 1)], [x], {aten.clamp.default: to_float_and_back})
    targets = call_targets(graph)
    assert aten.to.dtype not in targets and aten._to_copy.default in targets, targets


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_static_fake_inputs_are_recorded_on_meta_and_come_back_fake_on_their_device(group_name: str, device: str) -> None:
    """The ops run on meta kernels, not through the fake mode's Python dispatch (what made recording
    the lowering's buckets cost seconds on a 48-layer GPT), and every value is again a fake tensor
    of the inputs' own mode on their device, as Inductor reads it (CUDA is faked: this CPU build
    cannot even dispatch a collective on a fake CUDA tensor)."""

    def gather_and_cut(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        outputs = funcol.all_gather_into_tensor_coalesced([a, b], 2, group_name)
        ones = torch.full([5, 1], 2.0, device=a.device)  # a factory: its device= argument is recorded
        return [funcol.wait_tensor(outputs[0])[:5].view(5, 1) * ones, funcol.wait_tensor(outputs[1]).view(2, 3)]

    mode = FakeTensorMode()
    with mode:
        a, b = torch.empty(3, device=device), torch.empty(3, device=device)
    dispatched_before = FakeTensorMode.cache_hits + FakeTensorMode.cache_misses + sum(FakeTensorMode.cache_bypasses.values())
    graph = record_ops(gather_and_cut, [a, b])
    dispatched = FakeTensorMode.cache_hits + FakeTensorMode.cache_misses + sum(FakeTensorMode.cache_bypasses.values())
    assert dispatched == dispatched_before
    graph.lint()
    assert [n.meta["val"] for n in graph.find_nodes(op="placeholder")] == [a, b]
    values = [v for n in graph.nodes if n.op == "call_function" for v in tree_leaves(n.meta["val"])]
    assert len(values) == 12  # the coalesced pair, its getitems and waits, slice, view, full, detach, mul, view
    for value in values:
        assert isinstance(value, FakeTensor) and value.fake_mode is mode and value.device == a.device
    (full,) = graph.find_nodes(op="call_function", target=aten.full.default)
    assert full.kwargs["device"] == a.device
    first, second = graph.output_node().args[0]
    assert tuple(first.meta["val"].shape) == (5, 1) and tuple(second.meta["val"].shape) == (2, 3)
    assert first.meta["tensor_meta"].shape == (5, 1)


def test_symbolic_inputs_are_recorded_under_their_fake_mode() -> None:
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.empty(6), static_shapes=False)
    graph = record_ops(lambda t: [t * 2], [x])
    (doubled,) = graph.output_node().args[0]
    assert doubled.meta["val"].fake_mode is mode and doubled.meta["val"].shape == x.shape
    assert not isinstance(doubled.meta["val"].shape[0], int)


def test_an_input_at_a_storage_offset_keeps_it_in_its_views() -> None:
    """A meta stand-in starts at offset 0, so such an input is recorded under its fake mode: a view of
    it (a gradient that is a slice of a larger buffer, viewed flat by a reduction) keeps the offset."""
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(8)[2:]
    graph = record_ops(lambda t: [t.view(2, 3)], [x])
    (viewed,) = graph.output_node().args[0]
    assert viewed.meta["val"].fake_mode is mode and viewed.meta["val"].storage_offset() == 2
