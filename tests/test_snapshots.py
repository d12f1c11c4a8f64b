"""FX snapshot tests: the lowered forward and backward graphs of stages 0-3, pinned as text.

Two small models (an MLP whose sizes are not multiples of the world size, so every shard is
padded, and a 2-layer GPT with tied embeddings) are sharded at each stage, compiled with
backend="zero" and the eager compiler, and run once forward+backward on a fake 4-rank process
group (collectives return garbage but never block: only the graphs matter). Each graph the backend
records (`zerocompile.record_graphs()`) is normalized to one line per node:

    input primals_1: f32[32]
    all_gather_into_tensor: f32[128] = _c10d_functional.all_gather_into_tensor(primals_1, 4, WORLD)  # param: fc1.weight; free: primals_1

- the op without `torch.ops.` and without a `.default` overload; every argument as FX prints it,
  so a collective shows its group size, reduce op and split sizes; the group name is `WORLD`;
- `name: dtype[shape]` from the node's `meta["val"]` (the backend's `lower_markers` is wrapped to
  keep each lowered graph object: the recorded `.code` alone has no shapes);
- `param:` the parameters a collective serves (`meta["zero_params"]`), when the passes record them;
- `free:` the values FX's generated code drops after this node (its `x = None`), i.e. where each
  gathered buffer or unreduced gradient dies.

So a change to a pass reads as a diff of collectives, waits and frees. To re-pin after an
intended change: `EXPECTTEST_ACCEPT=1 pytest tests/test_snapshots.py`, then review the diff.

The fake group is created for this module's classes and destroyed after them; if a process group
already exists when they start, they fail instead of touching it.
"""

from __future__ import annotations

import os
import re
import unittest
from unittest import mock

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import zerocompile as zc
from zerocompile import backend, sharding
from zerocompile.passes.lowering import ALL_TO_ALL_REDUCE_SCATTER
from zerocompile.tools.gpt import GPT, GPTConfig

pytestmark = [pytest.mark.fast, pytest.mark.core]

WORLD = 4
GPT_CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)

_DTYPES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "b8",
}
_FREES = re.compile(r"^(?:\w+ = )+None$")
_ASSIGN = re.compile(r"^(\w+) = (.*)$")
_OP = re.compile(r"torch\.ops\.([\w.]+?)(?:\.default)?(?=\()")


class MLP(nn.Module):
    """Three layers, no size divisible by 4: every gather slices padding, every reduction pads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 11)
        self.fc3 = nn.Linear(11, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x))))).square().mean()


# ------------------------------------------------------------------------------- normalization


def _describe(value) -> str | None:
    if isinstance(value, torch.Tensor):
        dtype = _DTYPES.get(value.dtype, str(value.dtype).removeprefix("torch."))
        return f"{dtype}[{', '.join(str(s) for s in value.shape)}]"
    if isinstance(value, (tuple, list)):
        parts = [_describe(v) or "?" for v in value]
        return f"({', '.join(parts)})"
    if value is None:
        return None
    return type(value).__name__


def _split_frees(statement: str) -> tuple[str, list[str]]:
    """`x = op(a);  a = b = None` -> (`x = op(a)`, [a, b])."""
    body, sep, tail = statement.rpartition(";  ")
    if sep and _FREES.match(tail):
        return body, tail.split(" = ")[:-1]
    return statement, []


def normalize(code: str, graph: fx.Graph, group_name: str) -> str:
    """One line per node of the lowered graph's python code, annotated from the graph's meta."""
    nodes = {node.name: node for node in graph.nodes}
    group = re.compile(rf"(?<![\w']){re.escape(repr(group_name))}(?![\w'])")
    out: list[str] = []

    def annotate(line: str, notes: list[str]) -> str:
        return f"{line}  # {'; '.join(notes)}" if notes else line

    for raw in code.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("def "):
            params = line[line.index("(") + 1 : line.rindex(")")].split(", ")
            for name in params:
                if name == "self":
                    continue
                out.append(f"input {name}: {_describe(nodes[name].meta.get('val'))}")
            continue
        line = _UNSAFE_VIEW.sub("aten.view(", group.sub("WORLD", _OP.sub(r"\1", line)))
        statement, frees = _split_frees(line)
        notes = [f"free: {', '.join(frees)}"] if frees else []
        if statement.startswith("return "):
            out.append(annotate(statement, notes))
            continue
        if _FREES.match(statement):  # an unused input dropped on a line of its own
            out.append(f"free: {', '.join(statement.split(' = ')[:-1])}")
            continue
        match = _ASSIGN.match(statement)
        assert match is not None, f"unexpected line in lowered code: {raw!r}"
        name, rhs = match.groups()
        node = nodes[name]
        shape = _describe(node.meta.get("val"))
        param = ", ".join(name for name, _bytes in node.meta.get("zero_params", []))
        if param and rhs.startswith("_c10d_functional.") and not rhs.startswith("_c10d_functional.wait_tensor("):
            notes.insert(0, f"param: {param}")
        out.append(annotate(f"{name}: {shape} = {rhs}" if shape else f"{name} = {rhs}", notes))
    return _renumbered("\n".join(out), [n.name for n in graph.nodes if n.op != "output" and not _STABLE.match(n.name)])


# torch 2.15 reshapes a Linear's output with `_unsafe_view` where 2.11-2.14 use `view`: the same
# reshape of a fresh tensor, which the snapshots show as `view` on every version.
_UNSAFE_VIEW = re.compile(r"\baten\._unsafe_view\(")
_STABLE = re.compile(r"^(primals|tangents)_\d+$")  # AOTAutograd's own numbering of the inputs
_VALUE = re.compile(r"(?<![.\w])[A-Za-z_]\w*\b(?!\()")


def _renumbered(text: str, names: list[str]) -> str:
    """Values renamed `<op>`, `<op>_1`, ... in the order the graph defines them (a backward's
    inputs saved by the forward too; the parameters' and gradients' `primals_i`/`tangents_i` keep theirs).

    FX numbers a node after every node of its name made before it, in the joint graph too, so the
    backward's first getitem was `getitem_48` on torch 2.13 and `getitem_3` on 2.11: the snapshot
    should show the graph, not how many nodes torch's tracing happened to make first."""
    counts: dict[str, int] = {}
    renamed = {}
    for name in names:
        base = re.sub(r"_\d+$", "", name).removeprefix("_unsafe_")
        renamed[name] = f"{base}_{counts[base]}" if counts.get(base) else base
        counts[base] = counts.get(base, 0) + 1
    return _VALUE.sub(lambda match: renamed.get(match.group(0), match.group(0)), text)


# ------------------------------------------------------------------------------------ compiling


def lowered_graphs(model: nn.Module, args: tuple, stage: int, **settings) -> tuple[str, str]:
    """Shard (with `settings`), compile with the eager compiler, run forward+backward once;
    normalized (fw, bw)."""
    torch._dynamo.reset()
    captured: list[fx.Graph] = []  # the lowered graphs themselves, for their nodes' meta
    lower = backend.lower_markers

    def lower_and_capture(graph: fx.Graph, *rest, **kwargs):
        result = lower(graph, *rest, **kwargs)
        captured.append(graph)
        return result

    try:
        zc.shard(model, stage, **settings)
        compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
        with mock.patch.object(backend, "lower_markers", lower_and_capture), zc.record_graphs() as records:
            compiled(*args).backward()
    finally:
        torch._dynamo.reset()
    assert len(records) == len(captured), "every recorded graph should have been captured once"
    kinds = [r.kind for r in records]
    assert kinds == ["forward", "backward"], f"expected one forward and one backward graph, got {kinds}"
    group_name = dist.group.WORLD.group_name
    return tuple(normalize(r.code, g, group_name) for r, g in zip(records, captured))


def mlp_graphs(stage: int, **settings) -> tuple[str, str]:
    torch.manual_seed(0)
    return lowered_graphs(MLP(), (torch.randn(4, 7),), stage, **settings)


def gpt_graphs(stage: int, **settings) -> tuple[str, str]:
    torch.manual_seed(0)
    idx = torch.arange(2 * GPT_CONFIG.block_size).remainder(GPT_CONFIG.vocab_size).view(2, -1)
    return lowered_graphs(GPT(GPT_CONFIG), (idx, idx.roll(-1, dims=1)), stage, **settings)


def collective_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "_c10d_functional." in line and "wait_tensor(" not in line]


# A reduce-scatter to shards of N elements, and the all-to-all of N-element splits replacing it.
REDUCE_SCATTER = re.compile(
    r": f32\[(?P<shard>\d+)\] = _c10d_functional\.reduce_scatter_tensor\(\w+, 'avg', 4, WORLD\)  # param: (?P<param>[\w.]+)"
)
ALL_TO_ALL = re.compile(
    r" = _c10d_functional\.all_to_all_single\(\w+, \[(?P<shard>\d+), (?P=shard), (?P=shard), (?P=shard)\], "
    r"\[(?P=shard), (?P=shard), (?P=shard), (?P=shard)\], WORLD\)  # param: (?P<param>[\w.]+)"
)


def _match(pattern: re.Pattern, line: str) -> tuple[str, str]:
    match = pattern.search(line)
    assert match is not None, f"{line!r} does not match {pattern.pattern!r}"
    return match["param"], match["shard"]


# ------------------------------------------------------------------------------- process group


class FakeGroupTestCase(expecttest.TestCase):
    """Creates the fake 4-rank world for the class and destroys it after; never reuses one."""

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        if dist.is_initialized():
            raise RuntimeError(
                f"{cls.__name__}: a {dist.get_backend()} process group of {dist.get_world_size()} ranks "
                "is already initialised in this process (left over by another test module?); the "
                f"snapshot tests create and destroy their own fake group of {WORLD} and will not "
                "touch an existing one"
            )
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)

    @classmethod
    def tearDownClass(cls) -> None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            torch._dynamo.reset()
        finally:
            super().tearDownClass()


# ------------------------------------------------------------------------------------ snapshots


