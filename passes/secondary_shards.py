"""hpZ (ZeRO++'s hierarchical partitioning): stage 3's backward re-gathers inside a node.

Stage 3 re-gathers every parameter in the backward over all N ranks, across nodes. With
`ZeroConfig(secondary_shard_size=K)` the markers name a secondary group of K ranks (a node's), and
this pass rewrites the joint graph so that, for each parameter the backward gathers again:

- right after the forward's gather, `zerocompile::secondary_shard` keeps this rank's 1/K slice of the
  full parameter (its secondary shard);
- the backward's readers of the parameter (and of its views and casts) read instead a new
  `unshard` of the secondary shard over the secondary group, copied through the same views, all
  tagged MUST_RECOMPUTE, so the backward graph gathers from K ranks inside the node;
- the forward's gather and its views lose their MUST_RECOMPUTE tags: nothing in the backward reads
  them now, and a tag would pull the gather into the backward. The min-cut partitioner then has
  to save what the backward's gather reads, and since it may not recompute the opaque forward
  gather, the cheapest cut saves the secondary shard (Φ/K) rather than the gathered one (Φ).
  (A MUST_SAVE tag would not do: the partitioner bans recomputation only of nodes the forward's
  outputs need, which the secondary shard is not.)

The gradient is still reduce-scattered over all N ranks (the autograd graph is untouched), and the
optimizer state and the primary shards stay 1/N. A rank holds 1/K of each such parameter from its
forward use to its backward, where plain stage 3 holds 1/N: ZeRO++'s memory for traffic trade.

Runs on the joint graph after `tag_gathers_for_recompute` (only its MUST_RECOMPUTE gathers are
re-gathered; kept and local ones are not). A no-op on graphs whose markers name no secondary group.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed import distributed_c10d as c10d
from torch.utils.checkpoint import CheckpointPolicy

from .markers import UNSHARD, is_unshard, unshard_args
from .recompute_gathers import backward_nodes, gathered_values_of
from .stages import chunk_numel


@torch.library.custom_op("zerocompile::secondary_shard", mutates_args=())
def secondary_shard(full: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """This rank's slice of the flat `full` zero-padded to `group_size` aligned shards: what the
    ranks of `group_name` all-gather to rebuild it. The one op here that asks the group (its rank):
    the graph is the same on every rank, the slice is each rank's own."""
    numel = chunk_numel(full.numel(), group_size)
    rank = c10d._resolve_process_group(group_name).rank()
    flat = full.reshape(-1)
    start, stop = min(rank * numel, flat.numel()), min((rank + 1) * numel, flat.numel())
    part = flat[start:stop]
    return torch.nn.functional.pad(part, [0, numel - part.numel()]) if part.numel() < numel else part.clone()


@secondary_shard.register_fake
def _secondary_shard_fake(full: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    return full.new_empty(chunk_numel(full.numel(), group_size))


SECONDARY_SHARD = torch.ops.zerocompile.secondary_shard.default


def regather_from_secondary_shards(graph: fx.Graph) -> int:
    """Rewrite the joint `graph` in place as described above; returns how many parameters the
    backward now gathers from their secondary shards."""
    backward = backward_nodes(graph)
    rewritten = 0
    for marker in [n for n in graph.nodes if is_unshard(n)]:
        args = unshard_args(marker)
        # A local marker (no_sync's full copy) is no gather: the backward reads the copy itself.
        if args.secondary_size <= 1 or args.reads_local_copy or marker.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
            continue
        values = gathered_values_of(marker)
        if not any(user in backward for value in values for user in value.users if user not in values):
            continue
        _read_in_backward_from_secondary(marker, values, backward)
        rewritten += 1
    graph.lint()
    return rewritten


def _read_in_backward_from_secondary(marker: fx.Node, values: list[fx.Node], backward: set[fx.Node]) -> None:
    graph = marker.graph
    args = unshard_args(marker)
    full = marker.meta["val"]
    with graph.inserting_after(marker):
        secondary = graph.call_function(SECONDARY_SHARD, (marker, args.secondary_group, args.secondary_size))
    secondary.meta["val"] = _secondary_shard_fake(full, args.secondary_group, args.secondary_size)
    with graph.inserting_after(secondary):
        # Gathered in the forward's dtype, quantised where `secondary_quant_block` says (the forward's
        # quantisation, or exact when only what crosses nodes is: the slice holds the forward's
        # dequantised values, so an exact re-gather reproduces them); never differentiated, so the
        # reduction arguments do not matter: the backward's reduce_grad is already in the graph.
        block = args.secondary_quant_block
        regathered = graph.call_function(
            UNSHARD,
            (secondary, list(args.shape), args.stage, args.secondary_group, args.secondary_size, args.reduce_scatter),
            {"param": args.param, **({"gather_quant_block": block} if block else {})},
        )
    regathered.meta["val"] = full
    copies = {marker: regathered}
    for value in values:
        if value is marker:
            continue
        # Views and casts of the regathered parameter, as the forward made them of the gathered one.
        with graph.inserting_after(value):
            copy = graph.node_copy(value, lambda node: copies.get(node, node))
        copy.meta = dict(value.meta)
        copies[value] = copy
    made = set(copies.values())
    for value, copy in copies.items():
        value.meta.pop("recompute", None)
        copy.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        for user in [u for u in value.users if u in backward and u not in made]:
            user.replace_input_with(value, copy)
    # Views left without readers (the backward's own views of the forward's ones, now copied)
    # would still make the partitioner recompute the forward's gather for them.
    for node in [*reversed(list(copies.values())), *reversed(values[1:])]:
        if not node.users:
            graph.erase_node(node)
