"""Materialise a model built on the meta device straight into this rank's shards.

`with torch.device("meta"): model = Net(cfg)` costs no memory; `shard(model, stage, init=fn)`
then runs `model.apply(fn)` exactly as it would on the unsharded model (same modules, same order,
same random numbers), but a parameter exists in full only while one module's `fn` call uses it:
when the call returns, this rank keeps its slice and drops the rest. Every rank draws the same
numbers from the same generator state, so no values travel between ranks and the result equals,
bitwise, `model.apply(fn)` on the whole model.

Whose generator state: group rank 0's, on every rank (as DTensor's random ops follow one rank).
Group rank 0 broadcasts its CPU generator's state (and its accelerator's, where the shards live on
one) before the walk. A rank whose generator already equals rank 0's draws from its own and ends
advanced exactly as rank 0's is, so ranks seeded alike stay alike. A rank whose generator differs
draws the walk's numbers from rank 0's state and gets its own state back afterwards, so a stream
seeded per rank (dropout, data order) is left where it was.

How: the parameters and buffers stay meta tensors (full shape) for the whole walk, so model code
and `fn` see the model they expect. A `TorchDispatchMode` watches every operation `fn` runs; one
that touches a meta parameter's storage (directly, through `.data`, or a view) gets a real tensor
in its place. A first touch that overwrites the whole tensor (`normal_`, `zeros_`, `copy_`, ...)
gets fresh memory; any other first touch sees NaN, so reading a value nobody wrote shows up as a
parameter left partly unwritten. A parameter touched again after its call ended (GPT-2's
attention re-initialises its child projection) is gathered back from the ranks' slices unless
the operation overwrites it whole. Anything `fn` leaves on meta, or only partly writes, is an
error naming it: never uninitialised memory handed to training.

With weight files (`shard(weights=...)`), what they hold is read into this rank's part before the
walk, and no init runs on it: a module whose tensors all come from the files is not called, and in
the other calls an operation writing a loaded tensor is skipped before anything is computed (its
schema says which arguments it writes), while a view of one stays a meta tensor until something
reads its values.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from zerocompile.heap import trim_heap


aten = torch.ops.aten

# In-place operations that write every element of their first argument without reading it.
_OVERWRITES = {
    aten.normal_.default,
    aten.uniform_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.copy_.default,
    aten.bernoulli_.float,
    aten.bernoulli_.Tensor,
    aten.random_.default,
    getattr(aten.random_, "from"),
    aten.random_.to,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
}


@dataclasses.dataclass
class _Tracked:
    """One parameter or buffer of the meta model, and where its values live during the walk."""

    names: list[str]
    meta: torch.Tensor
    shard_numel: int | None  # None: kept whole (a buffer, or any tensor at stage 0)
    full: torch.Tensor | None = None  # the whole storage, flat, while some call uses it
    kept: torch.Tensor | None = None  # what this rank keeps: its padded slice, or the whole tensor
    partly_written: bool = False  # NaN left in the whole tensor when its last user returned
    loaded: bool = False  # `kept` was read from weight files: init's writes to it are skipped

    @property
    def storage_numel(self) -> int:
        return self.meta.untyped_storage().nbytes() // self.meta.element_size()


def built_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def check_meta_model(model: nn.Module) -> None:
    """A model is either all meta parameters or none: real parameters next to meta ones were made
    by code that ran on each rank without the walk, so nothing says the ranks agree on them."""
    real = [name for name, p in model.named_parameters() if not p.is_meta]
    if real:
        raise ValueError(
            f"parameters {real[:3]} are real tensors but the rest of the model is on the meta device: "
            "build the whole model under `with torch.device('meta'):` (zerocompile.shard(..., init=fn) "
            "initialises it) or none of it"
        )


# A module whose full tensors were smaller leaves holes glibc reuses anyway (its own trim threshold
# is 128 KiB): trimming after each of a model's many norms and biases would only cost start-up time.
_TRIM_AFTER_BYTES = 2**20


# What `shard(weights=...)` hands the walk for each tensor its files hold (a parameter under any of
# its names, a persistent buffer): a function reading this rank's part of it, given its shard size
# (None: the whole tensor), this rank's place in the group and the device.
PartReader = Callable[[int | None, int, torch.device], torch.Tensor]


def materialise_sharded(
    model: nn.Module,
    init: Callable[[nn.Module], Any] | None,
    *,
    shard_numels: dict[nn.Parameter, int | None],
    group: dist.ProcessGroup,
    device: torch.device,
    agree_over: dist.ProcessGroup | None = None,
    trim: bool = False,
    loaded: Mapping[torch.Tensor, PartReader] | None = None,
) -> tuple[dict[nn.Parameter, torch.Tensor], dict[tuple[nn.Module, str], torch.Tensor]]:
    """Run `model.apply(init)` (or each module's `reset_parameters()`) on the meta `model`.

    `shard_numels` is each distinct parameter's shard size over `group` as `shard()` decided it
    (None: kept whole, as at stage 0). `agree_over` (default `group`) is every rank that must hold
    the same values, whose group rank 0's generators the walk follows: with hybrid sharding the
    replicas of the shard group too. `trim` hands glibc's free heap pages back after each module on
    the CPU (see `zerocompile.heap`).

    `loaded` (from `shard(weights=...)`): tensors read from files instead of written by `init`,
    straight into this rank's part. A module whose tensors, its own and its submodules', all come
    from the files is not passed to `init`; in the other calls an operation writing a loaded tensor
    is skipped (nothing computed, no random number drawn) and one reading it sees the loaded values.

    Returns what this rank keeps of each distinct parameter (its padded flat slice at stages 1-3,
    the whole tensor at stage 0) and each buffer's value by (module, name). The model is not
    changed: the caller installs them once everything has succeeded.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    loaded = loaded or {}
    tracked = _tracked_tensors(model, shard_numels)
    read_buffers = _read_loaded(loaded, tracked, rank, device)
    covered = {StorageWeakRef(tensor.untyped_storage()) for tensor in loaded}
    skipped = _fully_loaded_modules(model, covered) if covered else set()
    walk = _ShardedWalk(tracked, covered, group, rank, world_size, device)
    call = init if init is not None else _reset_own_state

    def one_module(module: nn.Module) -> None:
        if module in skipped:
            return
        with walk:
            call(module)
        walk.keep_slices()
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if trim and device.type == "cpu" and sum(t.numel() * t.element_size() for t in own) >= _TRIM_AFTER_BYTES:
            # Each module's full tensors are freed between the slices kept of it and of the next:
            # glibc would keep those holes resident, and the build's peak would grow with the model
            # (101M GPT, 2 ranks: 268-303 MB held after shard() against 193 MB of shards).
            trim_heap()

    with torch.no_grad(), _following_group_rank0_generators(agree_over if agree_over is not None else group, device):
        model.apply(one_module)
    _raise_if_unwritten(list(tracked.values()), init is None)
    return _kept(model, tracked, read_buffers, device)


def _tracked_tensors(model: nn.Module, shard_numels: dict[nn.Parameter, int | None]) -> dict[StorageWeakRef, _Tracked]:
    """Every meta parameter and buffer by storage: tied names share one entry."""
    tracked: dict[StorageWeakRef, _Tracked] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.storage_offset() != 0 or param.untyped_storage().nbytes() != param.numel() * param.element_size():
            raise ValueError(
                f"parameter '{name}' {tuple(param.shape)} is a view into a larger meta tensor: make each "
                "parameter a tensor of its own (nn.Parameter(torch.empty(shape))) before zerocompile.shard()"
            )
        entry = tracked.setdefault(
            StorageWeakRef(param.untyped_storage()),
            _Tracked([], param, shard_numels[param]),
        )
        entry.names.append(name)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer.is_meta:
            tracked.setdefault(StorageWeakRef(buffer.untyped_storage()), _Tracked([], buffer, None)).names.append(name)
    return tracked


def _read_loaded(
    loaded: Mapping[torch.Tensor, PartReader], tracked: dict[StorageWeakRef, _Tracked], rank: int, device: torch.device
) -> dict[StorageWeakRef, torch.Tensor]:
    """This rank's part of each loaded tensor, read before the walk so that a call reading one sees
    the files' values. A buffer built off the meta device is read whole into a new tensor,
    returned by its storage, which replaces it once everything has succeeded."""
    read_buffers = {}
    for tensor, read in loaded.items():
        key = StorageWeakRef(tensor.untyped_storage())
        entry = tracked.get(key)
        if entry is None:
            read_buffers[key] = read(None, rank, device)
        else:
            entry.kept = read(entry.shard_numel, rank, device).reshape(-1)
            entry.loaded = True
    return read_buffers


def _fully_loaded_modules(model: nn.Module, covered: set[StorageWeakRef]) -> set[nn.Module]:
    """Modules `init` could write nothing in: every tensor in them and below them comes from the
    files. A parent of a tensor the files lack is still called: its init may be what writes it
    (GPT-2's attention initialises its child projection)."""
    return {
        module
        for module in model.modules()
        if all(StorageWeakRef(t.untyped_storage()) in covered for t in [*module.parameters(), *module.buffers()])
    }


def _kept(
    model: nn.Module, tracked: dict[StorageWeakRef, _Tracked], read_buffers: dict[StorageWeakRef, torch.Tensor], device: torch.device
) -> tuple[dict[nn.Parameter, torch.Tensor], dict[tuple[nn.Module, str], torch.Tensor]]:
    local = {param: entry.kept for entry in tracked.values() if isinstance(param := entry.meta, nn.Parameter)}
    buffers: dict[tuple[nn.Module, str], torch.Tensor] = {}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            key = StorageWeakRef(buffer.untyped_storage())
            if buffer.is_meta:
                buffers[(module, name)] = tracked[key].kept.view(buffer.shape)
            else:
                buffers[(module, name)] = read_buffers.get(key, buffer).to(device)
    return local, buffers


def _reset_own_state(module: nn.Module) -> None:
    """What `init=None` runs on each module: torch's own initialisers."""
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
    elif callable(getattr(module, "reset_running_stats", None)):
        module.reset_running_stats()


@contextlib.contextmanager
def _following_group_rank0_generators(group: dist.ProcessGroup, device: torch.device) -> Iterator[None]:
    """Inside: this rank's generators hold group rank 0's state (see the module docstring).

    One broadcast of the states' bytes (5 KB for the CPU generator), made by every rank of `group`
    alike: on the group's device, since NCCL carries device tensors only.
    """
    generators = _generators(device)
    own = [get() for get, _set in generators]
    packed = torch.cat(own).to(device)
    dist.broadcast(packed, src=dist.get_global_rank(group, 0), group=group)
    restore = []
    for (_get, set_state), mine, theirs in zip(generators, own, packed.cpu().split([s.numel() for s in own])):
        if not torch.equal(mine, theirs):
            set_state(theirs.clone())  # a state of its own, not a view into the broadcast bytes
            restore.append((set_state, mine))
    try:
        yield
    finally:
        for set_state, mine in restore:
            set_state(mine)


def _generators(device: torch.device) -> list[tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]]:
    """(get state, set state) of each generator the walk may draw from: the CPU's, and the device's
    where the shards live on an accelerator."""
    generators = [(torch.random.get_rng_state, torch.random.set_rng_state)]
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        generators.append((lambda: module.get_rng_state(device).cpu(), lambda state: module.set_rng_state(state, device)))
    return generators


