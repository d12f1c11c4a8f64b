"""Unit tests of bucketing and prefetch in `lower_markers(graph, bucket_bytes, prefetch)`.

Single process, no real collectives: small graphs are traced with `make_fx` on fake tensors (the
marker ops called directly, as in test_passes.py), lowered, and checked for exact bucket counts,
op order, `meta["val"]` shapes and dtypes, the ledger and `graph.lint()`.

The numbers are checked too: `run_ranks` interprets a lowered graph for all WORLD ranks in
lockstep, node by node, replacing each functional collective by what the group would compute from
every rank's input (all-gather = concatenation in rank order, reduce-scatter = rank r's chunk of
the reduction, all-to-all = rank r's split from every rank). So the bucket layouts traced from
`gather_bucket` / `reduce_scatter_bucket` / `all_reduce_bucket` are run as they appear in the graph
and compared with the original full parameters, the per-parameter reduction, and the unbucketed
lowering of the same graph.

Collectives resolve against a fake process group of 4 ranks (plus a 2-rank subgroup), created for
this module and destroyed at its end.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from fx_helpers import WORLD, call_targets, markers_in, node_index, output_args, trace
from zerocompile.passes import analysis, ledger, lowering
from zerocompile.passes.lower_markers import lower_markers
from zerocompile.passes.markers import REDUCE_GRAD, UNSHARD

aten = torch.ops.aten
funcol = torch.ops._c10d_functional
PACK = torch.ops.zero.pack.default
UNPACK = torch.ops.zero.unpack.default

# The forward/backward test model: four parameters, two of them padded over 4 ranks.
SHAPES = ([3, 5], [5, 4], [4, 2], [2])  # numel 15, 20, 8, 2
FQNS = ("l1.weight", "l2.weight", "l3.weight", "l3.bias")
SHARDS = (4, 5, 2, 1)  # ceil(numel / 4): padded numel 16, 20, 8, 4
FULL_BYTES_F32 = (60, 80, 32, 8)


@pytest.fixture(scope="module")
def subgroup_name(group_name):
    """A second group (ranks 0 and 1): markers of another group must get their own collective."""
    return dist.new_group([0, 1]).group_name

pytestmark = pytest.mark.usefixtures("group_name")


# --------------------------------------------------------------------------------------- helpers












def find(graph: fx.Graph, target) -> list[fx.Node]:
    """Nodes calling `target`, in graph order (find_nodes keeps creation order, not moves)."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def lower(gm: fx.GraphModule, **kwargs) -> dict[str, int]:
    """lower_markers, then: the graph lints, no marker remains, every new node has a fake val."""
    before = set(gm.graph.nodes)
    counts = lower_markers(gm.graph, **kwargs)
    gm.graph.lint()
    assert markers_in(gm.graph) == []
    for node in gm.graph.nodes:
        if node in before or node.op != "call_function":
            continue
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]  # split_with_sizes: a list
        assert vals and all(isinstance(v, FakeTensor) for v in vals), f"{node.format_node()} has no fake val"
    gm.recompile()
    return counts


def counts_of(gathers: int = 0, reductions: int = 0, gather_buckets: int = 0, reduction_buckets: int = 0, identities: int = 0):
    return {
        "gathers": gathers,
        "reductions": reductions,
        "identities": identities,
        "gather_buckets": gather_buckets,
        "reduction_buckets": reduction_buckets,
    }


def unwrap_views(node: fx.Node) -> fx.Node:
    """The node a chain of view / slice nodes starts from."""
    while node.target in (aten.view.default, aten.slice.Tensor):
        node = node.args[0]
    return node


def bucket_members(collective: fx.Node) -> list[fx.Node]:
    """The per-parameter inputs packed into a collective: the pack's inputs, or the lone input."""
    packed = collective.args[0]
    while packed.target is aten.view.default and packed.args[1] == [-1]:  # a lone gradient, flattened
        packed = packed.args[0]
    return list(packed.args[0]) if packed.target is PACK else [packed]


def gathered_shards(graph: fx.Graph) -> list[list[str]]:
    """For each all-gather in order, the names of the shards it carries."""
    return [[n.name for n in bucket_members(ag)] for ag in find(graph, funcol.all_gather_into_tensor.default)]


def forward_model(group_name: str, stage: int = 3, dtype=torch.float32, fqns=FQNS) -> fx.GraphModule:
    """relu, w1 [3, 5] mm, relu, w2 [5, 4] mm, w3 [4, 2] mm, + bias [2]: four markers in a row."""

    def f(s1, s2, s3, s4, x):
        h = x.relu()
        h = h @ UNSHARD(s1, SHAPES[0], stage, group_name, fqns[0])
        h = h.relu()
        h = h @ UNSHARD(s2, SHAPES[1], stage, group_name, fqns[1])
        h = h @ UNSHARD(s3, SHAPES[2], stage, group_name, fqns[2])
        return (h + UNSHARD(s4, SHAPES[3], stage, group_name, fqns[3]),)

    return trace(f, *[((n,), dtype) for n in SHARDS], ((2, 3), dtype))


def backward_model(group_name: str, stage: int = 2, dtype=torch.float32, fqns=FQNS) -> fx.GraphModule:
    """Four gradients computed (g * 2) and reduced one after another, returned as the outputs."""

    def f(g1, g2, g3, g4):
        grads = (g1, g2, g3, g4)
        return tuple(
            REDUCE_GRAD(g * 2, math.prod(s) if stage == 0 else n, stage, group_name, fqn)
            for g, s, n, fqn in zip(grads, SHAPES, SHARDS, fqns)
        )

    return trace(f, *[(tuple(s), dtype) for s in SHAPES])


def gather_model(specs: list[tuple]) -> fx.GraphModule:
    """One marker per spec (shape, stage, group, dtype, computed_shard), outputs the full values.

    A computed shard is `shard * 2`, traced just before its marker."""

    def f(*shards):
        outs = []
        for s, (full, stage, group, _, computed) in zip(shards, specs):
            outs.append(UNSHARD(s * 2 if computed else s, list(full), stage, group))
        return tuple(outs)

    def shard_numel(full, group):
        return math.ceil(math.prod(full) / lowering.group_size(group))

    return trace(f, *[((shard_numel(full, group),), dtype) for full, _, group, dtype, _ in specs])


