"""`shard(model, stage)`: turn an ordinary model into a ZeRO-sharded one, in place.

Each Parameter object stays where it is, under its name, so optimizers and user code holding it
keep working; at stages 1-3 its data becomes this rank's flat 1-D slice of the padded parameter.
Each module holding parameters gets a generated subclass whose `weight`/`bias`/... properties
return `zerocompile::unshard(shard)`: a class property wins over `nn.Module.__getattr__`, so model code is
untouched and every use of a parameter becomes a marker in the traced graph.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
import warnings
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zerocompile import dump
from zerocompile.accumulation import GradientSync, check_nothing_pending
from zerocompile.buffers import broadcast_buffers_in_forward
from zerocompile.config import (
    ZeroConfig,
    config_from_kwargs,
    refuse_concurrent_gloo_gathers,
    refuse_gloo_gathers_on_accelerator,
)
from zerocompile.distributed import agreed, backend_for, group_device, reduce_scatter_flavour
from zerocompile.heap import glibc_malloc_trim
from zerocompile.hybrid import hybrid_groups
from zerocompile.meta_init import PartReader, built_on_meta, check_meta_model, local_slice, materialise_sharded
from zerocompile.offload import DiskState, HostState, OffloadedState, Shards, offloaded_state
from zerocompile.optimizers import optimizer_list, refuse_unsupported_optimizer, replicated_state_keys
from zerocompile.passes.markers import UNSHARD, MarkerArgs
from zerocompile.passes.stages import StagePolicy, stage_policy
from zerocompile.process_hooks import ProcessHooks
from zerocompile.rank_deaths import RANK_DEATHS, watch_job, worth_watching
from zerocompile.user_warnings import warn_at_caller

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


def shard_info(param: torch.Tensor) -> ShardInfo | None:
    return getattr(param, "_zero", None)


def shard(
    model: nn.Module,
    stage: int | ZeroConfig | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    init: Callable[[nn.Module], Any] | None = None,
    weights: str | os.PathLike | None = None,
    weights_strict: bool = True,
    **settings: Any,
) -> nn.Module:
    """Shard `model` in place for ZeRO `stage` (0-3) over `group`; returns `model`.

    `stage` may also be a `ZeroConfig`; keyword settings override its fields. Pass `optimizer=`
    (one or a list) if it has already stepped, so its state is sharded too; a `torch.optim.Muon`
    or `Adafactor` passed in becomes its `zerocompile.optim` equivalent, which steps on shards.

    A model built under `with torch.device("meta"):` is materialised straight into this rank's
    shards, on the group's device: `init` runs as `model.apply(init)` would (default: each
    module's own `reset_parameters()`), one module's full parameters at a time, and the result
    equals that on the unsharded model from group rank 0's random state (see `meta_init`). Every
    rank draws from group rank 0's generator state: a rank whose generator equalled it ends
    advanced as rank 0's is; a rank whose generator differed gets its own state back. On a real
    model, `init` runs as `model.apply(init)` before sharding.

    `weights` (a meta-built model only): a directory `save_pretrained` or `save_weights` wrote (or
    a `.safetensors` file). Every parameter and persistent buffer it holds (a tied parameter under
    any of its names) is read straight into this rank's shard, and `init` gives values only to the
    rest: a module whose tensors all come from the files is not passed to `init`, and a write to
    a loaded tensor in any other call is skipped. Names and shapes are checked before anything is
    read; names in the files the model lacks raise unless `weights_strict=False`, which ignores
    them (as `from_pretrained` ignores another task's head). A model with real parameters is
    refused: call `load_weights` after `shard()`. On any failure the model stays on meta.
    """
    base = stage if isinstance(stage, ZeroConfig) else None
    if group is not None:
        settings["group"] = group
    config = config_from_kwargs(base, None if isinstance(stage, ZeroConfig) else stage, settings)
    on_meta = built_on_meta(model)
    _check_can_shard(model, on_meta)
    loaded = _weight_readers(model, weights, weights_strict, on_meta) if weights is not None else None
    from zerocompile.optim import SHARDED_EQUIVALENTS, take_over  # optim builds on this module

    optimizers = optimizer_list(optimizer)
    policy = stage_policy(config.stage)
    for passed in optimizers:
        if not (policy.shards_parameters and type(passed) in SHARDED_EQUIVALENTS):  # taken over below
            refuse_unsupported_optimizer(passed, {config.stage})
    group = config.group if config.group is not None else dist.group.WORLD
    refuse_concurrent_gloo_gathers(config, group)
    # Every parameter is on one device (checked above); a meta-built model lands on the group's.
    device = group_device(group) if on_meta else next((p.device for p in model.parameters()), group_device(group))
    refuse_gloo_gathers_on_accelerator(config, backend_for(group, device), device)
    config = config.for_backend(backend_for(group, device))
    hybrid = hybrid_groups(group, config.shard_size)
    world_size = dist.get_world_size(hybrid.shard)
    rank = dist.get_rank(hybrid.shard)
    replica_group_name = hybrid.replicate.group_name if hybrid.replicate is not None else ""
    # hpZ's secondary group: the shard group of a hybrid layout of that size (None: the group itself).
    secondary = hybrid_groups(group, config.secondary_shard_size, "secondary_shard_size").shard
    secondary_name, secondary_size = ("", 1) if secondary is group else (secondary.group_name, dist.get_world_size(secondary))

    owners = _parameter_owners(model)
    infos = {}
    flavour = reduce_scatter_flavour(hybrid.shard, device)
    for param, places in owners.items():
        names = tuple(f"{prefix}{'.' if prefix else ''}{attr}" for prefix, _module, attr in places)
        infos[param] = ShardInfo(
            fqn=names[0],
            names=names,
            shape=tuple(param.shape),
            numel=param.numel(),
            shard_numel=policy.local_numel(param.numel(), world_size),
            group_name=hybrid.shard.group_name,
            group_rank=rank,
            world_size=world_size,
            reduce_scatter=flavour,
            config=config,
            replica_group_name=replica_group_name,
            replicas=hybrid.replicas,
            secondary_group_name=secondary_name,
            secondary_size=secondary_size,
        )
    # A rank whose disk cannot take its state must not leave the others waiting in shard()'s broadcasts.
    offloaded = agreed(lambda: _offloaded_states(config, optimizers, infos, device), group) if config.offload else []
    if on_meta:
        shard_numels = {param: info.shard_numel if policy.shards_parameters else None for param, info in infos.items()}
        local, buffers = materialise_sharded(
            model, init, shard_numels=shard_numels, group=hybrid.shard, device=group_device(group), agree_over=group,
            trim=config.trim_heap, loaded=loaded,
        )
        _install_materialised(local, buffers, policy)
    else:
        if init is not None:
            with torch.no_grad():
                model.apply(init)
        _broadcast_from_group_rank0(model, group)
        if policy.shards_parameters:
            for param, info in infos.items():
                param.data = local_slice(param.detach().reshape(-1), info.shard_numel, rank)
    for param, info in infos.items():
        param._zero = info
    for passed in optimizers:
        if policy.shards_parameters:
            take_over(passed)
        _shard_optimizer_state(passed)
    for passed, store in zip(optimizers, offloaded):
        store.install(passed)
        first = next((infos[p].fqn for p in store.regions), "")
        dump.emit_offload(dump.dump_dir(config.dump_dir), f"{type(passed).__name__.lower()}@{first}", store.traffic)
    sync = GradientSync({shard_info(param).fqn: param for param in owners})
    notice = ShardedStateDictNotice()
    for module in {id(m): m for places in owners.values() for _p, m, _a in places}.values():
        _make_module_unshard_on_access(module, sync, notice)
    if config.broadcast_buffers:
        broadcast_buffers_in_forward(model, group, sync)
    if config.param_dtype is not None:
        model.register_forward_pre_hook(
            functools.partial(_cast_floating_inputs, dtype=config.param_dtype), with_kwargs=True
        )
    model._zero_config = config
    for prefix, module in model.named_modules():
        module._zero_prefix = prefix  # what the registration guard names; its mark of a sharded model
    WHILE_SHARDED.hold(model)
    if worth_watching(group):
        # Peers that can die: how this rank dies is recorded for them while a sharded model lives.
        WHILE_SHARDED.patch(watch_job, RANK_DEATHS.stop)
    return model


def _weight_readers(
    model: nn.Module, weights: str | os.PathLike, strict: bool, on_meta: bool
) -> dict[torch.Tensor, PartReader]:
    if not on_meta:
        raise ValueError(
            f"shard(weights={str(weights)!r}) fills a model built on the meta device, whose tensors hold no "
            "values yet; this model's parameters are real tensors, already initialised. Call "
            "zerocompile.load_weights(model, path) after shard() instead, or build the model under "
            "`with torch.device('meta'):`"
        )
    from zerocompile.weights import file_readers  # weights builds on this module

    return file_readers(model, weights, strict=strict)


def _cast_floating_inputs(module: nn.Module, args: tuple, kwargs: dict, *, dtype: torch.dtype) -> tuple | None:
    """Mixed precision: the model's floating-point inputs meet parameters of `dtype` (as FSDP's
    cast_forward_inputs); integer inputs such as token ids pass unchanged. Inside
    `zerocompile.gathered(model)` the parameters are full master-dtype tensors, so nothing is cast."""
    if getattr(module, "_zero_gathered", False):
        return None

    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    return torch.utils._pytree.tree_map(cast, (args, kwargs))


def _check_can_shard(model: nn.Module, on_meta: bool) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "zerocompile.shard() needs torch.distributed to be initialised: call "
            "zerocompile.init_distributed() first (it reads torchrun/Slurm settings and also works "
            "in a single process)"
        )
    _check_not_wrapped(model)
    already = [name for name, p in model.named_parameters() if shard_info(p) is not None]
    if already or getattr(model, "_zero_config", None) is not None:
        raise RuntimeError(
            f"the model is already sharded (e.g. parameter {already[:1]}): call zerocompile.shard() "
            "once per model; to change the stage, build the model again and shard it once"
        )
    if on_meta:
        check_meta_model(model)  # buffers may live anywhere: they move to the group's device
    devices: dict[torch.device, list[str]] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        devices.setdefault(tensor.device, []).append(name)
    if len(devices) > 1 and not on_meta:
        listing = "; ".join(f"{d}: {names[:3]}" for d, names in devices.items())
        raise ValueError(
            f"parameters and buffers are on several devices ({listing}): move the model to one "
            "device with model.to(device) before zerocompile.shard()"
        )
    _check_parameters_shardable(model)
    with_grad = [name for name, p in model.named_parameters() if p.grad is not None]
    if with_grad:
        raise RuntimeError(
            f"parameters {with_grad[:3]} hold gradients of the unsharded model: call "
            "optimizer.zero_grad(set_to_none=True) or model.zero_grad() before zerocompile.shard()"
        )


def _check_not_wrapped(model: nn.Module) -> None:
    """Another data-parallel wrapper already owns the parameters' synchronisation (DDP) or their
    layout (FSDP): sharding on top would reduce twice or slice slices."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("shard() takes the plain model, not a DistributedDataParallel wrapper: pass model.module")
    for name, module in model.named_modules():
        where = f"submodule '{name}'" if name else "the model"
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise TypeError(
                f"{where} is wrapped in DistributedDataParallel: shard() replaces DDP, so pass the "
                "plain modules (DDP's .module) and let zerocompile.shard(model, stage=0) do what DDP did"
            )
        if isinstance(module, (FullyShardedDataParallel, FSDPModule)):
            raise TypeError(
                f"{where} is already sharded by FSDP ({type(module).__name__}): zerocompile.shard() "
                "takes the plain, unsharded model. Build it without FSDP/fully_shard and call "
                "zerocompile.shard(model, stage=3) instead"
            )
    distributed = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if distributed:
        raise TypeError(
            f"parameters {distributed[:3]} are DTensors (sharded by FSDP's fully_shard or tensor "
            "parallelism): zerocompile.shard() takes the plain, unsharded model"
        )


