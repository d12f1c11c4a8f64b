"""`shard(model, stage)`: turn an ordinary model into a ZeRO-sharded one, in place.

Each Parameter object stays where it is, under its name, so optimizers and user code holding it
keep working; at stages 1-3 its data becomes this rank's flat 1-D slice of the padded parameter,
and it carries a `ShardInfo` (`zerocompile.sharded_parameters`). Each module gets a `ModuleState`,
and those holding parameters a generated class whose properties emit the unshard markers
(`zerocompile.sharded_modules`). While a sharded model lives, process-wide hooks check optimizer
steps and refuse parameters or submodules set on it (`WHILE_SHARDED`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
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
from zerocompile.dtensor_norms import install_empty_shard_norms, remove_empty_shard_norms
from zerocompile.dtensor_parameters import LocalStep, flat_grad, flat_state, link_parameters, on_shards, show_parameters
from zerocompile.gathered import is_gathered
from zerocompile.heap import glibc_malloc_trim
from zerocompile.hybrid import hybrid_groups
from zerocompile.meta_init import PartReader, built_on_meta, check_meta_model, local_slice, materialise_sharded
from zerocompile.offload import DiskState, HostState, OffloadedState, Shards, offloaded_state
from zerocompile.optim import SHARDED_EQUIVALENTS, take_over
from zerocompile.optimizers import optimizer_list, refuse_unsupported_optimizer, replicated_state_keys
from zerocompile.passes.stages import StagePolicy, stage_policy
from zerocompile.process_hooks import ProcessHooks, StepAround
from zerocompile.rank_deaths import RANK_DEATHS, watch_job, worth_watching
from zerocompile.sharded_modules import FIX_BEFORE_SHARD, data_replaced_message, install_state, module_state
from zerocompile.sharded_parameters import ShardInfo, parameter_owners, shard_info, shard_of_parameter, sharded_shape
from zerocompile.state_dicts import load_full_or_distributed_tensors
from zerocompile.user_warnings import warn_at_caller
from zerocompile.weights import file_readers


def shard(
    model: nn.Module,
    stage: int | ZeroConfig | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    init: Callable[[nn.Module], Any] | None = None,
    weights: str | os.PathLike | Mapping[torch.Tensor, PartReader] | None = None,
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
    refused: call `load_weights` after `shard()`. On any failure the model stays on meta. For a
    model whose names differ from the files' (a PEFT model: `zerocompile.from_pretrained(lora=)`),
    `weights` may be what `zerocompile.weights.file_readers` found for its tensors under the names
    the files use.
    """
    base = stage if isinstance(stage, ZeroConfig) else None
    if group is not None:
        settings["group"] = group
    config = config_from_kwargs(base, None if isinstance(stage, ZeroConfig) else stage, settings)
    on_meta = built_on_meta(model)
    _check_can_shard(model, on_meta)
    loaded = _weight_readers(model, weights, weights_strict, on_meta) if weights is not None else None
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

    owners = parameter_owners(model)
    infos = {}
    flavour = reduce_scatter_flavour(hybrid.shard, device)
    for param, places in owners.items():
        names = tuple(f"{prefix}{'.' if prefix else ''}{attr}" for prefix, _module, attr in places)
        infos[param] = ShardInfo(
            fqn=names[0],
            names=names,
            shape=tuple(param.shape),
            numel=param.numel(),
            shard_numel=policy.local_numel(tuple(param.shape), world_size),
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
        del local  # the parameters hold their shards now: offload's masters can replace them
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
    link_parameters(infos)
    sync = GradientSync({shard_info(param).fqn: param for param in owners})
    for prefix, module in model.named_modules():
        if install_state(module, prefix, sync).shards:
            module.register_load_state_dict_pre_hook(load_full_or_distributed_tensors)
    for passed in optimizers:
        show_parameters(passed)
    for passed, store in zip(optimizers, offloaded):
        passed.register_load_state_dict_post_hook(functools.partial(_loaded_into_store, store))
    if config.broadcast_buffers:
        broadcast_buffers_in_forward(model, group, sync)
    if config.param_dtype is not None:
        model.register_forward_pre_hook(
            functools.partial(_cast_floating_inputs, dtype=config.param_dtype), with_kwargs=True
        )
    model._zero_config = config
    WHILE_SHARDED.hold(model)
    if policy.shards_parameters:  # DTensor parameters: torch's clip_grad_norm_ over empty shards
        WHILE_SHARDED.patch(install_empty_shard_norms, remove_empty_shard_norms)
    if worth_watching(group):
        # Peers that can die: how this rank dies is recorded for them while a sharded model lives.
        WHILE_SHARDED.patch(watch_job, RANK_DEATHS.stop)
    return model


def _weight_readers(
    model: nn.Module, weights: str | os.PathLike | Mapping[torch.Tensor, PartReader], strict: bool, on_meta: bool
) -> Mapping[torch.Tensor, PartReader]:
    if not on_meta:
        raise ValueError(
            f"shard(weights={str(weights)!r}) fills a model built on the meta device, whose tensors hold no "
            "values yet; this model's parameters are real tensors, already initialised. Call "
            "zerocompile.load_weights(model, path) after shard() instead, or build the model under "
            "`with torch.device('meta'):`"
        )
    return weights if isinstance(weights, Mapping) else file_readers(model, weights, strict=strict)


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
    already = [name for name, p in model.named_parameters() if shard_info(p) is not None]
    if already or getattr(model, "_zero_config", None) is not None:
        raise RuntimeError(
            f"the model is already sharded (e.g. parameter {already[:1]}): call zerocompile.shard() "
            "once per model; to change the stage, build the model again and shard it once"
        )
    _check_not_wrapped(model)
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
    distributed = [(name, p) for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if distributed:
        name, param = distributed[0]
        mesh = param.device_mesh
        dims = mesh.mesh_dim_names or tuple(f"dim {d}" for d in range(mesh.ndim))
        raise TypeError(
            f"parameters {[n for n, _ in distributed[:3]]} are already DTensors ('{name}': "
            f"{tuple(param.placements)} over mesh dimensions {dims}, as tensor parallelism's "
            "parallelize_module makes them): zerocompile.shard() shards plain parameters over one process "
            "group, and sharding the local tensors of a tensor-parallel model over the data-parallel "
            "dimension of a 2-D mesh (TP x ZeRO) is not supported. For TP x ZeRO-3 use torch's "
            "fully_shard(model, mesh=mesh['dp']) after parallelize_module; or zerocompile.shard() the "
            "model without tensor parallelism"
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


def _loaded_into_store(store: OffloadedState, optimizer: torch.optim.Optimizer) -> None:
    """After `optimizer.load_state_dict`: the loaded state (keyed by the DTensor parameters) moved
    into the offload store, whose tensors users' state then shows."""
    with on_shards(optimizer):
        store.move_all_into_store(optimizer)
    LocalStep.of(optimizer).show_state()  # the store's tensors, not the loaded copies


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


def _refuse_new_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Global parameter-registration hook: a Parameter set on a module of a sharded model would be
    neither sharded nor reduced, so each rank would silently train its own copy. (torch runs no
    hook when a parameter is set to None; the module property reports that at the next use.)"""
    state = module_state(module)
    if state is None:
        return
    current = module._parameters.get(name)
    if current is param or (current is not None and is_gathered(current)):
        return  # re-setting the same object changes nothing; inside gathered() it checks on exit
    fqn = f"{state.prefix}{'.' if state.prefix else ''}{name}"
    raise RuntimeError(
        f"parameter '{fqn}' of a sharded model was given a new Parameter of shape {tuple(param.shape)} after "
        f"zerocompile.shard(): {FIX_BEFORE_SHARD}"
    )


def _refuse_new_submodule(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    """Global module-registration hook: replacing a submodule that holds parameters (or adding one)
    after shard() brings unsharded parameters or drops sharded ones. Parameter-free modules
    (dropout, activations) may still be swapped."""
    state = module_state(module)
    if state is None:
        return
    current = module._modules.get(name)
    old = [] if current is None else list(current.parameters())
    new = [] if submodule is None else list(submodule.parameters())
    if not old and not new or current is submodule or any(is_gathered(p) for p in old):
        return
    fqn = f"{state.prefix}{'.' if state.prefix else ''}{name}"
    raise RuntimeError(
        f"submodule '{fqn}' of a sharded model was {'replaced' if current is not None else 'added'} after "
        f"zerocompile.shard() ({len(new)} unsharded parameter(s) in, {len(old)} sharded out): {FIX_BEFORE_SHARD}"
    )


def _check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Before a step: an optimizer that cannot step on the shards, or state made for the full
    parameter, which means shard() came after the optimizer stepped (or built its state).

    Such state comes only from outside a step (before shard(), `load_state_dict`, a state dict
    swapped in), and what a step adds has the shards' shapes, so the walk (0.26-0.5 ms a step
    for 292 parameters here, more than the rest of the step's host work) runs again only when
    the groups, the state dict object or its number of entries changed, or a state was loaded."""
    state = optimizer.state
    looked_at = (tuple(len(group["params"]) for group in optimizer.param_groups), id(state), len(state))
    if optimizer.__dict__.get("_zero_state_checked") == looked_at:
        return
    _walk_optimizer_state(optimizer)
    if "_zero_state_checked" not in optimizer.__dict__:
        # A load can put the same number of entries in a new dict at a freed one's address.
        optimizer.register_load_state_dict_post_hook(lambda loaded: loaded.__dict__.pop("_zero_state_checked", None))
    optimizer._zero_state_checked = looked_at


def _walk_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
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
                    raise RuntimeError(data_replaced_message(info, param))
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
    step_around=StepAround(
        adopt=show_parameters,
        before=lambda optimizer, args, kwargs: LocalStep.of(optimizer).before(optimizer, args, kwargs),
        after=lambda optimizer: LocalStep.of(optimizer).after(optimizer),
    ),
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
    params = list({id(p): shard_of_parameter(p) for p in model.parameters()}.values())
    held = {"optimizer": 0}
    for one in optimizer_list(optimizer):
        store = offloaded_state(one)
        if store is not None:
            held[store.held_as] = held.get(store.held_as, 0) + store.master_bytes
        for param, state in flat_state(one).items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    stored = store is not None and store.view(param, key) is value
                    held[store.held_as if stored else "optimizer"] += value.numel() * value.element_size()
    return {
        "params": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(grad.numel() * grad.element_size() for p in params if (grad := flat_grad(p)) is not None),
        **held,
    }


def full_numel(model: nn.Module) -> int:
    """Φ: parameters of the unsharded model, tied ones counted once."""
    return sum(
        info.numel if (info := shard_info(p)) is not None else p.numel()
        for p in {id(p): p for p in model.parameters()}.values()
    )
