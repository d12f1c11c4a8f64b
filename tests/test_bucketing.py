"""Unit tests of bucketing and prefetch in `lower_markers(graph, bucket_bytes, prefetch)`.

Single process, no real collectives: small graphs are traced with `make_fx` on fake tensors (the
marker ops called directly, as in test_passes.py), lowered, and checked for exact bucket counts,
op order, `meta["val"]` shapes and dtypes, the ledger and `graph.lint()`.

The numbers are checked too: `run_ranks` interprets a lowered graph for all WORLD ranks in
lockstep, node by node, replacing each functional collective by what the group would compute from
every rank's input (all-gather = concatenation in rank order, coalesced all-gather = that for each
of its inputs, reduce-scatter = rank r's chunk of the reduction, all-to-all = rank r's split from
every rank). So the bucket layouts traced from
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
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fx_helpers import WORLD, call_targets, markers_in, node_index, on, output_args, trace
from zerocompile.passes import analysis, ledger, lowering
from zerocompile.passes.lower_markers import lower_markers
from zerocompile.passes.markers import REDUCE_GRAD, UNSHARD

aten = torch.ops.aten
funcol = torch.ops._c10d_functional
PACK = torch.ops.zerocompile.pack.default
UNPACK = torch.ops.zerocompile.unpack.default
AVERAGE_ROWS = torch.ops.zerocompile.average_rows.default
# A gather bucket is one coalesced all-gather: output i (a getitem) is parameter i, padded, gathered.
AG, GI, WAIT = funcol.all_gather_into_tensor_coalesced.default, operator.getitem, funcol.wait_tensor.default
SLICE, VIEW, MM, SPLIT = aten.slice.Tensor, aten.view.default, aten.mm.default, aten.split_with_sizes.default
MUL, ADD, SIN, MV = aten.mul.Tensor, aten.add.Tensor, aten.sin.default, aten.mv.default
RS, A2A, MEAN = funcol.reduce_scatter_tensor.default, funcol.all_to_all_single.default, AVERAGE_ROWS

# The forward/backward test model: four parameters, two of them padded over 4 ranks.
SHAPES = ([3, 5], [5, 4], [4, 2], [2])  # numel 15, 20, 8, 2
FQNS = ("l1.weight", "l2.weight", "l3.weight", "l3.bias")
SHARDS = (4, 5, 2, 1)  # ceil(numel / 4): padded numel 16, 20, 8, 4
FULL_BYTES_F32 = (60, 80, 32, 8)
# The forward model after its gather bucket: the bucket's outputs all taken, then all waited on,
# then each cut (the two padded ones) and viewed; then the model's compute.
GATHERED_FORWARD = [
    *[GI] * 4,
    *[WAIT] * 4,
    SLICE,
    VIEW,
    VIEW,
    VIEW,
    SLICE,
    VIEW,
    aten.relu.default,
    MM,
    aten.relu.default,
    MM,
    MM,
    aten.add.Tensor,
]


@pytest.fixture(scope="module")
def subgroup_name(group_name):
    """A second group (ranks 0 and 1): markers of another group must get their own collective."""
    return dist.new_group([0, 1]).group_name

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("group_name")]


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
    # every gather bucket, of one parameter or several, is one all-gather: coalesced on gloo's
    # layout, flat on the others'; never both in one graph of one group
    assert not (find(gm.graph, funcol.all_gather_into_tensor.default) and find(gm.graph, AG))
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


def bucket_members(collective: fx.Node) -> list[fx.Node]:
    """The per-parameter inputs of a collective: a gather's shards (`gather_members`); a
    reduction's packed gradients, or its lone input."""
    if collective.target is AG:
        return gather_members(collective)
    packed = collective.args[0]
    while packed.target is aten.view.default and packed.args[1] == [-1]:  # a lone gradient, flattened
        packed = packed.args[0]
    return list(packed.args[0]) if packed.target is PACK else [packed]


def gather_members(ag: fx.Node) -> list[fx.Node]:
    """The shards a coalesced all-gather carries, in output order: its inputs themselves, or with
    a cast (compute dtype != shard dtype) the shards of the one cast buffer, `pack(shards, 1,
    numels, dtype)`, whose `split` pieces (in order, one per shard) are its inputs."""
    assert ag.target is AG and not ag.kwargs
    inputs = list(ag.args[0])
    assert inputs
    if not any(node.target is GI for node in inputs):
        return inputs
    split = inputs[0].args[0]
    assert split.target is SPLIT
    packed = split.args[0]
    assert packed.target is PACK
    shards, rows, numels, dtype = packed.args
    assert rows == 1 and numels == [shard.meta["val"].numel() for shard in shards]
    assert dtype is not None and all(shard.meta["val"].dtype != dtype for shard in shards)  # a cast
    assert split.args == (packed, numels) and set(split.users) == set(inputs)
    assert [(node.target, node.args) for node in inputs] == [(GI, (split, i)) for i in range(len(shards))]
    assert [shape(node) for node in inputs] == [(n,) for n in numels]
    assert {node.meta["val"].dtype for node in (packed, *inputs)} == {dtype}
    return list(shards)


def gather_issue(ag: fx.Node) -> list[fx.Node]:
    """Every node that issues the bucket, in the order the lowering emits them: (pack, split, its
    getitems,) the all-gather, its output getitems."""
    inputs = list(ag.args[0])
    casting = [inputs[0].args[0].args[0], inputs[0].args[0], *inputs] if inputs[0].target is GI else []
    return [*casting, ag, *sorted(ag.users, key=lambda n: n.args[1])]


def gathered_chains(ag: fx.Node, shapes, dtype: torch.dtype) -> list[tuple]:
    """Checks what a coalesced all-gather's outputs become and returns, per parameter in bucket
    order, (getitem, wait, slice or None, view): output i = getitem(ag, i) of the padded full
    parameter [world * shard numel] -> its own wait_tensor -> a slice to the parameter's numel
    only if padded -> a view in its shape; all in `dtype`, nothing else reading them."""
    world = ag.args[1]
    members = gather_members(ag)
    assert len(shapes) == len(members)
    vals = ag.meta["val"]
    assert isinstance(vals, list) and all(isinstance(v, FakeTensor) for v in vals)
    padded = [world * member.meta["val"].numel() for member in members]
    assert [(tuple(v.shape), v.dtype) for v in vals] == [((n,), dtype) for n in padded]
    getitems = list(ag.users)
    assert all(node.target is GI for node in getitems)
    getitems.sort(key=lambda n: n.args[1])
    assert [node.args for node in getitems] == [(ag, i) for i in range(len(members))]
    chains = []
    for getitem, full, n in zip(getitems, shapes, padded):
        numel = math.prod(full)
        (wait,) = getitem.users
        assert wait.target is WAIT and wait.args == (getitem,)
        (after,) = wait.users
        if numel != n:
            sliced = after
            assert sliced.target is SLICE and sliced.args == (wait, 0, 0, numel)
            (view,) = sliced.users
        else:
            sliced, view = None, after
        assert view.target is VIEW and view.args == (sliced or wait, list(full))
        nodes = [getitem, wait, *([sliced] if sliced else []), view]
        assert [shape(node) for node in nodes] == [(n,), (n,), *([(numel,)] if sliced else []), tuple(full)]
        assert {node.meta["val"].dtype for node in nodes} == {dtype}
        chains.append((getitem, wait, sliced, view))
    return chains


