"""A shard seen as torch's DTensor: what torch's own state-dict tools (DCP's `get_model_state_dict`,
`set_model_state_dict`, `get_optimizer_state_dict`) and FSDP2 models speak.

A shard holds ceil(R/N) rows of its parameter's dim 0 (`zerocompile.passes.stages.shard_numel`),
so this rank's valid rows are exactly the local tensor of a `Shard(0)` DTensor of the parameter's
full shape over the shard group: `as_dtensor` is a view of the shard's own storage, no copy. A 0-d
parameter lives on rank 0 (the others hold a zero): a `Partial("sum")` DTensor says exactly that.
Hybrid sharding's replicas hold equal shards, so the mesh is the shard group alone: DCP writes one
copy of each offset, and `full_tensor()` gathers inside the shard group.

`shard_of` is the way back: any DTensor of the full shape (ours, FSDP2's, a different world size
or placement) as this rank's padded flat shard, from the local rows where they are ours and
through `full_tensor()` (a collective every rank of its mesh joins, as loading is) otherwise.
"""

from __future__ import annotations

import math

import torch
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from zerocompile.meta_init import local_slice
from zerocompile.sharded_parameters import ShardInfo


def group_mesh(group: c10d.ProcessGroup, device_type: str) -> DeviceMesh:
    """The 1-D mesh of `group` (made from the group, no collective), unnamed: equal to FSDP2's
    default mesh over the same ranks, so their DTensors copy into each other's."""
    return DeviceMesh.from_group(group, device_type)


def shard_mesh(info: ShardInfo, device: torch.device) -> DeviceMesh:
    """The mesh of `info`'s shard group."""
    return group_mesh(c10d._resolve_process_group(info.group_name), device.type)


def local_rows(info: ShardInfo) -> int:
    """How many of the parameter's dim-0 rows this rank's shard holds (torch.chunk's split)."""
    rows = info.shape[0]
    per_rank = math.ceil(rows / info.world_size)
    return max(0, min(rows, (info.group_rank + 1) * per_rank) - info.group_rank * per_rank)


def as_dtensor(shard: torch.Tensor, info: ShardInfo, mesh: DeviceMesh) -> DTensor:
    """`shard` (a flat padded shard of `info`'s layout: the parameter's, a gradient, optimizer
    state) as a DTensor of the parameter's full shape sharing its storage."""
    if not info.shape:
        return DTensor.from_local(shard[0], mesh, [Partial("sum")], run_check=False, shape=torch.Size(()), stride=())
    rows, rest = local_rows(info), info.shape[1:]
    local = shard[: rows * math.prod(rest)].view(rows, *rest)
    full = torch.empty(info.shape, device="meta")
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def shard_of(value: DTensor, info: ShardInfo) -> torch.Tensor:
    """This rank's padded flat shard of the DTensor `value` (of `info`'s full shape), a new tensor."""
    local = value.to_local()
    if _is_this_ranks_rows(value, info):
        shard = local.new_zeros(info.shard_numel)
        shard[: local.numel()].copy_(local.reshape(-1))
        return shard
    return local_slice(value.full_tensor().reshape(-1), info.shard_numel, info.group_rank)


def _is_this_ranks_rows(value: DTensor, info: ShardInfo) -> bool:
    """Whether `value`'s local tensor is exactly the rows this rank's shard holds."""
    if not info.shape or list(value.placements) != [Shard(0)] or value.device_mesh.size() != info.world_size:
        return False
    ours = c10d._resolve_process_group(info.group_name)
    if c10d.get_process_group_ranks(value.device_mesh.get_group()) != c10d.get_process_group_ranks(ours):
        return False
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    per_rank = math.ceil(info.shape[0] / info.world_size)
    return tuple(shape) == (local_rows(info), *info.shape[1:]) and offset[0] == min(info.group_rank * per_rank, info.shape[0])