def _check_parameters_shardable(model: nn.Module) -> None:
    """Parameters our collectives cannot carry fail here naming them rather than deep inside a
    collective."""
    for name, param in model.named_parameters():
        if param.layout != torch.strided:
            raise TypeError(
                f"parameter '{name}' is a {param.layout} tensor: zerocompile shards dense parameters "
                "only; make it dense (param.to_dense()) before zerocompile.shard()"
            )
        if param.is_complex():
            raise TypeError(
                f"parameter '{name}' is complex ({param.dtype}): zerocompile's collectives carry real "
                "dtypes. Store it as real pairs, nn.Parameter(torch.view_as_real(value)), and use "
                "torch.view_as_complex(self.<name>) in forward"
            )
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True and isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            raise TypeError(
                f"module '{name}' ({type(module).__name__}) has sparse=True, whose sparse gradients "
                "cannot be reduce-scattered: build it with sparse=False (dense gradients) before "
                "zerocompile.shard()"
            )


def _broadcast_from_group_rank0(model: nn.Module, group: dist.ProcessGroup) -> None:
    """All ranks start from group rank 0's values, as DDP does."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=src, group=group)


def _parameter_owners(model: nn.Module) -> dict[nn.Parameter, list[tuple[str, nn.Module, str]]]:
    """Each distinct Parameter with every (module prefix, module, attribute) holding it."""
    owners: dict[nn.Parameter, list[tuple[str, nn.Module, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(param, []).append((prefix, module, attr))
    return owners


def _install_materialised(
    local: dict[nn.Parameter, torch.Tensor], buffers: dict[tuple[nn.Module, str], torch.Tensor], policy: StagePolicy
) -> None:
    """Give each meta Parameter its materialised data, keeping the Parameter object (tied names,
    user references) by swapping its contents: a meta tensor's data cannot be set to a real one."""
    for param, data in local.items():
        fresh = nn.Parameter(data if policy.shards_parameters else data.view(param.shape), requires_grad=param.requires_grad)
        fresh.__dict__.update(param.__dict__)  # swap_tensors exchanges the attribute dicts too
        torch.utils.swap_tensors(param, fresh)
    for (module, name), value in buffers.items():
        module._buffers[name] = value


