"""Stage 3: tag each gathered parameter, and its views and casts, MUST_RECOMPUTE in the joint graph.

Left alone, the partitioner saves the gathered weight (or its transpose) for the backward, which
keeps every full parameter alive from forward to backward and silently undoes stage 3. Tagged, the
min-cut partitioner saves the shard instead and the backward graph gathers again. Must run on the
joint forward+backward graph before `min_cut_rematerialization_partition` (the default aot_autograd
partitioner ignores the tags).

Stages 1-2 keep gathered parameters through the backward, so their markers get no tag; and a tag
that activation checkpointing (`torch.utils.checkpoint`) put on a marker inside a checkpointed
region is removed: recomputing that gather would send the parameter again (Φ more per step) and
save nothing, since the stage holds full parameters for the whole step anyway.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .markers import is_unshard, unshard_args

aten = torch.ops.aten

# Ops whose output is the gathered parameter in another shape or dtype: saving one of them saves
# a full-size parameter just the same.
_CASTS = {
    aten._to_copy.default,
    aten.clone.default,
    aten._unsafe_view.default,
    torch.ops.prims.convert_element_type.default,
}


def _is_view_or_cast(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if target in _CASTS or target is operator.getitem:  # getitem: one parameter of a bucket
        return True
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def tag_gathers_for_recompute(graph: fx.Graph) -> int:
    """Tag stage-3 `unshard` nodes and their view/cast users; returns the number tagged.

    Stage 1-2 `unshard` nodes lose any recompute tag (activation checkpointing's), so the
    partitioner saves them like any other gather of those stages.
    """
    for node in graph.nodes:
        if is_unshard(node) and unshard_args(node).stage in (1, 2):
            node.meta.pop("recompute", None)
    tagged = 0
    frontier = [node for node in graph.nodes if is_unshard(node) and unshard_args(node).stage == 3]
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        tagged += 1
        frontier.extend(user for user in node.users if _is_view_or_cast(user))
    return tagged