def reduce_model(specs: list[tuple]) -> fx.GraphModule:
    """One reduce_grad per spec (shape, stage, group, dtype, extra_user), of `g * 2`; the result
    goes to the output, and with extra_user also into `result + 1` (also returned)."""

    def f(*grads):
        outs = []
        for g, (full, stage, group, _, extra_user) in zip(grads, specs):
            numel = math.prod(full) if stage == 0 else math.ceil(math.prod(full) / lowering.group_size(group))
            r = REDUCE_GRAD(g * 2, numel, stage, group)
            outs.append(r)
            if extra_user:
                outs.append(r + 1)
        return tuple(outs)

    return trace(f, *[(tuple(full), dtype) for full, _, _, dtype, _ in specs])


# ----------------------------------------------------------------- lockstep simulation of ranks


def _all_gather(inputs, world_size, group):
    assert world_size == len(inputs)
    return [torch.cat(inputs)] * len(inputs)


def _reduce_scatter(inputs, op, world_size, group):
    assert world_size == len(inputs) and op in ("sum", "avg")
    total = torch.stack(inputs).sum(0)
    if op == "avg":
        total = total / world_size
    return list(total.chunk(world_size))


def _all_to_all(inputs, output_splits, input_splits, group):
    world = len(inputs)
    assert len(input_splits) == len(output_splits) == world
    pieces = [x.split(input_splits) for x in inputs]
    return [torch.cat([pieces[sender][receiver] for sender in range(world)]) for receiver in range(world)]


def _all_reduce(inputs, op, group):
    assert op in ("sum", "avg")
    total = torch.stack(inputs).sum(0)
    return [total / len(inputs) if op == "avg" else total] * len(inputs)


SIMULATED = {
    funcol.all_gather_into_tensor.default: _all_gather,
    funcol.reduce_scatter_tensor.default: _reduce_scatter,
    funcol.all_to_all_single.default: _all_to_all,
    funcol.all_reduce.default: _all_reduce,
}