def _offloaded_states(
    config: ZeroConfig, optimizers: list[torch.optim.Optimizer], infos: dict[nn.Parameter, ShardInfo], device: torch.device
) -> list[OffloadedState]:
    """With `offload`, each optimizer's state store laid out and reserved (before anything changes)."""
    if not optimizers:
        raise ValueError(
            f"offload={config.offload!r} moves the optimizer's state, so shard() must know the optimizer: build it "
            "on the model before shard() and pass it, zerocompile.shard(model, ..., optimizer=optimizer)"
        )
    for passed in optimizers:
        foreign = [tuple(p.shape) for group in passed.param_groups for p in group["params"] if p not in infos]
        if foreign:
            raise ValueError(
                f"the optimizer holds {len(foreign)} parameter(s) that are not the model's (shapes {foreign[:3]}): "
                f"with offload={config.offload!r} pass only the optimizers of the model being sharded"
            )
    if device.type == "cpu" and glibc_malloc_trim() is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        warn_at_caller(
            f"offload={config.offload!r} with the parameters on the CPU, allocating with glibc's malloc: its heap keeps "
            "the holes of each step's freed buffers (gathered parameters, gradients), which can cost more memory than "
            "the offload saves (a 2.0B GPT's job ran out of memory that way). Preload tcmalloc or jemalloc "
            "(LD_PRELOAD; `zerocompile train` does) or set MALLOC_MMAP_THRESHOLD_=65536 in the ranks' environment"
        )
    shards = Shards(
        local_numel=lambda p: infos[p].shard_numel,
        full_ndim=lambda p: len(infos[p].shape),
        device=device,
        describe=lambda p: repr(infos[p].fqn),
        compute_dtype=config.param_dtype if config.offload_masters else None,
    )
    if any(shards.keeps_master(p) for passed in optimizers for group in passed.param_groups for p in group["params"]):
        _refuse_rounded_gradients(config)
    if config.offload == "disk":
        return [DiskState(passed, shards, config.offload_dir) for passed in optimizers]
    return [HostState(passed, shards) for passed in optimizers]


