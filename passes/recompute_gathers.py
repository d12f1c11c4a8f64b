"""Tag each gathered parameter that its stage does not keep for the backward (stage 3: see
`stages.py`), and its views and casts, MUST_RECOMPUTE in the joint graph; with a memory budget,
leave as many stage-3 parameters untagged as fit in it.

Left alone, the partitioner saves the gathered weight (or its transpose) for the backward, which
keeps every full parameter alive from forward to backward and silently undoes stage 3. Tagged, the
min-cut partitioner saves the shard instead and the backward graph gathers again. Must run on the
joint forward+backward graph before `min_cut_rematerialization_partition` (the default aot_autograd
partitioner ignores the tags).

Budgeted unsharding (`ZeroConfig.memory_budget`, stage 3): the parameters chosen by `choose_kept`
are left untagged, so the partitioner saves them gathered (the marker is an opaque op it may not
recompute) and the backward sends nothing for them: each saves one re-gather, (N-1)/N of its
gathered bytes. Budget None or 0 is a no-op beyond plain stage 3: the same tags, the same graphs.

Stages 1-2 keep gathered parameters through the backward, so their markers get no tag; and a tag
that activation checkpointing (`torch.utils.checkpoint`) put on a marker inside a checkpointed
region is removed (on a kept stage-3 marker too): recomputing that gather would send the parameter
again (Φ more per step) and save nothing, since the gathered parameter is held anyway.

Every gathered value left for the partitioner to save (stages 1-2, and the kept ones of stage 3)
gets `meta[KEPT]` = its parameter's FQN. The partitioner hands a saved node's meta to the backward
graph's placeholder for it, so the ledger can tell which backward inputs are gathered parameters
(`analysis.kept_inputs`). A `local` marker (no_sync's full copy) is not gathered: it is tagged as
before at stage 3 and never marked or kept.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .markers import is_unshard, unshard_args
from .stages import stage_policy

aten = torch.ops.aten

# node.meta key: the FQN of the gathered parameter this value is (itself, a view or a cast), on the
# values the partitioner may save for the backward.
KEPT = "zero_kept"

# Ops whose output is the gathered parameter in another shape or dtype: saving one of them saves
# a full-size parameter just the same.
_CASTS = {
    aten._to_copy.default,
    aten.clone.default,
    aten._unsafe_view.default,
    torch.ops.prims.convert_element_type.default,
}


def is_view_or_cast(node: fx.Node) -> bool:
    """Whether `node` only views or casts its input (a gathered parameter's reshape, slice, dtype cast)."""
    target = node.target
    if node.op != "call_function":
        return False
    if target in _CASTS or target is operator.getitem:  # getitem: one parameter of a bucket
        return True
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def tag_gathers_for_recompute(graph: fx.Graph, memory_budget: int | None = None) -> int:
    """Tag the `unshard` nodes of stages that re-gather in the backward, and their view/cast
    users, except those `choose_kept` keeps within `memory_budget` bytes; returns the number of
    nodes tagged.

    `unshard` nodes of stages that keep gathered parameters (and kept stage-3 ones) lose any
    recompute tag (activation checkpointing's), so the partitioner saves them like any other
    gather of those stages, and get `KEPT` on them and their views/casts. A graph without
    markers of a sharding stage (stage 0) is left as it is.
    """
    regathered: list[fx.Node] = []
    for node in graph.nodes:
        if not is_unshard(node):
            continue
        policy = stage_policy(unshard_args(node).stage)
        if policy.keeps_gathered_for_backward:
            node.meta.pop("recompute", None)
            if not unshard_args(node).reads_local_copy:
                _mark_kept(gathered_values_of(node))
        elif policy.shards_parameters:
            regathered.append(node)
    values = {node: gathered_values_of(node) for node in regathered}
    kept = set(choose_kept(graph, values, memory_budget)) if memory_budget else set()
    tagged = 0
    for node in regathered:
        if node in kept:
            node.meta.pop("recompute", None)
            _mark_kept(values[node])
            continue
        for value in values[node]:
            value.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        tagged += len(values[node])
    return tagged


def gathered_values_of(marker: fx.Node) -> list[fx.Node]:
    """The marker and every value that is its parameter in another shape or dtype (views and
    casts of it, transitively), in the order found."""
    found = [marker]
    seen = {marker}
    for node in found:  # grows while it is walked: a breadth-first walk of the view/cast users
        for user in node.users:
            if user not in seen and is_view_or_cast(user):
                seen.add(user)
                found.append(user)
    return found


def _mark_kept(values: list[fx.Node]) -> None:
    fqn = unshard_args(values[0]).param or values[0].name
    for value in values:
        value.meta[KEPT] = fqn


def choose_kept(graph: fx.Graph, values: dict[fx.Node, list[fx.Node]], memory_budget: int) -> list[fx.Node]:
    """The stage-3 `unshard` markers (keys of `values`, each mapped to `gathered_values_of` it) to
    keep gathered from the forward for the backward: at most `memory_budget` bytes of gathered
    full tensors (compute dtype, from `meta["val"]`), in the order they were chosen.

    Only a parameter the backward reads saves traffic: its gathered value, or a view or cast of
    it, is read by a node that depends on the backward's tangents. Keeping any other would spend
    the budget on nothing (the partitioner would not save it). Per byte kept, every such parameter
    saves the same, its re-gather's (N-1)/N of its bytes (up to its last shard's padding), so the
    order among them is by position: the one whose last forward use comes latest first, i.e. the
    ones the backward reads first. The kept parameters then sit at the forward's end and the
    backward's start, where the re-gather window is not also alive, so a step's gathered peak
    stays near the budget plus one window (gathering the first layers instead would hold them
    through every later window, forward and backward). Ties: larger first, then graph order.
    Each is kept if it still fits (first fit), so a parameter larger than the space left is
    passed over for smaller ones after it. A function of the graph alone: every rank chooses the
    same parameters. Linear in the graph, plus sorting the candidates.
    """
    position = {node: i for i, node in enumerate(graph.nodes)}
    backward = backward_nodes(graph)
    candidates = []
    size: dict[fx.Node, int] = {}
    for marker, derived in values.items():
        if unshard_args(marker).reads_local_copy:
            continue
        members = set(derived)
        readers = [user for value in derived for user in value.users if user not in members]
        if not any(reader in backward for reader in readers):
            continue
        last_forward_use = max((position[r] for r in readers if r not in backward), default=position[marker])
        value = marker.meta["val"]
        size[marker] = value.numel() * value.element_size()
        candidates.append((-last_forward_use, -size[marker], position[marker], marker))
    kept, used = [], 0
    for *_, marker in sorted(candidates, key=lambda candidate: candidate[:3]):
        if used + size[marker] <= memory_budget:
            kept.append(marker)
            used += size[marker]
    return kept


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The joint graph's backward: its tangent inputs and every call depending on one (graph
    order is topological, so one pass finds them)."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            backward.add(node)
        elif node.op == "call_function" and any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    return backward
