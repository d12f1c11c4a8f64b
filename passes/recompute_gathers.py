"""Tag each gathered parameter that its stage does not keep for the backward (stage 3: see
`stages.py`), and its views and casts, MUST_RECOMPUTE in the joint graph.

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
from .stages import stage_policy

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
    """Tag the `unshard` nodes of stages that re-gather in the backward, and their view/cast
    users; returns the number tagged.

    `unshard` nodes of stages that keep gathered parameters lose any recompute tag (activation
    checkpointing's), so the partitioner saves them like any other gather of those stages.
    """
    frontier = []
    for node in graph.nodes:
        if not is_unshard(node):
            continue
        policy = stage_policy(unshard_args(node).stage)
        if policy.keeps_gathered_for_backward:
            node.meta.pop("recompute", None)
        elif policy.shards_parameters:
            frontier.append(node)
    tagged = 0
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
