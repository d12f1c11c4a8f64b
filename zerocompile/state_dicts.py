"""A sharded model's `state_dict()` and `load_state_dict()`: the hooks `shard()` puts on each
module holding parameters, and zerocompile's own reading of a state dict.

A state dict of a sharded model holds this rank's shards. Loading a full state dict (as every rank
of a DDP job holds one) keeps this rank's slice of each full tensor; the first state dict that
holds shards says so, once per model, unless zerocompile itself is reading it (checkpoints).
"""

from __future__ import annotations

import contextvars
import warnings
from typing import Any

import torch
from torch import nn

from zerocompile.meta_init import local_slice
from zerocompile.sharded_modules import module_state
from zerocompile.sharded_parameters import shard_info

# Set while zerocompile itself reads a state dict (checkpoints), which must not warn the user.
_READING_OWN_STATE_DICT: contextvars.ContextVar[bool] = contextvars.ContextVar("zerocompile_reading_own_state_dict", default=False)


def own_state_dict(model: nn.Module) -> dict[str, Any]:
    """`model.state_dict(keep_vars=True)` for zerocompile's own use, without the notice below."""
    token = _READING_OWN_STATE_DICT.set(True)
    try:
        return model.state_dict(keep_vars=True)
    finally:
        _READING_OWN_STATE_DICT.reset(token)


def persistent_buffers(model: nn.Module, params: dict[nn.Parameter, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """The entries of `model`'s state dict that are not the parameters `params` names."""
    param_names = {name for names in params.values() for name in names}
    return {k: v for k, v in own_state_dict(model).items() if k not in param_names}


def keep_this_ranks_slice_of_full_tensors(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """`load_state_dict` of a full state dict (as every rank of a DDP job holds one): a tensor of a
    sharded parameter's full shape is replaced by this rank's slice of it, so the load needs no
    communication. The model's own shards (from `state_dict()`) pass unchanged, and any other
    shape meets torch's usual size-mismatch error."""
    for name, shard in module_state(module).shards.items():
        info = shard_info(shard)
        value = state_dict.get(prefix + name)
        held = module._parameters.get(name)  # full inside `gathered()`: then a full tensor fits as it is
        full_to_shard = held is not None and tuple(held.shape) != info.shape
        if full_to_shard and isinstance(value, torch.Tensor) and tuple(value.shape) == info.shape:
            state_dict[prefix + name] = local_slice(value.detach().reshape(-1), info.shard_numel, info.group_rank)


class ShardedStateDictNotice:
    """A `state_dict()` post-hook on every module of one sharded model: the first state dict that
    holds shards says so, once per model. `torch.save(model.state_dict(), ...)`, the DDP habit,
    would otherwise write 1/N of the model and fail only when loaded, maybe after the job ended."""

    def __init__(self) -> None:
        self.said = False

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict) -> None:
        if self.said or _READING_OWN_STATE_DICT.get():
            return
        for name, shard in module_state(module).shards.items():
            info = shard_info(shard)
            held = module._parameters.get(name)  # full inside `gathered()`: then nothing to say
            if held is not None and tuple(held.shape) != info.shape:
                self.said = True
                warnings.warn(
                    f"state_dict() of a model sharded by zerocompile (stage {info.stage}, {info.world_size} "
                    f"ranks) holds this rank's shards, not the model: '{prefix}{name}' is a flat "
                    f"{tuple(held.shape)} slice of {info.shape}. Saved with torch.save it loads only into this "
                    "model sharded the same way on this rank. To save the model: zerocompile.save(path, model, "
                    "optimizer) (every rank writes its shards; loads at any world size and stage), "
                    "zerocompile.full_state_dict(model) (full tensors on rank 0, for torch.save), or "
                    "zerocompile.save_weights(model, path) (safetensors, as Hugging Face). Said once per model.",
                    UserWarning,
                    stacklevel=2,
                )
                return
