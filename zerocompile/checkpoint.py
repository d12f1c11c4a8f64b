"""Checkpoints of sharded models: `save`, `load` (any stage, any world size) and `full_state_dict`.

Every parameter-shaped tensor (parameter, optimizer state such as `exp_avg`, EMA) is presented to
torch.distributed.checkpoint (DCP) as its full *flat* tensor of `numel` elements: at stages 1-3 a
DTensor sharded on dim 0 whose local part is the valid (unpadded) prefix of this rank's shard (at
its offset, which torch.chunk's split would not give: see `_global_view`), at stage 0 (or
unsharded) the whole tensor, replicated. The flat global tensor is the same whatever
wrote it, so resharding between stages and world sizes is DCP's planner's job, not ours: a rank
loading reads exactly the byte ranges that overlap its shard. Files are DCP's Hugging Face
(safetensors) format plus JSON: loading unpickles nothing (see `checkpoint_files`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import warnings
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d

from zerocompile import checkpoint_files as files
from zerocompile.accumulation import drop_kept_copies
from zerocompile.distributed import agreed
from zerocompile.dtensor_parameters import on_shards
from zerocompile.dtensors import group_mesh
from zerocompile.offload import full_precision, master_written, offloaded_state
from zerocompile.optimizers import optimizer_list, replicated_state_keys
from zerocompile.sharded_parameters import ShardInfo, is_sharded, parameter_owners, shard_info
from zerocompile.state_dicts import persistent_buffers

if TYPE_CHECKING:
    from zerocompile.ema import EMA


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model under torch.compile's and DDP's wrappers, whose names carry no wrapper prefix."""
    from torch._dynamo.eval_frame import OptimizedModule

    while True:
        if isinstance(model, OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def parameter_names(model: nn.Module) -> dict[nn.Parameter, tuple[str, ...]]:
    """Each distinct parameter with all its FQNs (tied ones have several; the first is primary)."""
    return {
        param: tuple(f"{prefix}{'.' if prefix else ''}{attr}" for prefix, _module, attr in places)
        for param, places in parameter_owners(model).items()
    }


@functools.cache
def _mesh(group: dist.ProcessGroup, device_type: str) -> Any:
    """One mesh per group object and device type, for one `save` or `load` (`_meshes_per_call`)."""
    return group_mesh(group, device_type)


def _meshes_per_call(operation: Callable[..., Any]) -> Callable[..., Any]:
    """`_mesh`'s cache emptied when `operation` ends: a mesh holds its group, and a cache for the
    process would keep every destroyed world alive (and hand it out again)."""

    @functools.wraps(operation)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return operation(*args, **kwargs)
        finally:
            _mesh.cache_clear()

    return run


def _global_view(local: torch.Tensor, info: ShardInfo | None) -> torch.Tensor:
    """`local` (laid out like its parameter on this rank) as DCP sees it: the flat full tensor.

    Writing into what this returns writes into `local`, which is how loading fills shards in place.
    """
    if not is_sharded(info):
        return local.detach().view(-1)
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    # Rank r holds [r * shard_numel, (r + 1) * shard_numel) of the flat tensor, the last ranks
    # shorter or empty. Shard(0) alone would tell DCP torch.chunk's split of the flat tensor, not
    # of the parameter's rows; the wrapper (torch's own, for shards DTensor's placements cannot
    # describe) gives DCP this rank's offset and size instead.
    offset = min(info.shard_offset, info.numel)
    return DTensor.from_local(
        LocalShardsWrapper([local.detach()[: info.valid_numel]], [(offset,)]),
        _mesh(c10d._resolve_process_group(info.group_name), local.device.type),
        [Shard(0)],
        run_check=False,
        shape=torch.Size([info.numel]),
        stride=(1,),
    )


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gathered_results(check: Callable[[], Any]) -> list[Any]:
    """`agreed(check)` on every rank, then every rank's (small, picklable) result, by rank."""
    result = agreed(check)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [result]
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return results


def _my_share() -> slice:
    """This rank's part of work split over the ranks: every world_size-th item, from its rank."""
    rank, world = _rank_and_world()
    return slice(rank, None, world)


def _check_group(params: dict[nn.Parameter, tuple[str, ...]]) -> None:
    if not dist.is_initialized():
        return
    for param, names in params.items():
        info = shard_info(param)
        # With hybrid sharding each shard group holds every shard, and the replicas' identical
        # copies of one chunk are written once (DCP drops duplicate chunks from the plan).
        if is_sharded(info) and info.world_size * info.replicas != dist.get_world_size():
            raise ValueError(
                f"parameter {names[0]!r} is sharded over a process group of {info.world_size} ranks "
                f"({info.replicas} replica(s)), not all {dist.get_world_size()}: checkpoints support models "
                "sharded over the whole world (shard(model, group=None), with or without shard_size)"
            )



# ---------------------------------------------------------------------------------------------
# What is saved: the DCP state dict and the JSON that describes it


def _model_state(params: dict[nn.Parameter, tuple[str, ...]], buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {f"param.{names[0]}": _global_view(full_precision(p), shard_info(p)) for p, names in params.items()}
    state.update({f"buffer.{name}": b.detach() for name, b in buffers.items()})
    return state


def _optimizer_parameters(
    optimizer: torch.optim.Optimizer, params: dict[nn.Parameter, tuple[str, ...]]
) -> list[list[str]]:
    """The FQNs of each param group's parameters; an error if one is not the model's."""
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        foreign = [tuple(p.shape) for p in group["params"] if p not in params]
        if foreign:
            raise ValueError(
                f"optimizer param group {index} holds {len(foreign)} parameter(s) that are not the "
                f"model's (shapes {foreign[:3]}): save the optimizer together with the model it optimizes"
            )
        groups.append([params[p][0] for p in group["params"]])
    return groups


def _optimizer_state(
    optimizer: torch.optim.Optimizer, params: dict[nn.Parameter, tuple[str, ...]], prefix: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """DCP entries of the optimizer state under `prefix`, and its JSON description (groups, kinds
    of state)."""
    group_fqns = _optimizer_parameters(optimizer, params)
    groups = []
    for fqns, group in zip(group_fqns, optimizer.param_groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        for key, value in settings.items():
            if isinstance(value, torch.Tensor) or not _is_json(value):
                raise TypeError(
                    f"optimizer param group setting {key!r} is a {type(value).__name__}: checkpoints "
                    "store param group settings as JSON (numbers, strings, bools, tuples)"
                )
        groups.append({"params": fqns, **settings})
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, dict[str, Any]] = {}
    replicated = replicated_state_keys(optimizer)
    for param, state in optimizer.state.items():
        fqn, info = params[param][0], shard_info(param)
        kinds[fqn] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key in replicated:
                tensors[f"{prefix}.{fqn}.{key}"] = value.detach()
                kinds[fqn][key] = {"kind": "replicated", "dtype": files.dtype_name(value.dtype), "shape": list(value.shape)}
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                tensors[f"{prefix}.{fqn}.{key}"] = value.detach()
                kinds[fqn][key] = {"kind": "scalar", "dtype": files.dtype_name(value.dtype)}
            elif isinstance(value, torch.Tensor) and value.shape == param.shape:
                tensors[f"{prefix}.{fqn}.{key}"] = _global_view(value, info)
                kinds[fqn][key] = {"kind": "like_param", "dtype": files.dtype_name(value.dtype)}
            elif not isinstance(value, torch.Tensor) and _is_json(value):
                kinds[fqn][key] = {"kind": "value", "value": value}
            else:
                raise TypeError(
                    f"optimizer state {key!r} of parameter {fqn!r} is "
                    f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}: "
                    f"checkpoints hold state shaped like the parameter ({tuple(param.shape)} here), "
                    "scalar tensors and JSON values"
                )
    return tensors, {"type": type(optimizer).__name__, "param_groups": groups, "state": kinds}


def _state_prefix(index: int) -> str:
    """Where the `index`th optimizer's state lies in the checkpoint (the first where a single
    optimizer's always has)."""
    return "optim" if index == 0 else f"optim{index}"


def _saved_optimizers(saved: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """The descriptions of the `count` optimizers passed to `load`, as `save` wrote them (one: a
    dict; several: a list); none asked for, none (a checkpoint's weights load without its
    optimizers)."""
    if count == 0:
        return []
    described = saved["optimizer"]
    if described is None:
        raise ValueError("the checkpoint holds no optimizer state: load without optimizer=, or save with it")
    described = [described] if isinstance(described, dict) else described
    if len(described) != count:
        raise ValueError(
            f"the checkpoint holds the state of {len(described)} optimizer(s), and load was given {count}: "
            "pass the optimizers saved, in the same order (optimizer=[...])"
        )
    return described


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _ema_state(ema: EMA, model: nn.Module, params: dict[nn.Parameter, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    if unwrap_model(ema.model) is not model:
        raise ValueError("the EMA passed averages another model: pass the EMA built with EMA(model, decay) of this model")
    return {f"ema.{params[p][0]}": _global_view(ema.shadow[p], shard_info(p)) for p in params}


def _held(
    model: nn.Module, params: dict[nn.Parameter, tuple[str, ...]], trainable_only: bool
) -> tuple[dict[nn.Parameter, tuple[str, ...]], dict[str, torch.Tensor]]:
    """The parameters and buffers a checkpoint holds: all of them, or (`trainable_only`) the
    parameters that require a gradient and no buffer."""
    if trainable_only:
        return {param: names for param, names in params.items() if param.requires_grad}, {}
    return params, persistent_buffers(model, params)


def _check_same_base(where: Path, saved: dict[str, Any], model: nn.Module) -> None:
    """A checkpoint of the trainable parameters alone goes with the base it was trained on: the
    record `zerocompile.from_pretrained` keeps of the base's files (their index's digest) must
    match where both have one."""
    trained_on, built_from = saved.get("base"), getattr(model, "_zero_base", None)
    if trained_on is None or built_from is None or trained_on["digest"] == built_from["digest"]:
        return
    raise ValueError(
        f"the checkpoint at {where} holds trainable parameters trained on the base at {trained_on['path']} "
        f"(index digest {trained_on['digest'][:12]}), and this model's base was read from {built_from['path']} "
        f"(digest {built_from['digest'][:12]}): other weights. Build the model from the base it was trained on "
        f"(zerocompile.from_pretrained({trained_on['path']!r}, ..., lora=...)) before loading"
    )


def _describe(
    model: nn.Module, params: dict[nn.Parameter, tuple[str, ...]], buffers: dict[str, torch.Tensor]
) -> dict[str, Any]:
    config = getattr(model, "_zero_config", None)
    saved_names = {name for names in params.values() for name in names} | set(buffers)
    return {
        "format": files.FORMAT,
        "version": files.VERSION,
        "stage": None if config is None else config.stage,
        "world_size": _rank_and_world()[1],
        "params": [
            {"names": list(names), "shape": list(_full_shape(p)), "dtype": files.dtype_name(full_precision(p).dtype)}
            for p, names in params.items()
        ],
        "buffers": [
            {"name": name, "shape": list(b.shape), "dtype": files.dtype_name(b.dtype)} for name, b in buffers.items()
        ],
        "state_dict_keys": [name for name in model.state_dict(keep_vars=True) if name in saved_names],
    }


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    info = shard_info(param)
    return tuple(info.shape) if info is not None else tuple(param.shape)


@_meshes_per_call
def save(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ema: EMA | None = None,
    trainable_only: bool = False,
    **extra: Any,
) -> None:
    """Write a checkpoint of `model` (and `optimizer`, one or a list, and `ema`) to directory
    `path`; every rank calls it.

    Each rank writes its own shards. `extra` holds this rank's tensors and JSON values (step
    counters, RNG states); `load` returns them. The checkpoint appears at `path` only when
    complete, replacing any older one there: a crash mid-save leaves the older one loadable.

    `trainable_only`: the parameters that require a gradient (a LoRA adapter) and their state
    alone, without the frozen base or the buffers, with the record of the base's files
    `zerocompile.from_pretrained` keeps; `load` fills those into a model built on the same base.
    """
    model = unwrap_model(model)
    final = Path(path).absolute()
    rank, _world = _rank_and_world()

    def gather_state() -> tuple[dict[str, torch.Tensor], dict[str, Any], tuple[dict, str]]:
        params = parameter_names(model)
        _check_group(params)
        saved, buffers = _held(model, params, trainable_only)
        if not saved:
            raise ValueError("save(trainable_only=True): no parameter of the model requires a gradient, so there is nothing to save")
        state = _model_state(saved, buffers)
        description = _describe(model, saved, buffers)
        description["trainable_only"] = trainable_only
        description["base"] = getattr(model, "_zero_base", None) if trainable_only else None
        description["optimizer"] = description["ema"] = None
        described = []
        for index, one in enumerate(optimizer_list(optimizer)):
            optim_tensors, description_of_one = _optimizer_state(one, params, _state_prefix(index))
            state.update(optim_tensors)
            described.append(description_of_one)
        if described:
            single = isinstance(optimizer, torch.optim.Optimizer) and len(described) == 1  # a MuonWithAdamW is two
            description["optimizer"] = described[0] if single else described
        if ema is not None:
            state.update(_ema_state(ema, model, saved))
            description["ema"] = {"decay": ema.decay}
        return state, description, files.encode_extra(extra)

    with on_shards(*optimizer_list(optimizer)):  # the flat state: what the checkpoint holds
        state, description, (extra_tensors, extra_json) = agreed(gather_state)
    staging = files.staging_dir(final)
    agreed(lambda: files.prepare_staging(final) if rank == 0 else None)
    agreed(lambda: files.write_extra(staging, rank, extra_tensors, extra_json))

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with _single_process_quietly():
        dcp.save(
            state,
            storage_writer=HuggingFaceStorageWriter(str(staging / files.STATE_DIR), save_distributed=True),
            no_dist=not dist.is_initialized(),
        )

    # Each rank hashes its share of the files (all are complete: dcp.save ends in a collective).
    shares = _gathered_results(
        lambda: {name: files.file_digest(staging / name) for name in files.data_files(staging)[_my_share()]}
    )
    description["files"] = {name: digest for share in shares for name, digest in sorted(share.items())}
    _release_disk_pages(optimizer)

    def publish() -> None:
        if rank == 0:
            files.write_json(staging / files.METADATA, description)
            files.publish(staging, final)

    agreed(publish)


# ---------------------------------------------------------------------------------------------
# Loading


def _check_matches(
    where: Path, saved: dict[str, Any], params: dict[nn.Parameter, tuple[str, ...]], buffers: dict[str, torch.Tensor]
) -> None:
    """An error naming every parameter and buffer whose names, ties, shape or dtype differ."""
    model_side = {
        names[0]: (names, tuple(_full_shape(p)), files.dtype_name(full_precision(p).dtype)) for p, names in params.items()
    }
    model_side.update({f"buffer {n}": ((n,), tuple(b.shape), files.dtype_name(b.dtype)) for n, b in buffers.items()})
    saved_side = {e["names"][0]: (tuple(e["names"]), tuple(e["shape"]), e["dtype"]) for e in saved["params"]}
    saved_side.update({f"buffer {e['name']}": ((e["name"],), tuple(e["shape"]), e["dtype"]) for e in saved["buffers"]})
    problems = []
    missing = [k for k in model_side if k not in saved_side]
    unexpected = [k for k in saved_side if k not in model_side]
    if missing:
        problems.append(f"in the model but not the checkpoint: {missing}")
    if unexpected:
        problems.append(f"in the checkpoint but not the model: {unexpected}")
    for key in model_side.keys() & saved_side.keys():
        (m_names, m_shape, m_dtype), (s_names, s_shape, s_dtype) = model_side[key], saved_side[key]
        if (m_shape, m_dtype) != (s_shape, s_dtype):
            problems.append(f"{key}: checkpoint {s_shape} {s_dtype}, model {m_shape} {m_dtype}")
        if set(m_names) != set(s_names):
            problems.append(f"{key}: tied to {list(s_names)} in the checkpoint, to {list(m_names)} in the model")
    if problems:
        raise ValueError(
            f"the checkpoint at {where} is of another model: " + "; ".join(sorted(problems))
            + ". Load it into the model it was saved from (same architecture and sizes)"
        )


def _optimizer_destinations(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], params: dict[nn.Parameter, tuple[str, ...]], prefix: str
) -> tuple[dict[str, torch.Tensor], dict[nn.Parameter, dict[str, Any]], list[tuple[torch.Tensor, ShardInfo]]]:
    """Fresh state for the saved optimizer state (its DCP entries under `prefix`): DCP views to
    fill, the state by parameter, and the tensors laid out like their parameter (whose padding
    must stay zero)."""
    group_fqns = _optimizer_parameters(optimizer, params)
    saved_fqns = [g["params"] for g in saved["param_groups"]]
    if group_fqns != saved_fqns:
        raise ValueError(
            f"the optimizer's param groups hold parameters {group_fqns}, the checkpoint's {saved_fqns}: "
            "build the optimizer with the same param groups as the one saved"
        )
    by_fqn = {names[0]: p for p, names in params.items()}
    store = offloaded_state(optimizer)
    views, states, like_param = {}, {}, []
    for fqn, kinds in saved["state"].items():
        param, info = by_fqn[fqn], shard_info(by_fqn[fqn])
        group = next(g for g, fqns in zip(optimizer.param_groups, group_fqns) if fqn in fqns)
        # As torch's Optimizer.load_state_dict: scalar state (`step`) stays on the CPU unless the
        # optimizer keeps it on the device (capturable / fused).
        scalar_device = param.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
        state = states[param] = {}
        for key, kind in kinds.items():
            if kind["kind"] == "value":
                state[key] = kind["value"]
                continue
            dtype = files.dtype_from_name(kind["dtype"])
            if kind["kind"] == "scalar":
                state[key] = views[f"{prefix}.{fqn}.{key}"] = torch.zeros((), dtype=dtype, device=scalar_device)
            elif kind["kind"] == "replicated":
                state[key] = views[f"{prefix}.{fqn}.{key}"] = param.new_zeros(kind["shape"], dtype=dtype)
            else:
                # Offloaded state is read straight into its store (on disk: never whole into memory).
                stored = store.view(param, key) if store is not None else None
                usable = stored is not None and stored.dtype == dtype
                state[key] = stored if usable else torch.zeros_like(param, dtype=dtype)
                views[f"{prefix}.{fqn}.{key}"] = _global_view(state[key], info)
                like_param.append((state[key], info))
    return views, states, like_param


def _install_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], states: dict[nn.Parameter, dict[str, Any]]
) -> None:
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        for key, value in saved_group.items():
            if key != "params":
                # JSON turned tuples (Adam's betas) into lists.
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    optimizer.state.clear()
    optimizer.state.update(states)


def _release_disk_pages(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None) -> None:
    """Pages of offloaded state that saving or loading mapped, dropped from memory (not from disk)."""
    for one in optimizer_list(optimizer):
        store = offloaded_state(one)
        if store is not None:
            store.release()


def _zero_padding(tensors: list[tuple[torch.Tensor, ShardInfo | None]]) -> None:
    """The padding past a shard's valid part stays zero, as shard() made it."""
    with torch.no_grad():
        for tensor, info in tensors:
            if is_sharded(info):
                tensor.view(-1)[info.valid_numel :].zero_()


@_meshes_per_call
def load(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ema: EMA | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by `save` into `model` (and `optimizer`, one or the list saved, and
    `ema`); returns `extra`. One saved `trainable_only` fills the parameters that require a
    gradient and leaves the rest (the frozen base, read from its files) as they are.

    The stage and world size may differ from the saving run's (N = 1 and unsharded models
    included). A checkpoint of another model, or a damaged one (a file truncated, changed or
    missing: the ranks verify the recorded SHA-256 of a share of the files each), fails before
    anything is changed, naming the parameters that differ or the damaged file. `extra` is what
    this rank saved (rank 0's if the saving run had no rank of this number).
    """
    model = unwrap_model(model)
    rank, _world = _rank_and_world()

    def plan() -> tuple[Path, dict, dict[str, torch.Tensor], list, list, dict[str, Any], dict[nn.Parameter, tuple[str, ...]]]:
        directory = files.resolve(path)
        saved = files.read_metadata(directory)
        files.check_files(directory, saved, _my_share())
        extra = files.read_extra(directory, rank)
        params = parameter_names(model)
        _check_group(params)
        if saved.get("trainable_only"):
            _check_same_base(directory, saved, model)
        filled, buffers = _held(model, params, bool(saved.get("trainable_only")))
        _check_matches(directory, saved, filled, buffers)
        views = _model_state(filled, buffers)
        padded = [(p, shard_info(p)) for p in filled]
        installs: list[tuple[torch.optim.Optimizer, dict, dict]] = []  # (optimizer, as saved, fresh state)
        optimizers = optimizer_list(optimizer)
        for index, (one, described) in enumerate(zip(optimizers, _saved_optimizers(saved, len(optimizers)))):
            optim_views, state_of_one, like_param = _optimizer_destinations(one, described, params, _state_prefix(index))
            views.update(optim_views)
            installs.append((one, described, state_of_one))
            padded += like_param
        if ema is not None:
            if saved["ema"] is None:
                raise ValueError("the checkpoint holds no EMA: load without ema=, or save with it")
            views.update(_ema_state(ema, model, filled))
            padded += [(ema.shadow[p], shard_info(p)) for p in filled]
        return directory, saved, views, installs, padded, extra, filled

    with on_shards(*optimizer_list(optimizer)):  # the flat state: what the checkpoint holds
        directory, saved, views, installs, padded, extra, filled = agreed(plan)

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        with _single_process_quietly():
            dcp.load(
                views,
                storage_reader=HuggingFaceStorageReader(str(directory / files.STATE_DIR)),
                no_dist=not dist.is_initialized(),
            )
        _zero_padding(padded)
        drop_kept_copies(model)
        for param in filled:
            master_written(param)
        for one, described, state in installs:
            _install_optimizer_state(one, described, state)
    _release_disk_pages(optimizer)
    if ema is not None:
        ema.decay = saved["ema"]["decay"]
    return extra


# ---------------------------------------------------------------------------------------------
# Full state dicts


def gathered_state_dict(
    model: nn.Module,
    local: Callable[[nn.Parameter], torch.Tensor],
    rank0_only: bool,
    cpu: bool,
    only: Callable[[nn.Parameter], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """The model's state dict with full tensors, each parameter's values taken from `local(param)`
    (laid out like the parameter on this rank): the parameters themselves, or an EMA's shadows.
    With `only`, just the parameters it accepts and no buffers (a LoRA adapter: nothing of the
    frozen base is gathered).

    Gathers one parameter at a time, so a rank holds at most one full tensor beyond the result.
    """
    model = unwrap_model(model)
    params = parameter_names(model)
    if only is not None:
        params = {param: names for param, names in params.items() if only(param)}
    keep = not rank0_only or _rank_and_world()[0] == 0
    full: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for param, names in params.items():
            info, values = shard_info(param), local(param).detach()
            if is_sharded(info):
                tensor = info.gather(values)
            else:
                tensor = values.clone()
            if keep:
                tensor = tensor.cpu() if cpu else tensor
                full.update(dict.fromkeys(names, tensor))
        if not keep:
            return {}
        for name, buffer in persistent_buffers(model, params).items() if only is None else ():
            full[name] = buffer.detach().clone().cpu() if cpu else buffer.detach().clone()
    return {name: full[name] for name in model.state_dict(keep_vars=True) if only is None or name in full}


def full_state_dict(model: nn.Module, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict: original names (tied ones all present), full shapes.

    Loads with `load_state_dict(strict=True)` into the model before `shard()`. Every rank must
    call it (it gathers); with `rank0_only` the other ranks get `{}`. With `cpu`, tensors are
    moved to the CPU.
    """
    return gathered_state_dict(model, full_precision, rank0_only, cpu)