class TestMLPSnapshots(FakeGroupTestCase):
    def test_stage_0(self) -> None:
        forward, backward = mlp_graphs(0)
        self.assertExpectedInline(forward, """\
input primals_1: f32[13, 7]
input primals_2: f32[13]
input primals_3: f32[4, 7]
input primals_4: f32[11, 13]
input primals_5: f32[11]
input primals_6: f32[3, 11]
input primals_7: f32[3]
t: f32[7, 13] = aten.t(primals_1)  # free: primals_1
addmm: f32[4, 13] = aten.addmm(primals_2, primals_3, t)  # free: primals_2, t
relu: f32[4, 13] = aten.relu(addmm)  # free: addmm
t_1: f32[13, 11] = aten.t(primals_4)  # free: primals_4
addmm_1: f32[4, 11] = aten.addmm(primals_5, relu, t_1)  # free: primals_5
relu_1: f32[4, 11] = aten.relu(addmm_1)  # free: addmm_1
t_2: f32[11, 3] = aten.t(primals_6)  # free: primals_6
addmm_2: f32[4, 3] = aten.addmm(primals_7, relu_1, t_2)  # free: primals_7
pow: f32[4, 3] = aten.pow.Tensor_Scalar(addmm_2, 2)
mean: f32[] = aten.mean(pow)  # free: pow
t_3: f32[3, 11] = aten.t(t_2)  # free: t_2
t_4: f32[11, 13] = aten.t(t_1)  # free: t_1
return (mean, primals_3, relu, relu_1, addmm_2, t_3, t_4)""")
        self.assertExpectedInline(backward, """\
input primals_3: f32[4, 7]
input relu: f32[4, 13]
input relu_1: f32[4, 11]
input addmm: f32[4, 3]
input t: f32[3, 11]
input t_1: f32[11, 13]
input tangents_1: f32[]
expand: f32[4, 3] = aten.expand(tangents_1, [4, 3])  # free: tangents_1
div: f32[4, 3] = aten.div.Scalar(expand, 12)  # free: expand
pow: f32[4, 3] = aten.pow.Tensor_Scalar(addmm, 1.0)  # free: addmm
mul: f32[4, 3] = aten.mul.Scalar(pow, 2.0)  # free: pow
mul_1: f32[4, 3] = aten.mul.Tensor(div, mul)  # free: div, mul
mm: f32[4, 11] = aten.mm(mul_1, t)  # free: t
t_2: f32[3, 4] = aten.t(mul_1)
mm_1: f32[3, 11] = aten.mm(t_2, relu_1)  # free: t_2
t_3: f32[11, 3] = aten.t(mm_1)  # free: mm_1
sum: f32[1, 3] = aten.sum.dim_IntList(mul_1, [0], True)  # free: mul_1
view: f32[3] = aten.view(sum, [3])  # free: sum
t_4: f32[3, 11] = aten.t(t_3)  # free: t_3
detach: f32[4, 11] = aten.detach(relu_1)  # free: relu_1
detach_1: f32[4, 11] = aten.detach(detach)  # free: detach
threshold_backward: f32[4, 11] = aten.threshold_backward(mm, detach_1, 0)  # free: mm, detach_1
mm_2: f32[4, 13] = aten.mm(threshold_backward, t_1)  # free: t_1
t_5: f32[11, 4] = aten.t(threshold_backward)
mm_3: f32[11, 13] = aten.mm(t_5, relu)  # free: t_5
t_6: f32[13, 11] = aten.t(mm_3)  # free: mm_3
sum_1: f32[1, 11] = aten.sum.dim_IntList(threshold_backward, [0], True)  # free: threshold_backward
view_1: f32[11] = aten.view(sum_1, [11])  # free: sum_1
t_7: f32[11, 13] = aten.t(t_6)  # free: t_6
detach_2: f32[4, 13] = aten.detach(relu)  # free: relu
detach_3: f32[4, 13] = aten.detach(detach_2)  # free: detach_2
threshold_backward_1: f32[4, 13] = aten.threshold_backward(mm_2, detach_3, 0)  # free: mm_2, detach_3
t_8: f32[13, 4] = aten.t(threshold_backward_1)
mm_4: f32[13, 7] = aten.mm(t_8, primals_3)  # free: t_8, primals_3
t_9: f32[7, 13] = aten.t(mm_4)  # free: mm_4
sum_2: f32[1, 13] = aten.sum.dim_IntList(threshold_backward_1, [0], True)  # free: threshold_backward_1
view_2: f32[13] = aten.view(sum_2, [13])  # free: sum_2
t_10: f32[13, 7] = aten.t(t_9)  # free: t_9
pack: f32[294] = zerocompile.pack([view, t_4, view_1, t_7, view_2, t_10], 1, [3, 33, 11, 143, 13, 91])  # free: view, t_4, view_1, t_7, view_2, t_10
all_reduce: f32[294] = _c10d_functional.all_reduce(pack, 'sum', WORLD)  # param: fc3.bias, fc3.weight, fc2.bias, fc2.weight, fc1.bias, fc1.weight; free: pack
wait_tensor: f32[294] = _c10d_functional.wait_tensor(all_reduce)  # free: all_reduce
unsqueeze: f32[1, 294] = aten.unsqueeze(wait_tensor, 0)  # free: wait_tensor
average_rows: f32[294] = zerocompile.average_rows(unsqueeze, 4)  # free: unsqueeze
split_with_sizes: (f32[3], f32[33], f32[11], f32[143], f32[13], f32[91]) = aten.split_with_sizes(average_rows, [3, 33, 11, 143, 13, 91])  # free: average_rows
getitem: f32[3] = split_with_sizes[0]
getitem_1: f32[33] = split_with_sizes[1]
getitem_2: f32[11] = split_with_sizes[2]
getitem_3: f32[143] = split_with_sizes[3]
getitem_4: f32[13] = split_with_sizes[4]
getitem_5: f32[91] = split_with_sizes[5]  # free: split_with_sizes
view_3: f32[3] = aten.view(getitem, [3])  # free: getitem
view_4: f32[3, 11] = aten.view(getitem_1, [3, 11])  # free: getitem_1
view_5: f32[11] = aten.view(getitem_2, [11])  # free: getitem_2
view_6: f32[11, 13] = aten.view(getitem_3, [11, 13])  # free: getitem_3
view_7: f32[13] = aten.view(getitem_4, [13])  # free: getitem_4
view_8: f32[13, 7] = aten.view(getitem_5, [13, 7])  # free: getitem_5
return (view_8, view_7, None, view_6, view_5, view_4, view_3)""")

    def test_stage_1(self) -> None:
        forward, backward = mlp_graphs(1)
        self.assertExpectedInline(forward, """\
input primals_1: f32[28]
input primals_2: f32[4]
input primals_3: f32[4, 7]
input primals_4: f32[39]
input primals_5: f32[3]
input primals_6: f32[11]
input primals_7: f32[1]
pack: f32[86] = zerocompile.pack([primals_1, primals_2, primals_4, primals_5, primals_6, primals_7], 1, [28, 4, 39, 3, 11, 1])  # free: primals_1, primals_2, primals_4, primals_5, primals_6, primals_7
all_gather_into_tensor: f32[344] = _c10d_functional.all_gather_into_tensor(pack, 4, WORLD)  # param: fc1.weight, fc1.bias, fc2.weight, fc2.bias, fc3.weight, fc3.bias; free: pack
wait_tensor: f32[344] = _c10d_functional.wait_tensor(all_gather_into_tensor)  # free: all_gather_into_tensor
unpack: (f32[112], f32[16], f32[156], f32[12], f32[44], f32[4]) = zerocompile.unpack(wait_tensor, 4, [28, 4, 39, 3, 11, 1])  # free: wait_tensor
getitem: f32[112] = unpack[0]
getitem_1: f32[16] = unpack[1]
getitem_2: f32[156] = unpack[2]
getitem_3: f32[12] = unpack[3]
getitem_4: f32[44] = unpack[4]
getitem_5: f32[4] = unpack[5]  # free: unpack
slice: f32[91] = aten.slice.Tensor(getitem, 0, 0, 91)  # free: getitem
view: f32[13, 7] = aten.view(slice, [13, 7])  # free: slice
slice_1: f32[13] = aten.slice.Tensor(getitem_1, 0, 0, 13)  # free: getitem_1
view_1: f32[13] = aten.view(slice_1, [13])  # free: slice_1
slice_2: f32[143] = aten.slice.Tensor(getitem_2, 0, 0, 143)  # free: getitem_2
view_2: f32[11, 13] = aten.view(slice_2, [11, 13])  # free: slice_2
slice_3: f32[11] = aten.slice.Tensor(getitem_3, 0, 0, 11)  # free: getitem_3
view_3: f32[11] = aten.view(slice_3, [11])  # free: slice_3
slice_4: f32[33] = aten.slice.Tensor(getitem_4, 0, 0, 33)  # free: getitem_4
view_4: f32[3, 11] = aten.view(slice_4, [3, 11])  # free: slice_4
slice_5: f32[3] = aten.slice.Tensor(getitem_5, 0, 0, 3)  # free: getitem_5
view_5: f32[3] = aten.view(slice_5, [3])  # free: slice_5
t: f32[7, 13] = aten.t(view)  # free: view
addmm: f32[4, 13] = aten.addmm(view_1, primals_3, t)  # free: view_1, t
relu: f32[4, 13] = aten.relu(addmm)  # free: addmm
t_1: f32[13, 11] = aten.t(view_2)  # free: view_2
addmm_1: f32[4, 11] = aten.addmm(view_3, relu, t_1)  # free: view_3
relu_1: f32[4, 11] = aten.relu(addmm_1)  # free: addmm_1
t_2: f32[11, 3] = aten.t(view_4)  # free: view_4
addmm_2: f32[4, 3] = aten.addmm(view_5, relu_1, t_2)  # free: view_5
pow: f32[4, 3] = aten.pow.Tensor_Scalar(addmm_2, 2)
mean: f32[] = aten.mean(pow)  # free: pow
t_3: f32[3, 11] = aten.t(t_2)  # free: t_2
t_4: f32[11, 13] = aten.t(t_1)  # free: t_1
return (mean, primals_3, relu, relu_1, addmm_2, t_3, t_4)""")
        self.assertExpectedInline(backward, """\
input primals_3: f32[4, 7]
input relu: f32[4, 13]
input relu_1: f32[4, 11]
input addmm: f32[4, 3]
input t: f32[3, 11]
input t_1: f32[11, 13]
input tangents_1: f32[]
expand: f32[4, 3] = aten.expand(tangents_1, [4, 3])  # free: tangents_1
div: f32[4, 3] = aten.div.Scalar(expand, 12)  # free: expand
pow: f32[4, 3] = aten.pow.Tensor_Scalar(addmm, 1.0)  # free: addmm
mul: f32[4, 3] = aten.mul.Scalar(pow, 2.0)  # free: pow
mul_1: f32[4, 3] = aten.mul.Tensor(div, mul)  # free: div, mul
mm: f32[4, 11] = aten.mm(mul_1, t)  # free: t
t_2: f32[3, 4] = aten.t(mul_1)
mm_1: f32[3, 11] = aten.mm(t_2, relu_1)  # free: t_2
t_3: f32[11, 3] = aten.t(mm_1)  # free: mm_1
sum: f32[1, 3] = aten.sum.dim_IntList(mul_1, [0], True)  # free: mul_1
view: f32[3] = aten.view(sum, [3])  # free: sum
t_4: f32[3, 11] = aten.t(t_3)  # free: t_3
detach: f32[4, 11] = aten.detach(relu_1)  # free: relu_1
detach_1: f32[4, 11] = aten.detach(detach)  # free: detach
threshold_backward: f32[4, 11] = aten.threshold_backward(mm, detach_1, 0)  # free: mm, detach_1
mm_2: f32[4, 13] = aten.mm(threshold_backward, t_1)  # free: t_1
t_5: f32[11, 4] = aten.t(threshold_backward)
mm_3: f32[11, 13] = aten.mm(t_5, relu)  # free: t_5
t_6: f32[13, 11] = aten.t(mm_3)  # free: mm_3
sum_1: f32[1, 11] = aten.sum.dim_IntList(threshold_backward, [0], True)  # free: threshold_backward
view_1: f32[11] = aten.view(sum_1, [11])  # free: sum_1
t_7: f32[11, 13] = aten.t(t_6)  # free: t_6
detach_2: f32[4, 13] = aten.detach(relu)  # free: relu
detach_3: f32[4, 13] = aten.detach(detach_2)  # free: detach_2
threshold_backward_1: f32[4, 13] = aten.threshold_backward(mm_2, detach_3, 0)  # free: mm_2, detach_3
t_8: f32[13, 4] = aten.t(threshold_backward_1)
mm_4: f32[13, 7] = aten.mm(t_8, primals_3)  # free: t_8, primals_3
t_9: f32[7, 13] = aten.t(mm_4)  # free: mm_4
sum_2: f32[1, 13] = aten.sum.dim_IntList(threshold_backward_1, [0], True)  # free: threshold_backward_1
view_2: f32[13] = aten.view(sum_2, [13])  # free: sum_2
t_10: f32[13, 7] = aten.t(t_9)  # free: t_9
pack: f32[344] = zerocompile.pack([view, t_4, view_1, t_7, view_2, t_10], 4, [1, 11, 3, 39, 4, 28])  # free: view, t_4, view_1, t_7, view_2, t_10
reduce_scatter_tensor: f32[86] = _c10d_functional.reduce_scatter_tensor(pack, 'avg', 4, WORLD)  # param: fc3.bias, fc3.weight, fc2.bias, fc2.weight, fc1.bias, fc1.weight; free: pack
wait_tensor: f32[86] = _c10d_functional.wait_tensor(reduce_scatter_tensor)  # free: reduce_scatter_tensor
split_with_sizes: (f32[1], f32[11], f32[3], f32[39], f32[4], f32[28]) = aten.split_with_sizes(wait_tensor, [1, 11, 3, 39, 4, 28])  # free: wait_tensor
getitem: f32[1] = split_with_sizes[0]
getitem_1: f32[11] = split_with_sizes[1]
getitem_2: f32[3] = split_with_sizes[2]
getitem_3: f32[39] = split_with_sizes[3]
getitem_4: f32[4] = split_with_sizes[4]
getitem_5: f32[28] = split_with_sizes[5]  # free: split_with_sizes
return (getitem_5, getitem_4, None, getitem_3, getitem_2, getitem_1, getitem)""")

    def test_stage_2(self) -> None:
        forward, backward = mlp_graphs(2)
        self.assertExpectedInline(forward, """\
input primals_1: f32[28]
input primals_2: f32[4]
input primals_3: f32[4, 7]
input primals_4: f32[39]
input primals_5: f32[3]
input primals_6: f32[11]
input primals_7: f32[1]
pack: f32[86] = zerocompile.pack([primals_1, primals_2, primals_4, primals_5, primals_6, primals_7], 1, [28, 4, 39, 3, 11, 1])  # free: primals_1, primals_2, primals_4, primals_5, primals_6, primals_7
all_gather_into_tensor: f32[344] = _c10d_functional.all_gather_into_tensor(pack, 4, WORLD)  # param: fc1.weight, fc1.bias, fc2.weight, fc2.bias, fc3.weight, fc3.bias; free: pack
wait_tensor: f32[344] = _c10d_functional.wait_tensor(all_gather_into_tensor)  # free: all_gather_into_tensor
unpack: (f32[112], f32[16], f32[156], f32[12], f32[44], f32[4]) = zerocompile.unpack(wait_tensor, 4, [28, 4, 39, 3, 11, 1])  # free: wait_tensor
getitem: f32[112] = unpack[0]
getitem_1: f32[16] = unpack[1]
getitem_2: f32[156] = unpack[2]
getitem_3: f32[12] = unpack[3]
getitem_4: f32[44] = unpack[4]
getitem_5: f32[4] = unpack[5]  # free: unpack
slice: f32[91] = aten.slice.Tensor(getitem, 0, 0, 91)  # free: getitem
view: f32[13, 7] = aten.view(slice, [13, 7])  # free: slice
slice_1: f32[13] = aten.slice.Tensor(getitem_1, 0, 0, 13)  # free: getitem_1
view_1: f32[13] = aten.view(slice_1, [13])  # free: slice_1
slice_2: f32[143] = aten.slice.Tensor(getitem_2, 0, 0, 143)  # free: getitem_2
view_2: f32[11, 13] = aten.view(slice_2, [11, 13])  # free: slice_2
slice_3: f32[11] = aten.slice.Tensor(getitem_3, 0, 0, 11)  # free: getitem_3
view_3: f32[11] = aten.view(slice_3, [11])  # free: slice_3
slice_4: f32[33] = aten.slice.Tensor(getitem_4, 0, 0, 33)  # free: getitem_4
view_4: f32[3, 11] = aten.view(slice_4, [3, 11])  # free: slice_4
slice_5: f32[3] = aten.slice.Tensor(getitem_5, 0, 0, 3)  # free: getitem_5
view_5: f32[3] = aten.view(slice_5, [3])  # free: slice_5
t: f32[7, 13] = aten.t(view)  # free: view
addmm: f32[4, 13] = aten.addmm(view_1, primals_3, t)  # free: view_1, t
relu: f32[4, 13] = aten.relu(addmm)  # free: addmm
t_1: f32[13, 11] = aten.t(view_2)  # free: view_2
addmm_1: f32[4, 11] = aten.addmm(view_3, relu, t_1)  # free: view_3
relu_1: f32[4, 11] = aten.relu(addmm_1)  # free: addmm_1
t_2: f32[11, 3] = aten.t(view_4)  # free: view_4
addmm_2: f32[4, 3] = aten.addmm(view_5, relu_1, t_2)  # free: view_5
pow: f32[4, 3] = aten.pow.Tensor_Scalar(addmm_2, 2)
mean: f32[] = aten.mean(pow)  # free: pow
t_3: f32[3, 11] = aten.t(t_2)  # free: t_2
t_4: f32[11, 13] = aten.t(t_1)  # free: t_1
return (mean, primals_3, relu, relu_1, addmm_2, t_3, t_4)""")
        self.assertExpectedInline(backward, """\
input primals_3: f32[4, 7]
input relu: f32[4, 13]
input relu_1: f32[4, 11]
input addmm: f32[4, 3]
input t: f32[3, 11]
input t_1: f32[11, 13]
input tangents_1: f32[]
expand: f32[4, 3] = aten.expand(tangents_1, [4, 3])  # free: tangents_1
div: f32[4, 3] = aten.div.Scalar(expand, 12)  # free: expand
pow: f32[4, 3] = aten.pow.Tensor_Scalar(addmm, 1.0)  # free: addmm
mul: f32[4, 3] = aten.mul.Scalar(pow, 2.0)  # free: pow
mul_1: f32[4, 3] = aten.mul.Tensor(div, mul)  # free: div, mul
mm: f32[4, 11] = aten.mm(mul_1, t)  # free: t
t_2: f32[3, 4] = aten.t(mul_1)
mm_1: f32[3, 11] = aten.mm(t_2, relu_1)  # free: t_2
t_3: f32[11, 3] = aten.t(mm_1)  # free: mm_1
sum: f32[1, 3] = aten.sum.dim_IntList(mul_1, [0], True)  # free: mul_1
view: f32[3] = aten.view(sum, [3])  # free: sum
t_4: f32[3, 11] = aten.t(t_3)  # free: t_3
detach: f32[4, 11] = aten.detach(relu_1)  # free: relu_1
detach_1: f32[4, 11] = aten.detach(detach)  # free: detach
threshold_backward: f32[4, 11] = aten.threshold_backward(mm, detach_1, 0)  # free: mm, detach_1
mm_2: f32[4, 13] = aten.mm(threshold_backward, t_1)  # free: t_1
t_5: f32[11, 4] = aten.t(threshold_backward)
mm_3: f32[11, 13] = aten.mm(t_5, relu)  # free: t_5
t_6: f32[13, 11] = aten.t(mm_3)  # free: mm_3
sum_1: f32[1, 11] = aten.sum.dim_IntList(threshold_backward, [0], True)  # free: threshold_backward
view_1: f32[11] = aten.view(sum_1, [11])  # free: sum_1
t_7: f32[11, 13] = aten.t(t_6)  # free: t_6
detach_2: f32[4, 13] = aten.detach(relu)  # free: relu
detach_3: f32[4, 13] = aten.detach(detach_2)  # free: detach_2
threshold_backward_1: f32[4, 13] = aten.threshold_backward(mm_2, detach_3, 0)  # free: mm_2, detach_3
t_8: f32[13, 4] = aten.t(threshold_backward_1)
mm_4: f32[13, 7] = aten.mm(t_8, primals_3)  # free: t_8, primals_3
t_9: f32[7, 13] = aten.t(mm_4)  # free: mm_4
sum_2: f32[1, 13] = aten.sum.dim_IntList(threshold_backward_1, [0], True)  # free: threshold_backward_1
view_2: f32[13] = aten.view(sum_2, [13])  # free: sum_2
t_10: f32[13, 7] = aten.t(t_9)  # free: t_9
pack: f32[344] = zerocompile.pack([view, t_4, view_1, t_7, view_2, t_10], 4, [1, 11, 3, 39, 4, 28])  # free: view, t_4, view_1, t_7, view_2, t_10
reduce_scatter_tensor: f32[86] = _c10d_functional.reduce_scatter_tensor(pack, 'avg', 4, WORLD)  # param: fc3.bias, fc3.weight, fc2.bias, fc2.weight, fc1.bias, fc1.weight; free: pack
wait_tensor: f32[86] = _c10d_functional.wait_tensor(reduce_scatter_tensor)  # free: reduce_scatter_tensor
split_with_sizes: (f32[1], f32[11], f32[3], f32[39], f32[4], f32[28]) = aten.split_with_sizes(wait_tensor, [1, 11, 3, 39, 4, 28])  # free: wait_tensor
getitem: f32[1] = split_with_sizes[0]
getitem_1: f32[11] = split_with_sizes[1]
getitem_2: f32[3] = split_with_sizes[2]
getitem_3: f32[39] = split_with_sizes[3]
getitem_4: f32[4] = split_with_sizes[4]
getitem_5: f32[28] = split_with_sizes[5]  # free: split_with_sizes
return (getitem_5, getitem_4, None, getitem_3, getitem_2, getitem_1, getitem)""")

    def test_stage_2_snapshot_fails_on_changed_collective(self) -> None:
        """gloo's layout (reduce-scatter built from all-to-all, coalesced gathers) must fail the
        pinned graphs, which are every other backend's (one flat all-gather per bucket)."""
        gloo = mock.patch.object(sharding, "reduce_scatter_flavour", lambda group, device: ALL_TO_ALL_REDUCE_SCATTER)
        forward, backward = mlp_graphs(2)
        with gloo:
            changed_forward, changed_backward = mlp_graphs(2)
        self.assertIn("= _c10d_functional.all_gather_into_tensor(", forward)
        self.assertNotIn("all_gather_into_tensor_coalesced(", forward)
        self.assertIn("= _c10d_functional.all_gather_into_tensor_coalesced(", changed_forward)
        self.assertNotIn("reduce_scatter_tensor(", changed_backward)
        # Same bucket with the same shard sizes: only the collective changed.
        scattered = [_match(REDUCE_SCATTER, line) for line in collective_lines(backward)]
        exchanged = [_match(ALL_TO_ALL, line) for line in collective_lines(changed_backward)]
        self.assertEqual(len(scattered), 1)  # the whole MLP fits one bucket (default bucket_bytes)
        self.assertEqual(scattered, exchanged)

        if os.getenv("EXPECTTEST_ACCEPT"):
            self.skipTest("accepting snapshots: this process still holds the old pinned literals")
        self.maxDiff = None  # the whole diff, to read which lines changed
        with gloo, self.assertRaises(AssertionError) as failure:
            self.test_stage_2()  # its forward snapshot fails first
        diff = str(failure.exception).splitlines()
        pinned = [line for line in diff if line.startswith("- ")]
        actual = [line for line in diff if line.startswith("+ ")]
        self.assertTrue(any("= _c10d_functional.all_gather_into_tensor(" in line for line in pinned), diff)
        self.assertTrue(any("= _c10d_functional.all_gather_into_tensor_coalesced(" in line for line in actual), diff)

    def test_stage_3(self) -> None:
        forward, backward = mlp_graphs(3)
        self.assertExpectedInline(forward, """\
input primals_1: f32[28]
input primals_2: f32[4]
input primals_3: f32[4, 7]
input primals_4: f32[39]
input primals_5: f32[3]
input primals_6: f32[11]
input primals_7: f32[1]
pack: f32[86] = zerocompile.pack([primals_1, primals_2, primals_4, primals_5, primals_6, primals_7], 1, [28, 4, 39, 3, 11, 1])  # free: primals_1, primals_2, primals_5, primals_7
all_gather_into_tensor: f32[344] = _c10d_functional.all_gather_into_tensor(pack, 4, WORLD)  # param: fc1.weight, fc1.bias, fc2.weight, fc2.bias, fc3.weight, fc3.bias; free: pack
wait_tensor: f32[344] = _c10d_functional.wait_tensor(all_gather_into_tensor)  # free: all_gather_into_tensor
unpack: (f32[112], f32[16], f32[156], f32[12], f32[44], f32[4]) = zerocompile.unpack(wait_tensor, 4, [28, 4, 39, 3, 11, 1])  # free: wait_tensor
getitem: f32[112] = unpack[0]
getitem_1: f32[16] = unpack[1]
getitem_2: f32[156] = unpack[2]
getitem_3: f32[12] = unpack[3]
getitem_4: f32[44] = unpack[4]
getitem_5: f32[4] = unpack[5]  # free: unpack
slice: f32[91] = aten.slice.Tensor(getitem, 0, 0, 91)  # free: getitem
view: f32[13, 7] = aten.view(slice, [13, 7])  # free: slice
slice_1: f32[13] = aten.slice.Tensor(getitem_1, 0, 0, 13)  # free: getitem_1
view_1: f32[13] = aten.view(slice_1, [13])  # free: slice_1
slice_2: f32[143] = aten.slice.Tensor(getitem_2, 0, 0, 143)  # free: getitem_2
view_2: f32[11, 13] = aten.view(slice_2, [11, 13])  # free: slice_2
slice_3: f32[11] = aten.slice.Tensor(getitem_3, 0, 0, 11)  # free: getitem_3
view_3: f32[11] = aten.view(slice_3, [11])  # free: slice_3
slice_4: f32[33] = aten.slice.Tensor(getitem_4, 0, 0, 33)  # free: getitem_4
view_4: f32[3, 11] = aten.view(slice_4, [3, 11])  # free: slice_4
slice_5: f32[3] = aten.slice.Tensor(getitem_5, 0, 0, 3)  # free: getitem_5
view_5: f32[3] = aten.view(slice_5, [3])  # free: slice_5
t: f32[7, 13] = aten.t(view)  # free: view
addmm: f32[4, 13] = aten.addmm(view_1, primals_3, t)  # free: view_1, t
relu: f32[4, 13] = aten.relu(addmm)  # free: addmm
t_1: f32[13, 11] = aten.t(view_2)  # free: view_2
addmm_1: f32[4, 11] = aten.addmm(view_3, relu, t_1)  # free: view_3, t_1
relu_1: f32[4, 11] = aten.relu(addmm_1)  # free: addmm_1
t_2: f32[11, 3] = aten.t(view_4)  # free: view_4
addmm_2: f32[4, 3] = aten.addmm(view_5, relu_1, t_2)  # free: view_5, t_2
pow: f32[4, 3] = aten.pow.Tensor_Scalar(addmm_2, 2)
mean: f32[] = aten.mean(pow)  # free: pow
return (mean, primals_3, primals_4, primals_6, relu, relu_1, addmm_2)""")
        self.assertExpectedInline(backward, """\
input primals_3: f32[4, 7]
input primals_4: f32[39]
input primals_6: f32[11]
input relu: f32[4, 13]
input relu_1: f32[4, 11]
input addmm: f32[4, 3]
input tangents_1: f32[]
pack: f32[50] = zerocompile.pack([primals_6, primals_4], 1, [11, 39])  # free: primals_6, primals_4
all_gather_into_tensor: f32[200] = _c10d_functional.all_gather_into_tensor(pack, 4, WORLD)  # param: fc3.weight, fc2.weight; free: pack
wait_tensor: f32[200] = _c10d_functional.wait_tensor(all_gather_into_tensor)  # free: all_gather_into_tensor
unpack: (f32[44], f32[156]) = zerocompile.unpack(wait_tensor, 4, [11, 39])  # free: wait_tensor
getitem: f32[44] = unpack[0]
getitem_1: f32[156] = unpack[1]  # free: unpack
slice: f32[33] = aten.slice.Tensor(getitem, 0, 0, 33)  # free: getitem
view: f32[3, 11] = aten.view(slice, [3, 11])  # free: slice
slice_1: f32[143] = aten.slice.Tensor(getitem_1, 0, 0, 143)  # free: getitem_1
view_1: f32[11, 13] = aten.view(slice_1, [11, 13])  # free: slice_1
expand: f32[4, 3] = aten.expand(tangents_1, [4, 3])  # free: tangents_1
div: f32[4, 3] = aten.div.Scalar(expand, 12)  # free: expand
pow: f32[4, 3] = aten.pow.Tensor_Scalar(addmm, 1.0)  # free: addmm
mul: f32[4, 3] = aten.mul.Scalar(pow, 2.0)  # free: pow
mul_1: f32[4, 3] = aten.mul.Tensor(div, mul)  # free: div, mul
t: f32[11, 3] = aten.t(view)  # free: view
t_1: f32[3, 11] = aten.t(t)  # free: t
mm: f32[4, 11] = aten.mm(mul_1, t_1)  # free: t_1
t_2: f32[3, 4] = aten.t(mul_1)
mm_1: f32[3, 11] = aten.mm(t_2, relu_1)  # free: t_2
t_3: f32[11, 3] = aten.t(mm_1)  # free: mm_1
sum: f32[1, 3] = aten.sum.dim_IntList(mul_1, [0], True)  # free: mul_1
view_2: f32[3] = aten.view(sum, [3])  # free: sum
t_4: f32[3, 11] = aten.t(t_3)  # free: t_3
detach: f32[4, 11] = aten.detach(relu_1)  # free: relu_1
detach_1: f32[4, 11] = aten.detach(detach)  # free: detach
threshold_backward: f32[4, 11] = aten.threshold_backward(mm, detach_1, 0)  # free: mm, detach_1
t_5: f32[13, 11] = aten.t(view_1)  # free: view_1
t_6: f32[11, 13] = aten.t(t_5)  # free: t_5
mm_2: f32[4, 13] = aten.mm(threshold_backward, t_6)  # free: t_6
t_7: f32[11, 4] = aten.t(threshold_backward)
mm_3: f32[11, 13] = aten.mm(t_7, relu)  # free: t_7
t_8: f32[13, 11] = aten.t(mm_3)  # free: mm_3
sum_1: f32[1, 11] = aten.sum.dim_IntList(threshold_backward, [0], True)  # free: threshold_backward
view_3: f32[11] = aten.view(sum_1, [11])  # free: sum_1
t_9: f32[11, 13] = aten.t(t_8)  # free: t_8
detach_2: f32[4, 13] = aten.detach(relu)  # free: relu
detach_3: f32[4, 13] = aten.detach(detach_2)  # free: detach_2
threshold_backward_1: f32[4, 13] = aten.threshold_backward(mm_2, detach_3, 0)  # free: mm_2, detach_3
t_10: f32[13, 4] = aten.t(threshold_backward_1)
mm_4: f32[13, 7] = aten.mm(t_10, primals_3)  # free: t_10, primals_3
t_11: f32[7, 13] = aten.t(mm_4)  # free: mm_4
sum_2: f32[1, 13] = aten.sum.dim_IntList(threshold_backward_1, [0], True)  # free: threshold_backward_1
view_4: f32[13] = aten.view(sum_2, [13])  # free: sum_2
t_12: f32[13, 7] = aten.t(t_11)  # free: t_11
pack_1: f32[344] = zerocompile.pack([view_2, t_4, view_3, t_9, view_4, t_12], 4, [1, 11, 3, 39, 4, 28])  # free: view_2, t_4, view_3, t_9, view_4, t_12
reduce_scatter_tensor: f32[86] = _c10d_functional.reduce_scatter_tensor(pack_1, 'avg', 4, WORLD)  # param: fc3.bias, fc3.weight, fc2.bias, fc2.weight, fc1.bias, fc1.weight; free: pack_1
wait_tensor_1: f32[86] = _c10d_functional.wait_tensor(reduce_scatter_tensor)  # free: reduce_scatter_tensor
split_with_sizes: (f32[1], f32[11], f32[3], f32[39], f32[4], f32[28]) = aten.split_with_sizes(wait_tensor_1, [1, 11, 3, 39, 4, 28])  # free: wait_tensor_1
getitem_2: f32[1] = split_with_sizes[0]
getitem_3: f32[11] = split_with_sizes[1]
getitem_4: f32[3] = split_with_sizes[2]
getitem_5: f32[39] = split_with_sizes[3]
getitem_6: f32[4] = split_with_sizes[4]
getitem_7: f32[28] = split_with_sizes[5]  # free: split_with_sizes
return (getitem_7, getitem_6, None, getitem_5, getitem_4, getitem_3, getitem_2)""")