def _shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Slice per-parameter optimizer state (exp_avg, ...) shaped like the full parameter, but for
    the state the optimizer keeps whole (Adafactor's column statistics of a one-row matrix have
    the matrix's shape)."""
    replicated = replicated_state_keys(optimizer)
    for param, state in optimizer.state.items():
        info = shard_info(param)
        if info is None or not info.policy.shards_parameters:
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == info.shape and value.dim() > 0 and key not in replicated:
                state[key] = local_slice(value.reshape(-1), info.shard_numel, info.group_rank)


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


@functools.cache
def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    def make_property(name: str) -> property:
        def full_parameter(self: nn.Module) -> torch.Tensor:
            param = self._parameters.get(name)
            # What shard() recorded, in one lookup: under torch.compile every attribute this reads
            # is traced and guarded at every use of every parameter. Walking param._zero's
            # ShardInfo, config and stage policy instead was a fifth of Dynamo's work on a GPT
            # (Python calls while tracing a 12-layer one: 5.7M, 4.6M with this lookup).
            sharded, markers, keywords = self._zero_access[name]
            # Traced, testing identity with the recorded shard would make Dynamo guard that two
            # sources are one object, in a guard function of Python run at every call; `hasattr`
            # is guarded in C++, and a Parameter put in the shard's place has no shard info.
            if torch.compiler.is_compiling():
                replaced = not hasattr(param, "_zero")
            else:
                replaced = param is not self._zero_shards[name]
            # The shape comparison is decided while tracing (a changed shape fails a guard).
            if replaced or tuple(param.shape) != sharded:  # a removed parameter (None) is replaced too
                _raise_changed_after_shard(self, name, param)
            if self._zero_sync.quiet:  # no no_sync copy or pending gradient: the plain marker
                return UNSHARD(param, *markers, **keywords)
            return self._zero_slots[name].marker(param, markers, keywords)

        return property(full_parameter, doc=f"the full `{name}`, gathered from its shards")

    attributes: dict[str, Any] = {name: make_property(name) for name in names}
    attributes["_zero_plain_class"] = cls  # what `gathered()` swaps back to for its block
    return type(cls.__name__, (cls,), attributes)


def _make_module_unshard_on_access(module: nn.Module, sync: GradientSync, notice: ShardedStateDictNotice) -> None:
    names = tuple(name for name, p in module._parameters.items() if p is not None)
    module._zero_shards = {name: module._parameters[name] for name in names}  # what the properties expect
    slots, access = {}, {}
    for name, shard in module._zero_shards.items():
        info = shard_info(shard)
        slots[name] = sync.slots[info.fqn]  # shared by every module holding the parameter
        # The marker's arguments after the shard (see zerocompile.passes.markers.unshard). The FQN
        # is left out: Dynamo would guard on it, and every block of a model compiled block by block
        # (or split by graph breaks) would then compile a graph of its own. The backend fills it in.
        markers, keywords = info.marker_args(shard.dtype).call()
        # The property's one lookup: the sharded shape, the marker's arguments.
        access[name] = (sharded_shape(info), markers, keywords)
    module._zero_slots = slots
    module._zero_access = access
    module._zero_sync = sync  # one per model: what no_sync(model) enters and exits
    module.__class__ = _sharded_class(type(module), names)
    module.register_load_state_dict_pre_hook(_keep_this_ranks_slice_of_full_tensors)
    module.register_state_dict_post_hook(notice)


def _keep_this_ranks_slice_of_full_tensors(
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
    for name, shard in module._zero_shards.items():
        info = shard_info(shard)
        value = state_dict.get(prefix + name)
        held = module._parameters.get(name)  # full inside `gathered()`: then a full tensor fits as it is
        full_to_shard = held is not None and tuple(held.shape) != info.shape
        if full_to_shard and isinstance(value, torch.Tensor) and tuple(value.shape) == info.shape:
            state_dict[prefix + name] = local_slice(value.detach().reshape(-1), info.shard_numel, info.group_rank)


# Set while zerocompile itself reads a state dict (checkpoints), which must not warn the user.
_READING_OWN_STATE_DICT: contextvars.ContextVar[bool] = contextvars.ContextVar("zerocompile_reading_own_state_dict", default=False)


def own_state_dict(model: nn.Module) -> dict[str, Any]:
    """`model.state_dict(keep_vars=True)` for zerocompile's own use, without the notice below."""
    token = _READING_OWN_STATE_DICT.set(True)
    try:
        return model.state_dict(keep_vars=True)
    finally:
        _READING_OWN_STATE_DICT.reset(token)


class ShardedStateDictNotice:
    """A `state_dict()` post-hook on every module of one sharded model: the first state dict that
    holds shards says so, once per model. `torch.save(model.state_dict(), ...)`, the DDP habit,
    would otherwise write 1/N of the model and fail only when loaded, maybe after the job ended."""

    def __init__(self) -> None:
        self.said = False

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict) -> None:
        if self.said or _READING_OWN_STATE_DICT.get():
            return
        for name, shard in module._zero_shards.items():
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


_FIX_BEFORE_SHARD = (
    "zerocompile.shard() slices each parameter once, so change the model before it (build the model "
    "again, change it, then shard it), or change values in place under "
    "`with zerocompile.gathered(model): module.weight.copy_(new)`"
)


def _raise_changed_after_shard(module: nn.Module, name: str, param: torch.Tensor | None) -> None:
    """The error for a parameter whose Parameter object or data changed since shard()."""
    info = shard_info(module._zero_shards[name])
    if param is None:
        raise RuntimeError(f"parameter '{info.fqn}' was removed after zerocompile.shard(): {_FIX_BEFORE_SHARD}")
    if param is not module._zero_shards[name]:
        raise RuntimeError(
            f"parameter '{info.fqn}' was replaced after zerocompile.shard() by a new Parameter of shape "
            f"{tuple(param.shape)}, which is not sharded: {_FIX_BEFORE_SHARD}"
        )
    raise RuntimeError(_data_replaced_message(info, param))


def _data_replaced_message(info: ShardInfo, param: torch.Tensor) -> str:
    return (
        f"parameter '{info.fqn}' holds a tensor of shape {tuple(param.shape)}, but at stage {info.stage} "
        f"it is sharded to {sharded_shape(info)} (full shape {info.shape}): its .data was replaced after "
        f"zerocompile.shard(). {_FIX_BEFORE_SHARD}"
    )


def _refuse_new_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Global parameter-registration hook: a Parameter set on a module of a sharded model would be
    neither sharded nor reduced, so each rank would silently train its own copy. (torch runs no
    hook when a parameter is set to None; the module property reports that at the next use.)"""
    prefix = module.__dict__.get("_zero_prefix")
    if prefix is None:
        return
    from zerocompile.gathered import is_gathered  # it imports this module

    current = module._parameters.get(name)
    if current is param or (current is not None and is_gathered(current)):
        return  # re-setting the same object changes nothing; inside gathered() it checks on exit
    fqn = f"{prefix}{'.' if prefix else ''}{name}"
    raise RuntimeError(
        f"parameter '{fqn}' of a sharded model was given a new Parameter of shape {tuple(param.shape)} after "
        f"zerocompile.shard(): {_FIX_BEFORE_SHARD}"
    )


def _refuse_new_submodule(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    """Global module-registration hook: replacing a submodule that holds parameters (or adding one)
    after shard() brings unsharded parameters or drops sharded ones. Parameter-free modules
    (dropout, activations) may still be swapped."""
    prefix = module.__dict__.get("_zero_prefix")
    if prefix is None:
        return
    from zerocompile.gathered import is_gathered  # it imports this module

    current = module._modules.get(name)
    old = [] if current is None else list(current.parameters())
    new = [] if submodule is None else list(submodule.parameters())
    if not old and not new or current is submodule or any(is_gathered(p) for p in old):
        return
    fqn = f"{prefix}{'.' if prefix else ''}{name}"
    raise RuntimeError(
        f"submodule '{fqn}' of a sharded model was {'replaced' if current is not None else 'added'} after "
        f"zerocompile.shard() ({len(new)} unsharded parameter(s) in, {len(old)} sharded out): {_FIX_BEFORE_SHARD}"
    )


def _check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Before a step: an optimizer that cannot step on the shards, or state made for the full
    parameter, which means shard() came after the optimizer stepped (or built its state)."""
    sharded = [(p, info) for group in optimizer.param_groups for p in group["params"] if (info := shard_info(p)) is not None]
    refuse_unsupported_optimizer(optimizer, {info.stage for _param, info in sharded})
    offloading = next((info for _param, info in sharded if info.config.offload is not None), None)
    if offloading is not None and offloaded_state(optimizer) is None:
        raise RuntimeError(
            f"parameter '{offloading.fqn}' belongs to a model sharded with offload={offloading.config.offload!r}, but this optimizer "
            f"({type(optimizer).__name__}) keeps its state in memory: it was not passed to shard(). Build it "
            "before shard() and pass it: zerocompile.shard(model, ..., optimizer=optimizer)"
        )
    replicated = replicated_state_keys(optimizer)
    for param, info in sharded:
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape and key not in replicated:
                if tuple(param.shape) != sharded_shape(info):  # the parameter changed, not the state
                    raise RuntimeError(_data_replaced_message(info, param))
                # Any other shape is the optimizer's own layout (Adafactor's row_var, LBFGS's flat
                # direction at stage 0); those that cannot step on shards were refused above.
                if tuple(value.shape) == info.shape:
                    raise RuntimeError(
                        f"optimizer state {key!r} of parameter '{info.fqn}' has the full shape "
                        f"{info.shape} but the parameter is sharded to {tuple(param.shape)}: the optimizer "
                        f"({type(optimizer).__name__}) stepped before zerocompile.shard(), or made its state "
                        "when built (as Adagrad does). Pass it in: zerocompile.shard(model, ..., optimizer=optimizer)"
                    )


def _trims_heap(param: torch.Tensor) -> bool:
    info = shard_info(param)
    return info is not None and info.config.trim_heap and param.device.type == "cpu"


WHILE_SHARDED = ProcessHooks(
    optimizer_checks=(_check_optimizer_state, check_nothing_pending),
    holds_sharded=lambda param: shard_info(param) is not None,
    trims=_trims_heap,
    parameter_registration=_refuse_new_parameter,
    module_registration=_refuse_new_submodule,
)


def _refuse_rounded_gradients(config: ZeroConfig) -> None:
    """With the masters offloaded, gradients land in param_dtype: what would round them where the
    masters in memory would not is refused, naming the fix."""
    keep = "or keep the master weights in memory with offload_masters=False"
    if config.reduce_dtype is not None and config.reduce_dtype.itemsize > config.param_dtype.itemsize:
        raise ValueError(
            f"offload={config.offload!r} keeps the master weights in the store and the gradients in param_dtype "
            f"{config.param_dtype}, which would round the {config.reduce_dtype} reductions reduce_dtype asks for: "
            f"leave reduce_dtype unset, {keep}"
        )
    if config.reduce_quant is not None:
        raise ValueError(
            f"offload={config.offload!r} keeps the master weights in the store and the gradients in param_dtype "
            f"{config.param_dtype}, which would round the fp32 sums of reduce_quant={config.reduce_quant!r}: drop "
            f"reduce_quant, {keep}"
        )


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None
) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and the state of `optimizer` (one or
    several), tied parameters counted once; where an optimizer's state is offloaded, what its store
    holds is counted under "optimizer_on_disk" (`offload="disk"`) or "optimizer_on_host"
    (`offload="cpu"`), not in "optimizer", with the master weights it keeps (`offload_masters`)."""
    params = list({id(p): p for p in model.parameters()}.values())
    held = {"optimizer": 0}
    for one in optimizer_list(optimizer):
        store = offloaded_state(one)
        if store is not None:
            held[store.held_as] = held.get(store.held_as, 0) + store.master_bytes
        for param, state in one.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    stored = store is not None and store.view(param, key) is value
                    held[store.held_as if stored else "optimizer"] += value.numel() * value.element_size()
    return {
        "params": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        **held,
    }


def full_numel(model: nn.Module) -> int:
    """Φ: parameters of the unsharded model, tied ones counted once."""
    return sum(
        info.numel if (info := shard_info(p)) is not None else p.numel()
        for p in {id(p): p for p in model.parameters()}.values()
    )
