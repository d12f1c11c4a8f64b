"""One table says what each stage does (`zerocompile.passes.stages`), and the passes follow it
with nothing but the markers' arguments: no process group exists for the group they name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
from torch.distributed import distributed_c10d as c10d
from torch.utils.checkpoint import CheckpointPolicy

from fx_helpers import call_targets, trace
from zerocompile.passes import ledger
from zerocompile.passes.lower_markers import lower_markers
from zerocompile.passes.lowering import ALL_TO_ALL_REDUCE_SCATTER, NATIVE_REDUCE_SCATTER
from zerocompile.passes.markers import REDUCE_GRAD, UNSHARD
from zerocompile.passes.merge_unshards import merge_repeated_unshards
from zerocompile.passes.recompute_gathers import tag_gathers_for_recompute
from zerocompile.passes.stages import STAGES, chunk_numel, padded_numel, shard_numel, stage_policy

pytestmark = pytest.mark.fast

funcol = torch.ops._c10d_functional
ABSENT = "no-such-group"  # resolving it would raise: the passes must never ask
WORLD = 3


def test_the_table_says_what_the_zero_paper_and_our_design_say():
    table = {
        stage: (p.shards_parameters, p.gathers_at_forward_start, p.keeps_gathered_for_backward, p.reduces_at_backward_end, p.reduction)
        for stage, p in STAGES.items()
    }
    assert table == {
        0: (False, False, False, False, "all_reduce"),
        1: (True, True, True, True, "reduce_scatter"),
        2: (True, True, True, False, "reduce_scatter"),
        3: (True, False, False, False, "reduce_scatter"),
    }
    assert [stage_policy(s).local_numel((10, 3), WORLD) for s in range(4)] == [30, 12, 12, 12]  # ceil(10 / 3) = 4 rows of 3


def test_a_shard_is_ceil_rows_over_n_rows_as_torch_chunk_and_dtensor_shard_0_split():
    """Rank r's shard holds rows [r * ceil(R / N), ...) flattened and zero-padded: its valid rows
    are exactly `torch.chunk`'s (and so DTensor `Shard(0)`'s local tensor on rank r, empty where
    chunk gives none), and the N shards end to end are the flat parameter then padding, which
    the gather's narrow-and-view relies on."""
    for world_size in range(1, 9):
        for shape in [(), (0,), (1,), (7,), (1, 8), (3, 64), (5, 3), (16, 4), (9, 2, 3)]:
            full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
            rows = full.reshape(1) if full.dim() == 0 else full
            shard = shard_numel(shape, world_size)
            assert padded_numel(shape, world_size) == shard * world_size
            assert shard * world_size >= full.numel()
            assert shard * world_size - full.numel() < world_size * max(1, math.prod(shape[1:])), (shape, world_size)
            padded = torch.cat([full.reshape(-1), full.new_zeros(shard * world_size - full.numel())])
            chunks = rows.chunk(world_size) if rows.shape[0] else ()
            for rank in range(world_size):
                flat = padded[rank * shard : (rank + 1) * shard]
                expected = chunks[rank].reshape(-1) if rank < len(chunks) else full.new_zeros(0)
                assert torch.equal(flat[: expected.numel()], expected), (shape, world_size, rank)
                assert not flat[expected.numel() :].any()


def test_chunks_of_a_collective_are_the_fewest_whole_16_element_blocks():
    """Rank r's chunk of a flat buffer cut inside a collective starts at element r * chunk:
    16-byte aligned for int8 codes (1 byte) and so for every wider dtype; no more padding than
    that needs."""
    for parts in range(1, 10):
        for numel in range(0, 300):
            chunk = chunk_numel(numel, parts)
            assert chunk % 16 == 0, (numel, parts, chunk)
            assert chunk * parts >= numel, (numel, parts, chunk)
            assert chunk == 0 or (chunk - 16) * parts < numel, (numel, parts, chunk)


def _step_graph(stage: int, flavour: str) -> fx.GraphModule:
    """Two uses of w1 (merged into one gather), a use of w2, and both gradients reduced."""
    policy = stage_policy(stage)

    def numel(shape: list[int]) -> int:
        return policy.local_numel(shape, WORLD)

    def f(s1, s2, g1, g2, x):
        group = (ABSENT, WORLD, flavour)
        h = x @ UNSHARD(s1, [3, 5], stage, *group, "w1")
        h = h @ UNSHARD(s2, [5, 4], stage, *group, "w2") + UNSHARD(s1, [3, 5], stage, *group, "w1").sum()
        r1 = REDUCE_GRAD(g1 * 2, numel([3, 5]), stage, *group, "w1")
        r2 = REDUCE_GRAD(g2 * 2, numel([5, 4]), stage, *group, "w2")
        return h.relu(), r1, r2

    shards = [(3, 5), (5, 4)] if not policy.shards_parameters else [(numel([3, 5]),), (numel([5, 4]),)]
    return trace(f, *shards, (3, 5), (5, 4), (2, 3))


@pytest.mark.parametrize("flavour", [NATIVE_REDUCE_SCATTER, ALL_TO_ALL_REDUCE_SCATTER])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_passes_follow_the_table_without_a_process_group(stage: int, flavour: str):
    with pytest.raises(Exception):
        c10d._resolve_process_group(ABSENT)
    policy = stage_policy(stage)
    gm = _step_graph(stage, flavour)

    assert merge_repeated_unshards(gm.graph) == 1
    tagged = tag_gathers_for_recompute(gm.graph)
    assert (tagged > 0) == (policy.shards_parameters and not policy.keeps_gathered_for_backward)
    assert all(
        n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE for n in gm.graph.nodes if n.target is UNSHARD
    ) == (tagged > 0)
    counts = lower_markers(gm.graph, bucket_bytes=10**6, prefetch=1)
    gm.graph.lint()

    targets = call_targets(gm.graph)
    # One bucket: a coalesced all-gather on gloo's layout, one flat all-gather on the others'.
    gather_op = (
        funcol.all_gather_into_tensor_coalesced if flavour == ALL_TO_ALL_REDUCE_SCATTER else funcol.all_gather_into_tensor
    )
    gathers = gm.graph.find_nodes(op="call_function", target=gather_op.default)
    assert len(gathers) == (1 if policy.shards_parameters else 0)
    assert counts["identities"] == (0 if policy.shards_parameters else 2)
    for gather in gathers:
        assert gather.args[1:] == (WORLD, ABSENT)
        # At the forward's start: before the first matmul, or just before w1's first use.
        first_compute = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
        index = {n: i for i, n in enumerate(gm.graph.nodes)}
        assert index[gather] < index[first_compute]
    reductions = {
        "all_reduce": [funcol.all_reduce.default],
        NATIVE_REDUCE_SCATTER: [funcol.reduce_scatter_tensor.default],
        ALL_TO_ALL_REDUCE_SCATTER: [funcol.all_to_all_single.default],
    }["all_reduce" if policy.reduction == "all_reduce" else flavour]
    assert [t for t in targets if t in reductions] == reductions  # both gradients, one bucket
    (reduction,) = gm.graph.find_nodes(op="call_function", target=reductions[0])
    if policy.reduces_at_backward_end:
        index = {n: i for i, n in enumerate(gm.graph.nodes)}
        assert index[reduction] > max(index[n] for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)

    book = ledger.graph_ledger(gm.graph, "step")
    assert book.world_size == WORLD
    ops = [entry.op for entry in book.entries]
    assert ops == (["all_gather"] if policy.shards_parameters else []) + [policy.reduction]
