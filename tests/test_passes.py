"""Unit tests of the FX graph passes (zerocompile/passes), single process, no real collectives.

In the style of torch/_inductor's fx_passes tests: small graphs are built by hand (`torch.fx.Graph`
with fake `meta["val"]`s) or by `make_fx` of a function calling the marker ops on fake tensors,
a pass runs, and the test asserts exact node counts, op order, tags, `graph.lint()` and the
`meta["val"]` of every node a pass inserts.

The collectives resolve against a "fake" process group of world size 4 (shapes only, no data), set
up once for this module and destroyed at its end so other test modules start clean.
"""

from __future__ import annotations

import math

import operator

import pytest
import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

from fx_helpers import WORLD, call_targets, markers_in, node_index, on, output_args, trace
from zerocompile.passes import analysis
from zerocompile.passes.lower_markers import lower_markers
from zerocompile.passes.marker_args import UnshardArgs
from zerocompile.passes.markers import REDUCE_GRAD, UNSHARD, MarkerArgs, is_unshard
from zerocompile.passes.merge_unshards import merge_repeated_unshards
from zerocompile.passes.recompute_gathers import tag_gathers_for_recompute

aten = torch.ops.aten
funcol = torch.ops._c10d_functional

# Op sequences the lowering produces (make_fx traces `reshape(-1)` of a contiguous grad as a view).
# A lone parameter's gather: one all-gather into one buffer, which is the parameter (padded).
GATHER_OP = funcol.all_gather_into_tensor.default
GATHER = [GATHER_OP, funcol.wait_tensor.default, aten.view.default]
GATHER_PADDED = [GATHER_OP, funcol.wait_tensor.default, aten.slice.Tensor, aten.view.default]
REDUCE_SCATTER = [aten.view.default, funcol.reduce_scatter_tensor.default, funcol.wait_tensor.default]
PACK = torch.ops.zerocompile.pack.default
AVERAGE_ROWS = torch.ops.zerocompile.average_rows.default
REDUCE_SCATTER_PADDED = [PACK, *REDUCE_SCATTER[1:]]
ALL_TO_ALL = [
    aten.view.default,
    funcol.all_to_all_single.default,
    funcol.wait_tensor.default,
    aten.view.default,
    AVERAGE_ROWS,
]
ALL_TO_ALL_PADDED = [PACK, *ALL_TO_ALL[1:]]
ALL_REDUCE = [funcol.all_reduce.default, funcol.wait_tensor.default, aten.unsqueeze.default, AVERAGE_ROWS]

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("group_name")]


# --------------------------------------------------------------------------------------- helpers










def assert_new_nodes_have_vals(graph: fx.Graph, before: set[fx.Node]) -> list[fx.Node]:
    """Every node a pass added carries a fake `meta["val"]` (a list of them for a coalesced
    collective's several outputs); returns the added nodes."""
    added = [n for n in graph.nodes if n not in before and n.op == "call_function"]
    for node in added:
        value = node.meta.get("val")
        values = value if isinstance(value, list) and value else [value]
        assert all(isinstance(v, FakeTensor) for v in values), f"{node.format_node()} has no fake meta['val']"
    return added




# ---------------------------------------------------------------------- merge_repeated_unshards


def _hand_built_graph(group_name: str):
    """p0 used three times (two at stage 3, once at stage 1), p1 once; returns graph and nodes."""
    mode = FakeTensorMode()
    graph = fx.Graph()
    p0 = graph.placeholder("p0")
    p1 = graph.placeholder("p1")
    with mode:
        p0.meta["val"] = torch.empty(4)
        p1.meta["val"] = torch.empty(4)
        full = torch.empty(3, 5)
    nodes = {
        "u0": graph.call_function(UNSHARD, (p0, [3, 5], 3, *on(group_name))),
        "u1": graph.call_function(UNSHARD, (p1, [3, 5], 3, *on(group_name))),
        "u2": graph.call_function(UNSHARD, (p0, [3, 5], 3, *on(group_name))),
        "u3": graph.call_function(UNSHARD, (p0, [3, 5], 1, *on(group_name))),
        "u4": graph.call_function(UNSHARD, (p0, [3, 5], 3, *on(group_name))),
    }
    for node in nodes.values():
        node.meta["val"] = full
    a = graph.call_function(aten.add.Tensor, (nodes["u0"], nodes["u1"]))
    b = graph.call_function(aten.mul.Tensor, (nodes["u2"], nodes["u3"]))
    c = graph.call_function(aten.sub.Tensor, (nodes["u4"], nodes["u2"]))
    graph.output((a, b, c))
    graph.lint()
    return graph, nodes, (a, b, c)


