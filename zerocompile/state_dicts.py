"""A sharded model's `state_dict()` and `load_state_dict()`: the hooks `shard()` puts on each
module holding parameters, and zerocompile's own reading of a state dict.

A state dict of a sharded model holds a DTensor per sharded parameter (its full shape, this rank's
rows, the shard's own storage), as FSDP2's does: torch's DCP state-dict tools read and write it.
Loading takes those, any other DTensor of the full shape, or a full tensor (as every rank of a DDP
job holds one: this rank keeps its slice, no communication). zerocompile's own reads
(checkpoints) see the sharded Parameters themselves.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from zerocompile.dtensors import as_dtensor, shard_mesh, shard_of
from zerocompile.gathered import is_gathered
from zerocompile.meta_init import local_slice
from zerocompile.sharded_modules import module_state
from zerocompile.sharded_parameters import ShardInfo, is_sharded, shard_info

# Set while zerocompile itself reads a state dict (checkpoints), which wants its Parameters as they are.
_READING_OWN_STATE_DICT: contextvars.ContextVar[bool] = contextvars.ContextVar("zerocompile_reading_own_state_dict", default=False)


def own_state_dict(model: nn.Module) -> dict[str, Any]:
    """`model.state_dict(keep_vars=True)` for zerocompile's own use: the sharded Parameters, not DTensors."""
    token = _READING_OWN_STATE_DICT.set(True)
    try:
        return model.state_dict(keep_vars=True)
    finally:
        _READING_OWN_STATE_DICT.reset(token)


def persistent_buffers(model: nn.Module, params: dict[nn.Parameter, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """The entries of `model`'s state dict that are not the parameters `params` names."""
    param_names = {name for names in params.values() for name in names}
    return {k: v for k, v in own_state_dict(model).items() if k not in param_names}


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
    """`load_state_dict` of a sharded parameter: a plain tensor of its full shape (as every rank of
    a DDP job holds one) is replaced by this rank's slice of it, with no communication; a DTensor
    of its full shape (this model's `state_dict()`, DCP's, FSDP2's, any placement) by this rank's
    shard of it (`dtensors.shard_of`). A flat shard of this layout passes unchanged, and any other
    shape meets torch's usual size-mismatch error."""
    for name, shard in module_state(module).shards.items():
        info = shard_info(shard)
        value = state_dict.get(prefix + name)
        if _whole_now(module, name, info) or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):
            if tuple(value.shape) == info.shape:
                state_dict[prefix + name] = shard_of(value, info)
        elif tuple(value.shape) == info.shape:
            state_dict[prefix + name] = local_slice(value.detach().reshape(-1), info.shard_numel, info.group_rank)


def shards_as_dtensors(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict) -> None:
    """A `state_dict()` post-hook on every module holding sharded parameters: each shard in the
    state dict becomes a DTensor of the parameter's full shape over the shard group, a view of the
    shard (`dtensors.as_dtensor`), as FSDP2's state dicts hold. DCP's `get_model_state_dict`
    gathers them into full tensors (`full_state_dict=True`) or saves each rank's rows, and
    `torch.save` writes what describes itself (`.shape`, `.full_tensor()`), not an anonymous
    1/N slice. zerocompile's own reads (checkpoints) keep the Parameters."""
    if _READING_OWN_STATE_DICT.get():
        return
    meshes: dict[str, DeviceMesh] = {}
    for name, shard in module_state(module).shards.items():
        info = shard_info(shard)
        key = prefix + name
        if _whole_now(module, name, info) or key not in state_dict:
            continue
        if info.group_name not in meshes:
            meshes[info.group_name] = shard_mesh(info, shard.device)
        value = state_dict[key]
        dtensor = as_dtensor(value.detach(), info, meshes[info.group_name])
        state_dict[key] = nn.Parameter(dtensor, requires_grad=value.requires_grad) if isinstance(value, nn.Parameter) else dtensor


def _whole_now(module: nn.Module, name: str, info: ShardInfo) -> bool:
    """Whether `module.name` holds its whole parameter now (stage 0, or inside `gathered()`), not a shard."""
    held = module._parameters.get(name)
    return held is None or not is_sharded(info) or is_gathered(held)
