"""What each marker op means in collectives: the one definition used eagerly and in graphs.

The marker ops' eager kernels call these functions directly, and `lower_markers` traces the same
functions into the graph in place of each marker, so the eager path and the compiled path cannot
drift apart. Everything here is built from `torch.ops._c10d_functional` ops, which Dynamo,
AOTAutograd and Inductor all understand, on any device and backend.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

funcol = torch.ops._c10d_functional


def group_size(group_name: str) -> int:
    return c10d._get_group_size_by_name(group_name)


def sends_textbook_reduce_scatter(group_name: str) -> bool:
    """Whether the group's own reduce-scatter already sends only (N-1)/N of the tensor.

    gloo's reduce-scatter sends as much as an all-reduce, 2(N-1)/N (measured); an all-to-all
    followed by a local sum sends the textbook (N-1)/N, so on gloo we build it from that.
    """
    group = c10d._resolve_process_group(group_name)
    return dist.get_backend(group) != "gloo"


def padded_numel(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) * world_size


def gather_full(shard: torch.Tensor, shape: list[int], group_name: str) -> torch.Tensor:
    """All-gather the flat shards and view the result in the parameter's full shape."""
    gathered = funcol.wait_tensor(funcol.all_gather_into_tensor(shard, group_size(group_name), group_name))
    numel = math.prod(shape)
    if gathered.numel() != numel:
        gathered = gathered[:numel]
    return gathered.view(shape)


def reduce_scatter_mean(grad: torch.Tensor, shard_numel: int, group_name: str) -> torch.Tensor:
    """This rank's flat shard of the gradient averaged over the group (padding zeros)."""
    world_size = group_size(group_name)
    flat = grad.reshape(-1)
    padding = shard_numel * world_size - flat.numel()
    if padding:
        flat = torch.constant_pad_nd(flat, [0, padding])
    if sends_textbook_reduce_scatter(group_name):
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(flat, "avg", world_size, group_name))
    splits = [shard_numel] * world_size
    received = funcol.wait_tensor(funcol.all_to_all_single(flat, splits, splits, group_name))
    return received.view(world_size, shard_numel).sum(0) / world_size


def all_reduce_mean(grad: torch.Tensor, group_name: str) -> torch.Tensor:
    """The gradient averaged over the group (stage 0, as DDP)."""
    summed = funcol.wait_tensor(funcol.all_reduce(grad, "sum", group_name))
    return summed / group_size(group_name)