def gathered_shards(graph: fx.Graph) -> list[list[str]]:
    """For each all-gather in order, the names of the shards it carries."""
    return [[n.name for n in bucket_members(ag)] for ag in find(graph, AG)]


def forward_model(
    group_name: str, stage: int = 3, dtype=torch.float32, fqns=FQNS, compute_dtype=None, textbook: bool = False
) -> fx.GraphModule:
    """relu, w1 [3, 5] mm, relu, w2 [5, 4] mm, w3 [4, 2] mm, + bias [2]: four markers in a row.

    Shards in `dtype`, gathered (and x given) in `compute_dtype` if set (mixed precision). On
    gloo's layout (coalesced gathers) unless `textbook`: the flat layout of every other backend."""

    def f(s1, s2, s3, s4, x):
        h = x.relu()
        h = h @ UNSHARD(s1, SHAPES[0], stage, *on(group_name, textbook), fqns[0], compute_dtype)
        h = h.relu()
        h = h @ UNSHARD(s2, SHAPES[1], stage, *on(group_name, textbook), fqns[1], compute_dtype)
        h = h @ UNSHARD(s3, SHAPES[2], stage, *on(group_name, textbook), fqns[2], compute_dtype)
        return (h + UNSHARD(s4, SHAPES[3], stage, *on(group_name, textbook), fqns[3], compute_dtype),)

    return trace(f, *[((n,), dtype) for n in SHARDS], ((2, 3), compute_dtype or dtype))


def backward_model(
    group_name: str, stage: int = 2, dtype=torch.float32, fqns=FQNS, textbook: bool = True
) -> fx.GraphModule:
    """Four gradients computed (g * 2) and reduced one after another, returned as the outputs."""

    def f(g1, g2, g3, g4):
        grads = (g1, g2, g3, g4)
        return tuple(
            REDUCE_GRAD(g * 2, math.prod(s) if stage == 0 else n, stage, *on(group_name, textbook), fqn)
            for g, s, n, fqn in zip(grads, SHAPES, SHARDS, fqns)
        )

    return trace(f, *[(tuple(s), dtype) for s in SHAPES])


def gather_model(specs: list[tuple], textbook: bool = False) -> fx.GraphModule:
    """One marker per spec (shape, stage, group, dtype, computed_shard), outputs the full values.

    A computed shard is `shard * 2`, traced just before its marker. Layout as `forward_model`'s."""

    def f(*shards):
        outs = []
        for s, (full, stage, group, _, computed) in zip(shards, specs):
            outs.append(UNSHARD(s * 2 if computed else s, list(full), stage, *on(group, textbook)))
        return tuple(outs)

    def shard_numel(full, group):
        return math.ceil(math.prod(full) / on(group)[1])

    return trace(f, *[((shard_numel(full, group),), dtype) for full, _, group, dtype, _ in specs])


def unlike_neighbours(kind: str, stages: tuple[int, int], group_name: str, subgroup_name: str) -> tuple[tuple, tuple, list]:
    """Four markers in a row, the middle two unlike the outer two in `kind` (their stage, of
    `stages`, their dtype or their group): the outer and inner (stage, group, dtype), and the specs."""
    f32, bf16 = torch.float32, torch.bfloat16
    outer = {"stage": (stages[0], group_name, f32), "dtype": (3, group_name, f32), "group": (3, group_name, f32)}[kind]
    inner = {"stage": (stages[1], group_name, f32), "dtype": (3, group_name, bf16), "group": (3, subgroup_name, f32)}[kind]
    shapes = [(3, 5), (5, 4), (4, 2), (2,)]
    kinds = [outer, inner, inner, outer]
    return outer, inner, [(full, stage, group, dtype, False) for full, (stage, group, dtype) in zip(shapes, kinds)]


def reduce_model(specs: list[tuple]) -> fx.GraphModule:
    """One reduce_grad per spec (shape, stage, group, dtype, extra_user), of `g * 2`; the result
    goes to the output, and with extra_user also into `result + 1` (also returned)."""

    def f(*grads):
        outs = []
        for g, (full, stage, group, _, extra_user) in zip(grads, specs):
            numel = math.prod(full) if stage == 0 else math.ceil(math.prod(full) / on(group)[1])
            r = REDUCE_GRAD(g * 2, numel, stage, *on(group))
            outs.append(r)
            if extra_user:
                outs.append(r + 1)
        return tuple(outs)

    return trace(f, *[(tuple(full), dtype) for full, _, _, dtype, _ in specs])


# ----------------------------------------------------------------- lockstep simulation of ranks


def _all_gather(inputs, world_size, group):
    assert world_size == len(inputs)
    return [torch.cat(inputs)] * len(inputs)


def _all_gather_coalesced(inputs, world_size, group):
    """inputs[r] is rank r's list of tensors; every rank gets, for each i, input i of every rank
    concatenated in rank order."""
    assert world_size == len(inputs)
    count = len(inputs[0])
    for rank_inputs in inputs:  # the same number of tensors on every rank, of the same shapes
        assert [(t.shape, t.dtype) for t in rank_inputs] == [(t.shape, t.dtype) for t in inputs[0]]
    outputs = [torch.cat([rank_inputs[i] for rank_inputs in inputs]) for i in range(count)]
    return [list(outputs) for _ in inputs]


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
    funcol.all_gather_into_tensor_coalesced.default: _all_gather_coalesced,
    funcol.reduce_scatter_tensor.default: _reduce_scatter,
    funcol.all_to_all_single.default: _all_to_all,
    funcol.all_reduce.default: _all_reduce,
}