def run_ranks(graph: fx.Graph, inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Run `graph` on every rank's inputs in lockstep; each collective sees all ranks' inputs.

    Returns each rank's outputs. wait_tensor is the identity (results are ready at once)."""
    envs: list[dict] = [{} for _ in inputs]
    placeholders = graph.find_nodes(op="placeholder")
    for env, rank_inputs in zip(envs, inputs):
        assert len(rank_inputs) == len(placeholders)
        env.update(zip(placeholders, rank_inputs))
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            return [list(fx.node.map_arg(node.args[0], env.__getitem__)) for env in envs]
        assert node.op == "call_function", node.format_node()
        args = [fx.node.map_arg(node.args, env.__getitem__) for env in envs]
        kwargs = [fx.node.map_arg(node.kwargs, env.__getitem__) for env in envs]
        if node.target in SIMULATED:
            assert not node.kwargs
            results = SIMULATED[node.target]([a[0] for a in args], *args[0][1:])
        elif node.target is funcol.wait_tensor.default:
            results = [a[0] for a in args]
        else:
            results = [node.target(*a, **k) for a, k in zip(args, kwargs)]
        for env, result in zip(envs, results):
            env[node] = result
    raise AssertionError("graph without output")


def shard_of(full: torch.Tensor, rank: int, world: int = WORLD) -> torch.Tensor:
    """Rank `rank`'s flat shard of `full`, zero-padded to a multiple of `world` (as the sharding)."""
    flat = full.reshape(-1)
    shard = math.ceil(flat.numel() / world)
    return torch.nn.functional.pad(flat, (0, shard * world - flat.numel())).view(world, shard)[rank].clone()


def test_run_ranks_simulates_collectives_by_rank(group_name):
    """The simulator itself: rank order of all-gather, chunks of reduce-scatter, all-to-all routing."""

    def f(a, b, c):
        gathered = funcol.wait_tensor(funcol.all_gather_into_tensor(a, WORLD, group_name))
        scattered = funcol.wait_tensor(funcol.reduce_scatter_tensor(b, "sum", WORLD, group_name))
        routed = funcol.wait_tensor(funcol.all_to_all_single(c, [1] * WORLD, [1] * WORLD, group_name))
        return gathered, scattered, routed

    gm = trace(f, (2,), (4,), (4,))
    inputs = [[torch.tensor([r, 10.0 + r]), torch.arange(4.0) * (r + 1), torch.arange(4.0) + 10 * r] for r in range(WORLD)]

    outs = run_ranks(gm.graph, inputs)

    for r, (gathered, scattered, routed) in enumerate(outs):
        assert gathered.tolist() == [0, 10, 1, 11, 2, 12, 3, 13]
        assert scattered.tolist() == [r * (1 + 2 + 3 + 4)]
        assert routed.tolist() == [r, 10 + r, 20 + r, 30 + r]


# ----------------------------------------------------------------------- gathers: bucket layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_bucket_is_one_all_gather_of_the_packed_shards(group_name, dtype):
    gm = forward_model(group_name, dtype=dtype)
    s1, s2, s3, s4, x = gm.graph.find_nodes(op="placeholder")

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(gathers=4, gather_buckets=1)
    total = sum(SHARDS)  # 12
    (ag,) = find(gm.graph, funcol.all_gather_into_tensor.default)
    packed = ag.args[0]
    assert packed.target is PACK and packed.args == ([s1, s2, s3, s4], 1, list(SHARDS))
    assert ag.args[1:] == (WORLD, group_name)
    (wait,) = ag.users
    assert wait.target is funcol.wait_tensor.default
    (unpacked,) = wait.users
    numels = [math.prod(full) for full in SHAPES]
    assert unpacked.target is UNPACK and unpacked.args == (wait, WORLD, list(SHARDS), numels)
    assert [shape(n) for n in (packed, ag, wait)] == [(total,), (WORLD * total,), (WORLD * total,)]

    # Per parameter: getitem (its flat, unpadded copy out of the bucket) -> view in its shape.
    pieces = sorted(unpacked.users, key=lambda n: n.args[1])
    assert [p.target for p in pieces] == [operator.getitem] * 4 and [p.args[1] for p in pieces] == [0, 1, 2, 3]
    fulls = []
    for piece, full, numel in zip(pieces, SHAPES, numels):
        (view,) = piece.users
        assert view.target is aten.view.default and view.args == (piece, full)
        assert shape(piece) == (numel,) and shape(view) == tuple(full)
        assert {n.meta["val"].dtype for n in (packed, ag, wait, piece, view)} == {dtype}
        fulls.append(view)

    # The compute now reads the full views, in the right places.
    mm1, mm2, mm3 = find(gm.graph, aten.mm.default)
    (add,) = find(gm.graph, aten.add.Tensor)
    assert (mm1.args[1], mm2.args[1], mm3.args[1], add.args[1]) == tuple(fulls)
    # The bucket goes where its first marker was: after the first relu, before the first mm.
    relu = aten.relu.default
    assert call_targets(gm.graph) == [
        relu,
        PACK,
        funcol.all_gather_into_tensor.default,
        funcol.wait_tensor.default,
        UNPACK,
        *[operator.getitem] * 4,
        *[aten.view.default] * 4,
        aten.mm.default,
        relu,
        aten.mm.default,
        aten.mm.default,
        aten.add.Tensor,
    ]


@pytest.mark.parametrize(
    "dtype, bucket_bytes, expected",
    [
        # full bytes in float32: 60, 80, 32, 8 (bfloat16: half)
        (torch.float32, 0, [["s1_1"], ["s2_1"], ["s3_1"], ["s4_1"]]),
        (torch.float32, 59, [["s1_1"], ["s2_1"], ["s3_1", "s4_1"]]),  # an oversized marker is alone
        (torch.float32, 70, [["s1_1"], ["s2_1"], ["s3_1", "s4_1"]]),
        (torch.float32, 139, [["s1_1"], ["s2_1", "s3_1", "s4_1"]]),  # 60 + 80 > 139
        (torch.float32, 140, [["s1_1", "s2_1"], ["s3_1", "s4_1"]]),  # 60 + 80 == 140 fits
        (torch.float32, 179, [["s1_1", "s2_1", "s3_1"], ["s4_1"]]),
        (torch.float32, 180, [["s1_1", "s2_1", "s3_1", "s4_1"]]),
        (torch.bfloat16, 70, [["s1_1", "s2_1"], ["s3_1", "s4_1"]]),  # 30 + 40: bytes, not elements
        (torch.bfloat16, 89, [["s1_1", "s2_1", "s3_1"], ["s4_1"]]),
    ],
)
def test_gather_buckets_close_when_the_next_marker_would_exceed_bucket_bytes(group_name, dtype, bucket_bytes, expected):
    gm = forward_model(group_name, dtype=dtype)

    counts = lower(gm, bucket_bytes=bucket_bytes)

    assert counts == counts_of(gathers=4, gather_buckets=len(expected))
    assert gathered_shards(gm.graph) == expected
    shard_numel = dict(zip(["s1_1", "s2_1", "s3_1", "s4_1"], SHARDS))
    for ag, names in zip(find(gm.graph, funcol.all_gather_into_tensor.default), expected):
        assert shape(ag) == (WORLD * sum(shard_numel[n] for n in names),)
    # Every use still reads a value of the parameter's full shape.
    mm1, mm2, mm3 = find(gm.graph, aten.mm.default)
    (add,) = find(gm.graph, aten.add.Tensor)
    assert [shape(n.args[1]) for n in (mm1, mm2, mm3, add)] == [tuple(s) for s in SHAPES]


@pytest.mark.parametrize("kind", ["stage", "dtype", "group"])
def test_gather_buckets_never_mix_stage_group_or_dtype(group_name, subgroup_name, kind):
    """Four markers in a row, the middle two different from the outer two: three buckets."""
    f32, bf16 = torch.float32, torch.bfloat16
    outer = {"stage": (1, group_name, f32), "dtype": (3, group_name, f32), "group": (3, group_name, f32)}[kind]
    inner = {"stage": (2, group_name, f32), "dtype": (3, group_name, bf16), "group": (3, subgroup_name, f32)}[kind]
    shapes = [(3, 5), (5, 4), (4, 2), (2,)]
    kinds = [outer, inner, inner, outer]
    gm = gather_model([(full, stage, group, dtype, False) for full, (stage, group, dtype) in zip(shapes, kinds)])

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(gathers=4, gather_buckets=3)
    assert gathered_shards(gm.graph) == [["arg0_1"], ["arg1_1", "arg2_1"], ["arg3_1"]]
    ags = find(gm.graph, funcol.all_gather_into_tensor.default)
    inner_world = 2 if kind == "group" else WORLD
    assert [ag.args[1:] for ag in ags] == [
        (WORLD, group_name),
        (inner_world, kinds[1][1]),
        (WORLD, group_name),
    ]
    assert [ag.meta["val"].dtype for ag in ags] == [outer[2], inner[2], outer[2]]
    inner_numel = sum(math.ceil(math.prod(s) / inner_world) for s in shapes[1:3])
    assert [shape(ag) for ag in ags] == [(16,), (inner_world * inner_numel,), (4,)]
    assert [shape(out) for out in output_args(gm.graph)] == shapes
    if kind == "stage":  # stages 1 and 2 gather at the start, in program order
        first = list(gm.graph.nodes)[len(shapes)]
        assert first.target is funcol.all_gather_into_tensor.default and first is ags[0]


def test_gather_of_a_computed_shard_stays_alone(group_name):
    specs = [((3, 5), 3, group_name, torch.float32, False), ((5, 4), 3, group_name, torch.float32, True)]
    specs += [((4, 2), 3, group_name, torch.float32, False), ((2,), 3, group_name, torch.float32, False)]
    gm = gather_model(specs)

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(gathers=4, gather_buckets=3)
    # s1 cannot take s2 (computed), and s3 cannot join s2's bucket: [s1], [s2 * 2], [s3, s4]
    assert gathered_shards(gm.graph) == [["arg0_1"], ["mul"], ["arg2_1", "arg3_1"]]
    (mul,) = find(gm.graph, aten.mul.Tensor)
    ags = find(gm.graph, funcol.all_gather_into_tensor.default)
    index = node_index(gm.graph)
    assert index[mul] < index[ags[1]]
    assert [shape(out) for out in output_args(gm.graph)] == [(3, 5), (5, 4), (4, 2), (2,)]


# ------------------------------------------------------------------------ reductions: bucket layout


@pytest.mark.parametrize("textbook", [True, False], ids=["reduce_scatter", "gloo_all_to_all"])
def test_reduction_bucket_is_one_collective_over_rank_major_blocks(group_name, textbook, monkeypatch):
    if not textbook:
        monkeypatch.setattr(lowering, "sends_textbook_reduce_scatter", lambda name: False)
    gm = backward_model(group_name, stage=2)
    grads = find(gm.graph, aten.mul.Tensor)

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(reductions=4, reduction_buckets=1)
    total = sum(SHARDS)
    # One pack of WORLD rows: rank r's row holds its shard of each gradient (layout: test_pack_*).
    (packed,) = find(gm.graph, PACK)
    assert packed.args == (grads, WORLD, list(SHARDS)) and shape(packed) == (WORLD * total,)
    if textbook:
        (rs,) = find(gm.graph, funcol.reduce_scatter_tensor.default)
        assert find(gm.graph, funcol.all_to_all_single.default) == []
        assert rs.args == (packed, "avg", WORLD, group_name) and shape(rs) == (total,)
        (wait,) = rs.users
        reduced = wait
        collective_ops = [funcol.reduce_scatter_tensor.default, funcol.wait_tensor.default]
    else:
        (a2a,) = find(gm.graph, funcol.all_to_all_single.default)
        assert find(gm.graph, funcol.reduce_scatter_tensor.default) == []
        assert a2a.args == (packed, [total] * WORLD, [total] * WORLD, group_name) and shape(a2a) == (WORLD * total,)
        (wait,) = a2a.users
        (rows,) = wait.users
        assert rows.target is aten.view.default and rows.args == (wait, [WORLD, total])
        (summed,) = rows.users
        assert summed.target is aten.sum.dim_IntList and summed.args == (rows, [0])
        (reduced,) = summed.users
        assert reduced.target is aten.div.Tensor and reduced.args == (summed, WORLD) and shape(reduced) == (total,)
        collective_ops = [
            funcol.all_to_all_single.default,
            funcol.wait_tensor.default,
            aten.view.default,
            aten.sum.dim_IntList,
            aten.div.Tensor,
        ]
    (split,) = reduced.users
    assert split.target is aten.split_with_sizes.default and split.args == (reduced, list(SHARDS))
    outs = output_args(gm.graph)
    assert [o.target for o in outs] == [operator.getitem] * 4
    assert [(o.args[0], o.args[1]) for o in outs] == [(split, i) for i in range(4)]
    assert [shape(o) for o in outs] == [(n,) for n in SHARDS]
    assert call_targets(gm.graph) == [
        *[aten.mul.Tensor] * 4,
        PACK,
        *collective_ops,
        aten.split_with_sizes.default,
        *[operator.getitem] * 4,
    ]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_pack_lays_out_rank_major_padded_blocks(dtype):
    """pack(tensors, rows, row_numels): row r holds, back to back, part r of each flattened,
    zero-padded tensor - what each rank of a reduce-scatter receives; cast to `dtype`."""
    grads = [torch.arange(15.0).view(3, 5), torch.arange(100.0, 120.0).view(5, 4), torch.tensor([7.0, 8.0])]
    packed = lowering.pack(grads, WORLD, [4, 5, 1], dtype)
    assert packed.shape == (WORLD * 10,) and packed.dtype == (dtype or torch.float32)
    rows = packed.view(WORLD, 10).float()
    padded = [torch.cat([g.reshape(-1), g.new_zeros(WORLD * n - g.numel())]) for g, n in zip(grads, [4, 5, 1])]
    for rank in range(WORLD):
        expected = torch.cat([p.view(WORLD, n)[rank] for p, n in zip(padded, [4, 5, 1])])
        assert torch.equal(rows[rank], expected.to(packed.dtype).float())


def test_pack_of_one_row_is_the_concatenation():
    shards = [torch.ones(3), torch.zeros(2, 2)]
    assert torch.equal(lowering.pack(shards, 1, [3, 4]), torch.tensor([1.0, 1, 1, 0, 0, 0, 0]))


def test_stage0_reduction_bucket_is_one_all_reduce_viewed_back(group_name):
    gm = backward_model(group_name, stage=0)
    grads = find(gm.graph, aten.mul.Tensor)

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(reductions=4, reduction_buckets=1)
    (ar,) = find(gm.graph, funcol.all_reduce.default)
    numels = [math.prod(s) for s in SHAPES]
    packed = ar.args[0]
    assert packed.target is PACK and packed.args == (grads, 1, numels)
    assert shape(packed) == (sum(FULL_BYTES_F32) // 4,)
    assert ar.args[1:] == ("sum", group_name)
    (wait,) = ar.users
    (mean,) = wait.users
    assert mean.target is aten.div.Tensor and mean.args == (wait, WORLD)
    (split,) = mean.users
    numels = [math.prod(s) for s in SHAPES]
    assert split.target is aten.split_with_sizes.default and split.args == (mean, numels)
    outs = output_args(gm.graph)
    for out, full, i in zip(outs, SHAPES, range(4)):
        assert out.target is aten.view.default and out.args[1] == full
        assert out.args[0].target is operator.getitem and out.args[0].args == (split, i)
        assert shape(out) == tuple(full) and out.meta["val"].is_contiguous()
    assert call_targets(gm.graph) == [
        *[aten.mul.Tensor] * 4,
        PACK,
        funcol.all_reduce.default,
        funcol.wait_tensor.default,
        aten.div.Tensor,
        aten.split_with_sizes.default,
        *[operator.getitem] * 4,
        *[aten.view.default] * 4,
    ]


@pytest.mark.parametrize("bucket_bytes, sizes", [(0, [1, 1, 1, 1]), (139, [1, 3]), (140, [2, 2]), (179, [3, 1]), (180, [4])])
def test_reduction_buckets_close_at_bucket_bytes_of_full_gradients(group_name, bucket_bytes, sizes):
    gm = backward_model(group_name, stage=2)

    counts = lower(gm, bucket_bytes=bucket_bytes)

    assert counts == counts_of(reductions=4, reduction_buckets=len(sizes))
    collectives = find(gm.graph, funcol.reduce_scatter_tensor.default)
    assert [len(bucket_members(rs)) for rs in collectives] == sizes
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    starts = [0, *ends[:-1]]
    assert [shape(rs) for rs in collectives] == [(sum(SHARDS[a:b]),) for a, b in zip(starts, ends)]
    assert [shape(o) for o in output_args(gm.graph)] == [(n,) for n in SHARDS]


@pytest.mark.parametrize("kind", ["stage", "dtype", "group"])
def test_reduction_buckets_never_mix_stage_group_or_dtype(group_name, subgroup_name, kind):
    f32, bf16 = torch.float32, torch.bfloat16
    outer = {"stage": (2, group_name, f32), "dtype": (3, group_name, f32), "group": (3, group_name, f32)}[kind]
    inner = {"stage": (3, group_name, f32), "dtype": (3, group_name, bf16), "group": (3, subgroup_name, f32)}[kind]
    shapes = [(3, 5), (5, 4), (4, 2), (2,)]
    kinds = [outer, inner, inner, outer]
    gm = reduce_model([(full, stage, group, dtype, False) for full, (stage, group, dtype) in zip(shapes, kinds)])

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(reductions=4, reduction_buckets=3)
    rss = find(gm.graph, funcol.reduce_scatter_tensor.default)
    inner_world = 2 if kind == "group" else WORLD
    assert [rs.args[1:] for rs in rss] == [("avg", WORLD, group_name), ("avg", inner_world, kinds[1][1]), ("avg", WORLD, group_name)]
    assert [rs.meta["val"].dtype for rs in rss] == [outer[2], inner[2], outer[2]]
    assert [len(bucket_members(rs)) for rs in rss] == [1, 2, 1]
    inner_shards = [math.ceil(math.prod(s) / inner_world) for s in shapes[1:3]]
    assert [shape(rs) for rs in rss] == [(4,), (sum(inner_shards),), (1,)]
    assert [shape(o) for o in output_args(gm.graph)] == [(4,), *[(n,) for n in inner_shards], (1,)]


def test_reduction_read_by_another_node_stays_alone(group_name):
    specs = [((3, 5), 2, group_name, torch.float32, False), ((5, 4), 2, group_name, torch.float32, True)]
    specs += [((4, 2), 2, group_name, torch.float32, False), ((2,), 2, group_name, torch.float32, False)]
    gm = reduce_model(specs)

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(reductions=4, reduction_buckets=3)
    rss = find(gm.graph, funcol.reduce_scatter_tensor.default)
    # [r1], [r2 (read by `r2 + 1`)], [r3, r4]: r3 cannot join the bucket of the unmovable r2
    assert [len(bucket_members(rs)) for rs in rss] == [1, 1, 2]
    assert [shape(rs) for rs in rss] == [(4,), (5,), (3,)]
    r1, r2, plus, r3, r4 = output_args(gm.graph)
    assert plus.target is aten.add.Tensor and plus.args == (r2, 1)
    assert r2.target is funcol.wait_tensor.default and r2.args == (rss[1],)
    index = node_index(gm.graph)
    assert index[r2] < index[plus] < index[rss[2]]


# -------------------------------------------------------------- numbers: lockstep simulated ranks


def _forward_inputs(dtype=torch.float64):
    """Full parameters, each rank's inputs of `forward_model` (its shards and x), the model's output."""
    torch.manual_seed(0)
    fulls = [torch.randn(s, dtype=dtype) for s in SHAPES]
    x = torch.randn(2, 3, dtype=dtype)
    per_rank = [[*(shard_of(w, r) for w in fulls), x] for r in range(WORLD)]
    expected = ((x.relu() @ fulls[0]).relu() @ fulls[1] @ fulls[2]) + fulls[3]
    return fulls, per_rank, expected


def _with_outputs(gm: fx.GraphModule) -> fx.GraphModule:
    """Also return each full parameter (the value that replaced each marker's use)."""
    mms = find(gm.graph, aten.mm.default)
    (add,) = find(gm.graph, aten.add.Tensor)
    uses = [mm.args[1] for mm in mms] + [add.args[1]]
    (y,) = output_args(gm.graph)
    gm.graph.output_node().args = ((y, *uses),)
    return gm


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("bucket_bytes", [0, 280, 350, 10**9])  # float64: 120, 160, 64, 16 bytes
def test_simulated_bucketed_gathers_rebuild_each_full_parameter(group_name, bucket_bytes, prefetch):
    fulls, per_rank, expected = _forward_inputs()
    gm = forward_model(group_name, dtype=torch.float64)
    lower(gm, bucket_bytes=bucket_bytes, prefetch=prefetch)
    _with_outputs(gm)
    gm.graph.lint()

    outs = run_ranks(gm.graph, per_rank)

    for rank_outs in outs:
        y, *params = rank_outs
        for got, want in zip(params, fulls):
            assert got.shape == want.shape and torch.equal(got, want)
        torch.testing.assert_close(y, expected)


def test_simulated_gather_bucket_depends_on_rank_order(group_name):
    """Control: the comparison above notices a wrong layout (two ranks' shards swapped)."""
    fulls, per_rank, _ = _forward_inputs()
    gm = forward_model(group_name, dtype=torch.float64)
    lower(gm, bucket_bytes=10**9)
    _with_outputs(gm)

    outs = run_ranks(gm.graph, [per_rank[1], per_rank[0], *per_rank[2:]])

    _, *params = outs[0]
    assert [torch.equal(got, want) for got, want in zip(params, fulls)] == [False] * 4


def _reduction_case(stage: int):
    """Each rank's four gradients (inputs of `backward_model`), and each rank's expected results."""
    torch.manual_seed(1)
    grads = [[torch.randn(s, dtype=torch.float64) for s in SHAPES] for _ in range(WORLD)]
    # what each rank must end with, per parameter: the mean of (g * 2) over ranks, its shard at stage >= 1
    means = [sum(grads[r][i] * 2 for r in range(WORLD)) / WORLD for i in range(len(SHAPES))]
    if stage == 0:
        expected = [means for _ in range(WORLD)]
    else:
        expected = [[shard_of(m, r) for m in means] for r in range(WORLD)]
    return grads, expected


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("bucket_bytes", [200, 280, 350, 10**9])  # float64: 120, 160, 64, 16 bytes
@pytest.mark.parametrize("stage, textbook", [(2, True), (2, False), (1, True), (0, True)], ids=["s2", "s2-gloo", "s1", "s0"])
def test_simulated_bucketed_reductions_match_per_parameter_reductions(group_name, monkeypatch, stage, textbook, bucket_bytes, prefetch):
    if not textbook:
        monkeypatch.setattr(lowering, "sends_textbook_reduce_scatter", lambda name: False)
    inputs, expected = _reduction_case(stage)
    bucketed = backward_model(group_name, stage=stage, dtype=torch.float64)
    single = backward_model(group_name, stage=stage, dtype=torch.float64)
    assert lower(bucketed, bucket_bytes=bucket_bytes, prefetch=prefetch)["reduction_buckets"] < 4
    assert lower(single)["reduction_buckets"] == 4  # the per-parameter functions

    got, reference = run_ranks(bucketed.graph, inputs), run_ranks(single.graph, inputs)

    for rank in range(WORLD):
        for mine, theirs, want in zip(got[rank], reference[rank], expected[rank]):
            assert mine.shape == want.shape == theirs.shape
            torch.testing.assert_close(mine, want)
            torch.testing.assert_close(mine, theirs)


# -------------------------------------------------------------------------------- prefetch: gathers


def _three_layer_stage3(group_name: str, computed_second: bool = False) -> fx.GraphModule:
    """x @ w1 [3, 5] @ w2 [5, 4] @ w3 [4, 2]: three gathers separated by matmuls."""

    def f(s1, s2, s3, x):
        h = x @ UNSHARD(s1, [3, 5], 3, group_name, "w1")
        h = h @ UNSHARD(s2 * 2 if computed_second else s2, [5, 4], 3, group_name, "w2")
        return (h @ UNSHARD(s3, [4, 2], 3, group_name, "w3"),)

    return trace(f, (4,), (5,), (2,), (2, 3))


AG, WAIT = funcol.all_gather_into_tensor.default, funcol.wait_tensor.default
SLICE, VIEW, MM = aten.slice.Tensor, aten.view.default, aten.mm.default


@pytest.mark.parametrize(
    "prefetch, expected",
    [
        # w1 is padded (16 -> slice 15); w2 and w3 are not. Single-parameter buckets.
        (0, [AG, WAIT, SLICE, VIEW, MM, AG, WAIT, VIEW, MM, AG, WAIT, VIEW, MM]),
        (1, [AG, WAIT, AG, SLICE, VIEW, MM, WAIT, AG, VIEW, MM, WAIT, VIEW, MM]),
        # the first `prefetch` buckets are issued up front, one after another
        (2, [AG, AG, WAIT, AG, SLICE, VIEW, MM, WAIT, VIEW, MM, WAIT, VIEW, MM]),
        (3, [AG, AG, AG, WAIT, SLICE, VIEW, MM, WAIT, VIEW, MM, WAIT, VIEW, MM]),
    ],
)
def test_prefetch_issues_each_gather_after_the_wait_of_the_bucket_prefetch_ahead(group_name, prefetch, expected):
    gm = _three_layer_stage3(group_name)
    shards = gm.graph.find_nodes(op="placeholder")[:3]

    counts = lower(gm, prefetch=prefetch)

    assert counts == counts_of(gathers=3, gather_buckets=3)
    assert call_targets(gm.graph) == expected
    # bucket k is the all-gather of shard k, wherever it now is
    by_shard = {ag.args[0]: ag for ag in find(gm.graph, AG)}
    ags = [by_shard[s] for s in shards]
    waits = [next(iter(ag.users)) for ag in ags]
    mms = find(gm.graph, MM)
    index = node_index(gm.graph)
    nodes = list(gm.graph.nodes)
    for k, (ag, wait, mm) in enumerate(zip(ags, waits, mms)):
        assert wait.target is WAIT and len(ag.users) == 1
        # the wait stays before its first use, after the previous layer's matmul
        assert (index[mms[k - 1]] if k else 0) < index[wait] < index[mm]
        assert unwrap_views(mm.args[1]) is wait  # the matmul reads this bucket's parameter
        if prefetch and k >= prefetch:  # issued right after the wait `prefetch` buckets back
            assert nodes[index[waits[k - prefetch]] + 1] is ag
        elif prefetch and k:  # one of the first `prefetch` buckets: right after the previous issue
            assert nodes[index[ags[k - 1]] + 1] is ag
        elif prefetch <= 1:  # not moved: right before its own wait
            assert nodes[index[wait] - 1] is ag
        else:  # bucket 0: not moved, but the next buckets' gathers now sit between it and its wait
            assert nodes[index[wait] - min(prefetch, len(ags))] is ag


def test_prefetch_two_issues_the_second_gather_no_later_than_prefetch_one(group_name):
    one, two = _three_layer_stage3(group_name), _three_layer_stage3(group_name)
    lower(one, prefetch=1)
    lower(two, prefetch=2)

    for gm in (one, two):
        index = node_index(gm.graph)
        s2 = gm.graph.find_nodes(op="placeholder")[1]
        (ag2,) = [ag for ag in find(gm.graph, AG) if ag.args[0] is s2]
        mm1 = find(gm.graph, MM)[0]
        assert index[ag2] < index[mm1], f"w2's all-gather after the first matmul:\n{gm.graph}"


def test_prefetch_moves_the_pack_with_its_all_gather(group_name):
    gm = forward_model(group_name)
    s1, s2, s3, s4, _ = gm.graph.find_nodes(op="placeholder")

    counts = lower(gm, bucket_bytes=140, prefetch=1)  # [w1, w2], [w3, bias]

    assert counts == counts_of(gathers=4, gather_buckets=2)
    _pack1, pack2 = find(gm.graph, PACK)
    ag1, ag2 = find(gm.graph, AG)
    wait1, wait2 = find(gm.graph, WAIT)
    assert pack2.args[0] == [s3, s4] and ag2.args[0] is pack2
    nodes = list(gm.graph.nodes)
    index = node_index(gm.graph)
    assert nodes[index[wait1] + 1 : index[wait1] + 3] == [pack2, ag2]
    assert nodes[index[wait1] + 3].target is UNPACK and nodes[index[wait1] + 3].args[0] is wait1
    # bucket 2's wait stays just before its unpacking, after bucket 1's last use (the second mm)
    mm2 = find(gm.graph, MM)[1]
    assert index[mm2] < index[wait2] and nodes[index[wait2] + 1].args[0] is wait2


@pytest.mark.parametrize("stage", [1, 2])
def test_prefetch_stage12_waits_each_gather_at_first_use_and_issues_the_next_after_it(group_name, stage):
    gm = forward_model(group_name, stage=stage)

    assert lower(gm, bucket_bytes=140, prefetch=1) == counts_of(gathers=4, gather_buckets=2)

    # buckets [w1, w2] and [w3, b3]: the first issued at the top, waited on just before w1's
    # matmul; the second issued right after that wait, waited on just before w3's matmul
    relu = aten.relu.default
    pack1, pack2 = find(gm.graph, PACK)
    ag1, ag2 = find(gm.graph, AG)
    wait1, wait2 = find(gm.graph, WAIT)
    mm1, mm2, mm3 = find(gm.graph, MM)
    nodes = list(gm.graph.nodes)
    index = node_index(gm.graph)
    n_placeholders = len(gm.graph.find_nodes(op="placeholder"))
    assert nodes[n_placeholders : n_placeholders + 3] == [pack1, ag1, find(gm.graph, relu)[0]]
    assert nodes[index[wait1] : index[wait1] + 3] == [wait1, pack2, ag2]
    assert index[ag2] < index[mm1] < index[mm2] < index[wait2] < index[mm3]
    assert nodes[index[mm2] + 1] is wait2
    assert [shape(out) for out in output_args(gm.graph)] == [(2, 2)]


def test_prefetch_does_not_move_a_gather_of_a_computed_shard(group_name):
    gm = _three_layer_stage3(group_name, computed_second=True)
    s1, s2, s3, _ = gm.graph.find_nodes(op="placeholder")

    lower(gm, prefetch=1)

    # bucket 2 (shard s2 * 2) stays after its mul; bucket 3 moves up behind bucket 2's wait
    mul = aten.mul.Tensor
    assert call_targets(gm.graph) == [AG, WAIT, SLICE, VIEW, MM, mul, AG, WAIT, AG, VIEW, MM, WAIT, VIEW, MM]
    ag1, ag2, ag3 = find(gm.graph, AG)
    assert ag2.args[0].target is mul and ag2.args[0].args == (s2, 2)
    assert (ag1.args[0], ag3.args[0]) == (s1, s3)


# ----------------------------------------------------------------------------- prefetch: reductions


def _three_reductions(group_name: str) -> fx.GraphModule:
    """Three gradients produced between other compute, each reduced where it is produced."""

    def f(g1, g2, g3):
        r1 = REDUCE_GRAD(g1 * 2, 4, 2, group_name, "w1")  # [3, 5]: padded
        r2 = REDUCE_GRAD(g2 + 1, 5, 2, group_name, "w2")  # [5, 4]
        r3 = REDUCE_GRAD(g3.sin(), 2, 2, group_name, "w3")  # [4, 2]
        return r1, r2, r3

    return trace(f, (3, 5), (5, 4), (4, 2))


MUL, ADD, SIN, COS = aten.mul.Tensor, aten.add.Tensor, aten.sin.default, aten.cos.default
RS, A2A, SUM, DIV = funcol.reduce_scatter_tensor.default, funcol.all_to_all_single.default, aten.sum.dim_IntList, aten.div.Tensor


@pytest.mark.parametrize(
    "prefetch, textbook, expected",
    [
        (0, True, [MUL, PACK, RS, WAIT, ADD, VIEW, RS, WAIT, SIN, VIEW, RS, WAIT]),
        (1, True, [MUL, PACK, RS, ADD, WAIT, VIEW, RS, SIN, WAIT, VIEW, RS, WAIT]),
        (2, True, [MUL, PACK, RS, ADD, WAIT, VIEW, RS, SIN, WAIT, VIEW, RS, WAIT]),  # always one ahead
        (
            1,
            False,
            [MUL, PACK, A2A, ADD, WAIT, VIEW, SUM, DIV, VIEW, A2A, SIN, WAIT, VIEW, SUM, DIV]
            + [VIEW, A2A, WAIT, VIEW, SUM, DIV],
        ),
    ],
    ids=["none", "one", "two", "one-gloo"],
)
def test_prefetch_waits_each_reduction_just_before_the_next_starts(group_name, monkeypatch, prefetch, textbook, expected):
    if not textbook:
        monkeypatch.setattr(lowering, "sends_textbook_reduce_scatter", lambda name: False)
    gm = _three_reductions(group_name)

    counts = lower(gm, prefetch=prefetch)

    assert counts == counts_of(reductions=3, reduction_buckets=3)
    assert call_targets(gm.graph) == expected
    # the last bucket's wait (and unpacking) is untouched: the outputs are its values
    outs = output_args(gm.graph)
    last = outs[-1]
    assert (last.target, shape(last)) == ((WAIT, (2,)) if textbook else (DIV, (2,)))
    assert [shape(o) for o in outs] == [(4,), (5,), (2,)]


def test_prefetch_moves_a_reduction_buckets_wait_and_unpacking_before_the_next_bucket(group_name):
    def f(g1, g2, g3, g4):
        r1 = REDUCE_GRAD(g1 * 2, 4, 2, group_name, "w1")  # [3, 5]
        r2 = REDUCE_GRAD(g2 * 2, 5, 2, group_name, "w2")  # [5, 4]: bucket [r1, r2], 140 bytes
        r3 = REDUCE_GRAD(g3.sin(), 2, 2, group_name, "w3")  # [4, 2]
        r4 = REDUCE_GRAD(g4.cos(), 1, 2, group_name, "b3")  # [2]: bucket [r3, r4]
        return r1, r2, r3, r4

    gm = trace(f, (3, 5), (5, 4), (4, 2), (2,))

    assert lower(gm, bucket_bytes=140, prefetch=1) == counts_of(reductions=4, reduction_buckets=2)

    split, getitem = aten.split_with_sizes.default, operator.getitem
    assert call_targets(gm.graph) == [
        MUL,
        MUL,
        *[PACK, RS],  # bucket 1 issued where r2 was
        SIN,
        COS,
        *[WAIT, split, getitem, getitem],  # bucket 1 waited on only now: in flight over sin, cos
        *[PACK, RS],  # bucket 2
        *[WAIT, split, getitem, getitem],  # the last bucket's wait stays after its collective
    ]
    rs1, rs2 = find(gm.graph, RS)
    wait1, wait2 = find(gm.graph, WAIT)
    split1, split2 = find(gm.graph, split)
    sin_node, cos_node = find(gm.graph, SIN)[0], find(gm.graph, COS)[0]
    assert wait1.args == (rs1,) and split1.args[0] is wait1 and wait2.args == (rs2,) and split2.args[0] is wait2
    nodes = list(gm.graph.nodes)
    index = node_index(gm.graph)
    packing_2 = nodes[index[split1] + 3]
    assert packing_2.target is PACK and packing_2.args[0] == [sin_node, cos_node]
    assert nodes[index[cos_node] + 1] is wait1
    assert [shape(o) for o in output_args(gm.graph)] == [(4,), (5,), (2,), (1,)]


def test_prefetch_keeps_the_wait_of_a_reduction_read_in_the_graph_before_its_reader(group_name):
    specs = [((3, 5), 2, group_name, torch.float32, True), ((5, 4), 2, group_name, torch.float32, False)]
    gm = reduce_model(specs)

    lower(gm, prefetch=1)

    r1, plus, _ = output_args(gm.graph)
    index = node_index(gm.graph)
    assert index[r1] < index[plus]


# ------------------------------------------------------------------------- ledger and analysis


def test_ledger_of_a_bucketed_forward_lists_every_member(group_name):
    gm = forward_model(group_name)
    lower(gm, bucket_bytes=140, prefetch=1)

    entries = ledger.graph_ledger(gm.graph, "forward").entries

    assert [e.op for e in entries] == ["all_gather", "all_gather"]
    assert [e.params for e in entries] == [list(FQNS[:2]), list(FQNS[2:])]
    assert [e.param_bytes for e in entries] == [[16, 20], [8, 4]]  # shard bytes (float32)
    assert [e.input_bytes for e in entries] == [36, 12]
    assert [e.sent_bytes for e in entries] == [3 * 36, 3 * 12]
    assert [e.bucket for e in entries] == [0, 1]
    ag1, ag2 = find(gm.graph, AG)
    index = node_index(gm.graph)
    assert [e.position for e in entries] == [index[ag1], index[ag2]]
    # bucket 2's all-gather is issued right after bucket 1's wait and is in flight over its mms
    assert entries[1].position == entries[0].wait_position + 2  # pack, then the all-gather
    assert "mm" in entries[1].overlaps and "mm_1" in entries[1].overlaps


def test_ledger_of_a_bf16_single_parameter_gather(group_name):
    gm = forward_model(group_name, dtype=torch.bfloat16)
    lower(gm, bucket_bytes=0)

    entries = ledger.graph_ledger(gm.graph, "forward").entries

    assert [e.params for e in entries] == [[f] for f in FQNS]
    assert [e.param_bytes for e in entries] == [[2 * n] for n in SHARDS]
    assert [e.dtype for e in entries] == ["bfloat16"] * 4


@pytest.mark.parametrize("stage, textbook", [(2, True), (2, False), (0, True)], ids=["s2", "s2-gloo", "s0"])
def test_ledger_of_a_bucketed_backward(group_name, monkeypatch, stage, textbook):
    if not textbook:
        monkeypatch.setattr(lowering, "sends_textbook_reduce_scatter", lambda name: False)
    gm = backward_model(group_name, stage=stage)
    lower(gm, bucket_bytes=140)

    book = ledger.graph_ledger(gm.graph, "backward")

    op = "all_reduce" if stage == 0 else ("reduce_scatter" if textbook else "all_to_all")
    assert [e.op for e in book.entries] == [op, op]
    assert [e.params for e in book.entries] == [list(FQNS[:2]), list(FQNS[2:])]
    if stage == 0:  # the whole gradient is this rank's
        assert [e.param_bytes for e in book.entries] == [[60, 80], [32, 8]]
        assert [e.input_bytes for e in book.entries] == [140, 40]
    else:
        assert [e.param_bytes for e in book.entries] == [[16, 20], [8, 4]]
        assert [e.input_bytes for e in book.entries] == [WORLD * 36, WORLD * 12]
    assert book.reduced_bytes == sum(e.input_bytes for e in book.entries)


def test_unreduced_gradients_of_a_bucket_each_wait_for_its_collective(group_name):
    gm = backward_model(group_name, stage=2)
    lower(gm, bucket_bytes=10**9)

    intervals = analysis.unreduced_grad_intervals(gm.graph)

    index = node_index(gm.graph)
    (rs,) = find(gm.graph, RS)
    muls = find(gm.graph, MUL)
    assert intervals == [(index[m], index[rs], math.prod(s)) for m, s in zip(muls, SHAPES)]
    assert analysis.peak_unreduced_grad_numel(gm.graph) == 45


@pytest.mark.parametrize("prefetch, peak", [(0, 20), (1, 16 + 20), (2, 16 + 20 + 8)])
def test_peak_gathered_numel_counts_a_prefetched_gather_from_its_all_gather(group_name, prefetch, peak):
    gm = _three_layer_stage3(group_name)
    shards = gm.graph.find_nodes(op="placeholder")[:3]
    lower(gm, prefetch=prefetch)

    intervals = analysis.gathered_live_intervals(gm.graph)

    index = node_index(gm.graph)
    by_shard = {ag.args[0]: ag for ag in find(gm.graph, AG)}
    mms = find(gm.graph, MM)
    expected = [(index[by_shard[s]], index[mm], n) for s, mm, n in zip(shards, mms, (16, 20, 8))]
    assert intervals == sorted(expected)
    assert analysis.peak_gathered_numel(gm.graph) == peak


def test_peak_gathered_numel_of_one_bucket_is_the_whole_gathered_buffer(group_name):
    gm = forward_model(group_name)
    lower(gm, bucket_bytes=10**9)

    (ag,) = find(gm.graph, AG)
    (add,) = find(gm.graph, ADD)
    index = node_index(gm.graph)
    # alive from the all-gather until the last member's last use (the bias add)
    assert analysis.gathered_live_intervals(gm.graph) == [(index[ag], index[add], WORLD * sum(SHARDS))]
    assert analysis.peak_gathered_numel(gm.graph) == 48
    assert analysis.saved_gathered_values(gm.graph) == []