def test_merge_repeated_unshards_keeps_first_and_rewires_users(group_name):
    graph, u, (add, mul, sub) = _hand_built_graph(group_name)

    assert merge_repeated_unshards(graph) == 2

    graph.lint()
    remaining = [n for n in graph.nodes if is_unshard(n)]
    assert remaining == [u["u0"], u["u1"], u["u3"]]
    assert add.args == (u["u0"], u["u1"])  # different placeholder: untouched
    assert mul.args == (u["u0"], u["u3"])  # u2 -> u0, stage-1 marker of p0 kept
    assert sub.args == (u["u0"], u["u0"])  # u4 and u2 both -> u0
    assert set(u["u0"].users) == {add, mul, sub}


def test_merge_repeated_unshards_on_traced_tied_weight(group_name):
    def f(s, x):
        a = x @ UNSHARD(s, [3, 5], 3, *on(group_name))
        b = UNSHARD(s, [3, 5], 3, *on(group_name)).t()
        return a, b

    gm = trace(f, (4,), (2, 3))
    assert len(markers_in(gm.graph)) == 2

    assert merge_repeated_unshards(gm.graph) == 1

    gm.graph.lint()
    (unshard,) = markers_in(gm.graph)
    assert sorted(user.target.__name__ for user in unshard.users) == ["mm.default", "t.default"]


def test_merge_repeated_unshards_no_op_leaves_graph_unchanged(group_name):
    def f(s0, s1, x):
        # Same placeholder at two stages and two placeholders: nothing to merge.
        a = x @ UNSHARD(s0, [3, 5], 3, *on(group_name))
        return a, UNSHARD(s0, [3, 5], 2, *on(group_name)), UNSHARD(s1, [3, 5], 3, *on(group_name))

    gm = trace(f, (4,), (4,), (2, 3))
    code_before = gm.graph.python_code("self").src
    nodes_before = list(gm.graph.nodes)

    assert merge_repeated_unshards(gm.graph) == 0

    assert list(gm.graph.nodes) == nodes_before
    assert gm.graph.python_code("self").src == code_before


# -------------------------------------------------------------------- tag_gathers_for_recompute


def test_tag_gathers_for_recompute_tags_stage3_views_and_casts_only(group_name):
    def f(s3, s1, x):
        w = UNSHARD(s3, [3, 5], 3, *on(group_name))
        transposed = w.t().unsqueeze(0)  # view of a view
        flat = w.view(15)
        wide = w.to(torch.float64)  # _to_copy
        compute = x @ w  # mm: a new value, not the parameter
        after = compute.t()  # a view of a compute result: not the parameter either
        v = UNSHARD(s1, [3, 5], 1, *on(group_name))
        return compute, transposed, flat, wide, after, v.t(), x @ v

    gm = trace(f, (4,), (4,), (2, 3))
    by_name = {n.name: n for n in gm.graph.nodes}

    assert tag_gathers_for_recompute(gm.graph) == 5

    tagged = {n.name for n in gm.graph.nodes if "recompute" in n.meta}
    assert tagged == {"unshard", "t", "unsqueeze", "view", "_to_copy"}
    for name in tagged:
        assert by_name[name].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    assert by_name["t"].target is aten.t.default and by_name["_to_copy"].target is aten._to_copy.default
    # compute users and everything of the stage-1 marker stay untagged
    assert by_name["mm"].target is aten.mm.default
    for name in ("mm", "t_1", "unshard_1", "t_2", "mm_1"):
        assert "recompute" not in by_name[name].meta, name
    assert by_name["unshard_1"].args[2] == 1
    gm.graph.lint()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_tag_gathers_for_recompute_ignores_other_stages(group_name, stage):
    def f(s, x):
        w = UNSHARD(s, [3, 5], stage, *on(group_name))
        return x @ w.t().t(), w.to(torch.float16)

    gm = trace(f, ((3, 5) if stage == 0 else (4,)), (2, 3))

    assert tag_gathers_for_recompute(gm.graph) == 0
    assert not any("recompute" in n.meta for n in gm.graph.nodes)


# --------------------------------------------------------------------------------- lower_markers


