"""Record the aten ops a function runs as an FX graph: what `lower_markers` splices in for markers.

`make_fx` does the same with every feature a general tracer needs (proxies at the torch-function
level, symbolic shapes, module stacks, pytrees of any output), and costs ~1.4 ms per op for it:
a 48-layer GPT's stage-3 forward bucket of 580 parameters is 1,800 ops, and tracing the
lowering's buckets took 4 s of that model's 37 s compile. The lowering functions (`lowering.py`)
need none of it: tensors in, a list of tensors out, static shapes. One `TorchDispatchMode`
that runs each op on the input values and appends it to a graph does the job.

Fake-tensor inputs of static shape are recorded through meta tensors of the same shape, strides and
dtype: the ops then run on meta kernels in C++ instead of through the fake mode's Python dispatch
(about half a millisecond an op, most of the recording's cost), and each recorded value is made a
fake tensor of the inputs' mode and device afterwards. The 48-layer GPT's `lower_markers` (4,070
recorded ops) went from 1.9-2.2 s to 1.25-1.35 s. Symbolic sizes, which meta tensors cannot carry,
are recorded under the fake mode itself.

Every recorded node carries `meta["val"]` (the op's output value) and `meta["tensor_meta"]`, as
make_fx's do. Ops in `decompositions` are recorded as their decomposition, and composite ops as
theirs (Inductor's post-grad graphs hold only decomposed ops).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def record_ops(
    fn: Callable[..., list[torch.Tensor]], inputs: list[torch.Tensor], decompositions: dict | None = None
) -> fx.Graph:
    """The graph of `fn(*inputs)`: a placeholder per input, the aten ops it ran, an output of the
    list of tensors it returned. Values are fake tensors of the inputs' fake mode, if they have one."""
    fake_mode = detect_fake_mode(inputs)
    if fake_mode is None:
        return _record(fn, inputs, decompositions)
    devices = {value.device for value in inputs}
    metas = [meta_like(value) if value.storage_offset() == 0 else None for value in inputs]
    if len(devices) != 1 or any(meta is None for meta in metas):  # an offset would be lost on meta
        with fake_mode:
            return _record(fn, inputs, decompositions)
    with unset_fake_temporarily():
        graph = _record(fn, metas, decompositions)
    _make_values_fake(graph, inputs, fake_mode, devices.pop())
    return graph


def _record(fn: Callable[..., list[torch.Tensor]], inputs: list[torch.Tensor], decompositions: dict | None) -> fx.Graph:
    graph = fx.Graph()
    recorder = _Recorder(graph, decompositions or {})
    for i, value in enumerate(inputs):
        recorder.remember(value, graph.placeholder(f"input_{i}"))
    with recorder:
        outputs = fn(*inputs)
    graph.output([recorder.node_of(value) for value in outputs])
    return graph


def meta_like(value: torch.Tensor) -> torch.Tensor | None:
    """A meta tensor of `value`'s shape, strides and dtype (at storage offset 0); None where they
    are symbolic."""
    if not all(isinstance(n, int) for n in (*value.shape, *value.stride())):
        return None
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


def _make_values_fake(graph: fx.Graph, inputs: list[torch.Tensor], fake_mode: FakeTensorMode, device: torch.device) -> None:
    """The meta values recorded become `fake_mode`'s fake tensors on `device`, and every meta device
    an op was given (a factory's `device=`, e.g. `ones_like` decomposed to `full`) becomes `device`;
    placeholders get the inputs themselves back."""
    meta = torch.device("meta")
    # One fake tensor per meta value (a list's items are its getitems' values too). Kept here, not
    # in the fake mode's converter memo: its weak-keyed lookup cost more than making the tensors.
    fakes: dict[int, FakeTensor] = {}

    def fake(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.device != meta:
            return value
        if id(value) not in fakes:
            fakes[id(value)] = FakeTensor(fake_mode, value, device)
        return fakes[id(value)]

    def real_device(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value == meta else value

    for node, value in zip(graph.find_nodes(op="placeholder"), inputs):
        node.meta["val"] = value
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if any(value == meta for value in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(value, torch.device)):
            node.args = pytree.tree_map(real_device, node.args)
            node.kwargs = pytree.tree_map(real_device, node.kwargs)
        if "val" in node.meta:
            node.meta["val"] = pytree.tree_map(fake, node.meta["val"])


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: fx.Graph, decompositions: dict) -> None:
        super().__init__()
        self.graph = graph
        self.decompositions = decompositions
        # By id; the values themselves are kept so that no id is reused while recording.
        self.nodes: dict[int, tuple[torch.Tensor, fx.Node]] = {}

    def remember(self, value: torch.Tensor, node: fx.Node) -> None:
        node.meta["val"] = value
        node.meta["tensor_meta"] = _extract_tensor_metadata(value)
        self.nodes[id(value)] = (value, node)

    def node_of(self, value: torch.Tensor) -> fx.Node:
        return self.nodes[id(value)][1]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        decomposition = self.decompositions.get(func)
        if decomposition is not None:
            with self:
                result = decomposition(*args, **kwargs)
            if result is not NotImplemented:
                return result
        # A decomposition's own calls arrive here undecomposed where they are composite (its
        # `x.to(dtype)` as aten.to.dtype): recorded as such, Inductor has no lowering for them
        # and calls them eagerly, each one a buffer written out between two kernels that would
        # have been one. make_fx decomposes them the same way.
        if func.namespace == "aten":  # `decompose` knows no prim ops (prim::device)
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        result = func(*args, **kwargs)
        if not any(isinstance(value, torch.Tensor) for value in pytree.tree_leaves(result)):
            return result  # a constant (prim.device, static sizes): nothing to record
        as_node = lambda value: self.node_of(value) if isinstance(value, torch.Tensor) else value  # noqa: E731
        node = self.graph.call_function(
            func,
            pytree.tree_map(as_node, args),
            pytree.tree_map(as_node, kwargs),
            # Named as make_fx names them (`wait_tensor`, not `wait_tensor_default`).
            name=self.graph._target_to_str(func.overloadpacket.__name__),
        )
        if isinstance(result, torch.Tensor):
            self.remember(result, node)
        elif isinstance(result, (list, tuple)) and all(isinstance(item, torch.Tensor) for item in result):
            node.meta["val"] = list(result) if isinstance(result, list) else result
            for index, item in enumerate(result):
                self.remember(item, self.graph.call_function(operator.getitem, (node, index)))
        else:
            raise NotImplementedError(f"recording {func} returning {type(result).__name__}: not a tensor or tensors")
        return result
