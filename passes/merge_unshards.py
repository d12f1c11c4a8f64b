"""Merge repeated `unshard` markers of one parameter in a Dynamo graph into one.

Every attribute access of a sharded parameter becomes its own marker, so a tied embedding (one
Parameter in two modules) or a weight used twice yields several. Merged before AOTAutograd, the
parameter is gathered once per graph and autograd sums its gradient contributions before the single
`reduce_grad`: one gather and one reduction per use window, as the ZeRO volume (2Φ / 3Φ) assumes.
No-op when every parameter is used once.
"""

from __future__ import annotations

import torch.fx as fx

from .markers import is_unshard, unshard_args


def merge_repeated_unshards(graph: fx.Graph) -> int:
    """Replace every later `unshard` of the same shard by the first; returns how many went."""
    first: dict[tuple, fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if not is_unshard(node):
            continue
        marker = unshard_args(node)
        key = (marker.shard, tuple(marker.shape), marker.stage, marker.group_name)
        if key in first:
            node.replace_all_uses_with(first[key])
            graph.erase_node(node)
            merged += 1
        else:
            first[key] = node
    return merged
