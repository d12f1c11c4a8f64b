"""`clip_grad_norm_` for a sharded model: torch's, with the norm taken over the whole model.

`torch.nn.utils.clip_grad_norm_` gives the same answer on a sharded model (its parameters are
DTensors), paying DTensor's dispatch per gradient; this one works on the flat gradients. Each rank
takes the norm of the gradient it holds (shards without their padding; stage-0 gradients, which
are whole and identical on every rank, once), the shard norms are combined over each parameter's
own process group (a sum of p-th powers, or a max for the inf-norm), and every local gradient is
scaled by the one resulting factor, as torch's `clip_grads_with_norm_` scales. Tied parameters are
one Parameter, so they count once.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d
from torch.nn.utils import get_total_norm
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from zerocompile.dtensor_parameters import flat_grad
from zerocompile.sharded_parameters import ShardInfo, shard_info


def clip_grad_norm_(
    model: nn.Module | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of a sharded model (or its parameters) to a total `norm_type`-norm of
    `max_norm`, as `torch.nn.utils.clip_grad_norm_` on the unsharded model would; returns the
    total norm before clipping, the same on every rank. Collective: call it on every rank.
    """
    params = list(model.parameters() if isinstance(model, nn.Module) else model)
    params = list({id(p): p for p in params}.values())  # tied parameters count once
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(
            f"zerocompile.clip_grad_norm_ supports norm_type > 0 (2.0, 1.0, float('inf'), ...), got {norm_type}"
        )
    whole: list[torch.Tensor] = []  # stage 0 and unsharded: complete here already
    by_group: dict[str, list[torch.Tensor]] = {}
    grads = []
    for param in params:
        info = shard_info(param)
        grad = flat_grad(param)
        if grad is None:
            continue
        grads.append(grad)
        if info is None or not info.policy.shards_parameters:
            whole.append(grad)
            continue
        by_group.setdefault(info.group_name, []).append(_without_padding(grad, info))
    # Sorted names: every rank runs the collectives of several groups in the same order.
    norms = [_group_norm(by_group[name], norm_type, name, foreach) for name in sorted(by_group)]
    if whole:
        norms.append(get_total_norm(whole, norm_type, foreach=foreach))
    total = get_total_norm(norms, norm_type, error_if_nonfinite)
    if grads:
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for (device, _dtype), ([same], _indices) in _group_tensors_by_device_and_dtype([grads]).items():
            if foreach or (foreach is None and _has_foreach_support(same, device)):
                torch._foreach_mul_(same, clip_coef.to(device))
            else:
                for grad in same:
                    grad.mul_(clip_coef.to(device))
    return total


def _without_padding(grad: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """This rank's slice of the real parameter; the padding past `info.numel` is not part of it."""
    real = max(0, min(info.shard_numel, info.numel - info.shard_offset))
    return grad[:real]


def _group_norm(shards: list[torch.Tensor], norm_type: float, group_name: str, foreach: bool | None) -> torch.Tensor:
    """The norm of the whole gradients whose shards (without padding, so some may be empty) this
    group's ranks hold.

    Every rank joins the all-reduce with the same dtype on its gradients' device, including one
    that holds only padding of the group: torch's norm of no tensors is a CPU float32 zero, which
    an NCCL group cannot take, and beside bf16 or fp16 norms it would not even match in size.
    """
    real = [shard for shard in shards if shard.numel()]  # the inf-norm of an empty tensor is an error
    dtype = functools.reduce(torch.promote_types, [shard.dtype for shard in shards])
    if real:
        local = get_total_norm(real, norm_type, foreach=foreach).to(dtype)
    else:
        local = shards[0].new_zeros((), dtype=dtype)
    group = c10d._resolve_process_group(group_name)
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local.pow(norm_type)
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered.pow(1.0 / norm_type)