class _ShardedWalk(TorchDispatchMode):
    """Gives each operation on a meta parameter or buffer a real tensor in its place."""

    def __init__(
        self,
        tracked: dict[StorageWeakRef, _Tracked],
        loaded: set[StorageWeakRef],
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.tracked, self.loaded = tracked, loaded
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.in_use: list[_Tracked] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.loaded:
            written = _written(func, args, kwargs)
            if written and all(self._is_loaded(t) for t in written):
                return _skipped(func, args, kwargs)
            if any(self._is_loaded(t) for t in written):
                raise RuntimeError(_mixed_write_message(func))
            if func.is_view and args and self._is_loaded(args[0]):
                # Stays a meta view: a later write through it is recognised and skipped, and only
                # a read gathers the loaded values.
                return func(*args, **kwargs)
        if func in _OVERWRITES and args and self._covers_whole(args[0]):
            self._materialise(self.tracked[StorageWeakRef(args[0].untyped_storage())], overwritten=True)
        args, kwargs = tree_map(self._real, (args, kwargs))
        return func(*args, **kwargs)

    def _is_loaded(self, value: torch.Tensor) -> bool:
        return value.layout == torch.strided and StorageWeakRef(value.untyped_storage()) in self.loaded

    def _entry(self, value: Any) -> _Tracked | None:
        if isinstance(value, torch.Tensor) and value.is_meta:
            return self.tracked.get(StorageWeakRef(value.untyped_storage()))
        return None

    def _covers_whole(self, value: Any) -> bool:
        entry = self._entry(value)
        return entry is not None and value.is_contiguous() and value.numel() == entry.storage_numel

    def _real(self, value: Any) -> Any:
        entry = self._entry(value)
        if entry is None:
            return value
        if entry.full is None:
            self._materialise(entry, overwritten=False)
        return entry.full.as_strided(value.shape, value.stride(), value.storage_offset())

    def _materialise(self, entry: _Tracked, *, overwritten: bool) -> None:
        if entry.full is not None:
            return
        if entry.kept is not None and entry.shard_numel is None:
            entry.full = entry.kept  # kept whole: keep writing into it
        elif entry.kept is not None and not overwritten:
            entry.full = self._gathered(entry)
        else:
            entry.full = torch.empty(entry.storage_numel, dtype=entry.meta.dtype, device=self.device)
            if not overwritten:
                entry.full.fill_(_unwritten_value(entry.full.dtype))
        self.in_use.append(entry)

    def _gathered(self, entry: _Tracked) -> torch.Tensor:
        """An earlier call's values, reassembled from the ranks' slices: every rank walks the same
        calls in the same order, so all reach this gather together."""
        padded = entry.kept.new_empty(entry.shard_numel * self.world_size)
        dist.all_gather_into_tensor(padded, entry.kept, group=self.group)
        return padded[: entry.storage_numel].clone()

    def keep_slices(self) -> None:
        """After one module's call: keep this rank's slice of every parameter it used, drop the rest."""
        for entry in self.in_use:
            if entry.loaded:  # only read: this rank's part from the files stays as it is
                entry.full = None
                continue
            # Judged on the whole tensor, which every rank holds alike, so all ranks agree.
            entry.partly_written = entry.full.is_floating_point() and bool(entry.full.isnan().any())
            if entry.shard_numel is None:
                entry.kept = entry.full
            else:
                entry.kept = local_slice(entry.full, entry.shard_numel, self.rank)
            entry.full = None
        self.in_use = []


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operation writes: the arguments its schema marks mutable (`Tensor(a!)`)."""
    written = []
    for argument, value in _bound(func, args, kwargs):
        if argument.alias_info is not None and argument.alias_info.is_write:
            values = value if isinstance(value, (list, tuple)) else [value]
            written += [v for v in values if isinstance(v, torch.Tensor)]
    return written


def _bound(func: Any, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """Each argument of `func`'s schema with the value passed for it (None where left out)."""
    return [
        (argument, args[i] if i < len(args) else kwargs.get(argument.name))
        for i, argument in enumerate(func._schema.arguments)
    ]


def _skipped(func: Any, args: tuple, kwargs: dict) -> Any:
    """What a skipped write returns: the arguments its results alias (the tensor an in-place op
    returns, an `out=`), as running it would have returned them."""
    by_alias = {
        frozenset(argument.alias_info.before_set): value
        for argument, value in _bound(func, args, kwargs)
        if argument.alias_info is not None
    }
    results = []
    for result in func._schema.returns:
        if result.alias_info is None:  # a value of its own too: skipping would leave it uncomputed
            raise RuntimeError(_mixed_write_message(func))
        results.append(by_alias[frozenset(result.alias_info.before_set)])
    return None if not results else results[0] if len(results) == 1 else tuple(results)


def _mixed_write_message(func: Any) -> str:
    return (
        f"init ran {func} on a tensor zerocompile.shard(weights=...) loads from the files, together with "
        "tensors it does not load or computing a new value: shard() skips init's writes to loaded tensors "
        "and cannot skip half an operation. Write each tensor with an operation of its own "
        "(torch.nn.init.normal_(module.weight), module.bias.zero_()). Nothing was changed."
    )


def local_slice(flat: torch.Tensor, shard_numel: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of `flat` zero-padded to `shard_numel` elements per rank, without
    building the padded whole."""
    shard = flat.new_zeros(shard_numel)
    start = rank * shard_numel
    end = min(start + shard_numel, flat.numel())
    if end > start:
        shard[: end - start].copy_(flat[start:end])
    return shard


def _unwritten_value(dtype: torch.dtype) -> float | int | bool:
    """What a value nobody wrote reads as: NaN where the dtype has one, so it survives arithmetic."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _raise_if_unwritten(entries: list[_Tracked], reset_route: bool) -> None:
    never = [e for e in entries if e.kept is None]
    partly = [e for e in entries if e.partly_written]
    if not never and not partly:
        return
    lines = []
    if never:
        lines.append(f"never written, still on the meta device: {_describe(never)}")
    if partly:
        lines.append(f"only partly written (NaN where nothing was written, or a value read before it was): {_describe(partly)}")
    source = "no module's reset_parameters()" if reset_route else "init"
    raise ValueError(
        f"zerocompile.shard() built this model on the meta device, where tensors hold no values, and "
        f"{source} gave these their values; {'; '.join(lines)}. Training would start from "
        "uninitialised memory. Fix: make init write every parameter and buffer (e.g. "
        "torch.nn.init.ones_(module.weight) for a norm layer, module.mask.copy_(...) for a buffer), "
        "or give the module a reset_parameters(), or create such tensors off the meta device "
        "(device='cpu' inside the meta context). Nothing was changed."
    )


def _describe(entries: list[_Tracked]) -> str:
    shown = [f"'{e.names[0]}' {tuple(e.meta.shape)}" for e in entries[:8]]
    more = f" and {len(entries) - 8} more" if len(entries) > 8 else ""
    return ", ".join(shown) + more