def _stage_graph(stage: int, group_name: str, dtype=torch.float32, textbook: bool = True) -> fx.GraphModule:
    """A forward part (two gathers around compute) and a backward part (two gradient reductions
    with a matmul between them).

    w1 is [3, 5] (15 elements: padded to 16 over 4 ranks, shard 4), w2 is [5, 4] (20: shard 5).
    """

    def shard_numel(shape):
        return math.prod(shape) if stage == 0 else math.ceil(math.prod(shape) / WORLD)

    def f(s1, s2, g1, g2, x):
        h = x.relu()
        h = h @ UNSHARD(s1, [3, 5], stage, *on(group_name))
        h = h.relu()
        h = h @ UNSHARD(s2, [5, 4], stage, *on(group_name))
        r1 = REDUCE_GRAD(g1 * 2, shard_numel([3, 5]), stage, *on(group_name, textbook))
        y = h @ h.t()
        r2 = REDUCE_GRAD(g2 + 1, shard_numel([5, 4]), stage, *on(group_name, textbook))
        return y, r1, r2

    shards = [(3, 5), (5, 4)] if stage == 0 else [(4,), (5,)]
    return trace(f, *[(s, dtype) for s in shards], ((3, 5), dtype), ((5, 4), dtype), ((2, 3), dtype))


