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


def gather_bucket(
    shards: list[torch.Tensor], shapes: list[list[int]], group_name: str, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """One all-gather for several parameters, in `dtype` (cast before sending: mixed precision
    halves the bytes). Rank r's buffer holds its shard of each parameter back to back, so the
    gathered buffer is [rank, parameter slice]; each parameter is its column block, flattened (a
    copy), unpadded."""
    if dtype is not None:
        shards = [shard.to(dtype) for shard in shards]
    if len(shards) == 1:
        return [gather_full(shards[0], shapes[0], group_name)]
    world_size = group_size(group_name)
    flat = torch.cat(shards)
    gathered = funcol.wait_tensor(funcol.all_gather_into_tensor(flat, world_size, group_name))
    rows = gathered.view(world_size, flat.numel())
    fulls = []
    for block, shape in zip(rows.split([s.numel() for s in shards], dim=1), shapes):
        fulls.append(block.reshape(-1)[: math.prod(shape)].view(shape))
    return fulls


def reduce_scatter_bucket(
    grads: list[torch.Tensor],
    shard_numels: list[int],
    group_name: str,
    reduce_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """One reduce-scatter for several gradients in `reduce_dtype`, laid out so each rank receives
    its shard of each; the shards come back in `grad_dtype` (the master parameters')."""
    grads = [grad.to(reduce_dtype) for grad in grads] if reduce_dtype is not None else grads
    if len(grads) == 1:
        shards = [reduce_scatter_mean(grads[0], shard_numels[0], group_name)]
    else:
        world_size = group_size(group_name)
        blocks = []
        for grad, shard_numel in zip(grads, shard_numels):
            flat = grad.reshape(-1)
            padding = shard_numel * world_size - flat.numel()
            if padding:
                flat = torch.constant_pad_nd(flat, [0, padding])
            blocks.append(flat.view(world_size, shard_numel))
        rank_major = torch.cat(blocks, dim=1).reshape(-1)
        shards = list(reduce_scatter_mean(rank_major, sum(shard_numels), group_name).split(shard_numels))
    return [shard.to(grad_dtype) for shard in shards] if grad_dtype is not None else shards


def all_reduce_bucket(
    grads: list[torch.Tensor],
    group_name: str,
    reduce_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """One all-reduce for several gradients (stage 0), as DDP's buckets; dtypes as above."""
    grads = [grad.to(reduce_dtype) for grad in grads] if reduce_dtype is not None else grads
    if len(grads) == 1:
        reduced = [all_reduce_mean(grads[0], group_name)]
    else:
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        parts = all_reduce_mean(flat, group_name).split([g.numel() for g in grads])
        reduced = [part.view(grad.shape) for part, grad in zip(parts, grads)]
    return [r.to(grad_dtype) for r in reduced] if grad_dtype is not None else reduced