class TestGPTSnapshots(FakeGroupTestCase):
    def test_stage_0(self) -> None:
        forward, backward = gpt_graphs(0)
        self.assertExpectedInline(forward, """\
input primals_1: i64[2, 8]
input primals_2: f32[32, 16]
input primals_3: f32[8, 16]
input primals_4: f32[16]
input primals_5: f32[16]
input primals_6: f32[48, 16]
input primals_7: f32[48]
input primals_8: f32[16, 16]
input primals_9: f32[16]
input primals_10: f32[16]
input primals_11: f32[16]
input primals_12: f32[64, 16]
input primals_13: f32[64]
input primals_14: f32[16, 64]
input primals_15: f32[16]
input primals_16: f32[16]
input primals_17: f32[16]
input primals_18: f32[48, 16]
input primals_19: f32[48]
input primals_20: f32[16, 16]
input primals_21: f32[16]
input primals_22: f32[16]
input primals_23: f32[16]
input primals_24: f32[64, 16]
input primals_25: f32[64]
input primals_26: f32[16, 64]
input primals_27: f32[16]
input primals_28: f32[16]
input primals_29: f32[16]
input primals_30: i64[2, 8]
arange: i64[8] = aten.arange(8, device = device(type='cpu'), pin_memory = False)
embedding: f32[2, 8, 16] = aten.embedding(primals_2, primals_1)
embedding_1: f32[8, 16] = aten.embedding(primals_3, arange)  # free: primals_3
add: f32[2, 8, 16] = aten.add.Tensor(embedding, embedding_1)  # free: embedding, embedding_1
unshard: f32[16] = aten.clone(primals_4)  # free: primals_4
unshard_1: f32[16] = aten.clone(primals_5)  # free: primals_5
native_layer_norm: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add, [16], unshard, unshard_1, 1e-05)
getitem: f32[2, 8, 16] = native_layer_norm[0]
getitem_1: f32[2, 8, 1] = native_layer_norm[1]
getitem_2: f32[2, 8, 1] = native_layer_norm[2]  # free: native_layer_norm
view: f32[16, 16] = aten.view(getitem, [16, 16])  # free: getitem
t: f32[16, 48] = aten.t(primals_6)  # free: primals_6
addmm: f32[16, 48] = aten.addmm(primals_7, view, t)  # free: primals_7
view_1: f32[2, 8, 48] = aten.view(addmm, [2, 8, 48])  # free: addmm
split: (f32[2, 8, 16], f32[2, 8, 16], f32[2, 8, 16]) = aten.split.Tensor(view_1, 16, 2)  # free: view_1
getitem_3: f32[2, 8, 16] = split[0]
getitem_4: f32[2, 8, 16] = split[1]
getitem_5: f32[2, 8, 16] = split[2]  # free: split
view_2: f32[2, 8, 2, 8] = aten.view(getitem_3, [2, 8, 2, 8])  # free: getitem_3
transpose: f32[2, 2, 8, 8] = aten.transpose.int(view_2, 1, 2)  # free: view_2
view_3: f32[2, 8, 2, 8] = aten.view(getitem_4, [2, 8, 2, 8])  # free: getitem_4
transpose_1: f32[2, 2, 8, 8] = aten.transpose.int(view_3, 1, 2)  # free: view_3
view_4: f32[2, 8, 2, 8] = aten.view(getitem_5, [2, 8, 2, 8])  # free: getitem_5
transpose_2: f32[2, 2, 8, 8] = aten.transpose.int(view_4, 1, 2)  # free: view_4
_scaled_dot_product_flash_attention_for_cpu: (f32[2, 2, 8, 8], f32[2, 2, 8]) = aten._scaled_dot_product_flash_attention_for_cpu(transpose, transpose_1, transpose_2, 0.0, True)
getitem_6: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu[0]
getitem_7: f32[2, 2, 8] = _scaled_dot_product_flash_attention_for_cpu[1]  # free: _scaled_dot_product_flash_attention_for_cpu
detach: f32[2, 2, 8, 8] = aten.detach(getitem_6)
transpose_3: f32[2, 8, 2, 8] = aten.transpose.int(getitem_6, 1, 2)  # free: getitem_6
view_5: f32[2, 8, 16] = aten.view(transpose_3, [2, 8, 16])  # free: transpose_3
view_6: f32[16, 16] = aten.view(view_5, [16, 16])  # free: view_5
t_1: f32[16, 16] = aten.t(primals_8)  # free: primals_8
addmm_1: f32[16, 16] = aten.addmm(primals_9, view_6, t_1)  # free: primals_9
view_7: f32[2, 8, 16] = aten.view(addmm_1, [2, 8, 16])  # free: addmm_1
add_1: f32[2, 8, 16] = aten.add.Tensor(add, view_7)  # free: view_7
unshard_2: f32[16] = aten.clone(primals_10)  # free: primals_10
unshard_3: f32[16] = aten.clone(primals_11)  # free: primals_11
native_layer_norm_1: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_1, [16], unshard_2, unshard_3, 1e-05)
getitem_8: f32[2, 8, 16] = native_layer_norm_1[0]
getitem_9: f32[2, 8, 1] = native_layer_norm_1[1]
getitem_10: f32[2, 8, 1] = native_layer_norm_1[2]  # free: native_layer_norm_1
view_8: f32[16, 16] = aten.view(getitem_8, [16, 16])  # free: getitem_8
t_2: f32[16, 64] = aten.t(primals_12)  # free: primals_12
addmm_2: f32[16, 64] = aten.addmm(primals_13, view_8, t_2)  # free: primals_13
view_9: f32[2, 8, 64] = aten.view(addmm_2, [2, 8, 64])
gelu: f32[2, 8, 64] = aten.gelu(view_9)  # free: view_9
view_10: f32[16, 64] = aten.view(gelu, [16, 64])  # free: gelu
t_3: f32[64, 16] = aten.t(primals_14)  # free: primals_14
addmm_3: f32[16, 16] = aten.addmm(primals_15, view_10, t_3)  # free: primals_15
view_11: f32[2, 8, 16] = aten.view(addmm_3, [2, 8, 16])  # free: addmm_3
add_2: f32[2, 8, 16] = aten.add.Tensor(add_1, view_11)  # free: view_11
unshard_4: f32[16] = aten.clone(primals_16)  # free: primals_16
unshard_5: f32[16] = aten.clone(primals_17)  # free: primals_17
native_layer_norm_2: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_2, [16], unshard_4, unshard_5, 1e-05)
getitem_11: f32[2, 8, 16] = native_layer_norm_2[0]
getitem_12: f32[2, 8, 1] = native_layer_norm_2[1]
getitem_13: f32[2, 8, 1] = native_layer_norm_2[2]  # free: native_layer_norm_2
view_12: f32[16, 16] = aten.view(getitem_11, [16, 16])  # free: getitem_11
t_4: f32[16, 48] = aten.t(primals_18)  # free: primals_18
addmm_4: f32[16, 48] = aten.addmm(primals_19, view_12, t_4)  # free: primals_19
view_13: f32[2, 8, 48] = aten.view(addmm_4, [2, 8, 48])  # free: addmm_4
split_1: (f32[2, 8, 16], f32[2, 8, 16], f32[2, 8, 16]) = aten.split.Tensor(view_13, 16, 2)  # free: view_13
getitem_14: f32[2, 8, 16] = split_1[0]
getitem_15: f32[2, 8, 16] = split_1[1]
getitem_16: f32[2, 8, 16] = split_1[2]  # free: split_1
view_14: f32[2, 8, 2, 8] = aten.view(getitem_14, [2, 8, 2, 8])  # free: getitem_14
transpose_4: f32[2, 2, 8, 8] = aten.transpose.int(view_14, 1, 2)  # free: view_14
view_15: f32[2, 8, 2, 8] = aten.view(getitem_15, [2, 8, 2, 8])  # free: getitem_15
transpose_5: f32[2, 2, 8, 8] = aten.transpose.int(view_15, 1, 2)  # free: view_15
view_16: f32[2, 8, 2, 8] = aten.view(getitem_16, [2, 8, 2, 8])  # free: getitem_16
transpose_6: f32[2, 2, 8, 8] = aten.transpose.int(view_16, 1, 2)  # free: view_16
_scaled_dot_product_flash_attention_for_cpu_1: (f32[2, 2, 8, 8], f32[2, 2, 8]) = aten._scaled_dot_product_flash_attention_for_cpu(transpose_4, transpose_5, transpose_6, 0.0, True)
getitem_17: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_1[0]
getitem_18: f32[2, 2, 8] = _scaled_dot_product_flash_attention_for_cpu_1[1]  # free: _scaled_dot_product_flash_attention_for_cpu_1
detach_1: f32[2, 2, 8, 8] = aten.detach(getitem_17)
transpose_7: f32[2, 8, 2, 8] = aten.transpose.int(getitem_17, 1, 2)  # free: getitem_17
view_17: f32[2, 8, 16] = aten.view(transpose_7, [2, 8, 16])  # free: transpose_7
view_18: f32[16, 16] = aten.view(view_17, [16, 16])  # free: view_17
t_5: f32[16, 16] = aten.t(primals_20)  # free: primals_20
addmm_5: f32[16, 16] = aten.addmm(primals_21, view_18, t_5)  # free: primals_21
view_19: f32[2, 8, 16] = aten.view(addmm_5, [2, 8, 16])  # free: addmm_5
add_3: f32[2, 8, 16] = aten.add.Tensor(add_2, view_19)  # free: view_19
unshard_6: f32[16] = aten.clone(primals_22)  # free: primals_22
unshard_7: f32[16] = aten.clone(primals_23)  # free: primals_23
native_layer_norm_3: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_3, [16], unshard_6, unshard_7, 1e-05)
getitem_19: f32[2, 8, 16] = native_layer_norm_3[0]
getitem_20: f32[2, 8, 1] = native_layer_norm_3[1]
getitem_21: f32[2, 8, 1] = native_layer_norm_3[2]  # free: native_layer_norm_3
view_20: f32[16, 16] = aten.view(getitem_19, [16, 16])  # free: getitem_19
t_6: f32[16, 64] = aten.t(primals_24)  # free: primals_24
addmm_6: f32[16, 64] = aten.addmm(primals_25, view_20, t_6)  # free: primals_25
view_21: f32[2, 8, 64] = aten.view(addmm_6, [2, 8, 64])
gelu_1: f32[2, 8, 64] = aten.gelu(view_21)  # free: view_21
view_22: f32[16, 64] = aten.view(gelu_1, [16, 64])  # free: gelu_1
t_7: f32[64, 16] = aten.t(primals_26)  # free: primals_26
addmm_7: f32[16, 16] = aten.addmm(primals_27, view_22, t_7)  # free: primals_27
view_23: f32[2, 8, 16] = aten.view(addmm_7, [2, 8, 16])  # free: addmm_7
add_4: f32[2, 8, 16] = aten.add.Tensor(add_3, view_23)  # free: view_23
unshard_8: f32[16] = aten.clone(primals_28)  # free: primals_28
unshard_9: f32[16] = aten.clone(primals_29)  # free: primals_29
native_layer_norm_4: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_4, [16], unshard_8, unshard_9, 1e-05)
getitem_22: f32[2, 8, 16] = native_layer_norm_4[0]
getitem_23: f32[2, 8, 1] = native_layer_norm_4[1]
getitem_24: f32[2, 8, 1] = native_layer_norm_4[2]  # free: native_layer_norm_4
t_8: f32[16, 32] = aten.t(primals_2)  # free: primals_2
view_24: f32[16, 16] = aten.view(getitem_22, [16, 16])  # free: getitem_22
mm: f32[16, 32] = aten.mm(view_24, t_8)
view_25: f32[2, 8, 32] = aten.view(mm, [2, 8, 32])  # free: mm
view_26: f32[16, 32] = aten.view(view_25, [-1, 32])  # free: view_25
view_27: i64[16] = aten.view(primals_30, [-1])  # free: primals_30
_log_softmax: f32[16, 32] = aten._log_softmax(view_26, 1, False)  # free: view_26
nll_loss_forward: (f32[], f32[]) = aten.nll_loss_forward(_log_softmax, view_27, None, 1, -100)
getitem_25: f32[] = nll_loss_forward[0]
getitem_26: f32[] = nll_loss_forward[1]  # free: nll_loss_forward
t_9: f32[32, 16] = aten.t(t_8)  # free: t_8
t_10: f32[16, 64] = aten.t(t_7)  # free: t_7
t_11: f32[64, 16] = aten.t(t_6)  # free: t_6
t_12: f32[16, 16] = aten.t(t_5)  # free: t_5
detach_2: f32[2, 2, 8, 8] = aten.detach(detach_1)  # free: detach_1
t_13: f32[48, 16] = aten.t(t_4)  # free: t_4
t_14: f32[16, 64] = aten.t(t_3)  # free: t_3
t_15: f32[64, 16] = aten.t(t_2)  # free: t_2
t_16: f32[16, 16] = aten.t(t_1)  # free: t_1
detach_3: f32[2, 2, 8, 8] = aten.detach(detach)  # free: detach
t_17: f32[48, 16] = aten.t(t)  # free: t
return (getitem_25, primals_1, arange, add, unshard, unshard_1, getitem_1, getitem_2, view, transpose, transpose_1, transpose_2, getitem_7, view_6, add_1, unshard_2, unshard_3, getitem_9, getitem_10, view_8, addmm_2, view_10, add_2, unshard_4, unshard_5, getitem_12, getitem_13, view_12, transpose_4, transpose_5, transpose_6, getitem_18, view_18, add_3, unshard_6, unshard_7, getitem_20, getitem_21, view_20, addmm_6, view_22, add_4, unshard_8, unshard_9, getitem_23, getitem_24, view_24, view_27, _log_softmax, getitem_26, t_9, t_10, t_11, t_12, detach_2, t_13, t_14, t_15, t_16, detach_3, t_17)""")
        self.assertExpectedInline(backward, """\
input primals_1: i64[2, 8]
input arange: i64[8]
input add: f32[2, 8, 16]
input unshard: f32[16]
input unshard_1: f32[16]
input getitem: f32[2, 8, 1]
input getitem_1: f32[2, 8, 1]
input view: f32[16, 16]
input transpose: f32[2, 2, 8, 8]
input transpose_1: f32[2, 2, 8, 8]
input transpose_2: f32[2, 2, 8, 8]
input getitem_2: f32[2, 2, 8]
input view_1: f32[16, 16]
input add_1: f32[2, 8, 16]
input unshard_2: f32[16]
input unshard_3: f32[16]
input getitem_3: f32[2, 8, 1]
input getitem_4: f32[2, 8, 1]
input view_2: f32[16, 16]
input addmm: f32[16, 64]
input view_3: f32[16, 64]
input add_2: f32[2, 8, 16]
input unshard_4: f32[16]
input unshard_5: f32[16]
input getitem_5: f32[2, 8, 1]
input getitem_6: f32[2, 8, 1]
input view_4: f32[16, 16]
input transpose_3: f32[2, 2, 8, 8]
input transpose_4: f32[2, 2, 8, 8]
input transpose_5: f32[2, 2, 8, 8]
input getitem_7: f32[2, 2, 8]
input view_5: f32[16, 16]
input add_3: f32[2, 8, 16]
input unshard_6: f32[16]
input unshard_7: f32[16]
input getitem_8: f32[2, 8, 1]
input getitem_9: f32[2, 8, 1]
input view_6: f32[16, 16]
input addmm_1: f32[16, 64]
input view_7: f32[16, 64]
input add_4: f32[2, 8, 16]
input unshard_8: f32[16]
input unshard_9: f32[16]
input getitem_10: f32[2, 8, 1]
input getitem_11: f32[2, 8, 1]
input view_8: f32[16, 16]
input view_9: i64[16]
input _log_softmax: f32[16, 32]
input getitem_12: f32[]
input t: f32[32, 16]
input t_1: f32[16, 64]
input t_2: f32[64, 16]
input t_3: f32[16, 16]
input detach: f32[2, 2, 8, 8]
input t_4: f32[48, 16]
input t_5: f32[16, 64]
input t_6: f32[64, 16]
input t_7: f32[16, 16]
input detach_1: f32[2, 2, 8, 8]
input t_8: f32[48, 16]
input tangents_1: f32[]
nll_loss_backward: f32[16, 32] = aten.nll_loss_backward(tangents_1, _log_softmax, view_9, None, 1, -100, getitem_12)  # free: tangents_1, view_9, getitem_12
detach_2: f32[16, 32] = aten.detach(_log_softmax)  # free: _log_softmax
detach_3: f32[16, 32] = aten.detach(detach_2)  # free: detach_2
_log_softmax_backward_data: f32[16, 32] = aten._log_softmax_backward_data(nll_loss_backward, detach_3, 1, torch.float32)  # free: nll_loss_backward, detach_3
view_10: f32[2, 8, 32] = aten.view(_log_softmax_backward_data, [2, 8, 32])  # free: _log_softmax_backward_data
view_11: f32[16, 32] = aten.view(view_10, [16, 32])  # free: view_10
t_9: f32[32, 16] = aten.t(view_11)
mm: f32[32, 16] = aten.mm(t_9, view_8)  # free: t_9, view_8
t_10: f32[16, 32] = aten.t(mm)  # free: mm
mm_1: f32[16, 16] = aten.mm(view_11, t)  # free: view_11, t
view_12: f32[2, 8, 16] = aten.view(mm_1, [2, 8, 16])  # free: mm_1
t_11: f32[32, 16] = aten.t(t_10)  # free: t_10
native_layer_norm_backward: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_12, add_4, [16], getitem_10, getitem_11, unshard_8, unshard_9, [True, True, True])  # free: view_12, add_4, getitem_10, getitem_11, unshard_8, unshard_9
getitem_13: f32[2, 8, 16] = native_layer_norm_backward[0]
getitem_14: f32[16] = native_layer_norm_backward[1]
getitem_15: f32[16] = native_layer_norm_backward[2]  # free: native_layer_norm_backward
view_13: f32[16, 16] = aten.view(getitem_13, [16, 16])
mm_2: f32[16, 64] = aten.mm(view_13, t_1)  # free: t_1
t_12: f32[16, 16] = aten.t(view_13)
mm_3: f32[16, 64] = aten.mm(t_12, view_7)  # free: t_12, view_7
t_13: f32[64, 16] = aten.t(mm_3)  # free: mm_3
sum: f32[1, 16] = aten.sum.dim_IntList(view_13, [0], True)  # free: view_13
view_14: f32[16] = aten.view(sum, [16])  # free: sum
t_14: f32[16, 64] = aten.t(t_13)  # free: t_13
view_15: f32[2, 8, 64] = aten.view(mm_2, [2, 8, 64])  # free: mm_2
view_16: f32[2, 8, 64] = aten.view(addmm_1, [2, 8, 64])  # free: addmm_1
gelu_backward: f32[2, 8, 64] = aten.gelu_backward(view_15, view_16)  # free: view_15, view_16
view_17: f32[16, 64] = aten.view(gelu_backward, [16, 64])  # free: gelu_backward
mm_4: f32[16, 16] = aten.mm(view_17, t_2)  # free: t_2
t_15: f32[64, 16] = aten.t(view_17)
mm_5: f32[64, 16] = aten.mm(t_15, view_6)  # free: t_15, view_6
t_16: f32[16, 64] = aten.t(mm_5)  # free: mm_5
sum_1: f32[1, 64] = aten.sum.dim_IntList(view_17, [0], True)  # free: view_17
view_18: f32[64] = aten.view(sum_1, [64])  # free: sum_1
t_17: f32[64, 16] = aten.t(t_16)  # free: t_16
view_19: f32[2, 8, 16] = aten.view(mm_4, [2, 8, 16])  # free: mm_4
native_layer_norm_backward_1: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_19, add_3, [16], getitem_8, getitem_9, unshard_6, unshard_7, [True, True, True])  # free: view_19, add_3, getitem_8, getitem_9, unshard_6, unshard_7
getitem_16: f32[2, 8, 16] = native_layer_norm_backward_1[0]
getitem_17: f32[16] = native_layer_norm_backward_1[1]
getitem_18: f32[16] = native_layer_norm_backward_1[2]  # free: native_layer_norm_backward_1
add_5: f32[2, 8, 16] = aten.add.Tensor(getitem_13, getitem_16)  # free: getitem_13, getitem_16
view_20: f32[16, 16] = aten.view(add_5, [16, 16])
mm_6: f32[16, 16] = aten.mm(view_20, t_3)  # free: t_3
t_18: f32[16, 16] = aten.t(view_20)
mm_7: f32[16, 16] = aten.mm(t_18, view_5)  # free: t_18, view_5
t_19: f32[16, 16] = aten.t(mm_7)  # free: mm_7
sum_2: f32[1, 16] = aten.sum.dim_IntList(view_20, [0], True)  # free: view_20
view_21: f32[16] = aten.view(sum_2, [16])  # free: sum_2
t_20: f32[16, 16] = aten.t(t_19)  # free: t_19
view_22: f32[2, 8, 16] = aten.view(mm_6, [2, 8, 16])  # free: mm_6
view_23: f32[2, 8, 2, 8] = aten.view(view_22, [2, 8, 2, 8])  # free: view_22
transpose_6: f32[2, 2, 8, 8] = aten.transpose.int(view_23, 1, 2)  # free: view_23
_scaled_dot_product_flash_attention_for_cpu_backward: (f32[2, 2, 8, 8], f32[2, 2, 8, 8], f32[2, 2, 8, 8]) = aten._scaled_dot_product_flash_attention_for_cpu_backward(transpose_6, transpose_3, transpose_4, transpose_5, detach, getitem_7, 0.0, True)  # free: transpose_6, transpose_3, transpose_4, transpose_5, detach, getitem_7
getitem_19: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[0]
getitem_20: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[1]
getitem_21: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[2]  # free: _scaled_dot_product_flash_attention_for_cpu_backward
transpose_7: f32[2, 8, 2, 8] = aten.transpose.int(getitem_21, 1, 2)  # free: getitem_21
view_24: f32[2, 8, 16] = aten.view(transpose_7, [2, 8, 16])  # free: transpose_7
transpose_8: f32[2, 8, 2, 8] = aten.transpose.int(getitem_20, 1, 2)  # free: getitem_20
view_25: f32[2, 8, 16] = aten.view(transpose_8, [2, 8, 16])  # free: transpose_8
transpose_9: f32[2, 8, 2, 8] = aten.transpose.int(getitem_19, 1, 2)  # free: getitem_19
view_26: f32[2, 8, 16] = aten.view(transpose_9, [2, 8, 16])  # free: transpose_9
cat: f32[2, 8, 48] = aten.cat([view_26, view_25, view_24], 2)  # free: view_26, view_25, view_24
view_27: f32[16, 48] = aten.view(cat, [16, 48])  # free: cat
mm_8: f32[16, 16] = aten.mm(view_27, t_4)  # free: t_4
t_21: f32[48, 16] = aten.t(view_27)
mm_9: f32[48, 16] = aten.mm(t_21, view_4)  # free: t_21, view_4
t_22: f32[16, 48] = aten.t(mm_9)  # free: mm_9
sum_3: f32[1, 48] = aten.sum.dim_IntList(view_27, [0], True)  # free: view_27
view_28: f32[48] = aten.view(sum_3, [48])  # free: sum_3
t_23: f32[48, 16] = aten.t(t_22)  # free: t_22
view_29: f32[2, 8, 16] = aten.view(mm_8, [2, 8, 16])  # free: mm_8
native_layer_norm_backward_2: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_29, add_2, [16], getitem_5, getitem_6, unshard_4, unshard_5, [True, True, True])  # free: view_29, add_2, getitem_5, getitem_6, unshard_4, unshard_5
getitem_22: f32[2, 8, 16] = native_layer_norm_backward_2[0]
getitem_23: f32[16] = native_layer_norm_backward_2[1]
getitem_24: f32[16] = native_layer_norm_backward_2[2]  # free: native_layer_norm_backward_2
add_6: f32[2, 8, 16] = aten.add.Tensor(add_5, getitem_22)  # free: add_5, getitem_22
view_30: f32[16, 16] = aten.view(add_6, [16, 16])
mm_10: f32[16, 64] = aten.mm(view_30, t_5)  # free: t_5
t_24: f32[16, 16] = aten.t(view_30)
mm_11: f32[16, 64] = aten.mm(t_24, view_3)  # free: t_24, view_3
t_25: f32[64, 16] = aten.t(mm_11)  # free: mm_11
sum_4: f32[1, 16] = aten.sum.dim_IntList(view_30, [0], True)  # free: view_30
view_31: f32[16] = aten.view(sum_4, [16])  # free: sum_4
t_26: f32[16, 64] = aten.t(t_25)  # free: t_25
view_32: f32[2, 8, 64] = aten.view(mm_10, [2, 8, 64])  # free: mm_10
view_33: f32[2, 8, 64] = aten.view(addmm, [2, 8, 64])  # free: addmm
gelu_backward_1: f32[2, 8, 64] = aten.gelu_backward(view_32, view_33)  # free: view_32, view_33
view_34: f32[16, 64] = aten.view(gelu_backward_1, [16, 64])  # free: gelu_backward_1
mm_12: f32[16, 16] = aten.mm(view_34, t_6)  # free: t_6
t_27: f32[64, 16] = aten.t(view_34)
mm_13: f32[64, 16] = aten.mm(t_27, view_2)  # free: t_27, view_2
t_28: f32[16, 64] = aten.t(mm_13)  # free: mm_13
sum_5: f32[1, 64] = aten.sum.dim_IntList(view_34, [0], True)  # free: view_34
view_35: f32[64] = aten.view(sum_5, [64])  # free: sum_5
t_29: f32[64, 16] = aten.t(t_28)  # free: t_28
view_36: f32[2, 8, 16] = aten.view(mm_12, [2, 8, 16])  # free: mm_12
native_layer_norm_backward_3: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_36, add_1, [16], getitem_3, getitem_4, unshard_2, unshard_3, [True, True, True])  # free: view_36, add_1, getitem_3, getitem_4, unshard_2, unshard_3
getitem_25: f32[2, 8, 16] = native_layer_norm_backward_3[0]
getitem_26: f32[16] = native_layer_norm_backward_3[1]
getitem_27: f32[16] = native_layer_norm_backward_3[2]  # free: native_layer_norm_backward_3
add_7: f32[2, 8, 16] = aten.add.Tensor(add_6, getitem_25)  # free: add_6, getitem_25
view_37: f32[16, 16] = aten.view(add_7, [16, 16])
mm_14: f32[16, 16] = aten.mm(view_37, t_7)  # free: t_7
t_30: f32[16, 16] = aten.t(view_37)
mm_15: f32[16, 16] = aten.mm(t_30, view_1)  # free: t_30, view_1
t_31: f32[16, 16] = aten.t(mm_15)  # free: mm_15
sum_6: f32[1, 16] = aten.sum.dim_IntList(view_37, [0], True)  # free: view_37
view_38: f32[16] = aten.view(sum_6, [16])  # free: sum_6
t_32: f32[16, 16] = aten.t(t_31)  # free: t_31
view_39: f32[2, 8, 16] = aten.view(mm_14, [2, 8, 16])  # free: mm_14
view_40: f32[2, 8, 2, 8] = aten.view(view_39, [2, 8, 2, 8])  # free: view_39
transpose_10: f32[2, 2, 8, 8] = aten.transpose.int(view_40, 1, 2)  # free: view_40
_scaled_dot_product_flash_attention_for_cpu_backward_1: (f32[2, 2, 8, 8], f32[2, 2, 8, 8], f32[2, 2, 8, 8]) = aten._scaled_dot_product_flash_attention_for_cpu_backward(transpose_10, transpose, transpose_1, transpose_2, detach_1, getitem_2, 0.0, True)  # free: transpose_10, transpose, transpose_1, transpose_2, detach_1, getitem_2
getitem_28: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[0]
getitem_29: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[1]
getitem_30: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[2]  # free: _scaled_dot_product_flash_attention_for_cpu_backward_1
transpose_11: f32[2, 8, 2, 8] = aten.transpose.int(getitem_30, 1, 2)  # free: getitem_30
view_41: f32[2, 8, 16] = aten.view(transpose_11, [2, 8, 16])  # free: transpose_11
transpose_12: f32[2, 8, 2, 8] = aten.transpose.int(getitem_29, 1, 2)  # free: getitem_29
view_42: f32[2, 8, 16] = aten.view(transpose_12, [2, 8, 16])  # free: transpose_12
transpose_13: f32[2, 8, 2, 8] = aten.transpose.int(getitem_28, 1, 2)  # free: getitem_28
view_43: f32[2, 8, 16] = aten.view(transpose_13, [2, 8, 16])  # free: transpose_13
cat_1: f32[2, 8, 48] = aten.cat([view_43, view_42, view_41], 2)  # free: view_43, view_42, view_41
view_44: f32[16, 48] = aten.view(cat_1, [16, 48])  # free: cat_1
mm_16: f32[16, 16] = aten.mm(view_44, t_8)  # free: t_8
t_33: f32[48, 16] = aten.t(view_44)
mm_17: f32[48, 16] = aten.mm(t_33, view)  # free: t_33, view
t_34: f32[16, 48] = aten.t(mm_17)  # free: mm_17
sum_7: f32[1, 48] = aten.sum.dim_IntList(view_44, [0], True)  # free: view_44
view_45: f32[48] = aten.view(sum_7, [48])  # free: sum_7
t_35: f32[48, 16] = aten.t(t_34)  # free: t_34
view_46: f32[2, 8, 16] = aten.view(mm_16, [2, 8, 16])  # free: mm_16
native_layer_norm_backward_4: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_46, add, [16], getitem, getitem_1, unshard, unshard_1, [True, True, True])  # free: view_46, add, getitem, getitem_1, unshard, unshard_1
getitem_31: f32[2, 8, 16] = native_layer_norm_backward_4[0]
getitem_32: f32[16] = native_layer_norm_backward_4[1]
getitem_33: f32[16] = native_layer_norm_backward_4[2]  # free: native_layer_norm_backward_4
add_8: f32[2, 8, 16] = aten.add.Tensor(add_7, getitem_31)  # free: add_7, getitem_31
sum_8: f32[1, 8, 16] = aten.sum.dim_IntList(add_8, [0], True)
view_47: f32[8, 16] = aten.view(sum_8, [8, 16])  # free: sum_8
embedding_dense_backward: f32[8, 16] = aten.embedding_dense_backward(view_47, arange, 8, -1, False)  # free: view_47, arange
embedding_dense_backward_1: f32[32, 16] = aten.embedding_dense_backward(add_8, primals_1, 32, -1, False)  # free: add_8, primals_1
add_9: f32[32, 16] = aten.add.Tensor(t_11, embedding_dense_backward_1)  # free: t_11, embedding_dense_backward_1
pack: f32[7232] = zerocompile.pack([getitem_15, getitem_14, view_14, t_14, view_18, t_17, getitem_18, getitem_17, view_21, t_20, view_28, t_23, getitem_24, getitem_23, view_31, t_26, view_35, t_29, getitem_27, getitem_26, view_38, t_32, view_45, t_35, getitem_33, getitem_32, embedding_dense_backward, add_9], 1, [16, 16, 16, 1024, 64, 1024, 16, 16, 16, 256, 48, 768, 16, 16, 16, 1024, 64, 1024, 16, 16, 16, 256, 48, 768, 16, 16, 128, 512])  # free: getitem_15, getitem_14, view_14, t_14, view_18, t_17, getitem_18, getitem_17, view_21, t_20, view_28, t_23, getitem_24, getitem_23, view_31, t_26, view_35, t_29, getitem_27, getitem_26, view_38, t_32, view_45, t_35, getitem_33, getitem_32, embedding_dense_backward, add_9
all_reduce: f32[7232] = _c10d_functional.all_reduce(pack, 'sum', WORLD)  # param: ln_f.bias, ln_f.weight, blocks.1.out.bias, blocks.1.out.weight, blocks.1.fc.bias, blocks.1.fc.weight, blocks.1.ln2.bias, blocks.1.ln2.weight, blocks.1.attn.proj.bias, blocks.1.attn.proj.weight, blocks.1.attn.qkv.bias, blocks.1.attn.qkv.weight, blocks.1.ln1.bias, blocks.1.ln1.weight, blocks.0.out.bias, blocks.0.out.weight, blocks.0.fc.bias, blocks.0.fc.weight, blocks.0.ln2.bias, blocks.0.ln2.weight, blocks.0.attn.proj.bias, blocks.0.attn.proj.weight, blocks.0.attn.qkv.bias, blocks.0.attn.qkv.weight, blocks.0.ln1.bias, blocks.0.ln1.weight, wpe.weight, wte.weight; free: pack
wait_tensor: f32[7232] = _c10d_functional.wait_tensor(all_reduce)  # free: all_reduce
unsqueeze: f32[1, 7232] = aten.unsqueeze(wait_tensor, 0)  # free: wait_tensor
average_rows: f32[7232] = zerocompile.average_rows(unsqueeze, 4)  # free: unsqueeze
split_with_sizes: (f32[16], f32[16], f32[16], f32[1024], f32[64], f32[1024], f32[16], f32[16], f32[16], f32[256], f32[48], f32[768], f32[16], f32[16], f32[16], f32[1024], f32[64], f32[1024], f32[16], f32[16], f32[16], f32[256], f32[48], f32[768], f32[16], f32[16], f32[128], f32[512]) = aten.split_with_sizes(average_rows, [16, 16, 16, 1024, 64, 1024, 16, 16, 16, 256, 48, 768, 16, 16, 16, 1024, 64, 1024, 16, 16, 16, 256, 48, 768, 16, 16, 128, 512])  # free: average_rows
getitem_34: f32[16] = split_with_sizes[0]
getitem_35: f32[16] = split_with_sizes[1]
getitem_36: f32[16] = split_with_sizes[2]
getitem_37: f32[1024] = split_with_sizes[3]
getitem_38: f32[64] = split_with_sizes[4]
getitem_39: f32[1024] = split_with_sizes[5]
getitem_40: f32[16] = split_with_sizes[6]
getitem_41: f32[16] = split_with_sizes[7]
getitem_42: f32[16] = split_with_sizes[8]
getitem_43: f32[256] = split_with_sizes[9]
getitem_44: f32[48] = split_with_sizes[10]
getitem_45: f32[768] = split_with_sizes[11]
getitem_46: f32[16] = split_with_sizes[12]
getitem_47: f32[16] = split_with_sizes[13]
getitem_48: f32[16] = split_with_sizes[14]
getitem_49: f32[1024] = split_with_sizes[15]
getitem_50: f32[64] = split_with_sizes[16]
getitem_51: f32[1024] = split_with_sizes[17]
getitem_52: f32[16] = split_with_sizes[18]
getitem_53: f32[16] = split_with_sizes[19]
getitem_54: f32[16] = split_with_sizes[20]
getitem_55: f32[256] = split_with_sizes[21]
getitem_56: f32[48] = split_with_sizes[22]
getitem_57: f32[768] = split_with_sizes[23]
getitem_58: f32[16] = split_with_sizes[24]
getitem_59: f32[16] = split_with_sizes[25]
getitem_60: f32[128] = split_with_sizes[26]
getitem_61: f32[512] = split_with_sizes[27]  # free: split_with_sizes
view_48: f32[16] = aten.view(getitem_34, [16])  # free: getitem_34
view_49: f32[16] = aten.view(getitem_35, [16])  # free: getitem_35
view_50: f32[16] = aten.view(getitem_36, [16])  # free: getitem_36
view_51: f32[16, 64] = aten.view(getitem_37, [16, 64])  # free: getitem_37
view_52: f32[64] = aten.view(getitem_38, [64])  # free: getitem_38
view_53: f32[64, 16] = aten.view(getitem_39, [64, 16])  # free: getitem_39
view_54: f32[16] = aten.view(getitem_40, [16])  # free: getitem_40
view_55: f32[16] = aten.view(getitem_41, [16])  # free: getitem_41
view_56: f32[16] = aten.view(getitem_42, [16])  # free: getitem_42
view_57: f32[16, 16] = aten.view(getitem_43, [16, 16])  # free: getitem_43
view_58: f32[48] = aten.view(getitem_44, [48])  # free: getitem_44
view_59: f32[48, 16] = aten.view(getitem_45, [48, 16])  # free: getitem_45
view_60: f32[16] = aten.view(getitem_46, [16])  # free: getitem_46
view_61: f32[16] = aten.view(getitem_47, [16])  # free: getitem_47
view_62: f32[16] = aten.view(getitem_48, [16])  # free: getitem_48
view_63: f32[16, 64] = aten.view(getitem_49, [16, 64])  # free: getitem_49
view_64: f32[64] = aten.view(getitem_50, [64])  # free: getitem_50
view_65: f32[64, 16] = aten.view(getitem_51, [64, 16])  # free: getitem_51
view_66: f32[16] = aten.view(getitem_52, [16])  # free: getitem_52
view_67: f32[16] = aten.view(getitem_53, [16])  # free: getitem_53
view_68: f32[16] = aten.view(getitem_54, [16])  # free: getitem_54
view_69: f32[16, 16] = aten.view(getitem_55, [16, 16])  # free: getitem_55
view_70: f32[48] = aten.view(getitem_56, [48])  # free: getitem_56
view_71: f32[48, 16] = aten.view(getitem_57, [48, 16])  # free: getitem_57
view_72: f32[16] = aten.view(getitem_58, [16])  # free: getitem_58
view_73: f32[16] = aten.view(getitem_59, [16])  # free: getitem_59
view_74: f32[8, 16] = aten.view(getitem_60, [8, 16])  # free: getitem_60
view_75: f32[32, 16] = aten.view(getitem_61, [32, 16])  # free: getitem_61
return (None, view_75, view_74, view_73, view_72, view_71, view_70, view_69, view_68, view_67, view_66, view_65, view_64, view_63, view_62, view_61, view_60, view_59, view_58, view_57, view_56, view_55, view_54, view_53, view_52, view_51, view_50, view_49, view_48, None)""")

    def test_stage_1(self) -> None:
        forward, backward = gpt_graphs(1)
        self.assertExpectedInline(forward, """\
input primals_1: i64[2, 8]
input primals_2: f32[128]
input primals_3: f32[32]
input primals_4: f32[4]
input primals_5: f32[4]
input primals_6: f32[192]
input primals_7: f32[12]
input primals_8: f32[64]
input primals_9: f32[4]
input primals_10: f32[4]
input primals_11: f32[4]
input primals_12: f32[256]
input primals_13: f32[16]
input primals_14: f32[256]
input primals_15: f32[4]
input primals_16: f32[4]
input primals_17: f32[4]
input primals_18: f32[192]
input primals_19: f32[12]
input primals_20: f32[64]
input primals_21: f32[4]
input primals_22: f32[4]
input primals_23: f32[4]
input primals_24: f32[256]
input primals_25: f32[16]
input primals_26: f32[256]
input primals_27: f32[4]
input primals_28: f32[4]
input primals_29: f32[4]
input primals_30: i64[2, 8]
pack: f32[1808] = zerocompile.pack([primals_2, primals_3, primals_4, primals_5, primals_6, primals_7, primals_8, primals_9, primals_10, primals_11, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, primals_21, primals_22, primals_23, primals_24, primals_25, primals_26, primals_27, primals_28, primals_29], 1, [128, 32, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4])  # free: primals_2, primals_3, primals_4, primals_5, primals_6, primals_7, primals_8, primals_9, primals_10, primals_11, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, primals_21, primals_22, primals_23, primals_24, primals_25, primals_26, primals_27, primals_28, primals_29
all_gather_into_tensor: f32[7232] = _c10d_functional.all_gather_into_tensor(pack, 4, WORLD)  # param: wte.weight, wpe.weight, blocks.0.ln1.weight, blocks.0.ln1.bias, blocks.0.attn.qkv.weight, blocks.0.attn.qkv.bias, blocks.0.attn.proj.weight, blocks.0.attn.proj.bias, blocks.0.ln2.weight, blocks.0.ln2.bias, blocks.0.fc.weight, blocks.0.fc.bias, blocks.0.out.weight, blocks.0.out.bias, blocks.1.ln1.weight, blocks.1.ln1.bias, blocks.1.attn.qkv.weight, blocks.1.attn.qkv.bias, blocks.1.attn.proj.weight, blocks.1.attn.proj.bias, blocks.1.ln2.weight, blocks.1.ln2.bias, blocks.1.fc.weight, blocks.1.fc.bias, blocks.1.out.weight, blocks.1.out.bias, ln_f.weight, ln_f.bias; free: pack
arange: i64[8] = aten.arange(8, device = device(type='cpu'), pin_memory = False)
wait_tensor: f32[7232] = _c10d_functional.wait_tensor(all_gather_into_tensor)  # free: all_gather_into_tensor
unpack: (f32[512], f32[128], f32[16], f32[16], f32[768], f32[48], f32[256], f32[16], f32[16], f32[16], f32[1024], f32[64], f32[1024], f32[16], f32[16], f32[16], f32[768], f32[48], f32[256], f32[16], f32[16], f32[16], f32[1024], f32[64], f32[1024], f32[16], f32[16], f32[16]) = zerocompile.unpack(wait_tensor, 4, [128, 32, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4])  # free: wait_tensor
getitem: f32[512] = unpack[0]
getitem_1: f32[128] = unpack[1]
getitem_2: f32[16] = unpack[2]
getitem_3: f32[16] = unpack[3]
getitem_4: f32[768] = unpack[4]
getitem_5: f32[48] = unpack[5]
getitem_6: f32[256] = unpack[6]
getitem_7: f32[16] = unpack[7]
getitem_8: f32[16] = unpack[8]
getitem_9: f32[16] = unpack[9]
getitem_10: f32[1024] = unpack[10]
getitem_11: f32[64] = unpack[11]
getitem_12: f32[1024] = unpack[12]
getitem_13: f32[16] = unpack[13]
getitem_14: f32[16] = unpack[14]
getitem_15: f32[16] = unpack[15]
getitem_16: f32[768] = unpack[16]
getitem_17: f32[48] = unpack[17]
getitem_18: f32[256] = unpack[18]
getitem_19: f32[16] = unpack[19]
getitem_20: f32[16] = unpack[20]
getitem_21: f32[16] = unpack[21]
getitem_22: f32[1024] = unpack[22]
getitem_23: f32[64] = unpack[23]
getitem_24: f32[1024] = unpack[24]
getitem_25: f32[16] = unpack[25]
getitem_26: f32[16] = unpack[26]
getitem_27: f32[16] = unpack[27]  # free: unpack
view: f32[32, 16] = aten.view(getitem, [32, 16])  # free: getitem
view_1: f32[8, 16] = aten.view(getitem_1, [8, 16])  # free: getitem_1
view_2: f32[16] = aten.view(getitem_2, [16])  # free: getitem_2
view_3: f32[16] = aten.view(getitem_3, [16])  # free: getitem_3
view_4: f32[48, 16] = aten.view(getitem_4, [48, 16])  # free: getitem_4
view_5: f32[48] = aten.view(getitem_5, [48])  # free: getitem_5
view_6: f32[16, 16] = aten.view(getitem_6, [16, 16])  # free: getitem_6
view_7: f32[16] = aten.view(getitem_7, [16])  # free: getitem_7
view_8: f32[16] = aten.view(getitem_8, [16])  # free: getitem_8
view_9: f32[16] = aten.view(getitem_9, [16])  # free: getitem_9
view_10: f32[64, 16] = aten.view(getitem_10, [64, 16])  # free: getitem_10
view_11: f32[64] = aten.view(getitem_11, [64])  # free: getitem_11
view_12: f32[16, 64] = aten.view(getitem_12, [16, 64])  # free: getitem_12
view_13: f32[16] = aten.view(getitem_13, [16])  # free: getitem_13
view_14: f32[16] = aten.view(getitem_14, [16])  # free: getitem_14
view_15: f32[16] = aten.view(getitem_15, [16])  # free: getitem_15
view_16: f32[48, 16] = aten.view(getitem_16, [48, 16])  # free: getitem_16
view_17: f32[48] = aten.view(getitem_17, [48])  # free: getitem_17
view_18: f32[16, 16] = aten.view(getitem_18, [16, 16])  # free: getitem_18
view_19: f32[16] = aten.view(getitem_19, [16])  # free: getitem_19
view_20: f32[16] = aten.view(getitem_20, [16])  # free: getitem_20
view_21: f32[16] = aten.view(getitem_21, [16])  # free: getitem_21
view_22: f32[64, 16] = aten.view(getitem_22, [64, 16])  # free: getitem_22
view_23: f32[64] = aten.view(getitem_23, [64])  # free: getitem_23
view_24: f32[16, 64] = aten.view(getitem_24, [16, 64])  # free: getitem_24
view_25: f32[16] = aten.view(getitem_25, [16])  # free: getitem_25
view_26: f32[16] = aten.view(getitem_26, [16])  # free: getitem_26
view_27: f32[16] = aten.view(getitem_27, [16])  # free: getitem_27
embedding: f32[2, 8, 16] = aten.embedding(view, primals_1)
embedding_1: f32[8, 16] = aten.embedding(view_1, arange)  # free: view_1
add: f32[2, 8, 16] = aten.add.Tensor(embedding, embedding_1)  # free: embedding, embedding_1
native_layer_norm: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add, [16], view_2, view_3, 1e-05)
getitem_28: f32[2, 8, 16] = native_layer_norm[0]
getitem_29: f32[2, 8, 1] = native_layer_norm[1]
getitem_30: f32[2, 8, 1] = native_layer_norm[2]  # free: native_layer_norm
view_28: f32[16, 16] = aten.view(getitem_28, [16, 16])  # free: getitem_28
t: f32[16, 48] = aten.t(view_4)  # free: view_4
addmm: f32[16, 48] = aten.addmm(view_5, view_28, t)  # free: view_5
view_29: f32[2, 8, 48] = aten.view(addmm, [2, 8, 48])  # free: addmm
split: (f32[2, 8, 16], f32[2, 8, 16], f32[2, 8, 16]) = aten.split.Tensor(view_29, 16, 2)  # free: view_29
getitem_31: f32[2, 8, 16] = split[0]
getitem_32: f32[2, 8, 16] = split[1]
getitem_33: f32[2, 8, 16] = split[2]  # free: split
view_30: f32[2, 8, 2, 8] = aten.view(getitem_31, [2, 8, 2, 8])  # free: getitem_31
transpose: f32[2, 2, 8, 8] = aten.transpose.int(view_30, 1, 2)  # free: view_30
view_31: f32[2, 8, 2, 8] = aten.view(getitem_32, [2, 8, 2, 8])  # free: getitem_32
transpose_1: f32[2, 2, 8, 8] = aten.transpose.int(view_31, 1, 2)  # free: view_31
view_32: f32[2, 8, 2, 8] = aten.view(getitem_33, [2, 8, 2, 8])  # free: getitem_33
transpose_2: f32[2, 2, 8, 8] = aten.transpose.int(view_32, 1, 2)  # free: view_32
_scaled_dot_product_flash_attention_for_cpu: (f32[2, 2, 8, 8], f32[2, 2, 8]) = aten._scaled_dot_product_flash_attention_for_cpu(transpose, transpose_1, transpose_2, 0.0, True)
getitem_34: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu[0]
getitem_35: f32[2, 2, 8] = _scaled_dot_product_flash_attention_for_cpu[1]  # free: _scaled_dot_product_flash_attention_for_cpu
detach: f32[2, 2, 8, 8] = aten.detach(getitem_34)
transpose_3: f32[2, 8, 2, 8] = aten.transpose.int(getitem_34, 1, 2)  # free: getitem_34
view_33: f32[2, 8, 16] = aten.view(transpose_3, [2, 8, 16])  # free: transpose_3
view_34: f32[16, 16] = aten.view(view_33, [16, 16])  # free: view_33
t_1: f32[16, 16] = aten.t(view_6)  # free: view_6
addmm_1: f32[16, 16] = aten.addmm(view_7, view_34, t_1)  # free: view_7
view_35: f32[2, 8, 16] = aten.view(addmm_1, [2, 8, 16])  # free: addmm_1
add_1: f32[2, 8, 16] = aten.add.Tensor(add, view_35)  # free: view_35
native_layer_norm_1: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_1, [16], view_8, view_9, 1e-05)
getitem_36: f32[2, 8, 16] = native_layer_norm_1[0]
getitem_37: f32[2, 8, 1] = native_layer_norm_1[1]
getitem_38: f32[2, 8, 1] = native_layer_norm_1[2]  # free: native_layer_norm_1
view_36: f32[16, 16] = aten.view(getitem_36, [16, 16])  # free: getitem_36
t_2: f32[16, 64] = aten.t(view_10)  # free: view_10
addmm_2: f32[16, 64] = aten.addmm(view_11, view_36, t_2)  # free: view_11
view_37: f32[2, 8, 64] = aten.view(addmm_2, [2, 8, 64])
gelu: f32[2, 8, 64] = aten.gelu(view_37)  # free: view_37
view_38: f32[16, 64] = aten.view(gelu, [16, 64])  # free: gelu
t_3: f32[64, 16] = aten.t(view_12)  # free: view_12
addmm_3: f32[16, 16] = aten.addmm(view_13, view_38, t_3)  # free: view_13
view_39: f32[2, 8, 16] = aten.view(addmm_3, [2, 8, 16])  # free: addmm_3
add_2: f32[2, 8, 16] = aten.add.Tensor(add_1, view_39)  # free: view_39
native_layer_norm_2: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_2, [16], view_14, view_15, 1e-05)
getitem_39: f32[2, 8, 16] = native_layer_norm_2[0]
getitem_40: f32[2, 8, 1] = native_layer_norm_2[1]
getitem_41: f32[2, 8, 1] = native_layer_norm_2[2]  # free: native_layer_norm_2
view_40: f32[16, 16] = aten.view(getitem_39, [16, 16])  # free: getitem_39
t_4: f32[16, 48] = aten.t(view_16)  # free: view_16
addmm_4: f32[16, 48] = aten.addmm(view_17, view_40, t_4)  # free: view_17
view_41: f32[2, 8, 48] = aten.view(addmm_4, [2, 8, 48])  # free: addmm_4
split_1: (f32[2, 8, 16], f32[2, 8, 16], f32[2, 8, 16]) = aten.split.Tensor(view_41, 16, 2)  # free: view_41
getitem_42: f32[2, 8, 16] = split_1[0]
getitem_43: f32[2, 8, 16] = split_1[1]
getitem_44: f32[2, 8, 16] = split_1[2]  # free: split_1
view_42: f32[2, 8, 2, 8] = aten.view(getitem_42, [2, 8, 2, 8])  # free: getitem_42
transpose_4: f32[2, 2, 8, 8] = aten.transpose.int(view_42, 1, 2)  # free: view_42
view_43: f32[2, 8, 2, 8] = aten.view(getitem_43, [2, 8, 2, 8])  # free: getitem_43
transpose_5: f32[2, 2, 8, 8] = aten.transpose.int(view_43, 1, 2)  # free: view_43
view_44: f32[2, 8, 2, 8] = aten.view(getitem_44, [2, 8, 2, 8])  # free: getitem_44
transpose_6: f32[2, 2, 8, 8] = aten.transpose.int(view_44, 1, 2)  # free: view_44
_scaled_dot_product_flash_attention_for_cpu_1: (f32[2, 2, 8, 8], f32[2, 2, 8]) = aten._scaled_dot_product_flash_attention_for_cpu(transpose_4, transpose_5, transpose_6, 0.0, True)
getitem_45: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_1[0]
getitem_46: f32[2, 2, 8] = _scaled_dot_product_flash_attention_for_cpu_1[1]  # free: _scaled_dot_product_flash_attention_for_cpu_1
detach_1: f32[2, 2, 8, 8] = aten.detach(getitem_45)
transpose_7: f32[2, 8, 2, 8] = aten.transpose.int(getitem_45, 1, 2)  # free: getitem_45
view_45: f32[2, 8, 16] = aten.view(transpose_7, [2, 8, 16])  # free: transpose_7
view_46: f32[16, 16] = aten.view(view_45, [16, 16])  # free: view_45
t_5: f32[16, 16] = aten.t(view_18)  # free: view_18
addmm_5: f32[16, 16] = aten.addmm(view_19, view_46, t_5)  # free: view_19
view_47: f32[2, 8, 16] = aten.view(addmm_5, [2, 8, 16])  # free: addmm_5
add_3: f32[2, 8, 16] = aten.add.Tensor(add_2, view_47)  # free: view_47
native_layer_norm_3: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_3, [16], view_20, view_21, 1e-05)
getitem_47: f32[2, 8, 16] = native_layer_norm_3[0]
getitem_48: f32[2, 8, 1] = native_layer_norm_3[1]
getitem_49: f32[2, 8, 1] = native_layer_norm_3[2]  # free: native_layer_norm_3
view_48: f32[16, 16] = aten.view(getitem_47, [16, 16])  # free: getitem_47
t_6: f32[16, 64] = aten.t(view_22)  # free: view_22
addmm_6: f32[16, 64] = aten.addmm(view_23, view_48, t_6)  # free: view_23
view_49: f32[2, 8, 64] = aten.view(addmm_6, [2, 8, 64])
gelu_1: f32[2, 8, 64] = aten.gelu(view_49)  # free: view_49
view_50: f32[16, 64] = aten.view(gelu_1, [16, 64])  # free: gelu_1
t_7: f32[64, 16] = aten.t(view_24)  # free: view_24
addmm_7: f32[16, 16] = aten.addmm(view_25, view_50, t_7)  # free: view_25
view_51: f32[2, 8, 16] = aten.view(addmm_7, [2, 8, 16])  # free: addmm_7
add_4: f32[2, 8, 16] = aten.add.Tensor(add_3, view_51)  # free: view_51
native_layer_norm_4: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_4, [16], view_26, view_27, 1e-05)
getitem_50: f32[2, 8, 16] = native_layer_norm_4[0]
getitem_51: f32[2, 8, 1] = native_layer_norm_4[1]
getitem_52: f32[2, 8, 1] = native_layer_norm_4[2]  # free: native_layer_norm_4
t_8: f32[16, 32] = aten.t(view)  # free: view
view_52: f32[16, 16] = aten.view(getitem_50, [16, 16])  # free: getitem_50
mm: f32[16, 32] = aten.mm(view_52, t_8)
view_53: f32[2, 8, 32] = aten.view(mm, [2, 8, 32])  # free: mm
view_54: f32[16, 32] = aten.view(view_53, [-1, 32])  # free: view_53
view_55: i64[16] = aten.view(primals_30, [-1])  # free: primals_30
_log_softmax: f32[16, 32] = aten._log_softmax(view_54, 1, False)  # free: view_54
nll_loss_forward: (f32[], f32[]) = aten.nll_loss_forward(_log_softmax, view_55, None, 1, -100)
getitem_53: f32[] = nll_loss_forward[0]
getitem_54: f32[] = nll_loss_forward[1]  # free: nll_loss_forward
t_9: f32[32, 16] = aten.t(t_8)  # free: t_8
t_10: f32[16, 64] = aten.t(t_7)  # free: t_7
t_11: f32[64, 16] = aten.t(t_6)  # free: t_6
t_12: f32[16, 16] = aten.t(t_5)  # free: t_5
detach_2: f32[2, 2, 8, 8] = aten.detach(detach_1)  # free: detach_1
t_13: f32[48, 16] = aten.t(t_4)  # free: t_4
t_14: f32[16, 64] = aten.t(t_3)  # free: t_3
t_15: f32[64, 16] = aten.t(t_2)  # free: t_2
t_16: f32[16, 16] = aten.t(t_1)  # free: t_1
detach_3: f32[2, 2, 8, 8] = aten.detach(detach)  # free: detach
t_17: f32[48, 16] = aten.t(t)  # free: t
return (getitem_53, primals_1, arange, add, view_2, view_3, getitem_29, getitem_30, view_28, transpose, transpose_1, transpose_2, getitem_35, view_34, add_1, view_8, view_9, getitem_37, getitem_38, view_36, addmm_2, view_38, add_2, view_14, view_15, getitem_40, getitem_41, view_40, transpose_4, transpose_5, transpose_6, getitem_46, view_46, add_3, view_20, view_21, getitem_48, getitem_49, view_48, addmm_6, view_50, add_4, view_26, view_27, getitem_51, getitem_52, view_52, view_55, _log_softmax, getitem_54, t_9, t_10, t_11, t_12, detach_2, t_13, t_14, t_15, t_16, detach_3, t_17)""")
        self.assertExpectedInline(backward, """\
input primals_1: i64[2, 8]
input arange: i64[8]
input add: f32[2, 8, 16]
input unshard: f32[16]
input unshard_1: f32[16]
input getitem: f32[2, 8, 1]
input getitem_1: f32[2, 8, 1]
input view: f32[16, 16]
input transpose: f32[2, 2, 8, 8]
input transpose_1: f32[2, 2, 8, 8]
input transpose_2: f32[2, 2, 8, 8]
input getitem_2: f32[2, 2, 8]
input view_1: f32[16, 16]
input add_1: f32[2, 8, 16]
input unshard_2: f32[16]
input unshard_3: f32[16]
input getitem_3: f32[2, 8, 1]
input getitem_4: f32[2, 8, 1]
input view_2: f32[16, 16]
input addmm: f32[16, 64]
input view_3: f32[16, 64]
input add_2: f32[2, 8, 16]
input unshard_4: f32[16]
input unshard_5: f32[16]
input getitem_5: f32[2, 8, 1]
input getitem_6: f32[2, 8, 1]
input view_4: f32[16, 16]
input transpose_3: f32[2, 2, 8, 8]
input transpose_4: f32[2, 2, 8, 8]
input transpose_5: f32[2, 2, 8, 8]
input getitem_7: f32[2, 2, 8]
input view_5: f32[16, 16]
input add_3: f32[2, 8, 16]
input unshard_6: f32[16]
input unshard_7: f32[16]
input getitem_8: f32[2, 8, 1]
input getitem_9: f32[2, 8, 1]
input view_6: f32[16, 16]
input addmm_1: f32[16, 64]
input view_7: f32[16, 64]
input add_4: f32[2, 8, 16]
input unshard_8: f32[16]
input unshard_9: f32[16]
input getitem_10: f32[2, 8, 1]
input getitem_11: f32[2, 8, 1]
input view_8: f32[16, 16]
input view_9: i64[16]
input _log_softmax: f32[16, 32]
input getitem_12: f32[]
input t: f32[32, 16]
input t_1: f32[16, 64]
input t_2: f32[64, 16]
input t_3: f32[16, 16]
input detach: f32[2, 2, 8, 8]
input t_4: f32[48, 16]
input t_5: f32[16, 64]
input t_6: f32[64, 16]
input t_7: f32[16, 16]
input detach_1: f32[2, 2, 8, 8]
input t_8: f32[48, 16]
input tangents_1: f32[]
nll_loss_backward: f32[16, 32] = aten.nll_loss_backward(tangents_1, _log_softmax, view_9, None, 1, -100, getitem_12)  # free: tangents_1, view_9, getitem_12
detach_2: f32[16, 32] = aten.detach(_log_softmax)  # free: _log_softmax
detach_3: f32[16, 32] = aten.detach(detach_2)  # free: detach_2
_log_softmax_backward_data: f32[16, 32] = aten._log_softmax_backward_data(nll_loss_backward, detach_3, 1, torch.float32)  # free: nll_loss_backward, detach_3
view_10: f32[2, 8, 32] = aten.view(_log_softmax_backward_data, [2, 8, 32])  # free: _log_softmax_backward_data
view_11: f32[16, 32] = aten.view(view_10, [16, 32])  # free: view_10
t_9: f32[32, 16] = aten.t(view_11)
mm: f32[32, 16] = aten.mm(t_9, view_8)  # free: t_9, view_8
t_10: f32[16, 32] = aten.t(mm)  # free: mm
mm_1: f32[16, 16] = aten.mm(view_11, t)  # free: view_11, t
view_12: f32[2, 8, 16] = aten.view(mm_1, [2, 8, 16])  # free: mm_1
t_11: f32[32, 16] = aten.t(t_10)  # free: t_10
native_layer_norm_backward: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_12, add_4, [16], getitem_10, getitem_11, unshard_8, unshard_9, [True, True, True])  # free: view_12, add_4, getitem_10, getitem_11, unshard_8, unshard_9
getitem_13: f32[2, 8, 16] = native_layer_norm_backward[0]
getitem_14: f32[16] = native_layer_norm_backward[1]
getitem_15: f32[16] = native_layer_norm_backward[2]  # free: native_layer_norm_backward
view_13: f32[16, 16] = aten.view(getitem_13, [16, 16])
mm_2: f32[16, 64] = aten.mm(view_13, t_1)  # free: t_1
t_12: f32[16, 16] = aten.t(view_13)
mm_3: f32[16, 64] = aten.mm(t_12, view_7)  # free: t_12, view_7
t_13: f32[64, 16] = aten.t(mm_3)  # free: mm_3
sum: f32[1, 16] = aten.sum.dim_IntList(view_13, [0], True)  # free: view_13
view_14: f32[16] = aten.view(sum, [16])  # free: sum
t_14: f32[16, 64] = aten.t(t_13)  # free: t_13
view_15: f32[2, 8, 64] = aten.view(mm_2, [2, 8, 64])  # free: mm_2
view_16: f32[2, 8, 64] = aten.view(addmm_1, [2, 8, 64])  # free: addmm_1
gelu_backward: f32[2, 8, 64] = aten.gelu_backward(view_15, view_16)  # free: view_15, view_16
view_17: f32[16, 64] = aten.view(gelu_backward, [16, 64])  # free: gelu_backward
mm_4: f32[16, 16] = aten.mm(view_17, t_2)  # free: t_2
t_15: f32[64, 16] = aten.t(view_17)
mm_5: f32[64, 16] = aten.mm(t_15, view_6)  # free: t_15, view_6
t_16: f32[16, 64] = aten.t(mm_5)  # free: mm_5
sum_1: f32[1, 64] = aten.sum.dim_IntList(view_17, [0], True)  # free: view_17
view_18: f32[64] = aten.view(sum_1, [64])  # free: sum_1
t_17: f32[64, 16] = aten.t(t_16)  # free: t_16
view_19: f32[2, 8, 16] = aten.view(mm_4, [2, 8, 16])  # free: mm_4
native_layer_norm_backward_1: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_19, add_3, [16], getitem_8, getitem_9, unshard_6, unshard_7, [True, True, True])  # free: view_19, add_3, getitem_8, getitem_9, unshard_6, unshard_7
getitem_16: f32[2, 8, 16] = native_layer_norm_backward_1[0]
getitem_17: f32[16] = native_layer_norm_backward_1[1]
getitem_18: f32[16] = native_layer_norm_backward_1[2]  # free: native_layer_norm_backward_1
add_5: f32[2, 8, 16] = aten.add.Tensor(getitem_13, getitem_16)  # free: getitem_13, getitem_16
view_20: f32[16, 16] = aten.view(add_5, [16, 16])
mm_6: f32[16, 16] = aten.mm(view_20, t_3)  # free: t_3
t_18: f32[16, 16] = aten.t(view_20)
mm_7: f32[16, 16] = aten.mm(t_18, view_5)  # free: t_18, view_5
t_19: f32[16, 16] = aten.t(mm_7)  # free: mm_7
sum_2: f32[1, 16] = aten.sum.dim_IntList(view_20, [0], True)  # free: view_20
view_21: f32[16] = aten.view(sum_2, [16])  # free: sum_2
t_20: f32[16, 16] = aten.t(t_19)  # free: t_19
view_22: f32[2, 8, 16] = aten.view(mm_6, [2, 8, 16])  # free: mm_6
view_23: f32[2, 8, 2, 8] = aten.view(view_22, [2, 8, 2, 8])  # free: view_22
transpose_6: f32[2, 2, 8, 8] = aten.transpose.int(view_23, 1, 2)  # free: view_23
_scaled_dot_product_flash_attention_for_cpu_backward: (f32[2, 2, 8, 8], f32[2, 2, 8, 8], f32[2, 2, 8, 8]) = aten._scaled_dot_product_flash_attention_for_cpu_backward(transpose_6, transpose_3, transpose_4, transpose_5, detach, getitem_7, 0.0, True)  # free: transpose_6, transpose_3, transpose_4, transpose_5, detach, getitem_7
getitem_19: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[0]
getitem_20: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[1]
getitem_21: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[2]  # free: _scaled_dot_product_flash_attention_for_cpu_backward
transpose_7: f32[2, 8, 2, 8] = aten.transpose.int(getitem_21, 1, 2)  # free: getitem_21
view_24: f32[2, 8, 16] = aten.view(transpose_7, [2, 8, 16])  # free: transpose_7
transpose_8: f32[2, 8, 2, 8] = aten.transpose.int(getitem_20, 1, 2)  # free: getitem_20
view_25: f32[2, 8, 16] = aten.view(transpose_8, [2, 8, 16])  # free: transpose_8
transpose_9: f32[2, 8, 2, 8] = aten.transpose.int(getitem_19, 1, 2)  # free: getitem_19
view_26: f32[2, 8, 16] = aten.view(transpose_9, [2, 8, 16])  # free: transpose_9
cat: f32[2, 8, 48] = aten.cat([view_26, view_25, view_24], 2)  # free: view_26, view_25, view_24
view_27: f32[16, 48] = aten.view(cat, [16, 48])  # free: cat
mm_8: f32[16, 16] = aten.mm(view_27, t_4)  # free: t_4
t_21: f32[48, 16] = aten.t(view_27)
mm_9: f32[48, 16] = aten.mm(t_21, view_4)  # free: t_21, view_4
t_22: f32[16, 48] = aten.t(mm_9)  # free: mm_9
sum_3: f32[1, 48] = aten.sum.dim_IntList(view_27, [0], True)  # free: view_27
view_28: f32[48] = aten.view(sum_3, [48])  # free: sum_3
t_23: f32[48, 16] = aten.t(t_22)  # free: t_22
view_29: f32[2, 8, 16] = aten.view(mm_8, [2, 8, 16])  # free: mm_8
native_layer_norm_backward_2: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_29, add_2, [16], getitem_5, getitem_6, unshard_4, unshard_5, [True, True, True])  # free: view_29, add_2, getitem_5, getitem_6, unshard_4, unshard_5
getitem_22: f32[2, 8, 16] = native_layer_norm_backward_2[0]
getitem_23: f32[16] = native_layer_norm_backward_2[1]
getitem_24: f32[16] = native_layer_norm_backward_2[2]  # free: native_layer_norm_backward_2
add_6: f32[2, 8, 16] = aten.add.Tensor(add_5, getitem_22)  # free: add_5, getitem_22
view_30: f32[16, 16] = aten.view(add_6, [16, 16])
mm_10: f32[16, 64] = aten.mm(view_30, t_5)  # free: t_5
t_24: f32[16, 16] = aten.t(view_30)
mm_11: f32[16, 64] = aten.mm(t_24, view_3)  # free: t_24, view_3
t_25: f32[64, 16] = aten.t(mm_11)  # free: mm_11
sum_4: f32[1, 16] = aten.sum.dim_IntList(view_30, [0], True)  # free: view_30
view_31: f32[16] = aten.view(sum_4, [16])  # free: sum_4
t_26: f32[16, 64] = aten.t(t_25)  # free: t_25
view_32: f32[2, 8, 64] = aten.view(mm_10, [2, 8, 64])  # free: mm_10
view_33: f32[2, 8, 64] = aten.view(addmm, [2, 8, 64])  # free: addmm
gelu_backward_1: f32[2, 8, 64] = aten.gelu_backward(view_32, view_33)  # free: view_32, view_33
view_34: f32[16, 64] = aten.view(gelu_backward_1, [16, 64])  # free: gelu_backward_1
mm_12: f32[16, 16] = aten.mm(view_34, t_6)  # free: t_6
t_27: f32[64, 16] = aten.t(view_34)
mm_13: f32[64, 16] = aten.mm(t_27, view_2)  # free: t_27, view_2
t_28: f32[16, 64] = aten.t(mm_13)  # free: mm_13
sum_5: f32[1, 64] = aten.sum.dim_IntList(view_34, [0], True)  # free: view_34
view_35: f32[64] = aten.view(sum_5, [64])  # free: sum_5
t_29: f32[64, 16] = aten.t(t_28)  # free: t_28
view_36: f32[2, 8, 16] = aten.view(mm_12, [2, 8, 16])  # free: mm_12
native_layer_norm_backward_3: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_36, add_1, [16], getitem_3, getitem_4, unshard_2, unshard_3, [True, True, True])  # free: view_36, add_1, getitem_3, getitem_4, unshard_2, unshard_3
getitem_25: f32[2, 8, 16] = native_layer_norm_backward_3[0]
getitem_26: f32[16] = native_layer_norm_backward_3[1]
getitem_27: f32[16] = native_layer_norm_backward_3[2]  # free: native_layer_norm_backward_3
add_7: f32[2, 8, 16] = aten.add.Tensor(add_6, getitem_25)  # free: add_6, getitem_25
view_37: f32[16, 16] = aten.view(add_7, [16, 16])
mm_14: f32[16, 16] = aten.mm(view_37, t_7)  # free: t_7
t_30: f32[16, 16] = aten.t(view_37)
mm_15: f32[16, 16] = aten.mm(t_30, view_1)  # free: t_30, view_1
t_31: f32[16, 16] = aten.t(mm_15)  # free: mm_15
sum_6: f32[1, 16] = aten.sum.dim_IntList(view_37, [0], True)  # free: view_37
view_38: f32[16] = aten.view(sum_6, [16])  # free: sum_6
t_32: f32[16, 16] = aten.t(t_31)  # free: t_31
view_39: f32[2, 8, 16] = aten.view(mm_14, [2, 8, 16])  # free: mm_14
view_40: f32[2, 8, 2, 8] = aten.view(view_39, [2, 8, 2, 8])  # free: view_39
transpose_10: f32[2, 2, 8, 8] = aten.transpose.int(view_40, 1, 2)  # free: view_40
_scaled_dot_product_flash_attention_for_cpu_backward_1: (f32[2, 2, 8, 8], f32[2, 2, 8, 8], f32[2, 2, 8, 8]) = aten._scaled_dot_product_flash_attention_for_cpu_backward(transpose_10, transpose, transpose_1, transpose_2, detach_1, getitem_2, 0.0, True)  # free: transpose_10, transpose, transpose_1, transpose_2, detach_1, getitem_2
getitem_28: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[0]
getitem_29: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[1]
getitem_30: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[2]  # free: _scaled_dot_product_flash_attention_for_cpu_backward_1
transpose_11: f32[2, 8, 2, 8] = aten.transpose.int(getitem_30, 1, 2)  # free: getitem_30
view_41: f32[2, 8, 16] = aten.view(transpose_11, [2, 8, 16])  # free: transpose_11
transpose_12: f32[2, 8, 2, 8] = aten.transpose.int(getitem_29, 1, 2)  # free: getitem_29
view_42: f32[2, 8, 16] = aten.view(transpose_12, [2, 8, 16])  # free: transpose_12
transpose_13: f32[2, 8, 2, 8] = aten.transpose.int(getitem_28, 1, 2)  # free: getitem_28
view_43: f32[2, 8, 16] = aten.view(transpose_13, [2, 8, 16])  # free: transpose_13
cat_1: f32[2, 8, 48] = aten.cat([view_43, view_42, view_41], 2)  # free: view_43, view_42, view_41
view_44: f32[16, 48] = aten.view(cat_1, [16, 48])  # free: cat_1
mm_16: f32[16, 16] = aten.mm(view_44, t_8)  # free: t_8
t_33: f32[48, 16] = aten.t(view_44)
mm_17: f32[48, 16] = aten.mm(t_33, view)  # free: t_33, view
t_34: f32[16, 48] = aten.t(mm_17)  # free: mm_17
sum_7: f32[1, 48] = aten.sum.dim_IntList(view_44, [0], True)  # free: view_44
view_45: f32[48] = aten.view(sum_7, [48])  # free: sum_7
t_35: f32[48, 16] = aten.t(t_34)  # free: t_34
view_46: f32[2, 8, 16] = aten.view(mm_16, [2, 8, 16])  # free: mm_16
native_layer_norm_backward_4: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_46, add, [16], getitem, getitem_1, unshard, unshard_1, [True, True, True])  # free: view_46, add, getitem, getitem_1, unshard, unshard_1
getitem_31: f32[2, 8, 16] = native_layer_norm_backward_4[0]
getitem_32: f32[16] = native_layer_norm_backward_4[1]
getitem_33: f32[16] = native_layer_norm_backward_4[2]  # free: native_layer_norm_backward_4
add_8: f32[2, 8, 16] = aten.add.Tensor(add_7, getitem_31)  # free: add_7, getitem_31
sum_8: f32[1, 8, 16] = aten.sum.dim_IntList(add_8, [0], True)
view_47: f32[8, 16] = aten.view(sum_8, [8, 16])  # free: sum_8
embedding_dense_backward: f32[8, 16] = aten.embedding_dense_backward(view_47, arange, 8, -1, False)  # free: view_47, arange
embedding_dense_backward_1: f32[32, 16] = aten.embedding_dense_backward(add_8, primals_1, 32, -1, False)  # free: add_8, primals_1
add_9: f32[32, 16] = aten.add.Tensor(t_11, embedding_dense_backward_1)  # free: t_11, embedding_dense_backward_1
pack: f32[7232] = zerocompile.pack([getitem_15, getitem_14, view_14, t_14, view_18, t_17, getitem_18, getitem_17, view_21, t_20, view_28, t_23, getitem_24, getitem_23, view_31, t_26, view_35, t_29, getitem_27, getitem_26, view_38, t_32, view_45, t_35, getitem_33, getitem_32, embedding_dense_backward, add_9], 4, [4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 32, 128])  # free: getitem_15, getitem_14, view_14, t_14, view_18, t_17, getitem_18, getitem_17, view_21, t_20, view_28, t_23, getitem_24, getitem_23, view_31, t_26, view_35, t_29, getitem_27, getitem_26, view_38, t_32, view_45, t_35, getitem_33, getitem_32, embedding_dense_backward, add_9
reduce_scatter_tensor: f32[1808] = _c10d_functional.reduce_scatter_tensor(pack, 'avg', 4, WORLD)  # param: ln_f.bias, ln_f.weight, blocks.1.out.bias, blocks.1.out.weight, blocks.1.fc.bias, blocks.1.fc.weight, blocks.1.ln2.bias, blocks.1.ln2.weight, blocks.1.attn.proj.bias, blocks.1.attn.proj.weight, blocks.1.attn.qkv.bias, blocks.1.attn.qkv.weight, blocks.1.ln1.bias, blocks.1.ln1.weight, blocks.0.out.bias, blocks.0.out.weight, blocks.0.fc.bias, blocks.0.fc.weight, blocks.0.ln2.bias, blocks.0.ln2.weight, blocks.0.attn.proj.bias, blocks.0.attn.proj.weight, blocks.0.attn.qkv.bias, blocks.0.attn.qkv.weight, blocks.0.ln1.bias, blocks.0.ln1.weight, wpe.weight, wte.weight; free: pack
wait_tensor: f32[1808] = _c10d_functional.wait_tensor(reduce_scatter_tensor)  # free: reduce_scatter_tensor
split_with_sizes: (f32[4], f32[4], f32[4], f32[256], f32[16], f32[256], f32[4], f32[4], f32[4], f32[64], f32[12], f32[192], f32[4], f32[4], f32[4], f32[256], f32[16], f32[256], f32[4], f32[4], f32[4], f32[64], f32[12], f32[192], f32[4], f32[4], f32[32], f32[128]) = aten.split_with_sizes(wait_tensor, [4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 32, 128])  # free: wait_tensor
getitem_34: f32[4] = split_with_sizes[0]
getitem_35: f32[4] = split_with_sizes[1]
getitem_36: f32[4] = split_with_sizes[2]
getitem_37: f32[256] = split_with_sizes[3]
getitem_38: f32[16] = split_with_sizes[4]
getitem_39: f32[256] = split_with_sizes[5]
getitem_40: f32[4] = split_with_sizes[6]
getitem_41: f32[4] = split_with_sizes[7]
getitem_42: f32[4] = split_with_sizes[8]
getitem_43: f32[64] = split_with_sizes[9]
getitem_44: f32[12] = split_with_sizes[10]
getitem_45: f32[192] = split_with_sizes[11]
getitem_46: f32[4] = split_with_sizes[12]
getitem_47: f32[4] = split_with_sizes[13]
getitem_48: f32[4] = split_with_sizes[14]
getitem_49: f32[256] = split_with_sizes[15]
getitem_50: f32[16] = split_with_sizes[16]
getitem_51: f32[256] = split_with_sizes[17]
getitem_52: f32[4] = split_with_sizes[18]
getitem_53: f32[4] = split_with_sizes[19]
getitem_54: f32[4] = split_with_sizes[20]
getitem_55: f32[64] = split_with_sizes[21]
getitem_56: f32[12] = split_with_sizes[22]
getitem_57: f32[192] = split_with_sizes[23]
getitem_58: f32[4] = split_with_sizes[24]
getitem_59: f32[4] = split_with_sizes[25]
getitem_60: f32[32] = split_with_sizes[26]
getitem_61: f32[128] = split_with_sizes[27]  # free: split_with_sizes
return (None, getitem_61, getitem_60, getitem_59, getitem_58, getitem_57, getitem_56, getitem_55, getitem_54, getitem_53, getitem_52, getitem_51, getitem_50, getitem_49, getitem_48, getitem_47, getitem_46, getitem_45, getitem_44, getitem_43, getitem_42, getitem_41, getitem_40, getitem_39, getitem_38, getitem_37, getitem_36, getitem_35, getitem_34, None)""")

    def test_stage_2(self) -> None:
        forward, backward = gpt_graphs(2)
        self.assertExpectedInline(forward, """\
input primals_1: i64[2, 8]
input primals_2: f32[128]
input primals_3: f32[32]
input primals_4: f32[4]
input primals_5: f32[4]
input primals_6: f32[192]
input primals_7: f32[12]
input primals_8: f32[64]
input primals_9: f32[4]
input primals_10: f32[4]
input primals_11: f32[4]
input primals_12: f32[256]
input primals_13: f32[16]
input primals_14: f32[256]
input primals_15: f32[4]
input primals_16: f32[4]
input primals_17: f32[4]
input primals_18: f32[192]
input primals_19: f32[12]
input primals_20: f32[64]
input primals_21: f32[4]
input primals_22: f32[4]
input primals_23: f32[4]
input primals_24: f32[256]
input primals_25: f32[16]
input primals_26: f32[256]
input primals_27: f32[4]
input primals_28: f32[4]
input primals_29: f32[4]
input primals_30: i64[2, 8]
pack: f32[1808] = zerocompile.pack([primals_2, primals_3, primals_4, primals_5, primals_6, primals_7, primals_8, primals_9, primals_10, primals_11, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, primals_21, primals_22, primals_23, primals_24, primals_25, primals_26, primals_27, primals_28, primals_29], 1, [128, 32, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4])  # free: primals_2, primals_3, primals_4, primals_5, primals_6, primals_7, primals_8, primals_9, primals_10, primals_11, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, primals_21, primals_22, primals_23, primals_24, primals_25, primals_26, primals_27, primals_28, primals_29
all_gather_into_tensor: f32[7232] = _c10d_functional.all_gather_into_tensor(pack, 4, WORLD)  # param: wte.weight, wpe.weight, blocks.0.ln1.weight, blocks.0.ln1.bias, blocks.0.attn.qkv.weight, blocks.0.attn.qkv.bias, blocks.0.attn.proj.weight, blocks.0.attn.proj.bias, blocks.0.ln2.weight, blocks.0.ln2.bias, blocks.0.fc.weight, blocks.0.fc.bias, blocks.0.out.weight, blocks.0.out.bias, blocks.1.ln1.weight, blocks.1.ln1.bias, blocks.1.attn.qkv.weight, blocks.1.attn.qkv.bias, blocks.1.attn.proj.weight, blocks.1.attn.proj.bias, blocks.1.ln2.weight, blocks.1.ln2.bias, blocks.1.fc.weight, blocks.1.fc.bias, blocks.1.out.weight, blocks.1.out.bias, ln_f.weight, ln_f.bias; free: pack
arange: i64[8] = aten.arange(8, device = device(type='cpu'), pin_memory = False)
wait_tensor: f32[7232] = _c10d_functional.wait_tensor(all_gather_into_tensor)  # free: all_gather_into_tensor
unpack: (f32[512], f32[128], f32[16], f32[16], f32[768], f32[48], f32[256], f32[16], f32[16], f32[16], f32[1024], f32[64], f32[1024], f32[16], f32[16], f32[16], f32[768], f32[48], f32[256], f32[16], f32[16], f32[16], f32[1024], f32[64], f32[1024], f32[16], f32[16], f32[16]) = zerocompile.unpack(wait_tensor, 4, [128, 32, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4])  # free: wait_tensor
getitem: f32[512] = unpack[0]
getitem_1: f32[128] = unpack[1]
getitem_2: f32[16] = unpack[2]
getitem_3: f32[16] = unpack[3]
getitem_4: f32[768] = unpack[4]
getitem_5: f32[48] = unpack[5]
getitem_6: f32[256] = unpack[6]
getitem_7: f32[16] = unpack[7]
getitem_8: f32[16] = unpack[8]
getitem_9: f32[16] = unpack[9]
getitem_10: f32[1024] = unpack[10]
getitem_11: f32[64] = unpack[11]
getitem_12: f32[1024] = unpack[12]
getitem_13: f32[16] = unpack[13]
getitem_14: f32[16] = unpack[14]
getitem_15: f32[16] = unpack[15]
getitem_16: f32[768] = unpack[16]
getitem_17: f32[48] = unpack[17]
getitem_18: f32[256] = unpack[18]
getitem_19: f32[16] = unpack[19]
getitem_20: f32[16] = unpack[20]
getitem_21: f32[16] = unpack[21]
getitem_22: f32[1024] = unpack[22]
getitem_23: f32[64] = unpack[23]
getitem_24: f32[1024] = unpack[24]
getitem_25: f32[16] = unpack[25]
getitem_26: f32[16] = unpack[26]
getitem_27: f32[16] = unpack[27]  # free: unpack
view: f32[32, 16] = aten.view(getitem, [32, 16])  # free: getitem
view_1: f32[8, 16] = aten.view(getitem_1, [8, 16])  # free: getitem_1
view_2: f32[16] = aten.view(getitem_2, [16])  # free: getitem_2
view_3: f32[16] = aten.view(getitem_3, [16])  # free: getitem_3
view_4: f32[48, 16] = aten.view(getitem_4, [48, 16])  # free: getitem_4
view_5: f32[48] = aten.view(getitem_5, [48])  # free: getitem_5
view_6: f32[16, 16] = aten.view(getitem_6, [16, 16])  # free: getitem_6
view_7: f32[16] = aten.view(getitem_7, [16])  # free: getitem_7
view_8: f32[16] = aten.view(getitem_8, [16])  # free: getitem_8
view_9: f32[16] = aten.view(getitem_9, [16])  # free: getitem_9
view_10: f32[64, 16] = aten.view(getitem_10, [64, 16])  # free: getitem_10
view_11: f32[64] = aten.view(getitem_11, [64])  # free: getitem_11
view_12: f32[16, 64] = aten.view(getitem_12, [16, 64])  # free: getitem_12
view_13: f32[16] = aten.view(getitem_13, [16])  # free: getitem_13
view_14: f32[16] = aten.view(getitem_14, [16])  # free: getitem_14
view_15: f32[16] = aten.view(getitem_15, [16])  # free: getitem_15
view_16: f32[48, 16] = aten.view(getitem_16, [48, 16])  # free: getitem_16
view_17: f32[48] = aten.view(getitem_17, [48])  # free: getitem_17
view_18: f32[16, 16] = aten.view(getitem_18, [16, 16])  # free: getitem_18
view_19: f32[16] = aten.view(getitem_19, [16])  # free: getitem_19
view_20: f32[16] = aten.view(getitem_20, [16])  # free: getitem_20
view_21: f32[16] = aten.view(getitem_21, [16])  # free: getitem_21
view_22: f32[64, 16] = aten.view(getitem_22, [64, 16])  # free: getitem_22
view_23: f32[64] = aten.view(getitem_23, [64])  # free: getitem_23
view_24: f32[16, 64] = aten.view(getitem_24, [16, 64])  # free: getitem_24
view_25: f32[16] = aten.view(getitem_25, [16])  # free: getitem_25
view_26: f32[16] = aten.view(getitem_26, [16])  # free: getitem_26
view_27: f32[16] = aten.view(getitem_27, [16])  # free: getitem_27
embedding: f32[2, 8, 16] = aten.embedding(view, primals_1)
embedding_1: f32[8, 16] = aten.embedding(view_1, arange)  # free: view_1
add: f32[2, 8, 16] = aten.add.Tensor(embedding, embedding_1)  # free: embedding, embedding_1
native_layer_norm: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add, [16], view_2, view_3, 1e-05)
getitem_28: f32[2, 8, 16] = native_layer_norm[0]
getitem_29: f32[2, 8, 1] = native_layer_norm[1]
getitem_30: f32[2, 8, 1] = native_layer_norm[2]  # free: native_layer_norm
view_28: f32[16, 16] = aten.view(getitem_28, [16, 16])  # free: getitem_28
t: f32[16, 48] = aten.t(view_4)  # free: view_4
addmm: f32[16, 48] = aten.addmm(view_5, view_28, t)  # free: view_5
view_29: f32[2, 8, 48] = aten.view(addmm, [2, 8, 48])  # free: addmm
split: (f32[2, 8, 16], f32[2, 8, 16], f32[2, 8, 16]) = aten.split.Tensor(view_29, 16, 2)  # free: view_29
getitem_31: f32[2, 8, 16] = split[0]
getitem_32: f32[2, 8, 16] = split[1]
getitem_33: f32[2, 8, 16] = split[2]  # free: split
view_30: f32[2, 8, 2, 8] = aten.view(getitem_31, [2, 8, 2, 8])  # free: getitem_31
transpose: f32[2, 2, 8, 8] = aten.transpose.int(view_30, 1, 2)  # free: view_30
view_31: f32[2, 8, 2, 8] = aten.view(getitem_32, [2, 8, 2, 8])  # free: getitem_32
transpose_1: f32[2, 2, 8, 8] = aten.transpose.int(view_31, 1, 2)  # free: view_31
view_32: f32[2, 8, 2, 8] = aten.view(getitem_33, [2, 8, 2, 8])  # free: getitem_33
transpose_2: f32[2, 2, 8, 8] = aten.transpose.int(view_32, 1, 2)  # free: view_32
_scaled_dot_product_flash_attention_for_cpu: (f32[2, 2, 8, 8], f32[2, 2, 8]) = aten._scaled_dot_product_flash_attention_for_cpu(transpose, transpose_1, transpose_2, 0.0, True)
getitem_34: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu[0]
getitem_35: f32[2, 2, 8] = _scaled_dot_product_flash_attention_for_cpu[1]  # free: _scaled_dot_product_flash_attention_for_cpu
detach: f32[2, 2, 8, 8] = aten.detach(getitem_34)
transpose_3: f32[2, 8, 2, 8] = aten.transpose.int(getitem_34, 1, 2)  # free: getitem_34
view_33: f32[2, 8, 16] = aten.view(transpose_3, [2, 8, 16])  # free: transpose_3
view_34: f32[16, 16] = aten.view(view_33, [16, 16])  # free: view_33
t_1: f32[16, 16] = aten.t(view_6)  # free: view_6
addmm_1: f32[16, 16] = aten.addmm(view_7, view_34, t_1)  # free: view_7
view_35: f32[2, 8, 16] = aten.view(addmm_1, [2, 8, 16])  # free: addmm_1
add_1: f32[2, 8, 16] = aten.add.Tensor(add, view_35)  # free: view_35
native_layer_norm_1: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_1, [16], view_8, view_9, 1e-05)
getitem_36: f32[2, 8, 16] = native_layer_norm_1[0]
getitem_37: f32[2, 8, 1] = native_layer_norm_1[1]
getitem_38: f32[2, 8, 1] = native_layer_norm_1[2]  # free: native_layer_norm_1
view_36: f32[16, 16] = aten.view(getitem_36, [16, 16])  # free: getitem_36
t_2: f32[16, 64] = aten.t(view_10)  # free: view_10
addmm_2: f32[16, 64] = aten.addmm(view_11, view_36, t_2)  # free: view_11
view_37: f32[2, 8, 64] = aten.view(addmm_2, [2, 8, 64])
gelu: f32[2, 8, 64] = aten.gelu(view_37)  # free: view_37
view_38: f32[16, 64] = aten.view(gelu, [16, 64])  # free: gelu
t_3: f32[64, 16] = aten.t(view_12)  # free: view_12
addmm_3: f32[16, 16] = aten.addmm(view_13, view_38, t_3)  # free: view_13
view_39: f32[2, 8, 16] = aten.view(addmm_3, [2, 8, 16])  # free: addmm_3
add_2: f32[2, 8, 16] = aten.add.Tensor(add_1, view_39)  # free: view_39
native_layer_norm_2: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_2, [16], view_14, view_15, 1e-05)
getitem_39: f32[2, 8, 16] = native_layer_norm_2[0]
getitem_40: f32[2, 8, 1] = native_layer_norm_2[1]
getitem_41: f32[2, 8, 1] = native_layer_norm_2[2]  # free: native_layer_norm_2
view_40: f32[16, 16] = aten.view(getitem_39, [16, 16])  # free: getitem_39
t_4: f32[16, 48] = aten.t(view_16)  # free: view_16
addmm_4: f32[16, 48] = aten.addmm(view_17, view_40, t_4)  # free: view_17
view_41: f32[2, 8, 48] = aten.view(addmm_4, [2, 8, 48])  # free: addmm_4
split_1: (f32[2, 8, 16], f32[2, 8, 16], f32[2, 8, 16]) = aten.split.Tensor(view_41, 16, 2)  # free: view_41
getitem_42: f32[2, 8, 16] = split_1[0]
getitem_43: f32[2, 8, 16] = split_1[1]
getitem_44: f32[2, 8, 16] = split_1[2]  # free: split_1
view_42: f32[2, 8, 2, 8] = aten.view(getitem_42, [2, 8, 2, 8])  # free: getitem_42
transpose_4: f32[2, 2, 8, 8] = aten.transpose.int(view_42, 1, 2)  # free: view_42
view_43: f32[2, 8, 2, 8] = aten.view(getitem_43, [2, 8, 2, 8])  # free: getitem_43
transpose_5: f32[2, 2, 8, 8] = aten.transpose.int(view_43, 1, 2)  # free: view_43
view_44: f32[2, 8, 2, 8] = aten.view(getitem_44, [2, 8, 2, 8])  # free: getitem_44
transpose_6: f32[2, 2, 8, 8] = aten.transpose.int(view_44, 1, 2)  # free: view_44
_scaled_dot_product_flash_attention_for_cpu_1: (f32[2, 2, 8, 8], f32[2, 2, 8]) = aten._scaled_dot_product_flash_attention_for_cpu(transpose_4, transpose_5, transpose_6, 0.0, True)
getitem_45: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_1[0]
getitem_46: f32[2, 2, 8] = _scaled_dot_product_flash_attention_for_cpu_1[1]  # free: _scaled_dot_product_flash_attention_for_cpu_1
detach_1: f32[2, 2, 8, 8] = aten.detach(getitem_45)
transpose_7: f32[2, 8, 2, 8] = aten.transpose.int(getitem_45, 1, 2)  # free: getitem_45
view_45: f32[2, 8, 16] = aten.view(transpose_7, [2, 8, 16])  # free: transpose_7
view_46: f32[16, 16] = aten.view(view_45, [16, 16])  # free: view_45
t_5: f32[16, 16] = aten.t(view_18)  # free: view_18
addmm_5: f32[16, 16] = aten.addmm(view_19, view_46, t_5)  # free: view_19
view_47: f32[2, 8, 16] = aten.view(addmm_5, [2, 8, 16])  # free: addmm_5
add_3: f32[2, 8, 16] = aten.add.Tensor(add_2, view_47)  # free: view_47
native_layer_norm_3: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_3, [16], view_20, view_21, 1e-05)
getitem_47: f32[2, 8, 16] = native_layer_norm_3[0]
getitem_48: f32[2, 8, 1] = native_layer_norm_3[1]
getitem_49: f32[2, 8, 1] = native_layer_norm_3[2]  # free: native_layer_norm_3
view_48: f32[16, 16] = aten.view(getitem_47, [16, 16])  # free: getitem_47
t_6: f32[16, 64] = aten.t(view_22)  # free: view_22
addmm_6: f32[16, 64] = aten.addmm(view_23, view_48, t_6)  # free: view_23
view_49: f32[2, 8, 64] = aten.view(addmm_6, [2, 8, 64])
gelu_1: f32[2, 8, 64] = aten.gelu(view_49)  # free: view_49
view_50: f32[16, 64] = aten.view(gelu_1, [16, 64])  # free: gelu_1
t_7: f32[64, 16] = aten.t(view_24)  # free: view_24
addmm_7: f32[16, 16] = aten.addmm(view_25, view_50, t_7)  # free: view_25
view_51: f32[2, 8, 16] = aten.view(addmm_7, [2, 8, 16])  # free: addmm_7
add_4: f32[2, 8, 16] = aten.add.Tensor(add_3, view_51)  # free: view_51
native_layer_norm_4: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_4, [16], view_26, view_27, 1e-05)
getitem_50: f32[2, 8, 16] = native_layer_norm_4[0]
getitem_51: f32[2, 8, 1] = native_layer_norm_4[1]
getitem_52: f32[2, 8, 1] = native_layer_norm_4[2]  # free: native_layer_norm_4
t_8: f32[16, 32] = aten.t(view)  # free: view
view_52: f32[16, 16] = aten.view(getitem_50, [16, 16])  # free: getitem_50
mm: f32[16, 32] = aten.mm(view_52, t_8)
view_53: f32[2, 8, 32] = aten.view(mm, [2, 8, 32])  # free: mm
view_54: f32[16, 32] = aten.view(view_53, [-1, 32])  # free: view_53
view_55: i64[16] = aten.view(primals_30, [-1])  # free: primals_30
_log_softmax: f32[16, 32] = aten._log_softmax(view_54, 1, False)  # free: view_54
nll_loss_forward: (f32[], f32[]) = aten.nll_loss_forward(_log_softmax, view_55, None, 1, -100)
getitem_53: f32[] = nll_loss_forward[0]
getitem_54: f32[] = nll_loss_forward[1]  # free: nll_loss_forward
t_9: f32[32, 16] = aten.t(t_8)  # free: t_8
t_10: f32[16, 64] = aten.t(t_7)  # free: t_7
t_11: f32[64, 16] = aten.t(t_6)  # free: t_6
t_12: f32[16, 16] = aten.t(t_5)  # free: t_5
detach_2: f32[2, 2, 8, 8] = aten.detach(detach_1)  # free: detach_1
t_13: f32[48, 16] = aten.t(t_4)  # free: t_4
t_14: f32[16, 64] = aten.t(t_3)  # free: t_3
t_15: f32[64, 16] = aten.t(t_2)  # free: t_2
t_16: f32[16, 16] = aten.t(t_1)  # free: t_1
detach_3: f32[2, 2, 8, 8] = aten.detach(detach)  # free: detach
t_17: f32[48, 16] = aten.t(t)  # free: t
return (getitem_53, primals_1, arange, add, view_2, view_3, getitem_29, getitem_30, view_28, transpose, transpose_1, transpose_2, getitem_35, view_34, add_1, view_8, view_9, getitem_37, getitem_38, view_36, addmm_2, view_38, add_2, view_14, view_15, getitem_40, getitem_41, view_40, transpose_4, transpose_5, transpose_6, getitem_46, view_46, add_3, view_20, view_21, getitem_48, getitem_49, view_48, addmm_6, view_50, add_4, view_26, view_27, getitem_51, getitem_52, view_52, view_55, _log_softmax, getitem_54, t_9, t_10, t_11, t_12, detach_2, t_13, t_14, t_15, t_16, detach_3, t_17)""")
        self.assertExpectedInline(backward, """\
input primals_1: i64[2, 8]
input arange: i64[8]
input add: f32[2, 8, 16]
input unshard: f32[16]
input unshard_1: f32[16]
input getitem: f32[2, 8, 1]
input getitem_1: f32[2, 8, 1]
input view: f32[16, 16]
input transpose: f32[2, 2, 8, 8]
input transpose_1: f32[2, 2, 8, 8]
input transpose_2: f32[2, 2, 8, 8]
input getitem_2: f32[2, 2, 8]
input view_1: f32[16, 16]
input add_1: f32[2, 8, 16]
input unshard_2: f32[16]
input unshard_3: f32[16]
input getitem_3: f32[2, 8, 1]
input getitem_4: f32[2, 8, 1]
input view_2: f32[16, 16]
input addmm: f32[16, 64]
input view_3: f32[16, 64]
input add_2: f32[2, 8, 16]
input unshard_4: f32[16]
input unshard_5: f32[16]
input getitem_5: f32[2, 8, 1]
input getitem_6: f32[2, 8, 1]
input view_4: f32[16, 16]
input transpose_3: f32[2, 2, 8, 8]
input transpose_4: f32[2, 2, 8, 8]
input transpose_5: f32[2, 2, 8, 8]
input getitem_7: f32[2, 2, 8]
input view_5: f32[16, 16]
input add_3: f32[2, 8, 16]
input unshard_6: f32[16]
input unshard_7: f32[16]
input getitem_8: f32[2, 8, 1]
input getitem_9: f32[2, 8, 1]
input view_6: f32[16, 16]
input addmm_1: f32[16, 64]
input view_7: f32[16, 64]
input add_4: f32[2, 8, 16]
input unshard_8: f32[16]
input unshard_9: f32[16]
input getitem_10: f32[2, 8, 1]
input getitem_11: f32[2, 8, 1]
input view_8: f32[16, 16]
input view_9: i64[16]
input _log_softmax: f32[16, 32]
input getitem_12: f32[]
input t: f32[32, 16]
input t_1: f32[16, 64]
input t_2: f32[64, 16]
input t_3: f32[16, 16]
input detach: f32[2, 2, 8, 8]
input t_4: f32[48, 16]
input t_5: f32[16, 64]
input t_6: f32[64, 16]
input t_7: f32[16, 16]
input detach_1: f32[2, 2, 8, 8]
input t_8: f32[48, 16]
input tangents_1: f32[]
nll_loss_backward: f32[16, 32] = aten.nll_loss_backward(tangents_1, _log_softmax, view_9, None, 1, -100, getitem_12)  # free: tangents_1, view_9, getitem_12
detach_2: f32[16, 32] = aten.detach(_log_softmax)  # free: _log_softmax
detach_3: f32[16, 32] = aten.detach(detach_2)  # free: detach_2
_log_softmax_backward_data: f32[16, 32] = aten._log_softmax_backward_data(nll_loss_backward, detach_3, 1, torch.float32)  # free: nll_loss_backward, detach_3
view_10: f32[2, 8, 32] = aten.view(_log_softmax_backward_data, [2, 8, 32])  # free: _log_softmax_backward_data
view_11: f32[16, 32] = aten.view(view_10, [16, 32])  # free: view_10
t_9: f32[32, 16] = aten.t(view_11)
mm: f32[32, 16] = aten.mm(t_9, view_8)  # free: t_9, view_8
t_10: f32[16, 32] = aten.t(mm)  # free: mm
mm_1: f32[16, 16] = aten.mm(view_11, t)  # free: view_11, t
view_12: f32[2, 8, 16] = aten.view(mm_1, [2, 8, 16])  # free: mm_1
t_11: f32[32, 16] = aten.t(t_10)  # free: t_10
native_layer_norm_backward: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_12, add_4, [16], getitem_10, getitem_11, unshard_8, unshard_9, [True, True, True])  # free: view_12, add_4, getitem_10, getitem_11, unshard_8, unshard_9
getitem_13: f32[2, 8, 16] = native_layer_norm_backward[0]
getitem_14: f32[16] = native_layer_norm_backward[1]
getitem_15: f32[16] = native_layer_norm_backward[2]  # free: native_layer_norm_backward
view_13: f32[16, 16] = aten.view(getitem_13, [16, 16])
mm_2: f32[16, 64] = aten.mm(view_13, t_1)  # free: t_1
t_12: f32[16, 16] = aten.t(view_13)
mm_3: f32[16, 64] = aten.mm(t_12, view_7)  # free: t_12, view_7
t_13: f32[64, 16] = aten.t(mm_3)  # free: mm_3
sum: f32[1, 16] = aten.sum.dim_IntList(view_13, [0], True)  # free: view_13
view_14: f32[16] = aten.view(sum, [16])  # free: sum
t_14: f32[16, 64] = aten.t(t_13)  # free: t_13
view_15: f32[2, 8, 64] = aten.view(mm_2, [2, 8, 64])  # free: mm_2
view_16: f32[2, 8, 64] = aten.view(addmm_1, [2, 8, 64])  # free: addmm_1
gelu_backward: f32[2, 8, 64] = aten.gelu_backward(view_15, view_16)  # free: view_15, view_16
view_17: f32[16, 64] = aten.view(gelu_backward, [16, 64])  # free: gelu_backward
mm_4: f32[16, 16] = aten.mm(view_17, t_2)  # free: t_2
t_15: f32[64, 16] = aten.t(view_17)
mm_5: f32[64, 16] = aten.mm(t_15, view_6)  # free: t_15, view_6
t_16: f32[16, 64] = aten.t(mm_5)  # free: mm_5
sum_1: f32[1, 64] = aten.sum.dim_IntList(view_17, [0], True)  # free: view_17
view_18: f32[64] = aten.view(sum_1, [64])  # free: sum_1
t_17: f32[64, 16] = aten.t(t_16)  # free: t_16
view_19: f32[2, 8, 16] = aten.view(mm_4, [2, 8, 16])  # free: mm_4
native_layer_norm_backward_1: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_19, add_3, [16], getitem_8, getitem_9, unshard_6, unshard_7, [True, True, True])  # free: view_19, add_3, getitem_8, getitem_9, unshard_6, unshard_7
getitem_16: f32[2, 8, 16] = native_layer_norm_backward_1[0]
getitem_17: f32[16] = native_layer_norm_backward_1[1]
getitem_18: f32[16] = native_layer_norm_backward_1[2]  # free: native_layer_norm_backward_1
add_5: f32[2, 8, 16] = aten.add.Tensor(getitem_13, getitem_16)  # free: getitem_13, getitem_16
view_20: f32[16, 16] = aten.view(add_5, [16, 16])
mm_6: f32[16, 16] = aten.mm(view_20, t_3)  # free: t_3
t_18: f32[16, 16] = aten.t(view_20)
mm_7: f32[16, 16] = aten.mm(t_18, view_5)  # free: t_18, view_5
t_19: f32[16, 16] = aten.t(mm_7)  # free: mm_7
sum_2: f32[1, 16] = aten.sum.dim_IntList(view_20, [0], True)  # free: view_20
view_21: f32[16] = aten.view(sum_2, [16])  # free: sum_2
t_20: f32[16, 16] = aten.t(t_19)  # free: t_19
view_22: f32[2, 8, 16] = aten.view(mm_6, [2, 8, 16])  # free: mm_6
view_23: f32[2, 8, 2, 8] = aten.view(view_22, [2, 8, 2, 8])  # free: view_22
transpose_6: f32[2, 2, 8, 8] = aten.transpose.int(view_23, 1, 2)  # free: view_23
_scaled_dot_product_flash_attention_for_cpu_backward: (f32[2, 2, 8, 8], f32[2, 2, 8, 8], f32[2, 2, 8, 8]) = aten._scaled_dot_product_flash_attention_for_cpu_backward(transpose_6, transpose_3, transpose_4, transpose_5, detach, getitem_7, 0.0, True)  # free: transpose_6, transpose_3, transpose_4, transpose_5, detach, getitem_7
getitem_19: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[0]
getitem_20: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[1]
getitem_21: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[2]  # free: _scaled_dot_product_flash_attention_for_cpu_backward
transpose_7: f32[2, 8, 2, 8] = aten.transpose.int(getitem_21, 1, 2)  # free: getitem_21
view_24: f32[2, 8, 16] = aten.view(transpose_7, [2, 8, 16])  # free: transpose_7
transpose_8: f32[2, 8, 2, 8] = aten.transpose.int(getitem_20, 1, 2)  # free: getitem_20
view_25: f32[2, 8, 16] = aten.view(transpose_8, [2, 8, 16])  # free: transpose_8
transpose_9: f32[2, 8, 2, 8] = aten.transpose.int(getitem_19, 1, 2)  # free: getitem_19
view_26: f32[2, 8, 16] = aten.view(transpose_9, [2, 8, 16])  # free: transpose_9
cat: f32[2, 8, 48] = aten.cat([view_26, view_25, view_24], 2)  # free: view_26, view_25, view_24
view_27: f32[16, 48] = aten.view(cat, [16, 48])  # free: cat
mm_8: f32[16, 16] = aten.mm(view_27, t_4)  # free: t_4
t_21: f32[48, 16] = aten.t(view_27)
mm_9: f32[48, 16] = aten.mm(t_21, view_4)  # free: t_21, view_4
t_22: f32[16, 48] = aten.t(mm_9)  # free: mm_9
sum_3: f32[1, 48] = aten.sum.dim_IntList(view_27, [0], True)  # free: view_27
view_28: f32[48] = aten.view(sum_3, [48])  # free: sum_3
t_23: f32[48, 16] = aten.t(t_22)  # free: t_22
view_29: f32[2, 8, 16] = aten.view(mm_8, [2, 8, 16])  # free: mm_8
native_layer_norm_backward_2: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_29, add_2, [16], getitem_5, getitem_6, unshard_4, unshard_5, [True, True, True])  # free: view_29, add_2, getitem_5, getitem_6, unshard_4, unshard_5
getitem_22: f32[2, 8, 16] = native_layer_norm_backward_2[0]
getitem_23: f32[16] = native_layer_norm_backward_2[1]
getitem_24: f32[16] = native_layer_norm_backward_2[2]  # free: native_layer_norm_backward_2
add_6: f32[2, 8, 16] = aten.add.Tensor(add_5, getitem_22)  # free: add_5, getitem_22
view_30: f32[16, 16] = aten.view(add_6, [16, 16])
mm_10: f32[16, 64] = aten.mm(view_30, t_5)  # free: t_5
t_24: f32[16, 16] = aten.t(view_30)
mm_11: f32[16, 64] = aten.mm(t_24, view_3)  # free: t_24, view_3
t_25: f32[64, 16] = aten.t(mm_11)  # free: mm_11
sum_4: f32[1, 16] = aten.sum.dim_IntList(view_30, [0], True)  # free: view_30
view_31: f32[16] = aten.view(sum_4, [16])  # free: sum_4
t_26: f32[16, 64] = aten.t(t_25)  # free: t_25
view_32: f32[2, 8, 64] = aten.view(mm_10, [2, 8, 64])  # free: mm_10
view_33: f32[2, 8, 64] = aten.view(addmm, [2, 8, 64])  # free: addmm
gelu_backward_1: f32[2, 8, 64] = aten.gelu_backward(view_32, view_33)  # free: view_32, view_33
view_34: f32[16, 64] = aten.view(gelu_backward_1, [16, 64])  # free: gelu_backward_1
mm_12: f32[16, 16] = aten.mm(view_34, t_6)  # free: t_6
t_27: f32[64, 16] = aten.t(view_34)
mm_13: f32[64, 16] = aten.mm(t_27, view_2)  # free: t_27, view_2
t_28: f32[16, 64] = aten.t(mm_13)  # free: mm_13
sum_5: f32[1, 64] = aten.sum.dim_IntList(view_34, [0], True)  # free: view_34
view_35: f32[64] = aten.view(sum_5, [64])  # free: sum_5
t_29: f32[64, 16] = aten.t(t_28)  # free: t_28
view_36: f32[2, 8, 16] = aten.view(mm_12, [2, 8, 16])  # free: mm_12
native_layer_norm_backward_3: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_36, add_1, [16], getitem_3, getitem_4, unshard_2, unshard_3, [True, True, True])  # free: view_36, add_1, getitem_3, getitem_4, unshard_2, unshard_3
getitem_25: f32[2, 8, 16] = native_layer_norm_backward_3[0]
getitem_26: f32[16] = native_layer_norm_backward_3[1]
getitem_27: f32[16] = native_layer_norm_backward_3[2]  # free: native_layer_norm_backward_3
add_7: f32[2, 8, 16] = aten.add.Tensor(add_6, getitem_25)  # free: add_6, getitem_25
view_37: f32[16, 16] = aten.view(add_7, [16, 16])
mm_14: f32[16, 16] = aten.mm(view_37, t_7)  # free: t_7
t_30: f32[16, 16] = aten.t(view_37)
mm_15: f32[16, 16] = aten.mm(t_30, view_1)  # free: t_30, view_1
t_31: f32[16, 16] = aten.t(mm_15)  # free: mm_15
sum_6: f32[1, 16] = aten.sum.dim_IntList(view_37, [0], True)  # free: view_37
view_38: f32[16] = aten.view(sum_6, [16])  # free: sum_6
t_32: f32[16, 16] = aten.t(t_31)  # free: t_31
view_39: f32[2, 8, 16] = aten.view(mm_14, [2, 8, 16])  # free: mm_14
view_40: f32[2, 8, 2, 8] = aten.view(view_39, [2, 8, 2, 8])  # free: view_39
transpose_10: f32[2, 2, 8, 8] = aten.transpose.int(view_40, 1, 2)  # free: view_40
_scaled_dot_product_flash_attention_for_cpu_backward_1: (f32[2, 2, 8, 8], f32[2, 2, 8, 8], f32[2, 2, 8, 8]) = aten._scaled_dot_product_flash_attention_for_cpu_backward(transpose_10, transpose, transpose_1, transpose_2, detach_1, getitem_2, 0.0, True)  # free: transpose_10, transpose, transpose_1, transpose_2, detach_1, getitem_2
getitem_28: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[0]
getitem_29: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[1]
getitem_30: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[2]  # free: _scaled_dot_product_flash_attention_for_cpu_backward_1
transpose_11: f32[2, 8, 2, 8] = aten.transpose.int(getitem_30, 1, 2)  # free: getitem_30
view_41: f32[2, 8, 16] = aten.view(transpose_11, [2, 8, 16])  # free: transpose_11
transpose_12: f32[2, 8, 2, 8] = aten.transpose.int(getitem_29, 1, 2)  # free: getitem_29
view_42: f32[2, 8, 16] = aten.view(transpose_12, [2, 8, 16])  # free: transpose_12
transpose_13: f32[2, 8, 2, 8] = aten.transpose.int(getitem_28, 1, 2)  # free: getitem_28
view_43: f32[2, 8, 16] = aten.view(transpose_13, [2, 8, 16])  # free: transpose_13
cat_1: f32[2, 8, 48] = aten.cat([view_43, view_42, view_41], 2)  # free: view_43, view_42, view_41
view_44: f32[16, 48] = aten.view(cat_1, [16, 48])  # free: cat_1
mm_16: f32[16, 16] = aten.mm(view_44, t_8)  # free: t_8
t_33: f32[48, 16] = aten.t(view_44)
mm_17: f32[48, 16] = aten.mm(t_33, view)  # free: t_33, view
t_34: f32[16, 48] = aten.t(mm_17)  # free: mm_17
sum_7: f32[1, 48] = aten.sum.dim_IntList(view_44, [0], True)  # free: view_44
view_45: f32[48] = aten.view(sum_7, [48])  # free: sum_7
t_35: f32[48, 16] = aten.t(t_34)  # free: t_34
view_46: f32[2, 8, 16] = aten.view(mm_16, [2, 8, 16])  # free: mm_16
native_layer_norm_backward_4: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_46, add, [16], getitem, getitem_1, unshard, unshard_1, [True, True, True])  # free: view_46, add, getitem, getitem_1, unshard, unshard_1
getitem_31: f32[2, 8, 16] = native_layer_norm_backward_4[0]
getitem_32: f32[16] = native_layer_norm_backward_4[1]
getitem_33: f32[16] = native_layer_norm_backward_4[2]  # free: native_layer_norm_backward_4
add_8: f32[2, 8, 16] = aten.add.Tensor(add_7, getitem_31)  # free: add_7, getitem_31
sum_8: f32[1, 8, 16] = aten.sum.dim_IntList(add_8, [0], True)
view_47: f32[8, 16] = aten.view(sum_8, [8, 16])  # free: sum_8
embedding_dense_backward: f32[8, 16] = aten.embedding_dense_backward(view_47, arange, 8, -1, False)  # free: view_47, arange
embedding_dense_backward_1: f32[32, 16] = aten.embedding_dense_backward(add_8, primals_1, 32, -1, False)  # free: add_8, primals_1
add_9: f32[32, 16] = aten.add.Tensor(t_11, embedding_dense_backward_1)  # free: t_11, embedding_dense_backward_1
pack: f32[7232] = zerocompile.pack([getitem_15, getitem_14, view_14, t_14, view_18, t_17, getitem_18, getitem_17, view_21, t_20, view_28, t_23, getitem_24, getitem_23, view_31, t_26, view_35, t_29, getitem_27, getitem_26, view_38, t_32, view_45, t_35, getitem_33, getitem_32, embedding_dense_backward, add_9], 4, [4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 32, 128])  # free: getitem_15, getitem_14, view_14, t_14, view_18, t_17, getitem_18, getitem_17, view_21, t_20, view_28, t_23, getitem_24, getitem_23, view_31, t_26, view_35, t_29, getitem_27, getitem_26, view_38, t_32, view_45, t_35, getitem_33, getitem_32, embedding_dense_backward, add_9
reduce_scatter_tensor: f32[1808] = _c10d_functional.reduce_scatter_tensor(pack, 'avg', 4, WORLD)  # param: ln_f.bias, ln_f.weight, blocks.1.out.bias, blocks.1.out.weight, blocks.1.fc.bias, blocks.1.fc.weight, blocks.1.ln2.bias, blocks.1.ln2.weight, blocks.1.attn.proj.bias, blocks.1.attn.proj.weight, blocks.1.attn.qkv.bias, blocks.1.attn.qkv.weight, blocks.1.ln1.bias, blocks.1.ln1.weight, blocks.0.out.bias, blocks.0.out.weight, blocks.0.fc.bias, blocks.0.fc.weight, blocks.0.ln2.bias, blocks.0.ln2.weight, blocks.0.attn.proj.bias, blocks.0.attn.proj.weight, blocks.0.attn.qkv.bias, blocks.0.attn.qkv.weight, blocks.0.ln1.bias, blocks.0.ln1.weight, wpe.weight, wte.weight; free: pack
wait_tensor: f32[1808] = _c10d_functional.wait_tensor(reduce_scatter_tensor)  # free: reduce_scatter_tensor
split_with_sizes: (f32[4], f32[4], f32[4], f32[256], f32[16], f32[256], f32[4], f32[4], f32[4], f32[64], f32[12], f32[192], f32[4], f32[4], f32[4], f32[256], f32[16], f32[256], f32[4], f32[4], f32[4], f32[64], f32[12], f32[192], f32[4], f32[4], f32[32], f32[128]) = aten.split_with_sizes(wait_tensor, [4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 32, 128])  # free: wait_tensor
getitem_34: f32[4] = split_with_sizes[0]
getitem_35: f32[4] = split_with_sizes[1]
getitem_36: f32[4] = split_with_sizes[2]
getitem_37: f32[256] = split_with_sizes[3]
getitem_38: f32[16] = split_with_sizes[4]
getitem_39: f32[256] = split_with_sizes[5]
getitem_40: f32[4] = split_with_sizes[6]
getitem_41: f32[4] = split_with_sizes[7]
getitem_42: f32[4] = split_with_sizes[8]
getitem_43: f32[64] = split_with_sizes[9]
getitem_44: f32[12] = split_with_sizes[10]
getitem_45: f32[192] = split_with_sizes[11]
getitem_46: f32[4] = split_with_sizes[12]
getitem_47: f32[4] = split_with_sizes[13]
getitem_48: f32[4] = split_with_sizes[14]
getitem_49: f32[256] = split_with_sizes[15]
getitem_50: f32[16] = split_with_sizes[16]
getitem_51: f32[256] = split_with_sizes[17]
getitem_52: f32[4] = split_with_sizes[18]
getitem_53: f32[4] = split_with_sizes[19]
getitem_54: f32[4] = split_with_sizes[20]
getitem_55: f32[64] = split_with_sizes[21]
getitem_56: f32[12] = split_with_sizes[22]
getitem_57: f32[192] = split_with_sizes[23]
getitem_58: f32[4] = split_with_sizes[24]
getitem_59: f32[4] = split_with_sizes[25]
getitem_60: f32[32] = split_with_sizes[26]
getitem_61: f32[128] = split_with_sizes[27]  # free: split_with_sizes
return (None, getitem_61, getitem_60, getitem_59, getitem_58, getitem_57, getitem_56, getitem_55, getitem_54, getitem_53, getitem_52, getitem_51, getitem_50, getitem_49, getitem_48, getitem_47, getitem_46, getitem_45, getitem_44, getitem_43, getitem_42, getitem_41, getitem_40, getitem_39, getitem_38, getitem_37, getitem_36, getitem_35, getitem_34, None)""")

    def test_stage_3(self) -> None:
        forward, backward = gpt_graphs(3)
        self.assertExpectedInline(forward, """\
input primals_1: i64[2, 8]
input primals_2: f32[128]
input primals_3: f32[32]
input primals_4: f32[4]
input primals_5: f32[4]
input primals_6: f32[192]
input primals_7: f32[12]
input primals_8: f32[64]
input primals_9: f32[4]
input primals_10: f32[4]
input primals_11: f32[4]
input primals_12: f32[256]
input primals_13: f32[16]
input primals_14: f32[256]
input primals_15: f32[4]
input primals_16: f32[4]
input primals_17: f32[4]
input primals_18: f32[192]
input primals_19: f32[12]
input primals_20: f32[64]
input primals_21: f32[4]
input primals_22: f32[4]
input primals_23: f32[4]
input primals_24: f32[256]
input primals_25: f32[16]
input primals_26: f32[256]
input primals_27: f32[4]
input primals_28: f32[4]
input primals_29: f32[4]
input primals_30: i64[2, 8]
pack: f32[1808] = zerocompile.pack([primals_2, primals_3, primals_4, primals_5, primals_6, primals_7, primals_8, primals_9, primals_10, primals_11, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, primals_21, primals_22, primals_23, primals_24, primals_25, primals_26, primals_27, primals_28, primals_29], 1, [128, 32, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4])  # free: primals_3, primals_7, primals_9, primals_13, primals_15, primals_19, primals_21, primals_25, primals_27
all_gather_into_tensor: f32[7232] = _c10d_functional.all_gather_into_tensor(pack, 4, WORLD)  # param: wte.weight, wpe.weight, blocks.0.ln1.weight, blocks.0.ln1.bias, blocks.0.attn.qkv.weight, blocks.0.attn.qkv.bias, blocks.0.attn.proj.weight, blocks.0.attn.proj.bias, blocks.0.ln2.weight, blocks.0.ln2.bias, blocks.0.fc.weight, blocks.0.fc.bias, blocks.0.out.weight, blocks.0.out.bias, blocks.1.ln1.weight, blocks.1.ln1.bias, blocks.1.attn.qkv.weight, blocks.1.attn.qkv.bias, blocks.1.attn.proj.weight, blocks.1.attn.proj.bias, blocks.1.ln2.weight, blocks.1.ln2.bias, blocks.1.fc.weight, blocks.1.fc.bias, blocks.1.out.weight, blocks.1.out.bias, ln_f.weight, ln_f.bias; free: pack
wait_tensor: f32[7232] = _c10d_functional.wait_tensor(all_gather_into_tensor)  # free: all_gather_into_tensor
unpack: (f32[512], f32[128], f32[16], f32[16], f32[768], f32[48], f32[256], f32[16], f32[16], f32[16], f32[1024], f32[64], f32[1024], f32[16], f32[16], f32[16], f32[768], f32[48], f32[256], f32[16], f32[16], f32[16], f32[1024], f32[64], f32[1024], f32[16], f32[16], f32[16]) = zerocompile.unpack(wait_tensor, 4, [128, 32, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4, 192, 12, 64, 4, 4, 4, 256, 16, 256, 4, 4, 4])  # free: wait_tensor
getitem: f32[512] = unpack[0]
getitem_1: f32[128] = unpack[1]
getitem_2: f32[16] = unpack[2]
getitem_3: f32[16] = unpack[3]
getitem_4: f32[768] = unpack[4]
getitem_5: f32[48] = unpack[5]
getitem_6: f32[256] = unpack[6]
getitem_7: f32[16] = unpack[7]
getitem_8: f32[16] = unpack[8]
getitem_9: f32[16] = unpack[9]
getitem_10: f32[1024] = unpack[10]
getitem_11: f32[64] = unpack[11]
getitem_12: f32[1024] = unpack[12]
getitem_13: f32[16] = unpack[13]
getitem_14: f32[16] = unpack[14]
getitem_15: f32[16] = unpack[15]
getitem_16: f32[768] = unpack[16]
getitem_17: f32[48] = unpack[17]
getitem_18: f32[256] = unpack[18]
getitem_19: f32[16] = unpack[19]
getitem_20: f32[16] = unpack[20]
getitem_21: f32[16] = unpack[21]
getitem_22: f32[1024] = unpack[22]
getitem_23: f32[64] = unpack[23]
getitem_24: f32[1024] = unpack[24]
getitem_25: f32[16] = unpack[25]
getitem_26: f32[16] = unpack[26]
getitem_27: f32[16] = unpack[27]  # free: unpack
view: f32[32, 16] = aten.view(getitem, [32, 16])  # free: getitem
view_1: f32[8, 16] = aten.view(getitem_1, [8, 16])  # free: getitem_1
view_2: f32[16] = aten.view(getitem_2, [16])  # free: getitem_2
view_3: f32[16] = aten.view(getitem_3, [16])  # free: getitem_3
view_4: f32[48, 16] = aten.view(getitem_4, [48, 16])  # free: getitem_4
view_5: f32[48] = aten.view(getitem_5, [48])  # free: getitem_5
view_6: f32[16, 16] = aten.view(getitem_6, [16, 16])  # free: getitem_6
view_7: f32[16] = aten.view(getitem_7, [16])  # free: getitem_7
view_8: f32[16] = aten.view(getitem_8, [16])  # free: getitem_8
view_9: f32[16] = aten.view(getitem_9, [16])  # free: getitem_9
view_10: f32[64, 16] = aten.view(getitem_10, [64, 16])  # free: getitem_10
view_11: f32[64] = aten.view(getitem_11, [64])  # free: getitem_11
view_12: f32[16, 64] = aten.view(getitem_12, [16, 64])  # free: getitem_12
view_13: f32[16] = aten.view(getitem_13, [16])  # free: getitem_13
view_14: f32[16] = aten.view(getitem_14, [16])  # free: getitem_14
view_15: f32[16] = aten.view(getitem_15, [16])  # free: getitem_15
view_16: f32[48, 16] = aten.view(getitem_16, [48, 16])  # free: getitem_16
view_17: f32[48] = aten.view(getitem_17, [48])  # free: getitem_17
view_18: f32[16, 16] = aten.view(getitem_18, [16, 16])  # free: getitem_18
view_19: f32[16] = aten.view(getitem_19, [16])  # free: getitem_19
view_20: f32[16] = aten.view(getitem_20, [16])  # free: getitem_20
view_21: f32[16] = aten.view(getitem_21, [16])  # free: getitem_21
view_22: f32[64, 16] = aten.view(getitem_22, [64, 16])  # free: getitem_22
view_23: f32[64] = aten.view(getitem_23, [64])  # free: getitem_23
view_24: f32[16, 64] = aten.view(getitem_24, [16, 64])  # free: getitem_24
view_25: f32[16] = aten.view(getitem_25, [16])  # free: getitem_25
view_26: f32[16] = aten.view(getitem_26, [16])  # free: getitem_26
view_27: f32[16] = aten.view(getitem_27, [16])  # free: getitem_27
arange: i64[8] = aten.arange(8, device = device(type='cpu'), pin_memory = False)
embedding: f32[2, 8, 16] = aten.embedding(view, primals_1)
embedding_1: f32[8, 16] = aten.embedding(view_1, arange)  # free: view_1
add: f32[2, 8, 16] = aten.add.Tensor(embedding, embedding_1)  # free: embedding, embedding_1
native_layer_norm: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add, [16], view_2, view_3, 1e-05)  # free: view_2, view_3
getitem_28: f32[2, 8, 16] = native_layer_norm[0]
getitem_29: f32[2, 8, 1] = native_layer_norm[1]
getitem_30: f32[2, 8, 1] = native_layer_norm[2]  # free: native_layer_norm
view_28: f32[16, 16] = aten.view(getitem_28, [16, 16])  # free: getitem_28
t: f32[16, 48] = aten.t(view_4)  # free: view_4
addmm: f32[16, 48] = aten.addmm(view_5, view_28, t)  # free: view_5, t
view_29: f32[2, 8, 48] = aten.view(addmm, [2, 8, 48])  # free: addmm
split: (f32[2, 8, 16], f32[2, 8, 16], f32[2, 8, 16]) = aten.split.Tensor(view_29, 16, 2)  # free: view_29
getitem_31: f32[2, 8, 16] = split[0]
getitem_32: f32[2, 8, 16] = split[1]
getitem_33: f32[2, 8, 16] = split[2]  # free: split
view_30: f32[2, 8, 2, 8] = aten.view(getitem_31, [2, 8, 2, 8])  # free: getitem_31
transpose: f32[2, 2, 8, 8] = aten.transpose.int(view_30, 1, 2)  # free: view_30
view_31: f32[2, 8, 2, 8] = aten.view(getitem_32, [2, 8, 2, 8])  # free: getitem_32
transpose_1: f32[2, 2, 8, 8] = aten.transpose.int(view_31, 1, 2)  # free: view_31
view_32: f32[2, 8, 2, 8] = aten.view(getitem_33, [2, 8, 2, 8])  # free: getitem_33
transpose_2: f32[2, 2, 8, 8] = aten.transpose.int(view_32, 1, 2)  # free: view_32
_scaled_dot_product_flash_attention_for_cpu: (f32[2, 2, 8, 8], f32[2, 2, 8]) = aten._scaled_dot_product_flash_attention_for_cpu(transpose, transpose_1, transpose_2, 0.0, True)
getitem_34: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu[0]
getitem_35: f32[2, 2, 8] = _scaled_dot_product_flash_attention_for_cpu[1]  # free: _scaled_dot_product_flash_attention_for_cpu
detach: f32[2, 2, 8, 8] = aten.detach(getitem_34)
transpose_3: f32[2, 8, 2, 8] = aten.transpose.int(getitem_34, 1, 2)  # free: getitem_34
view_33: f32[2, 8, 16] = aten.view(transpose_3, [2, 8, 16])  # free: transpose_3
view_34: f32[16, 16] = aten.view(view_33, [16, 16])  # free: view_33
t_1: f32[16, 16] = aten.t(view_6)  # free: view_6
addmm_1: f32[16, 16] = aten.addmm(view_7, view_34, t_1)  # free: view_7, t_1
view_35: f32[2, 8, 16] = aten.view(addmm_1, [2, 8, 16])  # free: addmm_1
add_1: f32[2, 8, 16] = aten.add.Tensor(add, view_35)  # free: view_35
native_layer_norm_1: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_1, [16], view_8, view_9, 1e-05)  # free: view_8, view_9
getitem_36: f32[2, 8, 16] = native_layer_norm_1[0]
getitem_37: f32[2, 8, 1] = native_layer_norm_1[1]
getitem_38: f32[2, 8, 1] = native_layer_norm_1[2]  # free: native_layer_norm_1
view_36: f32[16, 16] = aten.view(getitem_36, [16, 16])  # free: getitem_36
t_2: f32[16, 64] = aten.t(view_10)  # free: view_10
addmm_2: f32[16, 64] = aten.addmm(view_11, view_36, t_2)  # free: view_11, t_2
view_37: f32[2, 8, 64] = aten.view(addmm_2, [2, 8, 64])
gelu: f32[2, 8, 64] = aten.gelu(view_37)  # free: view_37
view_38: f32[16, 64] = aten.view(gelu, [16, 64])  # free: gelu
t_3: f32[64, 16] = aten.t(view_12)  # free: view_12
addmm_3: f32[16, 16] = aten.addmm(view_13, view_38, t_3)  # free: view_13, t_3
view_39: f32[2, 8, 16] = aten.view(addmm_3, [2, 8, 16])  # free: addmm_3
add_2: f32[2, 8, 16] = aten.add.Tensor(add_1, view_39)  # free: view_39
native_layer_norm_2: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_2, [16], view_14, view_15, 1e-05)  # free: view_14, view_15
getitem_39: f32[2, 8, 16] = native_layer_norm_2[0]
getitem_40: f32[2, 8, 1] = native_layer_norm_2[1]
getitem_41: f32[2, 8, 1] = native_layer_norm_2[2]  # free: native_layer_norm_2
view_40: f32[16, 16] = aten.view(getitem_39, [16, 16])  # free: getitem_39
t_4: f32[16, 48] = aten.t(view_16)  # free: view_16
addmm_4: f32[16, 48] = aten.addmm(view_17, view_40, t_4)  # free: view_17, t_4
view_41: f32[2, 8, 48] = aten.view(addmm_4, [2, 8, 48])  # free: addmm_4
split_1: (f32[2, 8, 16], f32[2, 8, 16], f32[2, 8, 16]) = aten.split.Tensor(view_41, 16, 2)  # free: view_41
getitem_42: f32[2, 8, 16] = split_1[0]
getitem_43: f32[2, 8, 16] = split_1[1]
getitem_44: f32[2, 8, 16] = split_1[2]  # free: split_1
view_42: f32[2, 8, 2, 8] = aten.view(getitem_42, [2, 8, 2, 8])  # free: getitem_42
transpose_4: f32[2, 2, 8, 8] = aten.transpose.int(view_42, 1, 2)  # free: view_42
view_43: f32[2, 8, 2, 8] = aten.view(getitem_43, [2, 8, 2, 8])  # free: getitem_43
transpose_5: f32[2, 2, 8, 8] = aten.transpose.int(view_43, 1, 2)  # free: view_43
view_44: f32[2, 8, 2, 8] = aten.view(getitem_44, [2, 8, 2, 8])  # free: getitem_44
transpose_6: f32[2, 2, 8, 8] = aten.transpose.int(view_44, 1, 2)  # free: view_44
_scaled_dot_product_flash_attention_for_cpu_1: (f32[2, 2, 8, 8], f32[2, 2, 8]) = aten._scaled_dot_product_flash_attention_for_cpu(transpose_4, transpose_5, transpose_6, 0.0, True)
getitem_45: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_1[0]
getitem_46: f32[2, 2, 8] = _scaled_dot_product_flash_attention_for_cpu_1[1]  # free: _scaled_dot_product_flash_attention_for_cpu_1
detach_1: f32[2, 2, 8, 8] = aten.detach(getitem_45)
transpose_7: f32[2, 8, 2, 8] = aten.transpose.int(getitem_45, 1, 2)  # free: getitem_45
view_45: f32[2, 8, 16] = aten.view(transpose_7, [2, 8, 16])  # free: transpose_7
view_46: f32[16, 16] = aten.view(view_45, [16, 16])  # free: view_45
t_5: f32[16, 16] = aten.t(view_18)  # free: view_18
addmm_5: f32[16, 16] = aten.addmm(view_19, view_46, t_5)  # free: view_19, t_5
view_47: f32[2, 8, 16] = aten.view(addmm_5, [2, 8, 16])  # free: addmm_5
add_3: f32[2, 8, 16] = aten.add.Tensor(add_2, view_47)  # free: view_47
native_layer_norm_3: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_3, [16], view_20, view_21, 1e-05)  # free: view_20, view_21
getitem_47: f32[2, 8, 16] = native_layer_norm_3[0]
getitem_48: f32[2, 8, 1] = native_layer_norm_3[1]
getitem_49: f32[2, 8, 1] = native_layer_norm_3[2]  # free: native_layer_norm_3
view_48: f32[16, 16] = aten.view(getitem_47, [16, 16])  # free: getitem_47
t_6: f32[16, 64] = aten.t(view_22)  # free: view_22
addmm_6: f32[16, 64] = aten.addmm(view_23, view_48, t_6)  # free: view_23, t_6
view_49: f32[2, 8, 64] = aten.view(addmm_6, [2, 8, 64])
gelu_1: f32[2, 8, 64] = aten.gelu(view_49)  # free: view_49
view_50: f32[16, 64] = aten.view(gelu_1, [16, 64])  # free: gelu_1
t_7: f32[64, 16] = aten.t(view_24)  # free: view_24
addmm_7: f32[16, 16] = aten.addmm(view_25, view_50, t_7)  # free: view_25, t_7
view_51: f32[2, 8, 16] = aten.view(addmm_7, [2, 8, 16])  # free: addmm_7
add_4: f32[2, 8, 16] = aten.add.Tensor(add_3, view_51)  # free: view_51
native_layer_norm_4: (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1]) = aten.native_layer_norm(add_4, [16], view_26, view_27, 1e-05)  # free: view_26, view_27
getitem_50: f32[2, 8, 16] = native_layer_norm_4[0]
getitem_51: f32[2, 8, 1] = native_layer_norm_4[1]
getitem_52: f32[2, 8, 1] = native_layer_norm_4[2]  # free: native_layer_norm_4
t_8: f32[16, 32] = aten.t(view)  # free: view
view_52: f32[16, 16] = aten.view(getitem_50, [16, 16])  # free: getitem_50
mm: f32[16, 32] = aten.mm(view_52, t_8)  # free: t_8
view_53: f32[2, 8, 32] = aten.view(mm, [2, 8, 32])  # free: mm
view_54: f32[16, 32] = aten.view(view_53, [-1, 32])  # free: view_53
view_55: i64[16] = aten.view(primals_30, [-1])  # free: primals_30
_log_softmax: f32[16, 32] = aten._log_softmax(view_54, 1, False)  # free: view_54
nll_loss_forward: (f32[], f32[]) = aten.nll_loss_forward(_log_softmax, view_55, None, 1, -100)
getitem_53: f32[] = nll_loss_forward[0]
getitem_54: f32[] = nll_loss_forward[1]  # free: nll_loss_forward
detach_2: f32[2, 2, 8, 8] = aten.detach(detach_1)  # free: detach_1
detach_3: f32[2, 2, 8, 8] = aten.detach(detach)  # free: detach
return (getitem_53, primals_1, primals_2, primals_4, primals_5, primals_6, primals_8, primals_10, primals_11, primals_12, primals_14, primals_16, primals_17, primals_18, primals_20, primals_22, primals_23, primals_24, primals_26, primals_28, primals_29, arange, add, getitem_29, getitem_30, view_28, transpose, transpose_1, transpose_2, getitem_35, view_34, add_1, getitem_37, getitem_38, view_36, addmm_2, view_38, add_2, getitem_40, getitem_41, view_40, transpose_4, transpose_5, transpose_6, getitem_46, view_46, add_3, getitem_48, getitem_49, view_48, addmm_6, view_50, add_4, getitem_51, getitem_52, view_52, view_55, _log_softmax, getitem_54, detach_2, detach_3)""")
        self.assertExpectedInline(backward, """\
input primals_1: i64[2, 8]
input primals_2: f32[128]
input primals_4: f32[4]
input primals_5: f32[4]
input primals_6: f32[192]
input primals_8: f32[64]
input primals_10: f32[4]
input primals_11: f32[4]
input primals_12: f32[256]
input primals_14: f32[256]
input primals_16: f32[4]
input primals_17: f32[4]
input primals_18: f32[192]
input primals_20: f32[64]
input primals_22: f32[4]
input primals_23: f32[4]
input primals_24: f32[256]
input primals_26: f32[256]
input primals_28: f32[4]
input primals_29: f32[4]
input arange: i64[8]
input add: f32[2, 8, 16]
input getitem: f32[2, 8, 1]
input getitem_1: f32[2, 8, 1]
input view: f32[16, 16]
input transpose: f32[2, 2, 8, 8]
input transpose_1: f32[2, 2, 8, 8]
input transpose_2: f32[2, 2, 8, 8]
input getitem_2: f32[2, 2, 8]
input view_1: f32[16, 16]
input add_1: f32[2, 8, 16]
input getitem_3: f32[2, 8, 1]
input getitem_4: f32[2, 8, 1]
input view_2: f32[16, 16]
input addmm: f32[16, 64]
input view_3: f32[16, 64]
input add_2: f32[2, 8, 16]
input getitem_5: f32[2, 8, 1]
input getitem_6: f32[2, 8, 1]
input view_4: f32[16, 16]
input transpose_3: f32[2, 2, 8, 8]
input transpose_4: f32[2, 2, 8, 8]
input transpose_5: f32[2, 2, 8, 8]
input getitem_7: f32[2, 2, 8]
input view_5: f32[16, 16]
input add_3: f32[2, 8, 16]
input getitem_8: f32[2, 8, 1]
input getitem_9: f32[2, 8, 1]
input view_6: f32[16, 16]
input addmm_1: f32[16, 64]
input view_7: f32[16, 64]
input add_4: f32[2, 8, 16]
input getitem_10: f32[2, 8, 1]
input getitem_11: f32[2, 8, 1]
input view_8: f32[16, 16]
input view_9: i64[16]
input _log_softmax: f32[16, 32]
input getitem_12: f32[]
input detach: f32[2, 2, 8, 8]
input detach_1: f32[2, 2, 8, 8]
input tangents_1: f32[]
nll_loss_backward: f32[16, 32] = aten.nll_loss_backward(tangents_1, _log_softmax, view_9, None, 1, -100, getitem_12)  # free: tangents_1, view_9, getitem_12
detach_2: f32[16, 32] = aten.detach(_log_softmax)  # free: _log_softmax
detach_3: f32[16, 32] = aten.detach(detach_2)  # free: detach_2
_log_softmax_backward_data: f32[16, 32] = aten._log_softmax_backward_data(nll_loss_backward, detach_3, 1, torch.float32)  # free: nll_loss_backward, detach_3
view_10: f32[2, 8, 32] = aten.view(_log_softmax_backward_data, [2, 8, 32])  # free: _log_softmax_backward_data
view_11: f32[16, 32] = aten.view(view_10, [16, 32])  # free: view_10
t: f32[32, 16] = aten.t(view_11)
mm: f32[32, 16] = aten.mm(t, view_8)  # free: t, view_8
pack: f32[1704] = zerocompile.pack([primals_2, primals_28, primals_29, primals_26, primals_24, primals_22, primals_23, primals_20, primals_18, primals_16, primals_17, primals_14, primals_12, primals_10, primals_11, primals_8, primals_6, primals_4, primals_5], 1, [128, 4, 4, 256, 256, 4, 4, 64, 192, 4, 4, 256, 256, 4, 4, 64, 192, 4, 4])  # free: primals_2, primals_28, primals_29, primals_26, primals_24, primals_22, primals_23, primals_20, primals_18, primals_16, primals_17, primals_14, primals_12, primals_10, primals_11, primals_8, primals_6, primals_4, primals_5
all_gather_into_tensor: f32[6816] = _c10d_functional.all_gather_into_tensor(pack, 4, WORLD)  # param: wte.weight, ln_f.weight, ln_f.bias, blocks.1.out.weight, blocks.1.fc.weight, blocks.1.ln2.weight, blocks.1.ln2.bias, blocks.1.attn.proj.weight, blocks.1.attn.qkv.weight, blocks.1.ln1.weight, blocks.1.ln1.bias, blocks.0.out.weight, blocks.0.fc.weight, blocks.0.ln2.weight, blocks.0.ln2.bias, blocks.0.attn.proj.weight, blocks.0.attn.qkv.weight, blocks.0.ln1.weight, blocks.0.ln1.bias; free: pack
wait_tensor: f32[6816] = _c10d_functional.wait_tensor(all_gather_into_tensor)  # free: all_gather_into_tensor
unpack: (f32[512], f32[16], f32[16], f32[1024], f32[1024], f32[16], f32[16], f32[256], f32[768], f32[16], f32[16], f32[1024], f32[1024], f32[16], f32[16], f32[256], f32[768], f32[16], f32[16]) = zerocompile.unpack(wait_tensor, 4, [128, 4, 4, 256, 256, 4, 4, 64, 192, 4, 4, 256, 256, 4, 4, 64, 192, 4, 4])  # free: wait_tensor
getitem_13: f32[512] = unpack[0]
getitem_14: f32[16] = unpack[1]
getitem_15: f32[16] = unpack[2]
getitem_16: f32[1024] = unpack[3]
getitem_17: f32[1024] = unpack[4]
getitem_18: f32[16] = unpack[5]
getitem_19: f32[16] = unpack[6]
getitem_20: f32[256] = unpack[7]
getitem_21: f32[768] = unpack[8]
getitem_22: f32[16] = unpack[9]
getitem_23: f32[16] = unpack[10]
getitem_24: f32[1024] = unpack[11]
getitem_25: f32[1024] = unpack[12]
getitem_26: f32[16] = unpack[13]
getitem_27: f32[16] = unpack[14]
getitem_28: f32[256] = unpack[15]
getitem_29: f32[768] = unpack[16]
getitem_30: f32[16] = unpack[17]
getitem_31: f32[16] = unpack[18]  # free: unpack
view_12: f32[32, 16] = aten.view(getitem_13, [32, 16])  # free: getitem_13
view_13: f32[16] = aten.view(getitem_14, [16])  # free: getitem_14
view_14: f32[16] = aten.view(getitem_15, [16])  # free: getitem_15
view_15: f32[16, 64] = aten.view(getitem_16, [16, 64])  # free: getitem_16
view_16: f32[64, 16] = aten.view(getitem_17, [64, 16])  # free: getitem_17
view_17: f32[16] = aten.view(getitem_18, [16])  # free: getitem_18
view_18: f32[16] = aten.view(getitem_19, [16])  # free: getitem_19
view_19: f32[16, 16] = aten.view(getitem_20, [16, 16])  # free: getitem_20
view_20: f32[48, 16] = aten.view(getitem_21, [48, 16])  # free: getitem_21
view_21: f32[16] = aten.view(getitem_22, [16])  # free: getitem_22
view_22: f32[16] = aten.view(getitem_23, [16])  # free: getitem_23
view_23: f32[16, 64] = aten.view(getitem_24, [16, 64])  # free: getitem_24
view_24: f32[64, 16] = aten.view(getitem_25, [64, 16])  # free: getitem_25
view_25: f32[16] = aten.view(getitem_26, [16])  # free: getitem_26
view_26: f32[16] = aten.view(getitem_27, [16])  # free: getitem_27
view_27: f32[16, 16] = aten.view(getitem_28, [16, 16])  # free: getitem_28
view_28: f32[48, 16] = aten.view(getitem_29, [48, 16])  # free: getitem_29
view_29: f32[16] = aten.view(getitem_30, [16])  # free: getitem_30
view_30: f32[16] = aten.view(getitem_31, [16])  # free: getitem_31
t_1: f32[16, 32] = aten.t(mm)  # free: mm
t_2: f32[16, 32] = aten.t(view_12)  # free: view_12
t_3: f32[32, 16] = aten.t(t_2)  # free: t_2
mm_1: f32[16, 16] = aten.mm(view_11, t_3)  # free: view_11, t_3
view_31: f32[2, 8, 16] = aten.view(mm_1, [2, 8, 16])  # free: mm_1
t_4: f32[32, 16] = aten.t(t_1)  # free: t_1
native_layer_norm_backward: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_31, add_4, [16], getitem_10, getitem_11, view_13, view_14, [True, True, True])  # free: view_31, add_4, getitem_10, getitem_11, view_13, view_14
getitem_32: f32[2, 8, 16] = native_layer_norm_backward[0]
getitem_33: f32[16] = native_layer_norm_backward[1]
getitem_34: f32[16] = native_layer_norm_backward[2]  # free: native_layer_norm_backward
view_32: f32[16, 16] = aten.view(getitem_32, [16, 16])
t_5: f32[64, 16] = aten.t(view_15)  # free: view_15
t_6: f32[16, 64] = aten.t(t_5)  # free: t_5
mm_2: f32[16, 64] = aten.mm(view_32, t_6)  # free: t_6
t_7: f32[16, 16] = aten.t(view_32)
mm_3: f32[16, 64] = aten.mm(t_7, view_7)  # free: t_7, view_7
t_8: f32[64, 16] = aten.t(mm_3)  # free: mm_3
sum: f32[1, 16] = aten.sum.dim_IntList(view_32, [0], True)  # free: view_32
view_33: f32[16] = aten.view(sum, [16])  # free: sum
t_9: f32[16, 64] = aten.t(t_8)  # free: t_8
view_34: f32[2, 8, 64] = aten.view(mm_2, [2, 8, 64])  # free: mm_2
view_35: f32[2, 8, 64] = aten.view(addmm_1, [2, 8, 64])  # free: addmm_1
gelu_backward: f32[2, 8, 64] = aten.gelu_backward(view_34, view_35)  # free: view_34, view_35
view_36: f32[16, 64] = aten.view(gelu_backward, [16, 64])  # free: gelu_backward
t_10: f32[16, 64] = aten.t(view_16)  # free: view_16
t_11: f32[64, 16] = aten.t(t_10)  # free: t_10
mm_4: f32[16, 16] = aten.mm(view_36, t_11)  # free: t_11
t_12: f32[64, 16] = aten.t(view_36)
mm_5: f32[64, 16] = aten.mm(t_12, view_6)  # free: t_12, view_6
t_13: f32[16, 64] = aten.t(mm_5)  # free: mm_5
sum_1: f32[1, 64] = aten.sum.dim_IntList(view_36, [0], True)  # free: view_36
view_37: f32[64] = aten.view(sum_1, [64])  # free: sum_1
t_14: f32[64, 16] = aten.t(t_13)  # free: t_13
view_38: f32[2, 8, 16] = aten.view(mm_4, [2, 8, 16])  # free: mm_4
native_layer_norm_backward_1: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_38, add_3, [16], getitem_8, getitem_9, view_17, view_18, [True, True, True])  # free: view_38, add_3, getitem_8, getitem_9, view_17, view_18
getitem_35: f32[2, 8, 16] = native_layer_norm_backward_1[0]
getitem_36: f32[16] = native_layer_norm_backward_1[1]
getitem_37: f32[16] = native_layer_norm_backward_1[2]  # free: native_layer_norm_backward_1
add_5: f32[2, 8, 16] = aten.add.Tensor(getitem_32, getitem_35)  # free: getitem_32, getitem_35
view_39: f32[16, 16] = aten.view(add_5, [16, 16])
t_15: f32[16, 16] = aten.t(view_19)  # free: view_19
t_16: f32[16, 16] = aten.t(t_15)  # free: t_15
mm_6: f32[16, 16] = aten.mm(view_39, t_16)  # free: t_16
t_17: f32[16, 16] = aten.t(view_39)
mm_7: f32[16, 16] = aten.mm(t_17, view_5)  # free: t_17, view_5
t_18: f32[16, 16] = aten.t(mm_7)  # free: mm_7
sum_2: f32[1, 16] = aten.sum.dim_IntList(view_39, [0], True)  # free: view_39
view_40: f32[16] = aten.view(sum_2, [16])  # free: sum_2
t_19: f32[16, 16] = aten.t(t_18)  # free: t_18
view_41: f32[2, 8, 16] = aten.view(mm_6, [2, 8, 16])  # free: mm_6
view_42: f32[2, 8, 2, 8] = aten.view(view_41, [2, 8, 2, 8])  # free: view_41
transpose_6: f32[2, 2, 8, 8] = aten.transpose.int(view_42, 1, 2)  # free: view_42
_scaled_dot_product_flash_attention_for_cpu_backward: (f32[2, 2, 8, 8], f32[2, 2, 8, 8], f32[2, 2, 8, 8]) = aten._scaled_dot_product_flash_attention_for_cpu_backward(transpose_6, transpose_3, transpose_4, transpose_5, detach, getitem_7, 0.0, True)  # free: transpose_6, transpose_3, transpose_4, transpose_5, detach, getitem_7
getitem_38: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[0]
getitem_39: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[1]
getitem_40: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward[2]  # free: _scaled_dot_product_flash_attention_for_cpu_backward
transpose_7: f32[2, 8, 2, 8] = aten.transpose.int(getitem_40, 1, 2)  # free: getitem_40
view_43: f32[2, 8, 16] = aten.view(transpose_7, [2, 8, 16])  # free: transpose_7
transpose_8: f32[2, 8, 2, 8] = aten.transpose.int(getitem_39, 1, 2)  # free: getitem_39
view_44: f32[2, 8, 16] = aten.view(transpose_8, [2, 8, 16])  # free: transpose_8
transpose_9: f32[2, 8, 2, 8] = aten.transpose.int(getitem_38, 1, 2)  # free: getitem_38
view_45: f32[2, 8, 16] = aten.view(transpose_9, [2, 8, 16])  # free: transpose_9
cat: f32[2, 8, 48] = aten.cat([view_45, view_44, view_43], 2)  # free: view_45, view_44, view_43
view_46: f32[16, 48] = aten.view(cat, [16, 48])  # free: cat
t_20: f32[16, 48] = aten.t(view_20)  # free: view_20
t_21: f32[48, 16] = aten.t(t_20)  # free: t_20
mm_8: f32[16, 16] = aten.mm(view_46, t_21)  # free: t_21
t_22: f32[48, 16] = aten.t(view_46)
mm_9: f32[48, 16] = aten.mm(t_22, view_4)  # free: t_22, view_4
t_23: f32[16, 48] = aten.t(mm_9)  # free: mm_9
sum_3: f32[1, 48] = aten.sum.dim_IntList(view_46, [0], True)  # free: view_46
view_47: f32[48] = aten.view(sum_3, [48])  # free: sum_3
t_24: f32[48, 16] = aten.t(t_23)  # free: t_23
view_48: f32[2, 8, 16] = aten.view(mm_8, [2, 8, 16])  # free: mm_8
native_layer_norm_backward_2: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_48, add_2, [16], getitem_5, getitem_6, view_21, view_22, [True, True, True])  # free: view_48, add_2, getitem_5, getitem_6, view_21, view_22
getitem_41: f32[2, 8, 16] = native_layer_norm_backward_2[0]
getitem_42: f32[16] = native_layer_norm_backward_2[1]
getitem_43: f32[16] = native_layer_norm_backward_2[2]  # free: native_layer_norm_backward_2
add_6: f32[2, 8, 16] = aten.add.Tensor(add_5, getitem_41)  # free: add_5, getitem_41
view_49: f32[16, 16] = aten.view(add_6, [16, 16])
t_25: f32[64, 16] = aten.t(view_23)  # free: view_23
t_26: f32[16, 64] = aten.t(t_25)  # free: t_25
mm_10: f32[16, 64] = aten.mm(view_49, t_26)  # free: t_26
t_27: f32[16, 16] = aten.t(view_49)
mm_11: f32[16, 64] = aten.mm(t_27, view_3)  # free: t_27, view_3
t_28: f32[64, 16] = aten.t(mm_11)  # free: mm_11
sum_4: f32[1, 16] = aten.sum.dim_IntList(view_49, [0], True)  # free: view_49
view_50: f32[16] = aten.view(sum_4, [16])  # free: sum_4
t_29: f32[16, 64] = aten.t(t_28)  # free: t_28
view_51: f32[2, 8, 64] = aten.view(mm_10, [2, 8, 64])  # free: mm_10
view_52: f32[2, 8, 64] = aten.view(addmm, [2, 8, 64])  # free: addmm
gelu_backward_1: f32[2, 8, 64] = aten.gelu_backward(view_51, view_52)  # free: view_51, view_52
view_53: f32[16, 64] = aten.view(gelu_backward_1, [16, 64])  # free: gelu_backward_1
t_30: f32[16, 64] = aten.t(view_24)  # free: view_24
t_31: f32[64, 16] = aten.t(t_30)  # free: t_30
mm_12: f32[16, 16] = aten.mm(view_53, t_31)  # free: t_31
t_32: f32[64, 16] = aten.t(view_53)
mm_13: f32[64, 16] = aten.mm(t_32, view_2)  # free: t_32, view_2
t_33: f32[16, 64] = aten.t(mm_13)  # free: mm_13
sum_5: f32[1, 64] = aten.sum.dim_IntList(view_53, [0], True)  # free: view_53
view_54: f32[64] = aten.view(sum_5, [64])  # free: sum_5
t_34: f32[64, 16] = aten.t(t_33)  # free: t_33
view_55: f32[2, 8, 16] = aten.view(mm_12, [2, 8, 16])  # free: mm_12
native_layer_norm_backward_3: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_55, add_1, [16], getitem_3, getitem_4, view_25, view_26, [True, True, True])  # free: view_55, add_1, getitem_3, getitem_4, view_25, view_26
getitem_44: f32[2, 8, 16] = native_layer_norm_backward_3[0]
getitem_45: f32[16] = native_layer_norm_backward_3[1]
getitem_46: f32[16] = native_layer_norm_backward_3[2]  # free: native_layer_norm_backward_3
add_7: f32[2, 8, 16] = aten.add.Tensor(add_6, getitem_44)  # free: add_6, getitem_44
view_56: f32[16, 16] = aten.view(add_7, [16, 16])
t_35: f32[16, 16] = aten.t(view_27)  # free: view_27
t_36: f32[16, 16] = aten.t(t_35)  # free: t_35
mm_14: f32[16, 16] = aten.mm(view_56, t_36)  # free: t_36
t_37: f32[16, 16] = aten.t(view_56)
mm_15: f32[16, 16] = aten.mm(t_37, view_1)  # free: t_37, view_1
t_38: f32[16, 16] = aten.t(mm_15)  # free: mm_15
sum_6: f32[1, 16] = aten.sum.dim_IntList(view_56, [0], True)  # free: view_56
view_57: f32[16] = aten.view(sum_6, [16])  # free: sum_6
t_39: f32[16, 16] = aten.t(t_38)  # free: t_38
view_58: f32[2, 8, 16] = aten.view(mm_14, [2, 8, 16])  # free: mm_14
view_59: f32[2, 8, 2, 8] = aten.view(view_58, [2, 8, 2, 8])  # free: view_58
transpose_10: f32[2, 2, 8, 8] = aten.transpose.int(view_59, 1, 2)  # free: view_59
_scaled_dot_product_flash_attention_for_cpu_backward_1: (f32[2, 2, 8, 8], f32[2, 2, 8, 8], f32[2, 2, 8, 8]) = aten._scaled_dot_product_flash_attention_for_cpu_backward(transpose_10, transpose, transpose_1, transpose_2, detach_1, getitem_2, 0.0, True)  # free: transpose_10, transpose, transpose_1, transpose_2, detach_1, getitem_2
getitem_47: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[0]
getitem_48: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[1]
getitem_49: f32[2, 2, 8, 8] = _scaled_dot_product_flash_attention_for_cpu_backward_1[2]  # free: _scaled_dot_product_flash_attention_for_cpu_backward_1
transpose_11: f32[2, 8, 2, 8] = aten.transpose.int(getitem_49, 1, 2)  # free: getitem_49
view_60: f32[2, 8, 16] = aten.view(transpose_11, [2, 8, 16])  # free: transpose_11
transpose_12: f32[2, 8, 2, 8] = aten.transpose.int(getitem_48, 1, 2)  # free: getitem_48
view_61: f32[2, 8, 16] = aten.view(transpose_12, [2, 8, 16])  # free: transpose_12
transpose_13: f32[2, 8, 2, 8] = aten.transpose.int(getitem_47, 1, 2)  # free: getitem_47
view_62: f32[2, 8, 16] = aten.view(transpose_13, [2, 8, 16])  # free: transpose_13
cat_1: f32[2, 8, 48] = aten.cat([view_62, view_61, view_60], 2)  # free: view_62, view_61, view_60
view_63: f32[16, 48] = aten.view(cat_1, [16, 48])  # free: cat_1
t_40: f32[16, 48] = aten.t(view_28)  # free: view_28
t_41: f32[48, 16] = aten.t(t_40)  # free: t_40
mm_16: f32[16, 16] = aten.mm(view_63, t_41)  # free: t_41
t_42: f32[48, 16] = aten.t(view_63)
mm_17: f32[48, 16] = aten.mm(t_42, view)  # free: t_42, view
t_43: f32[16, 48] = aten.t(mm_17)  # free: mm_17
sum_7: f32[1, 48] = aten.sum.dim_IntList(view_63, [0], True)  # free: view_63
view_64: f32[48] = aten.view(sum_7, [48])  # free: sum_7
t_44: f32[48, 16] = aten.t(t_43)  # free: t_43
view_65: f32[2, 8, 16] = aten.view(mm_16, [2, 8, 16])  # free: mm_16
native_layer_norm_backward_4: (f32[2, 8, 16], f32[16], f32[16]) = aten.native_layer_norm_backward(view_65, add, [16], getitem, getitem_1, view_29, view_30, [True, True, True])  # free: view_65, add, getitem, getitem_1, view_29, view_30
getitem_50: f32[2, 8, 16] = native_layer_norm_backward_4[0]
getitem_51: f32[16] = native_layer_norm_backward_4[1]
getitem_52: f32[16] = native_layer_norm_backward_4[2]  # free: native_layer_norm_backward_4
add_8: f32[2, 8, 16] = aten.add.Tensor(add_7, getitem_50)  # free: add_7, getitem_50
sum_8: f32[1, 8, 16] = aten.sum.dim_IntList(add_8, [0], True)
view_66: f32[8, 16] = aten.view(sum_8, [8, 16])  # free: sum_8
embedding_dense_backward: f32[8, 16] = aten.embedding_dense_backward(view_66, arange, 8, -1, False)  # free: view_66, arange
embedding_dense_backward_1: f32[32, 16] = aten.embedding_dense_backward(add_8, primals_1, 32, -1, False)  # free: add_8, primals_1
add_9: f32[32, 16] = aten.add.Tensor(t_4, embedding_dense_backward_1)  # free: t_4, embedding_dense_backward_1
pack_1: f32[7232] = zerocompile.pack([getitem_34, getitem_33, view_33, t_9, view_37, t_14, getitem_37, getitem_36, view_40, t_19, view_47, t_24, getitem_43, getitem_42, view_50, t_29, view_54, t_34, getitem_46, getitem_45, view_57, t_39, view_64, t_44, getitem_52, getitem_51, embedding_dense_backward, add_9], 4, [4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 32, 128])  # free: getitem_34, getitem_33, view_33, t_9, view_37, t_14, getitem_37, getitem_36, view_40, t_19, view_47, t_24, getitem_43, getitem_42, view_50, t_29, view_54, t_34, getitem_46, getitem_45, view_57, t_39, view_64, t_44, getitem_52, getitem_51, embedding_dense_backward, add_9
reduce_scatter_tensor: f32[1808] = _c10d_functional.reduce_scatter_tensor(pack_1, 'avg', 4, WORLD)  # param: ln_f.bias, ln_f.weight, blocks.1.out.bias, blocks.1.out.weight, blocks.1.fc.bias, blocks.1.fc.weight, blocks.1.ln2.bias, blocks.1.ln2.weight, blocks.1.attn.proj.bias, blocks.1.attn.proj.weight, blocks.1.attn.qkv.bias, blocks.1.attn.qkv.weight, blocks.1.ln1.bias, blocks.1.ln1.weight, blocks.0.out.bias, blocks.0.out.weight, blocks.0.fc.bias, blocks.0.fc.weight, blocks.0.ln2.bias, blocks.0.ln2.weight, blocks.0.attn.proj.bias, blocks.0.attn.proj.weight, blocks.0.attn.qkv.bias, blocks.0.attn.qkv.weight, blocks.0.ln1.bias, blocks.0.ln1.weight, wpe.weight, wte.weight; free: pack_1
wait_tensor_1: f32[1808] = _c10d_functional.wait_tensor(reduce_scatter_tensor)  # free: reduce_scatter_tensor
split_with_sizes: (f32[4], f32[4], f32[4], f32[256], f32[16], f32[256], f32[4], f32[4], f32[4], f32[64], f32[12], f32[192], f32[4], f32[4], f32[4], f32[256], f32[16], f32[256], f32[4], f32[4], f32[4], f32[64], f32[12], f32[192], f32[4], f32[4], f32[32], f32[128]) = aten.split_with_sizes(wait_tensor_1, [4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 4, 256, 16, 256, 4, 4, 4, 64, 12, 192, 4, 4, 32, 128])  # free: wait_tensor_1
getitem_53: f32[4] = split_with_sizes[0]
getitem_54: f32[4] = split_with_sizes[1]
getitem_55: f32[4] = split_with_sizes[2]
getitem_56: f32[256] = split_with_sizes[3]
getitem_57: f32[16] = split_with_sizes[4]
getitem_58: f32[256] = split_with_sizes[5]
getitem_59: f32[4] = split_with_sizes[6]
getitem_60: f32[4] = split_with_sizes[7]
getitem_61: f32[4] = split_with_sizes[8]
getitem_62: f32[64] = split_with_sizes[9]
getitem_63: f32[12] = split_with_sizes[10]
getitem_64: f32[192] = split_with_sizes[11]
getitem_65: f32[4] = split_with_sizes[12]
getitem_66: f32[4] = split_with_sizes[13]
getitem_67: f32[4] = split_with_sizes[14]
getitem_68: f32[256] = split_with_sizes[15]
getitem_69: f32[16] = split_with_sizes[16]
getitem_70: f32[256] = split_with_sizes[17]
getitem_71: f32[4] = split_with_sizes[18]
getitem_72: f32[4] = split_with_sizes[19]
getitem_73: f32[4] = split_with_sizes[20]
getitem_74: f32[64] = split_with_sizes[21]
getitem_75: f32[12] = split_with_sizes[22]
getitem_76: f32[192] = split_with_sizes[23]
getitem_77: f32[4] = split_with_sizes[24]
getitem_78: f32[4] = split_with_sizes[25]
getitem_79: f32[32] = split_with_sizes[26]
getitem_80: f32[128] = split_with_sizes[27]  # free: split_with_sizes
return (None, getitem_80, getitem_79, getitem_78, getitem_77, getitem_76, getitem_75, getitem_74, getitem_73, getitem_72, getitem_71, getitem_70, getitem_69, getitem_68, getitem_67, getitem_66, getitem_65, getitem_64, getitem_63, getitem_62, getitem_61, getitem_60, getitem_59, getitem_58, getitem_57, getitem_56, getitem_55, getitem_54, getitem_53, None)""")



class TestMemoryBudgetZero(FakeGroupTestCase):
    """memory_budget=0 is plain stage 3: the pinned graphs above, node for node. A budget above
    the model's size changes them (the forward returns gathered weights, the backward gathers
    nothing), so the setting does reach the pass and the equality is not vacuous."""

    def test_budget_0_lowers_the_graphs_of_plain_stage_3(self) -> None:
        plain = {graphs: graphs(3) for graphs in (mlp_graphs, gpt_graphs)}
        for graphs, expected in plain.items():
            self.assertEqual(graphs(3, memory_budget=0), expected)
        forward, backward = mlp_graphs(3, memory_budget=2**30)
        self.assertNotEqual(forward, plain[mlp_graphs][0])
        self.assertNotIn("all_gather", backward)
        self.assertIn("all_gather", plain[mlp_graphs][1])


if __name__ == "__main__":
    unittest.main()