def _expected_order(stage: int, textbook: bool = True) -> list:
    if stage == 0:
        r1 = r2 = ALL_REDUCE
    elif textbook:
        r1, r2 = REDUCE_SCATTER_PADDED, REDUCE_SCATTER
    else:
        r1, r2 = ALL_TO_ALL_PADDED, ALL_TO_ALL
    g1, g2 = GATHER_PADDED, GATHER
    relu, mm, mul, t, add = aten.relu.default, aten.mm.default, aten.mul.Tensor, aten.t.default, aten.add.Tensor
    # Reductions where the gradient is produced, below the view Inductor would fuse into the
    # kernel after it (lower_markers._reduce_before_the_next_kernel_call).
    if stage == 0:
        return [relu, mm, relu, mm, mul, t, *r1, mm, add, *r2]
    if stage == 1:  # gathers first, reductions last
        return [*g1, *g2, relu, mm, relu, mm, mul, t, mm, add, *r1, *r2]
    if stage == 2:  # gathers first
        return [*g1, *g2, relu, mm, relu, mm, mul, t, *r1, mm, add, *r2]
    # Stage 3: each gather just before its use, above the relu Inductor would fuse into the kernel
    # before it (lower_markers._gather_after_the_last_kernel_call).
    return [*g1, relu, mm, *g2, relu, mm, mul, t, *r1, mm, add, *r2]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lower_markers_op_order_and_counts(group_name, stage):
    gm = _stage_graph(stage, group_name)
    before = set(gm.graph.nodes)

    counts = lower_markers(gm.graph)

    gm.graph.lint()
    assert markers_in(gm.graph) == []
    if stage == 0:
        assert counts == {"gathers": 0, "reductions": 2, "identities": 2, "gather_buckets": 0, "reduction_buckets": 2}
    else:
        assert counts == {"gathers": 2, "reductions": 2, "identities": 0, "gather_buckets": 2, "reduction_buckets": 2}
    assert call_targets(gm.graph) == _expected_order(stage)
    assert_new_nodes_have_vals(gm.graph, before)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lower_markers_gathers_shapes_with_padding(group_name, stage):
    gm = _stage_graph(stage, group_name, dtype=torch.bfloat16)
    s1, s2 = gm.graph.find_nodes(op="placeholder")[:2]

    lower_markers(gm.graph)

    gathers = gm.graph.find_nodes(op="call_function", target=GATHER_OP)
    assert [g.args for g in gathers] == [(s1, WORLD, group_name), (s2, WORLD, group_name)]
    # w1: 4 x 4 = 16 gathered, sliced to 15, viewed [3, 5]; w2: 4 x 5 = 20, viewed [5, 4] directly
    (ag1, ag2) = gathers  # a lone parameter's buffer is the parameter: no copy out
    wait1, wait2 = (next(iter(ag.users)) for ag in (ag1, ag2))
    slice1 = next(iter(wait1.users))
    view1, view2 = next(iter(slice1.users)), next(iter(wait2.users))
    assert slice1.target is aten.slice.Tensor and slice1.args == (wait1, 0, 0, 15)
    assert view1.target is aten.view.default and view1.args == (slice1, [3, 5])
    assert view2.target is aten.view.default and view2.args == (wait2, [5, 4])
    shapes = [tuple(n.meta["val"].shape) for n in (ag1, wait1, slice1, view1, ag2, wait2, view2)]
    assert shapes == [(16,), (16,), (15,), (3, 5), (20,), (20,), (5, 4)]
    assert {n.meta["val"].dtype for n in (ag1, wait1, slice1, view1, ag2, wait2, view2)} == {torch.bfloat16}
    # the matmuls now consume the full views
    (mm1, mm2, _) = gm.graph.find_nodes(op="call_function", target=aten.mm.default)
    assert mm1.args[1] is view1 and mm2.args[1] is view2


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lower_markers_reduce_scatter_shapes_with_padding(group_name, stage):
    gm = _stage_graph(stage, group_name)

    lower_markers(gm.graph)

    y, r1, r2 = output_args(gm.graph)
    assert r1.target is funcol.wait_tensor.default and r2.target is funcol.wait_tensor.default
    rs1, rs2 = r1.args[0], r2.args[0]
    assert rs1.target is funcol.reduce_scatter_tensor.default and rs1.args[1:] == ("avg", WORLD, group_name)
    assert rs2.target is funcol.reduce_scatter_tensor.default and rs2.args[1:] == ("avg", WORLD, group_name)
    pad = rs1.args[0]
    (mul,) = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
    assert pad.target is PACK and pad.args == ([mul], WORLD, [4])  # 15 -> 16
    assert rs2.args[0].target is aten.view.default  # 20 elements: no padding
    assert [tuple(n.meta["val"].shape) for n in (pad, rs1, r1, rs2.args[0], rs2, r2)] == [
        (16,), (4,), (4,), (20,), (5,), (5,)
    ]
    assert tuple(y.meta["val"].shape) == (2, 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lower_markers_gloo_builds_reduce_scatter_from_all_to_all(group_name, stage):
    gm = _stage_graph(stage, group_name, textbook=False)
    before = set(gm.graph.nodes)

    counts = lower_markers(gm.graph)

    gm.graph.lint()
    assert counts == {"gathers": 2, "reductions": 2, "identities": 0, "gather_buckets": 2, "reduction_buckets": 2}
    assert call_targets(gm.graph) == _expected_order(stage, textbook=False)
    assert gm.graph.find_nodes(op="call_function", target=funcol.reduce_scatter_tensor.default) == []
    assert_new_nodes_have_vals(gm.graph, before)
    _, r1, r2 = output_args(gm.graph)
    for result, shard_numel, sent in ((r1, 4, 16), (r2, 5, 20)):
        assert result.target is AVERAGE_ROWS and result.args[1] == WORLD
        rows = result.args[0]
        assert rows.target is aten.view.default and rows.args[1] == [WORLD, shard_numel]
        wait = rows.args[0]
        assert wait.target is funcol.wait_tensor.default
        a2a = wait.args[0]
        assert a2a.target is funcol.all_to_all_single.default
        assert a2a.args[1:] == ([shard_numel] * WORLD, [shard_numel] * WORLD, group_name)
        assert tuple(a2a.args[0].meta["val"].shape) == (sent,)
        assert tuple(a2a.meta["val"].shape) == (sent,)
        assert tuple(rows.meta["val"].shape) == (WORLD, shard_numel)
        assert tuple(result.meta["val"].shape) == (shard_numel,)


def test_lower_markers_stage0_unshard_rewired_and_reduce_grad_all_reduces(group_name):
    gm = _stage_graph(0, group_name)
    s1, s2, g1, g2, _x = gm.graph.find_nodes(op="placeholder")

    lower_markers(gm.graph)

    (mm1, mm2, _) = gm.graph.find_nodes(op="call_function", target=aten.mm.default)
    assert mm1.args[1] is s1 and mm2.args[1] is s2  # the parameter itself, no copy
    assert gm.graph.find_nodes(op="call_function", target=GATHER_OP) == []
    _, r1, r2 = output_args(gm.graph)
    for result, shape in ((r1, (3, 5)), (r2, (5, 4))):
        assert result.target is AVERAGE_ROWS and result.args[1] == WORLD
        row = result.args[0]
        assert row.target is aten.unsqueeze.default and row.args[1] == 0
        wait = row.args[0]
        assert wait.target is funcol.wait_tensor.default
        assert wait.args[0].target is funcol.all_reduce.default and wait.args[0].args[1:] == ("sum", group_name)
        assert tuple(result.meta["val"].shape) == shape


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_lower_markers_reads_a_kept_copy_instead_of_gathering(group_name, compute_dtype):
    """`full=` (the copy a no_sync block kept): the marker's users read the copy (cast for mixed
    precision), nothing is gathered for it; the other parameter still is."""

    def f(s1, s2, f1, x):
        h = x @ UNSHARD(s1, [3, 5], 3, *on(group_name), compute_dtype=compute_dtype, full=f1)
        return h.to(torch.float32) @ UNSHARD(s2, [5, 4], 3, *on(group_name))

    gm = trace(f, ((4,), torch.float32), ((5,), torch.float32), ((3, 5), torch.float32), ((2, 3), compute_dtype or torch.float32))
    _s1, _s2, f1, _x = gm.graph.find_nodes(op="placeholder")
    before = set(gm.graph.nodes)

    counts = lower_markers(gm.graph)

    gm.graph.lint()
    assert markers_in(gm.graph) == []
    assert (counts["identities"], counts["gathers"], counts["gather_buckets"]) == (1, 1, 1)
    first_mm = gm.graph.find_nodes(op="call_function", target=aten.mm.default)[0]
    weight = first_mm.args[1]
    if compute_dtype is None:
        assert weight is f1
    else:
        assert weight.args[0] is f1 and weight.meta["val"].dtype == compute_dtype
    assert len(gm.graph.find_nodes(op="call_function", target=GATHER_OP)) == 1
    assert_new_nodes_have_vals(gm.graph, before)


def test_lower_markers_stage0_reduce_grad_of_non_contiguous_grad(group_name):
    def f(p, x):
        return (REDUCE_GRAD(x.t(), 15, 0, *on(group_name)),)

    gm = trace(f, (5, 3), (5, 3))

    lower_markers(gm.graph)

    (result,) = output_args(gm.graph)
    assert call_targets(gm.graph) == [aten.t.default, *ALL_REDUCE]
    assert tuple(result.meta["val"].shape) == (3, 5)
    assert result.meta["val"].is_contiguous()  # what the marker's fake kernel promised


def test_lower_markers_stage0_returned_parameter_becomes_clone(group_name):
    def f(p, x):
        w = UNSHARD(p, [3, 5], 0, *on(group_name))
        return x @ w, w

    gm = trace(f, (3, 5), (2, 3))
    p = gm.graph.find_nodes(op="placeholder")[0]

    assert lower_markers(gm.graph) == {"gathers": 0, "reductions": 0, "identities": 1, "gather_buckets": 0, "reduction_buckets": 0}

    gm.graph.lint()
    mm, returned = output_args(gm.graph)
    assert returned.target is aten.clone.default and returned.args == (p,)
    assert mm.args[1] is returned  # the other use now reads the copy (one node for both uses)
    assert tuple(returned.meta["val"].shape) == (3, 5)
    assert markers_in(gm.graph) == []


@pytest.mark.parametrize("stage", [1, 2])
def test_lower_markers_stage12_gathers_directly_after_placeholders(group_name, stage):
    gm = _stage_graph(stage, group_name)
    lower_markers(gm.graph)

    nodes = list(gm.graph.nodes)
    n_placeholders = len(gm.graph.find_nodes(op="placeholder"))
    assert all(n.op == "placeholder" for n in nodes[:n_placeholders])
    gathers = nodes[n_placeholders : n_placeholders + len(GATHER_PADDED) + len(GATHER)]
    assert [n.target for n in gathers] == GATHER_PADDED + GATHER


@pytest.mark.parametrize("stage", [2, 3])
def test_lower_markers_stage23_reductions_stay_where_gradient_is_produced(group_name, stage):
    gm = _stage_graph(stage, group_name)
    lower_markers(gm.graph)

    index = node_index(gm.graph)
    (mul,) = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
    (*_, mm) = gm.graph.find_nodes(op="call_function", target=aten.mm.default)
    (add,) = gm.graph.find_nodes(op="call_function", target=aten.add.Tensor)
    rs1, rs2 = gm.graph.find_nodes(op="call_function", target=funcol.reduce_scatter_tensor.default)
    assert index[mul] < index[rs1] < index[mm] < index[add] < index[rs2]
    assert [n.target for n in list(gm.graph.nodes)[index[rs2] :]] == [*REDUCE_SCATTER[1:], "output"]


def test_lower_markers_stage1_reductions_just_before_output(group_name):
    gm = _stage_graph(1, group_name)
    lower_markers(gm.graph)

    nodes = list(gm.graph.nodes)
    tail = nodes[-1 - len(REDUCE_SCATTER_PADDED) - len(REDUCE_SCATTER) : -1]
    assert [n.target for n in tail] == REDUCE_SCATTER_PADDED + REDUCE_SCATTER
    assert nodes[-1].op == "output"
    index = node_index(gm.graph)
    (add,) = gm.graph.find_nodes(op="call_function", target=aten.add.Tensor)
    assert max(index[n] for n in gm.graph.nodes if n.target is funcol.wait_tensor.default) > index[add]


@pytest.mark.parametrize("stage", [1, 2])
def test_lower_markers_stage12_keeps_program_order_of_moved_gathers(group_name, stage):
    def f(s1, s2, x):
        w1 = UNSHARD(s1, [3, 5], stage, *on(group_name))  # first node after the placeholders
        w2 = UNSHARD(s2, [5, 4], stage, *on(group_name))
        return (x @ w1 @ w2,)

    gm = trace(f, (4,), (5,), (2, 3))
    s1, s2, _ = gm.graph.find_nodes(op="placeholder")

    lower_markers(gm.graph)

    gathers = gm.graph.find_nodes(op="call_function", target=GATHER_OP)
    assert [g.args[0] for g in gathers] == [s1, s2]


# -------------------------------------------------------------------------------------- analysis


def _gather(shard: torch.Tensor, shape: list[int], group_name: str) -> torch.Tensor:
    """A hand-written gather (not via lowering) so analysis tests do not depend on lower_markers."""
    gathered = funcol.wait_tensor(funcol.all_gather_into_tensor(shard, WORLD, group_name))
    return gathered.view(shape)


def test_collectives_lists_ops_numel_dtype_in_order(group_name):
    def f(s, g, a, b):
        w = _gather(s, [4, 2], group_name)  # bf16, 2 elements sent
        r = funcol.wait_tensor(funcol.reduce_scatter_tensor(g, "avg", WORLD, group_name))  # 16
        x = funcol.wait_tensor(funcol.all_reduce(a, "sum", group_name))  # 6
        y = funcol.wait_tensor(funcol.all_to_all_single(b, [2] * WORLD, [2] * WORLD, group_name))  # 8
        return w, r, x, y

    gm = trace(f, ((2,), torch.bfloat16), (16,), (2, 3), ((8,), torch.float64))

    found = analysis.collectives(gm.graph)

    assert [(c.op, c.numel, c.dtype) for c in found] == [
        ("all_gather", 2, torch.bfloat16),
        ("reduce_scatter", 16, torch.float32),
        ("all_reduce", 6, torch.float32),
        ("all_to_all", 8, torch.float64),
    ]
    nodes = list(gm.graph.nodes)
    assert [nodes[c.position].target for c in found] == [
        funcol.all_gather_into_tensor.default,
        funcol.reduce_scatter_tensor.default,
        funcol.all_reduce.default,
        funcol.all_to_all_single.default,
    ]
    assert [c.bytes for c in found] == [4, 64, 24, 64]


def test_saved_gathered_values_detects_returned_view_of_gathered_parameter(group_name):
    def f(s, x):
        w = _gather(s, [3, 4], group_name)
        wt = w.t()
        return x @ w, wt, s

    gm = trace(f, (3,), (2, 3))
    by_name = {n.name: n for n in gm.graph.nodes}

    gathered = analysis.gathered_values(gm.graph)
    saved = analysis.saved_gathered_values(gm.graph)

    assert {n.name for n in gathered} == {"all_gather_into_tensor", "wait_tensor", "view", "t"}
    assert saved == [by_name["t"]]


def test_saved_gathered_values_empty_when_only_shards_returned(group_name):
    def f(s, x):
        w = _gather(s, [3, 4], group_name)
        return (x @ w).relu(), s, x

    gm = trace(f, (3,), (2, 3))

    assert len(analysis.gathered_values(gm.graph)) == 3
    assert analysis.saved_gathered_values(gm.graph) == []


def test_saved_gathered_values_single_output_graph(group_name):
    def f(s):
        return _gather(s, [3, 4], group_name).t()

    gm = trace(f, (3,))

    assert [n.name for n in analysis.saved_gathered_values(gm.graph)] == ["t"]


def test_peak_gathered_numel_sequential_windows_take_the_larger(group_name):
    def f(s1, s2, x):
        h = x @ _gather(s1, [3, 4], group_name)  # 12 elements, dead after this mm
        return (h @ _gather(s2, [4, 5], group_name),)  # 20 elements

    gm = trace(f, (3,), (5,), (2, 3))

    intervals = analysis.gathered_live_intervals(gm.graph)
    assert [n for _, _, n in intervals] == [12, 20]
    (s1, e1, _), (s2, _, _) = intervals
    assert e1 < s2
    assert analysis.peak_gathered_numel(gm.graph) == 20


def test_peak_gathered_numel_overlapping_windows_add_up(group_name):
    def f(s1, s2, x):
        w1 = _gather(s1, [3, 4], group_name)
        w2 = _gather(s2, [4, 5], group_name)  # gathered while w1 is still needed
        return (x @ w1 @ w2,)

    gm = trace(f, (3,), (5,), (2, 3))

    (s1, e1, _), (s2, _, _) = analysis.gathered_live_intervals(gm.graph)
    assert s2 <= e1
    assert analysis.peak_gathered_numel(gm.graph) == 32


def test_peak_gathered_numel_counts_use_through_views(group_name):
    def f(s1, s2, x):
        wt = _gather(s1, [4, 3], group_name).t()  # the buffer lives as long as its transpose
        w2 = _gather(s2, [4, 5], group_name)
        return (x @ wt @ w2,)

    gm = trace(f, (3,), (5,), (2, 3))

    assert analysis.peak_gathered_numel(gm.graph) == 32


def test_peak_gathered_numel_without_gathers_is_zero(group_name):
    gm = trace(lambda x: (x.relu(),), (2, 3))
    assert analysis.gathered_live_intervals(gm.graph) == []
    assert analysis.peak_gathered_numel(gm.graph) == 0


# ----------------------------------------------- end to end: joint graph -> partition -> lowering


def _compile_two_layer_mlp(stage: int, group_name: str, tag: bool) -> dict:
    """AOTAutograd on a 2-layer MLP whose weights go through the markers, as the backend does.

    w1 [7, 6] (42 elements: shard 11, padded 44), w2 [5, 7] (35: shard 9, padded 36); biases and
    the input are ordinary tensors. The forward and backward graphs are lowered and recorded.
    """
    seen: dict = {}

    def partition(joint, joint_inputs, **kwargs):
        seen["tagged"] = tag_gathers_for_recompute(joint.graph) if tag else 0
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            seen[f"{kind}_counts"] = lower_markers(gm.graph)
            gm.recompile()
            seen[kind] = gm
            return make_boxed_func(gm.forward)

        return compile_graph

    def mlp(s1, b1, s2, b2, x):
        h = torch.nn.functional.linear(x, UNSHARD(s1, [7, 6], stage, *on(group_name)), b1).relu()
        return torch.nn.functional.linear(h, UNSHARD(s2, [5, 7], stage, *on(group_name)), b2)

    compiled = aot_function(mlp, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"), partition_fn=partition)
    s1, s2 = torch.randn(11, requires_grad=True), torch.randn(9, requires_grad=True)
    b1, b2 = torch.randn(7, requires_grad=True), torch.randn(5, requires_grad=True)
    out = compiled(s1, b1, s2, b2, torch.randn(3, 6))
    assert out.shape == (3, 5)
    out.sum().backward()  # the fake group moves no data: only the shapes are meaningful
    assert s1.grad.shape == (11,) and s2.grad.shape == (9,)
    return seen


def test_end_to_end_stage3_forward_saves_no_gathered_parameter(group_name):
    seen = _compile_two_layer_mlp(3, group_name, tag=True)
    fw, bw = seen["fw"].graph, seen["bw"].graph

    # unshard + t for w1; unshard + t (forward) + t (backward's transpose back) for w2
    assert seen["tagged"] == 5
    assert seen["fw_counts"] == {"gathers": 2, "reductions": 0, "identities": 0, "gather_buckets": 2, "reduction_buckets": 0}
    assert seen["bw_counts"] == {"gathers": 1, "reductions": 2, "identities": 0, "gather_buckets": 1, "reduction_buckets": 2}
    assert markers_in(fw) == [] and markers_in(bw) == []
    fw.lint()
    bw.lint()

    assert analysis.saved_gathered_values(fw) == []
    assert fw.find_nodes(op="placeholder")[2] in output_args(fw)[1:]  # the w2 shard is saved, not w2
    assert [(c.op, c.numel) for c in analysis.collectives(fw)] == [("all_gather", 11), ("all_gather", 9)]
    assert analysis.peak_gathered_numel(fw) == 44  # one layer's weight at a time

    # The backward re-gathers w2 (needed for dx of layer 2; layer 1 needs no w1 since x has no grad)
    # before it uses it, and reduce-scatters both padded gradients where they are produced.
    assert [(c.op, c.numel) for c in analysis.collectives(bw)] == [
        ("all_gather", 9),
        ("reduce_scatter", 36),
        ("reduce_scatter", 44),
    ]
    (regather,) = bw.find_nodes(op="call_function", target=GATHER_OP)
    assert regather.args[0].op == "placeholder"
    assert analysis.peak_gathered_numel(bw) == 36


def test_end_to_end_stage3_without_tags_saves_gathered_parameter(group_name):
    """The control: the check above fails when the recompute tags are missing."""
    seen = _compile_two_layer_mlp(3, group_name, tag=False)

    saved = analysis.saved_gathered_values(seen["fw"].graph)
    assert len(saved) == 1 and tuple(saved[0].meta["val"].shape) == (5, 7)  # full w2 kept for the backward
    assert seen["bw_counts"] == {"gathers": 0, "reductions": 2, "identities": 0, "gather_buckets": 0, "reduction_buckets": 2}


def test_end_to_end_stage1_keeps_gathered_weights_and_reduces_at_the_end(group_name):
    seen = _compile_two_layer_mlp(1, group_name, tag=True)
    fw, bw = seen["fw"].graph, seen["bw"].graph

    assert seen["tagged"] == 0
    assert len(analysis.saved_gathered_values(fw)) == 1  # stage 1 keeps full weights for the backward
    assert analysis.peak_gathered_numel(fw) == 44 + 36  # both gathered up front
    n_placeholders = len(fw.find_nodes(op="placeholder"))
    first_ops = [n.target for n in list(fw.nodes)[n_placeholders : n_placeholders + 2 * len(GATHER_PADDED)]]
    assert first_ops == GATHER_PADDED + GATHER_PADDED
    assert [(c.op, c.numel) for c in analysis.collectives(bw)] == [("reduce_scatter", 36), ("reduce_scatter", 44)]
    tail = [n.target for n in list(bw.nodes)[-7:-1]]
    assert tail == REDUCE_SCATTER_PADDED + REDUCE_SCATTER_PADDED


# The schemas torch.library inferred from the ops' hand-written signatures, which every snapshot
# was taken with: the ones `marker_args` derives must stay these.
UNSHARD_SCHEMA = (
    "zerocompile::unshard(Tensor shard, SymInt[] shape, SymInt stage, str group_name, SymInt world_size, "
    'str reduce_scatter, str param="", ScalarType? compute_dtype=None, ScalarType? reduce_dtype=None, '
    "bool local=False, Tensor? pending=None, SymInt gather_quant_block=0, SymInt reduce_quant_block=0, "
    'str replica_group="", SymInt replicas=1, SymInt replica_quant_block=0, str secondary_group="", '
    "SymInt secondary_size=1, SymInt secondary_quant_block=0, Tensor? full=None) -> Tensor"
)
REDUCE_GRAD_SCHEMA = (
    "zerocompile::reduce_grad(Tensor grad, SymInt shard_numel, SymInt stage, str group_name, SymInt world_size, "
    'str reduce_scatter, str param="", ScalarType? reduce_dtype=None, ScalarType? grad_dtype=None, '
    'SymInt quant_block=0, str replica_group="", SymInt replicas=1, SymInt replica_quant_block=0) -> Tensor'
)


def test_marker_schemas_come_from_their_records_and_markers_leave_defaults_out():
    """The ops' schemas, derived from `UnshardArgs` and `ReduceGradArgs`, are the ones the graphs
    were always traced with; `MarkerArgs` (what shard() decides for a parameter's markers) passes
    its arguments positionally through `reduce_dtype`, the rest as keywords only where set."""
    assert str(UNSHARD._schema) == UNSHARD_SCHEMA
    assert str(REDUCE_GRAD._schema) == REDUCE_GRAD_SCHEMA

    assert MarkerArgs((3, 5), 1, "g", 4, "native").call() == (([3, 5], 1, "g", 4, "native", "", None, None), {})
    marker = MarkerArgs((3, 5), 3, "g", 4, "native", compute_dtype=torch.bfloat16, replica_group="r", replicas=2)
    args, keywords = marker.call()
    assert keywords == {"replica_group": "r", "replicas": 2}
    assert UnshardArgs("s", *args, **keywords) == UnshardArgs(
        "s", [3, 5], 3, "g", 4, "native", compute_dtype=torch.bfloat16, replica_group="r", replicas=2
    )
