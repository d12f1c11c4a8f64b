"""`ShardedGradScaler`: torch's `GradScaler` for sharded models, every rank skipping a step together.

fp16 training scales the loss so small gradients survive fp16, and skips the optimizer step in
which any gradient overflowed. torch's `GradScaler` looks for the overflow in the gradients this
rank holds. At stages 1-3 those are its shards: an inf lands in the shard of the one rank that
owns that element, that rank skips the step, every other rank takes it, and the ranks' parameters
silently part for good (stage 0 holds whole, identical gradients, so there it is safe).

Here the ranks agree first: each finds its own infs as torch does, then one max all-reduce of the
found-inf flag over each process group the optimizer's parameters are sharded over (as FSDP's
`ShardedGradScaler` does over its group) gives every rank the same answer, so all step or all skip
and all update the scale alike. Everything else (scaling, the step, the scale's growth and
backoff, state dicts) is torch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from zerocompile.dtensor_parameters import on_shards
from zerocompile.offload import offloaded_state
from zerocompile.sharded_parameters import shard_info


class ShardedGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` (same arguments and use) whose found-inf flag is agreed across the
    ranks that shard the optimizer's parameters: after `unscale_` / `step`, either every rank
    stepped or every rank skipped. Collective: `unscale_` and `step` must run on every rank.

        scaler = zc.ShardedGradScaler("cuda")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)                  # optional: to clip unscaled gradients
        zc.clip_grad_norm_(model, 1.0)
        scaler.step(optimizer)
        scaler.update()
    """

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        store = offloaded_state(optimizer)
        if store is not None and store.masters and store.compute_dtype == torch.float16:
            raise ValueError(
                "the model's offload keeps its fp32 master weights in the offload store and the gradients in "
                "float16, where unscaling them would underflow (torch refuses to unscale fp16 gradients): shard with "
                "offload_masters=False to keep the masters and fp32 gradients in memory, or use bfloat16 without a "
                "GradScaler"
            )
        with on_shards(optimizer):  # plain flat gradients: torch's unscale does not take DTensors
            found_per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        groups = _sharded_groups(optimizer)
        if not groups:
            return found_per_device
        # One flag for this rank (any device's inf counts), carried to each group's parameter
        # device, where the group's backend takes tensors, and maxed over the group.
        flag = found_inf.new_zeros(())
        for found in found_per_device.values():
            flag = torch.maximum(flag, found.to(flag.device).reshape(()))
        for group_name, device in sorted(groups.items()):  # the same order on every rank
            flag = flag.to(device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=c10d._resolve_process_group(group_name))
        return {flag.device: flag}


def _sharded_groups(optimizer: torch.optim.Optimizer) -> dict[str, torch.device]:
    """The process groups the optimizer's parameters are sharded over, each with the device its
    parameters live on."""
    groups: dict[str, torch.device] = {}
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            info = shard_info(param)
            if info is not None:
                groups.setdefault(info.group_name, param.device)
    return groups
