"""A sharded model's `load_state_dict()`: the hook `shard()` puts on each module holding
parameters, and zerocompile's own reading of a state dict.

A state dict of a sharded model holds its DTensor parameters (`zerocompile.dtensor_parameters`:
the full shape, this rank's rows, the shard's own storage), as FSDP2's does: torch's DCP
state-dict tools read and write it. Loading takes those, any other DTensor of the full shape, or a
full tensor (as every rank of a DDP job holds one: this rank keeps its slice, no communication).
zerocompile's own reads (checkpoints) take the flat shards from `parameter_owners`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zerocompile.dtensors import as_dtensor, shard_of
from zerocompile.gathered import is_gathered
from zerocompile.meta_init import local_slice
from zerocompile.sharded_modules import module_state
from zerocompile.sharded_parameters import ShardInfo, is_sharded, shard_info


def persistent_buffers(model: nn.Module, params: dict[nn.Parameter, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """The entries of `model`'s state dict that are not the parameters `params` names."""
    param_names = {name for names in params.values() for name in names}
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in param_names}


def load_full_or_distributed_tensors(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """`load_state_dict` into a sharded parameter (a DTensor): a plain tensor of its full shape (as
    every rank of a DDP job holds one) loads as this rank's slice of it, with no communication; a
    DTensor of its full shape (this model's `state_dict()`, DCP's, FSDP2's, any mesh or placement)
    as this rank's shard of it (`dtensors.shard_of`); a flat shard of this layout as it is. Any
    other shape meets torch's usual size-mismatch error."""
    state = module_state(module)
    state.sync.drop_kept_copies()  # the parameters they copy are about to change
    for name, shard in state.shards.items():
        info = shard_info(shard)
        key = prefix + name
        value = state_dict.get(key)
        if _whole_now(module, name, info) or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):
            if tuple(value.shape) != info.shape:
                continue
            flat = shard_of(value, info)
        elif tuple(value.shape) == info.shape:
            flat = local_slice(value.detach().reshape(-1), info.shard_numel, info.group_rank)
        elif tuple(value.shape) == (info.shard_numel,):
            flat = value.detach()
        else:
            continue
        state_dict[key] = as_dtensor(flat, info, module._parameters[name].device_mesh)


def _whole_now(module: nn.Module, name: str, info: ShardInfo) -> bool:
    """Whether `module.name` holds its whole parameter now (stage 0, or inside `gathered()`), not a shard."""
    held = module._parameters.get(name)
    return held is None or not is_sharded(info) or is_gathered(held)