def run_ranks(graph: fx.Graph, inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Run `graph` on every rank's inputs in lockstep; each collective sees all ranks' inputs.

    Returns each rank's outputs. wait_tensor is the identity (results are ready at once); a
    collective with several outputs (coalesced) gives each rank a list, read by getitem nodes."""
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
            assert all(a[1:] == args[0][1:] for a in args)  # every rank calls it alike
            results = SIMULATED[node.target]([a[0] for a in args], *args[0][1:])
            assert len(results) == len(envs)
        elif node.target is funcol.wait_tensor.default:
            results = [a[0] for a in args]
        else:
            results = [node.target(*a, **k) for a, k in zip(args, kwargs)]
        for env, result in zip(envs, results):
            env[node] = result
    raise AssertionError("graph without output")


def shard_of(full: torch.Tensor, rank: int, world: int = WORLD) -> torch.Tensor:
    """Rank `rank`'s flat shard of `full`, zero-padded to a multiple of `world`, as this module's
    graphs shard (the lowering takes any shard size: these are smaller than shard()'s, which are
    rounded up to 16 elements)."""
    flat = full.reshape(-1)
    shard = math.ceil(flat.numel() / world)
    return torch.nn.functional.pad(flat, (0, shard * world - flat.numel())).view(world, shard)[rank].clone()


def test_run_ranks_simulates_collectives_by_rank(group_name):
    """The simulator itself: rank order of all-gather (plain and coalesced: per input, in rank
    order), chunks of reduce-scatter, all-to-all routing."""

    def f(a, b, c, d):
        gathered = funcol.wait_tensor(funcol.all_gather_into_tensor(a, WORLD, group_name))
        scattered = funcol.wait_tensor(funcol.reduce_scatter_tensor(b, "sum", WORLD, group_name))
        routed = funcol.wait_tensor(funcol.all_to_all_single(c, [1] * WORLD, [1] * WORLD, group_name))
        first, second = funcol.all_gather_into_tensor_coalesced([d, a], WORLD, group_name)
        return gathered, scattered, routed, funcol.wait_tensor(first), funcol.wait_tensor(second)

    gm = trace(f, (2,), (4,), (4,), (1,))
    a, _, _, d = gm.graph.find_nodes(op="placeholder")
    (coalesced,) = find(gm.graph, AG)
    assert coalesced.args == ([d, a], WORLD, group_name)
    assert sorted(user.args for user in coalesced.users) == [(coalesced, 0), (coalesced, 1)]
    assert [shape(o) for o in output_args(gm.graph)] == [(8,), (1,), (4,), (4,), (8,)]
    inputs = [
        [torch.tensor([r, 10.0 + r]), torch.arange(4.0) * (r + 1), torch.arange(4.0) + 10 * r, torch.tensor([100.0 + r])]
        for r in range(WORLD)
    ]

    outs = run_ranks(gm.graph, inputs)

    for r, (gathered, scattered, routed, first, second) in enumerate(outs):
        assert gathered.tolist() == [0, 10, 1, 11, 2, 12, 3, 13]
        assert scattered.tolist() == [r * (1 + 2 + 3 + 4)]
        assert routed.tolist() == [r, 10 + r, 20 + r, 30 + r]
        assert first.tolist() == [100, 101, 102, 103]  # output i: input i of every rank
        assert second.tolist() == [0, 10, 1, 11, 2, 12, 3, 13]


# ----------------------------------------------------------------------- gathers: bucket layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_bucket_is_one_coalesced_all_gather_of_the_shards(group_name, dtype):
    gm = forward_model(group_name, dtype=dtype)
    s1, s2, s3, s4, x = gm.graph.find_nodes(op="placeholder")

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(gathers=4, gather_buckets=1)
    (ag,) = find(gm.graph, AG)
    # No cast: the shards themselves are its inputs, nothing packed before or copied out after.
    assert ag.args == ([s1, s2, s3, s4], WORLD, group_name)
    assert find(gm.graph, PACK) == [] and find(gm.graph, SPLIT) == []
    assert [(tuple(v.shape), v.dtype) for v in ag.meta["val"]] == [((WORLD * n,), dtype) for n in SHARDS]

    # Per parameter: getitem (its padded full tensor) -> wait -> (slice if padded) -> view.
    chains = gathered_chains(ag, SHAPES, dtype)
    getitems, waits, slices, fulls = (list(column) for column in zip(*chains))
    assert [sliced is not None for sliced in slices] == [True, False, False, True]  # 15 of 16, 2 of 4
    assert [sliced.args[3] for sliced in slices if sliced] == [15, 2]

    # The compute now reads the full views, in the right places.
    mm1, mm2, mm3 = find(gm.graph, MM)
    (add,) = find(gm.graph, aten.add.Tensor)
    assert (mm1.args[1], mm2.args[1], mm3.args[1], add.args[1]) == tuple(fulls)
    # The bucket goes where its first marker was, before the first mm, and up above the relu that
    # Inductor writes into one kernel with what precedes it; its outputs are all taken, then all
    # waited on, then each cut and viewed.
    relu = aten.relu.default
    (relu1, relu2) = find(gm.graph, relu)
    nodes = list(gm.graph.nodes)
    index = node_index(gm.graph)
    assert nodes[index[ag] : index[mm1] + 1] == [
        ag,
        *getitems,
        *waits,
        slices[0],
        fulls[0],
        fulls[1],
        fulls[2],
        slices[3],
        fulls[3],
        relu1,
        mm1,
    ]
    assert call_targets(gm.graph) == [AG, *GATHERED_FORWARD]


def test_mixed_precision_gather_bucket_casts_once_and_sends_the_pieces(group_name):
    """Compute dtype bf16, float32 shards: one pack casts the bucket, split into one piece per
    shard; the pieces are the all-gather's inputs, its outputs are in bf16."""
    bf16 = torch.bfloat16
    gm = forward_model(group_name, dtype=torch.float32, compute_dtype=bf16)
    s1, s2, s3, s4, x = gm.graph.find_nodes(op="placeholder")

    counts = lower(gm, bucket_bytes=10**9)  # full bf16 bytes: 30 + 40 + 16 + 4

    assert counts == counts_of(gathers=4, gather_buckets=1)
    (packed,) = find(gm.graph, PACK)
    assert packed.args == ([s1, s2, s3, s4], 1, list(SHARDS), bf16)
    assert (shape(packed), packed.meta["val"].dtype) == ((sum(SHARDS),), bf16)
    (split,) = packed.users
    assert split.target is SPLIT and split.args == (packed, list(SHARDS))
    assert [(tuple(v.shape), v.dtype) for v in split.meta["val"]] == [((n,), bf16) for n in SHARDS]
    pieces = sorted(split.users, key=lambda n: n.args[1])
    (ag,) = find(gm.graph, AG)
    assert ag.args == (pieces, WORLD, group_name)
    assert bucket_members(ag) == [s1, s2, s3, s4]
    chains = gathered_chains(ag, SHAPES, bf16)
    getitems, waits, slices, fulls = (list(column) for column in zip(*chains))
    mm1, mm2, mm3 = find(gm.graph, MM)
    (add,) = find(gm.graph, aten.add.Tensor)
    assert (mm1.args[1], mm2.args[1], mm3.args[1], add.args[1]) == tuple(fulls)
    assert gather_issue(ag) == [packed, split, *pieces, ag, *getitems]
    # the cast and the bucket above the relu, as in fp32
    assert call_targets(gm.graph) == [PACK, SPLIT, *[GI] * 4, AG, *GATHERED_FORWARD]
    # the ledger counts the bf16 bytes sent, and the float32 shard bytes each rank holds
    (entry,) = ledger.graph_ledger(gm.graph, "forward").entries
    assert (entry.op, entry.dtype, entry.input_bytes) == ("all_gather", "bfloat16", 2 * sum(SHARDS))
    assert entry.params == list(FQNS) and entry.param_bytes == [4 * n for n in SHARDS]


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
    full_shape = dict(zip(["s1_1", "s2_1", "s3_1", "s4_1"], SHAPES))
    for ag, names in zip(find(gm.graph, AG), expected):
        assert [shape(out) for out in sorted(ag.users, key=lambda n: n.args[1])] == [(WORLD * shard_numel[n],) for n in names]
        gathered_chains(ag, [full_shape[n] for n in names], dtype)
    # Every use still reads a value of the parameter's full shape.
    mm1, mm2, mm3 = find(gm.graph, aten.mm.default)
    (add,) = find(gm.graph, aten.add.Tensor)
    assert [shape(n.args[1]) for n in (mm1, mm2, mm3, add)] == [tuple(s) for s in SHAPES]


@pytest.mark.parametrize("kind", ["stage", "dtype", "group"])
def test_gather_buckets_never_mix_stage_group_or_dtype(group_name, subgroup_name, kind):
    """Four markers in a row, the middle two different from the outer two: three buckets."""
    outer, inner, specs = unlike_neighbours(kind, (1, 2), group_name, subgroup_name)
    shapes = [full for full, *_ in specs]
    gm = gather_model(specs)

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(gathers=4, gather_buckets=3)
    assert gathered_shards(gm.graph) == [["arg0_1"], ["arg1_1", "arg2_1"], ["arg3_1"]]
    ags = find(gm.graph, AG)
    inner_world = 2 if kind == "group" else WORLD
    assert [ag.args[1:] for ag in ags] == [
        (WORLD, group_name),
        (inner_world, inner[1]),
        (WORLD, group_name),
    ]
    assert [[v.dtype for v in ag.meta["val"]] for ag in ags] == [[outer[2]], [inner[2]] * 2, [outer[2]]]
    inner_padded = [inner_world * math.ceil(math.prod(s) / inner_world) for s in shapes[1:3]]
    assert [[tuple(v.shape) for v in ag.meta["val"]] for ag in ags] == [[(16,)], [(n,) for n in inner_padded], [(4,)]]
    chains = [
        gathered_chains(ags[0], shapes[:1], outer[2]),
        gathered_chains(ags[1], shapes[1:3], inner[2]),
        gathered_chains(ags[2], shapes[3:], outer[2]),
    ]
    views = [view for bucket in chains for (_, _, _, view) in bucket]
    assert output_args(gm.graph) == views
    assert [shape(out) for out in output_args(gm.graph)] == shapes
    if kind == "stage":  # stages 1 and 2 gather at the start, in program order
        first = list(gm.graph.nodes)[len(shapes)]
        assert first.target is AG and first is ags[0]


def test_gather_of_a_computed_shard_stays_alone(group_name):
    specs = [((3, 5), 3, group_name, torch.float32, False), ((5, 4), 3, group_name, torch.float32, True)]
    specs += [((4, 2), 3, group_name, torch.float32, False), ((2,), 3, group_name, torch.float32, False)]
    gm = gather_model(specs)

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(gathers=4, gather_buckets=3)
    # s1 cannot take s2 (computed), and s3 cannot join s2's bucket: [s1], [s2 * 2], [s3, s4]
    assert gathered_shards(gm.graph) == [["arg0_1"], ["mul"], ["arg2_1", "arg3_1"]]
    (mul,) = find(gm.graph, aten.mul.Tensor)
    ags = find(gm.graph, AG)
    assert ags[1].args[0] == [mul]
    index = node_index(gm.graph)
    assert index[mul] < index[ags[1]]
    chains = [gathered_chains(ag, SHAPES[a:b], torch.float32) for ag, (a, b) in zip(ags, [(0, 1), (1, 2), (2, 4)])]
    assert output_args(gm.graph) == [view for bucket in chains for (_, _, _, view) in bucket]
    assert [shape(out) for out in output_args(gm.graph)] == [(3, 5), (5, 4), (4, 2), (2,)]


# ------------------------------------------------------------------------ reductions: bucket layout


@pytest.mark.parametrize("textbook", [True, False], ids=["reduce_scatter", "gloo_all_to_all"])
def test_reduction_bucket_is_one_collective_over_rank_major_blocks(group_name, textbook):
    gm = backward_model(group_name, stage=2, textbook=textbook)
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
        (reduced,) = rows.users
        assert reduced.target is AVERAGE_ROWS and reduced.args == (rows, WORLD) and shape(reduced) == (total,)
        collective_ops = [funcol.all_to_all_single.default, funcol.wait_tensor.default, aten.view.default, AVERAGE_ROWS]
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



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_average_rows_is_the_mean_rounded_once(dtype):
    """average_rows(rows, ranks): the sum over dim 0 divided by `ranks`, accumulated in fp32 and
    rounded to the rows' dtype once, as the fused kernel it replaces rounded (3 ranks: dividing
    a sum already rounded to bf16 rounds twice and differs in some elements)."""
    rows = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    mean = lowering.average_rows(rows, 3)
    assert mean.shape == (4096,) and mean.dtype == dtype
    in_fp32 = rows.float()
    assert torch.equal(mean, ((in_fp32[0] + in_fp32[1] + in_fp32[2]) / 3).to(dtype))
    one_row = lowering.average_rows(rows[:1], 4)  # after an all-reduce: one summed row
    assert torch.equal(one_row, (in_fp32[0] / 4).to(dtype))
    with FakeTensorMode():
        fake = lowering.average_rows(torch.empty(4, 6, 5, dtype=dtype), 4)
    assert fake.shape == (6, 5) and fake.dtype == dtype

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
    (row,) = wait.users
    assert row.target is aten.unsqueeze.default and row.args == (wait, 0)
    (mean,) = row.users
    assert mean.target is AVERAGE_ROWS and mean.args == (row, WORLD)
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
        aten.unsqueeze.default,
        AVERAGE_ROWS,
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
    outer, inner, specs = unlike_neighbours(kind, (2, 3), group_name, subgroup_name)
    gm = reduce_model(specs)

    counts = lower(gm, bucket_bytes=10**9)

    assert counts == counts_of(reductions=4, reduction_buckets=3)
    rss = find(gm.graph, funcol.reduce_scatter_tensor.default)
    inner_world = 2 if kind == "group" else WORLD
    assert [rs.args[1:] for rs in rss] == [("avg", WORLD, group_name), ("avg", inner_world, inner[1]), ("avg", WORLD, group_name)]
    assert [rs.meta["val"].dtype for rs in rss] == [outer[2], inner[2], outer[2]]
    assert [len(bucket_members(rs)) for rs in rss] == [1, 2, 1]
    inner_shards = [math.ceil(math.prod(full) / inner_world) for full, *_ in specs[1:3]]
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


# ------------------------------------------------------------- reductions: placement around kernels


_FUSED_AFTER_A_GRADIENT = {
    "pointwise-reduction": lambda x, i: (x.sin() * 2).sum(0, keepdim=True),
    "views": lambda x, i: x.t().unsqueeze(0)[0],
    "embedding": lambda x, i: torch.nn.functional.embedding(i, x),
    "index_put": lambda x, i: torch.zeros(4, 4).index_put((i,), x, accumulate=True),
}


@pytest.mark.parametrize("fused", _FUSED_AFTER_A_GRADIENT, ids=str)
def test_reduction_moves_down_past_what_inductor_fuses_into_the_next_kernel(group_name, fused):
    """Spliced where its gradient is produced, a reduction moves below the nodes Inductor writes
    into one kernel with their neighbours, to just before the next call of its own (the mm): its
    pack and collective, extern calls, would otherwise end that kernel early."""

    def f(a, b, x, i, w):
        r = REDUCE_GRAD(a @ b, 4, 3, *on(group_name), "w")  # [3, 5]: padded, packed
        return r, _FUSED_AFTER_A_GRADIENT[fused](x, i) @ w

    gm = trace(f, (3, 2), (2, 5), (4, 4), ((4,), torch.int64), (4, 4))
    fused_targets = call_targets(gm.graph)[2:-1]  # between the marker and the last mm

    lower(gm)

    assert call_targets(gm.graph) == [MM, *fused_targets, PACK, RS, WAIT, MM]


def test_reduction_moves_down_no_further_than_its_first_reader(group_name):
    def f(a, b, x):
        r = REDUCE_GRAD(a @ b, 4, 3, *on(group_name), "w")
        y = x.sin()
        return r * 2, y

    gm = trace(f, (3, 2), (2, 5), (4, 4))

    lower(gm)

    assert call_targets(gm.graph) == [MM, SIN, PACK, RS, WAIT, MUL]


# -------------------------------------------------------------- numbers: lockstep simulated ranks


def _forward_inputs(dtype=torch.float64, compute_dtype=None):
    """Full parameters (in the dtype they are gathered in), each rank's inputs of `forward_model`
    (its shards in `dtype` and x), the model's output."""
    torch.manual_seed(0)
    fulls = [torch.randn(s, dtype=dtype) for s in SHAPES]
    x = torch.randn(2, 3, dtype=compute_dtype or dtype)
    per_rank = [[*(shard_of(w, r) for w in fulls), x] for r in range(WORLD)]
    fulls = [w.to(compute_dtype or dtype) for w in fulls]
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


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("compute_dtype", [None, torch.float32], ids=["same", "cast"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("bucket_bytes", [0, 280, 350, 10**9])  # float64: 120, 160, 64, 16 bytes
def test_simulated_bucketed_gathers_rebuild_each_full_parameter(group_name, bucket_bytes, prefetch, compute_dtype, stage):
    """float64 shards; with `cast`, gathered in float32 (pack, split, coalesced all-gather).
    Stage 2 gathers at the top and, with prefetch, waits at first use; stage 3 where used."""
    fulls, per_rank, expected = _forward_inputs(compute_dtype=compute_dtype)
    gm = forward_model(group_name, stage=stage, dtype=torch.float64, compute_dtype=compute_dtype)
    s = ["s1_1", "s2_1", "s3_1", "s4_1"]
    buckets = {0: [s[:1], s[1:2], s[2:3], s[3:]], 280: [s[:2], s[2:]], 350: [s[:3], s[3:]], 10**9: [s]}[bucket_bytes]
    # with the cast, the same buckets: bucket_bytes counts bytes of the gathered (float32) parameters
    counts = lower(gm, bucket_bytes=bucket_bytes // 2 if compute_dtype else bucket_bytes, prefetch=prefetch)
    assert counts == counts_of(gathers=4, gather_buckets=len(buckets))
    assert gathered_shards(gm.graph) == buckets
    assert len(find(gm.graph, PACK)) == (len(buckets) if compute_dtype else 0)
    _with_outputs(gm)
    gm.graph.lint()

    outs = run_ranks(gm.graph, per_rank)

    for rank_outs in outs:
        y, *params = rank_outs
        assert len(params) == len(fulls) == 4
        for got, want in zip(params, fulls):
            assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
        assert y.dtype == expected.dtype
        torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("compute_dtype", [None, torch.float32], ids=["same", "cast"])
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("bucket_bytes", [0, 280, 10**9])  # float64: 120, 160, 64, 16 bytes
def test_flat_gather_bucket_is_one_pack_one_all_gather_one_wait(group_name, bucket_bytes, prefetch, compute_dtype, stage):
    """Every backend but gloo: a bucket's shards packed (and cast) by one op, one all-gather into
    one buffer, one wait, the parameters cut out of its [rank, shard] rows; a lone parameter is
    its buffer (no pack, no copy). Run by all ranks, each parameter comes back whole."""
    fulls, per_rank, expected = _forward_inputs(compute_dtype=compute_dtype)
    gm = forward_model(group_name, stage=stage, dtype=torch.float64, compute_dtype=compute_dtype, textbook=True)
    sizes = {0: [1, 1, 1, 1], 280: [2, 2], 10**9: [4]}[bucket_bytes]
    counts = lower(gm, bucket_bytes=bucket_bytes // 2 if compute_dtype else bucket_bytes, prefetch=prefetch)
    assert counts == counts_of(gathers=4, gather_buckets=len(sizes))
    gathers = find(gm.graph, funcol.all_gather_into_tensor.default)
    assert find(gm.graph, AG) == [] and len(gathers) == len(sizes)
    assert len(find(gm.graph, WAIT)) == len(sizes)  # one wait per bucket, not per parameter
    packs = find(gm.graph, PACK)
    assert len(packs) == sum(1 for n in sizes if n > 1 or compute_dtype)
    for gather, size in zip(gathers, sizes):
        (wait,) = gather.users
        sent = gather.args[0]
        if size > 1 or compute_dtype:
            assert sent.target is PACK and len(sent.args[0]) == size and shape(gather) == (WORLD * shape(sent)[0],)
        else:
            assert sent.op == "placeholder"
    # One copy out of the shared rows per bucket of several: unpack(buffer, ranks, shard numels).
    unpacks = find(gm.graph, UNPACK)
    assert [(len(u.args[2]), u.args[1]) for u in unpacks] == [(n, WORLD) for n in sizes if n > 1]
    assert all(u.args[0].target is WAIT for u in unpacks)
    _with_outputs(gm)
    gm.graph.lint()

    outs = run_ranks(gm.graph, per_rank)

    for rank_outs in outs:
        y, *params = rank_outs
        for got, want in zip(params, fulls):
            assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
        torch.testing.assert_close(y, expected)


def test_flat_gather_pieces_name_their_own_parameters_and_live_apart(group_name):
    """The analysis of a flat bucket: each piece of the copy out is its own parameter (not the
    bucket's first), the gathered buffer dies at the copy out, each copy at its own last use."""
    gm = forward_model(group_name, dtype=torch.float64, textbook=True)
    lower(gm, bucket_bytes=10**9)
    _with_outputs(gm)  # every full parameter returned: saved, as a forward keeping them would
    kept = analysis.kept_params(gm.graph)
    assert sorted(kept) == sorted(FQNS)
    assert [kept[fqn] for fqn in FQNS] == [2 * n for n in FULL_BYTES_F32]  # float64
    (gather,) = find(gm.graph, funcol.all_gather_into_tensor.default)
    intervals = analysis.gathered_live_intervals(gm.graph)
    position = node_index(gm.graph)
    (unpack,) = find(gm.graph, UNPACK)
    buffer = [i for i in intervals if i[2] == WORLD * sum(SHARDS)]
    assert buffer == [(position[gather], position[unpack], WORLD * sum(SHARDS))]
    copies = [size for interval in intervals if interval not in buffer for size in interval[2:]]
    assert sorted(copies) == sorted(WORLD * n for n in SHARDS)  # each padded parameter's own copy


def test_flat_gather_bucket_cuts_each_parameter_from_its_own_columns(group_name):
    """Control for the test above: the rows of a flat gather hold every parameter's shard side by
    side, so cutting the buffer as if it held one parameter after another (a wrong layout)
    returns other parameters' values."""
    fulls, per_rank, _ = _forward_inputs()
    gm = forward_model(group_name, dtype=torch.float64, textbook=True)
    lower(gm, bucket_bytes=10**9)
    (unpack,) = find(gm.graph, UNPACK)
    unpack.target = SPLIT  # the buffer cut as if parameter after parameter
    unpack.args = (unpack.args[0], [WORLD * n for n in SHARDS])
    _with_outputs(gm)

    outs = run_ranks(gm.graph, per_rank)

    _, *params = outs[0]
    assert [torch.equal(got, want) for got, want in zip(params, fulls)] == [False] * 4


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
def test_simulated_bucketed_reductions_match_per_parameter_reductions(group_name, stage, textbook, bucket_bytes, prefetch):
    inputs, expected = _reduction_case(stage)
    bucketed = backward_model(group_name, stage=stage, dtype=torch.float64, textbook=textbook)
    single = backward_model(group_name, stage=stage, dtype=torch.float64, textbook=textbook)
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
    """x @ w1 [3, 5] @ w2 [5, 4] @ w3 [4, 2]: three gathers separated by matmuls (gloo's layout)."""
    group = on(group_name, textbook=False)

    def f(s1, s2, s3, x):
        h = x @ UNSHARD(s1, [3, 5], 3, *group, "w1")
        h = h @ UNSHARD(s2 * 2 if computed_second else s2, [5, 4], 3, *group, "w2")
        return (h @ UNSHARD(s3, [4, 2], 3, *group, "w3"),)

    return trace(f, (4,), (5,), (2,), (2, 3))


def _single_gathers(gm: fx.GraphModule, shapes=([3, 5], [5, 4], [4, 2])) -> list[tuple]:
    """Bucket k of `_three_layer_stage3` (the all-gather of shard k alone, wherever it now is):
    (all-gather, its getitem, wait, slice or None, view), structure checked."""
    by_shard = {}
    for ag in find(gm.graph, AG):
        (shard,) = bucket_members(ag)
        by_shard[unwrap_computed(shard)] = ag
    shards = gm.graph.find_nodes(op="placeholder")[: len(shapes)]
    assert set(by_shard) == set(shards)
    return [(by_shard[s], *gathered_chains(by_shard[s], [full], torch.float32)[0]) for s, full in zip(shards, shapes)]


def unwrap_computed(shard: fx.Node) -> fx.Node:
    """The placeholder a computed shard (`s * 2`) is computed from."""
    return shard.args[0] if shard.target is aten.mul.Tensor else shard


@pytest.mark.parametrize(
    "prefetch, expected",
    [
        # w1 is padded (16 -> slice 15); w2 and w3 are not. Single-parameter buckets: the
        # coalesced all-gather of one shard, its one output (getitem), that output's wait.
        (0, [AG, GI, WAIT, SLICE, VIEW, MM, AG, GI, WAIT, VIEW, MM, AG, GI, WAIT, VIEW, MM]),
        (1, [AG, GI, WAIT, AG, GI, SLICE, VIEW, MM, WAIT, AG, GI, VIEW, MM, WAIT, VIEW, MM]),
        # the first `prefetch` buckets are issued up front, one after another
        (2, [AG, GI, AG, GI, WAIT, AG, GI, SLICE, VIEW, MM, WAIT, VIEW, MM, WAIT, VIEW, MM]),
        (3, [AG, GI, AG, GI, AG, GI, WAIT, SLICE, VIEW, MM, WAIT, VIEW, MM, WAIT, VIEW, MM]),
    ],
)
def test_prefetch_issues_each_gather_after_the_wait_of_the_bucket_prefetch_ahead(group_name, prefetch, expected):
    gm = _three_layer_stage3(group_name)

    counts = lower(gm, prefetch=prefetch)

    assert counts == counts_of(gathers=3, gather_buckets=3)
    assert call_targets(gm.graph) == expected
    buckets = _single_gathers(gm)
    ags = [ag for ag, *_ in buckets]
    outs = [out for _, out, *_ in buckets]
    waits = [wait for _, _, wait, *_ in buckets]
    mms = find(gm.graph, MM)
    index = node_index(gm.graph)
    nodes = list(gm.graph.nodes)
    for k, ((ag, out, wait, _sliced, view), mm) in enumerate(zip(buckets, mms)):
        assert mm.args[1] is view  # the matmul reads this bucket's parameter
        # the wait stays before its first use, after the previous layer's matmul
        assert (index[mms[k - 1]] if k else 0) < index[wait] < index[mm]
        assert nodes[index[ag] + 1] is out  # the output moves with its all-gather
        if prefetch and k >= prefetch:  # issued right after the wait `prefetch` buckets back
            assert nodes[index[waits[k - prefetch]] + 1] is ag
        elif prefetch and k:  # one of the first `prefetch` buckets: right after the previous issue
            assert nodes[index[outs[k - 1]] + 1] is ag
        elif prefetch <= 1:  # not moved: right before its own wait
            assert nodes[index[wait] - 2 : index[wait]] == [ag, out]
        else:  # bucket 0: not moved, but the next buckets' issues now sit between it and its wait
            assert nodes[index[wait] - 2 * min(prefetch, len(ags))] is ag


def test_prefetch_two_issues_the_second_gather_no_later_than_prefetch_one(group_name):
    one, two = _three_layer_stage3(group_name), _three_layer_stage3(group_name)
    lower(one, prefetch=1)
    lower(two, prefetch=2)

    for gm in (one, two):
        index = node_index(gm.graph)
        s2 = gm.graph.find_nodes(op="placeholder")[1]
        (ag2,) = [ag for ag in find(gm.graph, AG) if ag.args[0] == [s2]]
        mm1 = find(gm.graph, MM)[0]
        assert index[ag2] < index[mm1], f"w2's all-gather after the first matmul:\n{gm.graph}"


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["same", "cast"])
def test_prefetch_moves_a_buckets_whole_issue_behind_the_last_wait_of_the_bucket_before(group_name, compute_dtype):
    """Bucket 2's issue (with a cast: pack, split and the pieces too, then the all-gather and its
    outputs) goes right after the last of bucket 1's waits; its own waits stay together just
    before its first use."""
    gm = forward_model(group_name, compute_dtype=compute_dtype)
    s1, s2, s3, s4, _ = gm.graph.find_nodes(op="placeholder")
    dtype = compute_dtype or torch.float32

    # [w1, w2], [w3, bias]: float32 full bytes 60 + 80 and 32 + 8, bfloat16 half that
    counts = lower(gm, bucket_bytes=70 if compute_dtype else 140, prefetch=1)

    assert counts == counts_of(gathers=4, gather_buckets=2)
    ag1, ag2 = find(gm.graph, AG)
    assert bucket_members(ag1) == [s1, s2] and bucket_members(ag2) == [s3, s4]
    (out1a, wait1a, slice1a, view1a), (out1b, wait1b, _, view1b) = gathered_chains(ag1, SHAPES[:2], dtype)
    (out2a, wait2a, _, view2a), (out2b, wait2b, slice2b, view2b) = gathered_chains(ag2, SHAPES[2:], dtype)
    issue1, issue2 = gather_issue(ag1), gather_issue(ag2)
    assert len(issue1) == len(issue2) == (7 if compute_dtype else 3)  # (pack, split, 2 pieces,) ag, 2 outputs
    relu1, relu2 = find(gm.graph, aten.relu.default)
    mm1, mm2, mm3 = find(gm.graph, MM)
    (add,) = find(gm.graph, aten.add.Tensor)
    nodes = list(gm.graph.nodes)
    index = node_index(gm.graph)
    assert nodes[index[issue1[0]] :] == [
        *issue1,  # above the first relu, which joins the kernel after the waits
        wait1a,
        wait1b,  # bucket 1's last wait, and right after it:
        *issue2,
        slice1a,
        view1a,
        view1b,
        relu1,
        mm1,
        relu2,
        mm2,  # bucket 1's last use; bucket 2 in flight since its wait
        wait2a,
        wait2b,
        view2a,
        slice2b,
        view2b,
        mm3,
        add,
        gm.graph.output_node(),
    ]
    assert (mm1.args[1], mm2.args[1], mm3.args[1], add.args[1]) == (view1a, view1b, view2a, view2b)


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["same", "cast"])
@pytest.mark.parametrize("stage", [1, 2])
def test_prefetch_stage12_waits_each_gather_at_first_use_and_issues_the_next_after_it(group_name, stage, compute_dtype):
    gm = forward_model(group_name, stage=stage, compute_dtype=compute_dtype)
    s1, s2, s3, s4, _ = gm.graph.find_nodes(op="placeholder")
    dtype = compute_dtype or torch.float32

    assert lower(gm, bucket_bytes=70 if compute_dtype else 140, prefetch=1) == counts_of(gathers=4, gather_buckets=2)

    # buckets [w1, w2] and [w3, b3]: the first issued at the top, waited on just before w1's
    # matmul; the second issued right after the last of those waits, waited on just before w3's
    ag1, ag2 = find(gm.graph, AG)
    assert bucket_members(ag1) == [s1, s2] and bucket_members(ag2) == [s3, s4]
    (out1a, wait1a, slice1a, view1a), (out1b, wait1b, _, view1b) = gathered_chains(ag1, SHAPES[:2], dtype)
    (out2a, wait2a, _, view2a), (out2b, wait2b, slice2b, view2b) = gathered_chains(ag2, SHAPES[2:], dtype)
    relu1, relu2 = find(gm.graph, aten.relu.default)
    mm1, mm2, mm3 = find(gm.graph, MM)
    (add,) = find(gm.graph, aten.add.Tensor)
    n_placeholders = len(gm.graph.find_nodes(op="placeholder"))
    assert list(gm.graph.nodes)[n_placeholders:] == [
        *gather_issue(ag1),  # at the top, before any compute
        relu1,
        wait1a,
        wait1b,
        *gather_issue(ag2),
        slice1a,
        view1a,
        view1b,
        mm1,
        relu2,
        mm2,
        wait2a,
        wait2b,
        view2a,
        slice2b,
        view2b,
        mm3,
        add,
        gm.graph.output_node(),
    ]
    assert (mm1.args[1], mm2.args[1], mm3.args[1], add.args[1]) == (view1a, view1b, view2a, view2b)
    assert [shape(out) for out in output_args(gm.graph)] == [(2, 2)]


def test_prefetch_does_not_move_a_gather_of_a_computed_shard(group_name):
    gm = _three_layer_stage3(group_name, computed_second=True)
    s1, s2, s3, _ = gm.graph.find_nodes(op="placeholder")

    lower(gm, prefetch=1)

    # bucket 2 (shard s2 * 2) stays after its mul; bucket 3 moves up behind bucket 2's wait
    mul = aten.mul.Tensor
    assert call_targets(gm.graph) == [
        *[AG, GI, WAIT, SLICE, VIEW, MM],
        mul,
        *[AG, GI, WAIT],
        *[AG, GI],  # bucket 3 issued
        *[VIEW, MM],
        *[WAIT, VIEW, MM],
    ]
    ag1, ag2, ag3 = find(gm.graph, AG)
    (mul_node,) = find(gm.graph, mul)
    assert ag2.args[0] == [mul_node] and mul_node.args == (s2, 2)
    assert (ag1.args[0], ag3.args[0]) == ([s1], [s3])
    (_, _, wait1, _, _), (_, out2, wait2, _, _), (_, out3, wait3, _, _) = _single_gathers(gm)
    nodes = list(gm.graph.nodes)
    index = node_index(gm.graph)
    assert nodes[index[mul_node] : index[wait2] + 3] == [mul_node, ag2, out2, wait2, ag3, out3]


# ----------------------------------------------------------------------------- prefetch: reductions


def _three_reductions(group_name: str, textbook: bool = True) -> fx.GraphModule:
    """Three weight gradients, each a matmul (a call of its own, as in a real backward), each
    reduced where it is produced."""

    def f(a1, b1, a2, b2, a3, b3):
        r1 = REDUCE_GRAD(a1 @ b1, 4, 2, *on(group_name, textbook), "w1")  # [3, 5]: padded
        r2 = REDUCE_GRAD(a2 @ b2, 5, 2, *on(group_name, textbook), "w2")  # [5, 4]
        r3 = REDUCE_GRAD(a3 @ b3, 2, 2, *on(group_name, textbook), "w3")  # [4, 2]
        return r1, r2, r3

    return trace(f, (3, 2), (2, 5), (5, 2), (2, 4), (4, 2), (2, 2))




@pytest.mark.parametrize(
    "prefetch, textbook, expected",
    [
        (0, True, [MM, PACK, RS, WAIT, MM, VIEW, RS, WAIT, MM, VIEW, RS, WAIT]),
        (1, True, [MM, PACK, RS, MM, WAIT, VIEW, RS, MM, WAIT, VIEW, RS, WAIT]),
        (2, True, [MM, PACK, RS, MM, WAIT, VIEW, RS, MM, WAIT, VIEW, RS, WAIT]),  # always one ahead
        (
            1,
            False,
            [MM, PACK, A2A, MM, WAIT, VIEW, MEAN, VIEW, A2A, MM, WAIT, VIEW, MEAN]
            + [VIEW, A2A, WAIT, VIEW, MEAN],
        ),
    ],
    ids=["none", "one", "two", "one-gloo"],
)
def test_prefetch_waits_each_reduction_just_before_the_next_starts(group_name, prefetch, textbook, expected):
    gm = _three_reductions(group_name, textbook)

    counts = lower(gm, prefetch=prefetch)

    assert counts == counts_of(reductions=3, reduction_buckets=3)
    assert call_targets(gm.graph) == expected
    # the last bucket's wait (and unpacking) is untouched: the outputs are its values
    outs = output_args(gm.graph)
    last = outs[-1]
    assert (last.target, shape(last)) == ((WAIT, (2,)) if textbook else (MEAN, (2,)))
    assert [shape(o) for o in outs] == [(4,), (5,), (2,)]


@pytest.mark.parametrize(
    "stage, keywords",
    [
        (2, {"replica_group": "replicas", "replicas": 2}),
        (3, {"replica_group": "replicas", "replicas": 2, "quant_block": 4, "replica_quant_block": 4}),
        (0, {"quant_block": 4}),
    ],
    ids=["hybrid", "hybrid-int8", "stage0-int8"],
)
def test_prefetch_leaves_the_second_collective_of_a_bucket_in_flight_over_the_next_gradient(group_name, stage, keywords):
    """A bucket of two collectives in a row (hybrid sharding: the mean across replicas, the one
    collective crossing nodes, after the reduce-scatter inside the node; stage 0 int8: a
    reduce-scatter, then a gather of the means) waits for its first at once, as the second reads
    it, and leaves the second in flight until the next bucket starts, as a bucket of one does:
    waited in place, the mean across nodes blocked the backward for the whole transfer."""
    shapes = ((3, 2), (2, 5), (5, 2), (2, 4), (4, 2), (2, 2))

    def f(a1, b1, a2, b2, a3, b3):
        return tuple(
            REDUCE_GRAD(a @ b, numel if stage == 0 else math.ceil(numel / WORLD), stage, *on(group_name), fqn, **keywords)
            for a, b, numel, fqn in ((a1, b1, 15, "w1"), (a2, b2, 20, "w2"), (a3, b3, 8, "w3"))
        )

    gm = trace(f, *shapes)
    lower(gm, prefetch=1)

    index = node_index(gm.graph)
    products = find(gm.graph, MM)
    issues = [n for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "_c10d_functional" and n.target is not WAIT]
    assert len(issues) == 6, gm.graph  # two a bucket, three buckets
    for k in range(2):
        first, second, next_bucket = issues[2 * k : 2 * k + 3]
        assert max(index[w] for w in analysis.waits_of(first)) < index[second]
        second_waits = analysis.waits_of(second)
        assert index[second] < index[products[k + 1]] < min(index[w] for w in second_waits), gm.graph
        assert max(index[w] for w in second_waits) < index[next_bucket]


def test_prefetch_moves_a_reduction_buckets_wait_and_unpacking_before_the_next_bucket(group_name):
    def f(g1, g2, a3, b3, a4, b4):
        r1 = REDUCE_GRAD(g1 * 2, 4, 2, *on(group_name), "w1")  # [3, 5]
        r2 = REDUCE_GRAD(g2 * 2, 5, 2, *on(group_name), "w2")  # [5, 4]: bucket [r1, r2], 140 bytes
        r3 = REDUCE_GRAD(a3 @ b3, 2, 2, *on(group_name), "w3")  # [4, 2]
        r4 = REDUCE_GRAD(a4 @ b4, 1, 2, *on(group_name), "b3")  # [2]: bucket [r3, r4]
        return r1, r2, r3, r4

    gm = trace(f, (3, 5), (5, 4), (4, 3), (3, 2), (2, 3), (3,))

    assert lower(gm, bucket_bytes=140, prefetch=1) == counts_of(reductions=4, reduction_buckets=2)

    split, getitem = aten.split_with_sizes.default, operator.getitem
    assert call_targets(gm.graph) == [
        MUL,
        MUL,
        *[PACK, RS],  # bucket 1 issued where r2 was
        MM,
        MV,
        *[WAIT, split, getitem, getitem],  # bucket 1 waited on only now: in flight over mm, mv
        *[PACK, RS],  # bucket 2
        *[WAIT, split, getitem, getitem],  # the last bucket's wait stays after its collective
    ]
    rs1, rs2 = find(gm.graph, RS)
    wait1, wait2 = find(gm.graph, WAIT)
    split1, split2 = find(gm.graph, split)
    mm_node, mv_node = find(gm.graph, MM)[0], find(gm.graph, MV)[0]
    assert wait1.args == (rs1,) and split1.args[0] is wait1 and wait2.args == (rs2,) and split2.args[0] is wait2
    nodes = list(gm.graph.nodes)
    index = node_index(gm.graph)
    packing_2 = nodes[index[split1] + 3]
    assert packing_2.target is PACK and packing_2.args[0] == [mm_node, mv_node]
    assert nodes[index[mv_node] + 1] is wait1
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
    (_, wait1a, _, _), (_, wait1b, _, _) = gathered_chains(ag1, SHAPES[:2], torch.float32)
    (_, wait2a, _, _), (_, wait2b, _, _) = gathered_chains(ag2, SHAPES[2:], torch.float32)
    index = node_index(gm.graph)
    assert [e.position for e in entries] == [index[ag1], index[ag2]]
    # a bucket is done when its last wait is: that is its wait position
    assert [e.wait_position for e in entries] == [index[wait1b], index[wait2b]]
    assert index[wait1a] < index[wait1b] and index[wait2a] < index[wait2b]
    # bucket 2's all-gather is issued right after bucket 1's last wait (nothing to pack: no
    # cast) and is in flight over bucket 1's slice and views, both relus and both mms
    assert entries[1].position == entries[0].wait_position + 1
    assert entries[0].overlaps == []  # only its own outputs and waits in between
    assert entries[1].overlaps == ["slice_1", "view", "view_1", "relu", "mm", "relu_1", "mm_1"]
    # each bucket's buffers are freed after the last use of its last parameter
    mm1, mm2, mm3 = find(gm.graph, MM)
    (add,) = find(gm.graph, ADD)
    assert [(e.freed_after, e.freed_position) for e in entries] == [("mm_1", index[mm2]), ("add", index[add])]


def test_ledger_of_a_bf16_single_parameter_gather(group_name):
    gm = forward_model(group_name, dtype=torch.bfloat16)
    lower(gm, bucket_bytes=0)

    entries = ledger.graph_ledger(gm.graph, "forward").entries

    assert [e.params for e in entries] == [[f] for f in FQNS]
    assert [e.param_bytes for e in entries] == [[2 * n] for n in SHARDS]
    assert [e.dtype for e in entries] == ["bfloat16"] * 4


@pytest.mark.parametrize("stage, textbook", [(2, True), (2, False), (0, True)], ids=["s2", "s2-gloo", "s0"])
def test_ledger_of_a_bucketed_backward(group_name, stage, textbook):
    gm = backward_model(group_name, stage=stage, textbook=textbook)
    lower(gm, bucket_bytes=140)

    book = ledger.graph_ledger(gm.graph, "backward")

    op = "all_reduce" if stage == 0 else "reduce_scatter"
    assert [e.op for e in book.entries] == [op, op]
    detail = "" if textbook else "all_to_all + sum on gloo"
    assert [e.detail for e in book.entries] == [detail, detail]
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
    lower(gm, prefetch=prefetch)

    intervals = analysis.gathered_live_intervals(gm.graph)

    index = node_index(gm.graph)
    ags = [ag for ag, *_ in _single_gathers(gm)]
    mms = find(gm.graph, MM)
    expected = [(index[ag], index[mm], n) for ag, mm, n in zip(ags, mms, (16, 20, 8))]
    assert intervals == sorted(expected)
    assert analysis.peak_gathered_numel(gm.graph) == peak


def test_peak_gathered_numel_of_one_bucket_counts_each_buffer_from_the_all_gather(group_name):
    gm = forward_model(group_name)
    lower(gm, bucket_bytes=10**9)

    (ag,) = find(gm.graph, AG)
    mm1, mm2, mm3 = find(gm.graph, MM)
    (add,) = find(gm.graph, ADD)
    index = node_index(gm.graph)
    # one buffer per parameter (padded), each alive from the all-gather until its last use
    ends = [index[mm1], index[mm2], index[mm3], index[add]]
    assert analysis.gathered_live_intervals(gm.graph) == [(index[ag], end, WORLD * n) for end, n in zip(ends, SHARDS)]
    assert analysis.peak_gathered_numel(gm.graph) == WORLD * sum(SHARDS) == 48  # all alive when issued
    assert analysis.saved_gathered_values(gm.graph) == []
