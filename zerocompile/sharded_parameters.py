"""What `shard()` records on each parameter it shards, and how the rest of zerocompile reads it.

Every sharded Parameter carries a `ShardInfo` as `param._zero`: its names, full shape, shard size,
group and the settings of the `shard()` call that made it. Optimizers, checkpoints, weights,
`gathered()` and the backend read parameters through this module, never through `shard()`'s own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from zerocompile.config import ZeroConfig
from zerocompile.passes.markers import MarkerArgs
from zerocompile.passes.stages import StagePolicy, stage_policy
@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What a sharded Parameter is, attached to it as `param._zero`."""

    fqn: str
    names: tuple[str, ...]  # every FQN it is reachable under (tied parameters have several)
    shape: tuple[int, ...]
    numel: int
    shard_numel: int
    group_name: str
    group_rank: int
    world_size: int  # of the group
    reduce_scatter: str  # how the group reduce-scatters this parameter's gradient (its device's backend)
    # The settings of the shard() call that made it: the backend compiles a graph with those of
    # the parameters it holds, so two models on one group keep their own.
    config: ZeroConfig
    # Hybrid sharding (`zerocompile.hybrid`): `group_name` is the shard group, and the shard is
    # replicated on the ranks of this group (its gradient averaged across them).
    replica_group_name: str = ""
    replicas: int = 1
    # hpZ (`zerocompile.passes.secondary_shards`): the stage-3 backward re-gathers over this group.
    secondary_group_name: str = ""
    secondary_size: int = 1

    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def policy(self) -> StagePolicy:
        return stage_policy(self.config.stage)

    def marker_args(self, dtype: torch.dtype) -> MarkerArgs:
        """The arguments of the markers this parameter's modules emit, `dtype` being its shard's: the
        config's dtypes, and the block sizes of the collectives it quantises and the replica and
        secondary groups only where they apply (so default graphs read as before). A parameter that
        is not floating point (an integer table) travels exactly: int8 codes would round it. No FQN:
        the backend fills it in from the traced tensors. With `quant_scope="cross_node"` the
        collectives inside a node stay exact: hybrid sharding's inside the shard group, hpZ's
        re-gathers inside the secondary group."""
        config, quantisable = self.config, dtype.is_floating_point
        gather_block = config.quant_block if quantisable and config.gather_quant and self.policy.shards_parameters else 0
        reduce_block = config.quant_block if quantisable and config.reduce_quant else 0
        hybrid, hpz = self.replicas > 1, self.secondary_size > 1
        inside_nodes_too = config.quant_scope == "all"
        return self._marker(
            compute_dtype=config.param_dtype,
            reduce_dtype=config.reduce_dtype,
            gather_quant_block=gather_block if inside_nodes_too or not hybrid else 0,
            reduce_quant_block=reduce_block if inside_nodes_too or not hybrid else 0,
            replica_group=self.replica_group_name if hybrid else "",
            replicas=self.replicas,
            replica_quant_block=reduce_block if hybrid else 0,
            secondary_group=self.secondary_group_name if hpz else "",
            secondary_size=self.secondary_size,
            secondary_quant_block=gather_block if hpz and inside_nodes_too else 0,
        )

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The full parameter from every rank's `shard` (the marker's eager kernel, blocking), exact
        and in the master dtype; a copy of `shard` where the stage keeps parameters whole."""
        return self._marker(param=self.fqn).unshard(shard)

    def _marker(self, **optional: Any) -> MarkerArgs:
        return MarkerArgs(
            shape=self.shape, stage=self.stage, group_name=self.group_name, world_size=self.world_size,
            reduce_scatter=self.reduce_scatter, **optional,
        )

    @property
    def shard_offset(self) -> int:
        return self.group_rank * self.shard_numel

    @property
    def valid_numel(self) -> int:
        """Elements of this rank's shard that hold the parameter (the rest is padding)."""
        return max(0, min(self.shard_numel, self.numel - self.shard_offset))


def shard_info(param: torch.Tensor) -> ShardInfo | None:
    return getattr(param, "_zero", None)


def is_sharded(info: ShardInfo | None) -> bool:
    """Whether a parameter with this shard info (None: not sharded) holds a flat shard, not its whole tensor."""
    return info is not None and info.policy.shards_parameters


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape `param` has in the model as written, sharded or not: what optimizer groups that
    look at shapes (weight decay only where `dim() >= 2`, as nanoGPT's `configure_optimizers`) must
    ask once `shard()` has made every parameter a flat 1-D shard."""
    info = shard_info(param)
    return param.shape if info is None else torch.Size(info.shape)


def sharded_shape(info: ShardInfo) -> tuple[int, ...]:
    """The shape a sharded Parameter's data has on every rank: its flat shard, or whole where the
    stage keeps parameters whole."""
    return (info.shard_numel,) if info.policy.shards_parameters else info.shape


def shard_of_parameter(param: torch.Tensor) -> torch.Tensor:
    """The flat shard behind `param` when it is the DTensor parameter users see
    (`zerocompile.dtensor_parameters`), else `param` itself."""
    link = getattr(param, "_zero_link", None)
    return param if link is None else link.shard


def user_parameter(param: torch.Tensor) -> torch.Tensor:
    """The DTensor parameter users see for the shard `param`, else `param` itself."""
    link = getattr(param, "_zero_link", None)
    return param if link is None else link.param


def written_count(shard: torch.Tensor) -> int:
    """A count that grows with every write into `shard`: in place, or through the DTensor
    parameter that shows it (whose writes count in that DTensor's own version, not the shard's)."""
    user = user_parameter(shard)
    return shard._version + (user._version if user is not shard else 0)


def views_its_shard(param: torch.Tensor, shard: torch.Tensor) -> bool:
    """Whether `param` (what a module holds) still shows `shard`: the shard itself, or its DTensor
    parameter whose local rows are the shard's storage (not replaced through `param.data = ...`)."""
    if param is shard:
        return True
    local, info = getattr(param, "_local_tensor", None), shard_info(shard)
    if local is None or info is None or tuple(param.shape) != info.shape:  # `.data = t` sets a DTensor's shape
        return False
    return local.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()


def parameter_owners(model: nn.Module) -> dict[nn.Parameter, list[tuple[str, nn.Module, str]]]:
    """Each distinct Parameter (a sharded one as its flat shard, whatever the module holds) with
    every (module prefix, module, attribute) holding it."""
    owners: dict[nn.Parameter, list[tuple[str, nn.Module, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(shard_of_parameter(param), []).append((prefix, module, attr))
    return owners
