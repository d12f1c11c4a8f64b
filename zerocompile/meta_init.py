"""Materialise a model built on the meta device straight into this rank's shards.

`with torch.device("meta"): model = Net(cfg)` costs no memory; `shard(model, stage, init=fn)`
then runs `model.apply(fn)` exactly as it would on the unsharded model (same modules, same order,
same random numbers), but a parameter exists in full only while one module's `fn` call uses it:
when the call returns, this rank keeps its slice and drops the rest. Every rank draws the same
numbers from the same generator state, so no values travel between ranks and the result equals,
bitwise, `model.apply(fn)` on the whole model.

How: the parameters and buffers stay meta tensors (full shape) for the whole walk, so model code
and `fn` see the model they expect. A `TorchDispatchMode` watches every operation `fn` runs; one
that touches a meta parameter's storage (directly, through `.data`, or a view) gets a real tensor
in its place. A first touch that overwrites the whole tensor (`normal_`, `zeros_`, `copy_`, ...)
gets fresh memory; any other first touch sees NaN, so reading a value nobody wrote shows up as a
parameter left partly unwritten. A parameter touched again after its call ended (GPT-2's
attention re-initialises its child projection) is gathered back from the ranks' slices unless
the operation overwrites it whole. Anything `fn` leaves on meta, or only partly writes, is an
error naming it: never uninitialised memory handed to training.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable

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


def materialise_sharded(
    model: nn.Module,
    init: Callable[[nn.Module], Any] | None,
    *,
    shard_numels: dict[nn.Parameter, int | None],
    group: dist.ProcessGroup,
    device: torch.device,
    agree_over: dist.ProcessGroup | None = None,
    trim: bool = False,
) -> tuple[dict[nn.Parameter, torch.Tensor], dict[tuple[nn.Module, str], torch.Tensor]]:
    """Run `model.apply(init)` (or each module's `reset_parameters()`) on the meta `model`.

    `shard_numels` is each distinct parameter's shard size over `group` as `shard()` decided it
    (None: kept whole, as at stage 0). `agree_over` (default `group`) is every rank that must hold
    the same values: with hybrid sharding the replicas of the shard group too. `trim` hands
    glibc's free heap pages back after each module on the CPU (see `zerocompile.heap`).

    Returns what this rank keeps of each distinct parameter (its padded flat slice at stages 1-3,
    the whole tensor at stage 0) and each buffer's value by (module, name). The model is not
    changed: the caller installs them once everything has succeeded.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_generators_agree(agree_over if agree_over is not None else group, device)
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

    walk = _ShardedWalk(tracked, group, rank, world_size, device)
    call = init if init is not None else _reset_own_state

    def one_module(module: nn.Module) -> None:
        with walk:
            call(module)
        walk.keep_slices()
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if trim and device.type == "cpu" and sum(t.numel() * t.element_size() for t in own) >= _TRIM_AFTER_BYTES:
            # Each module's full tensors are freed between the slices kept of it and of the next:
            # glibc would keep those holes resident, and the build's peak would grow with the model
            # (101M GPT, 2 ranks: 268-303 MB held after shard() against 193 MB of shards).
            trim_heap()

    with torch.no_grad():
        model.apply(one_module)
    _raise_if_unwritten(list(tracked.values()), init is None)

    local = {param: entry.kept for entry in tracked.values() if isinstance(param := entry.meta, nn.Parameter)}
    buffers: dict[tuple[nn.Module, str], torch.Tensor] = {}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            entry = tracked.get(StorageWeakRef(buffer.untyped_storage())) if buffer.is_meta else None
            buffers[(module, name)] = entry.kept.view(buffer.shape) if entry is not None else buffer.to(device)
    return local, buffers


def _reset_own_state(module: nn.Module) -> None:
    """What `init=None` runs on each module: torch's own initialisers."""
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
    elif callable(getattr(module, "reset_running_stats", None)):
        module.reset_running_stats()


def _check_generators_agree(group: dist.ProcessGroup, device: torch.device) -> None:
    """The walk needs every rank to draw the same numbers; a rank seeded differently would silently
    hold slices of a different model. One small all-gather of a digest of each generator state."""
    states = [torch.random.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device.type).get_rng_state(device).cpu())
    digest = hashlib.sha256(b"".join(s.numpy().tobytes() for s in states)).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    differing = [r for r, value in enumerate(every) if not torch.equal(value, every[0])]
    if differing:
        raise RuntimeError(
            f"the random number generators of group ranks {differing} differ from group rank 0's before "
            "zerocompile.shard(init=...): every rank computes the same initial values itself, so seed every "
            "rank alike (torch.manual_seed(seed)) before shard(), and seed per rank (dropout, data) after it"
        )


class _ShardedWalk(TorchDispatchMode):
    """Gives each operation on a meta parameter or buffer a real tensor in its place."""

    def __init__(
        self,
        tracked: dict[StorageWeakRef, _Tracked],
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.tracked = tracked
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.in_use: list[_Tracked] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _OVERWRITES and args and self._covers_whole(args[0]):
            self._materialise(self.tracked[StorageWeakRef(args[0].untyped_storage())], overwritten=True)
        args, kwargs = tree_map(self._real, (args, kwargs))
        return func(*args, **kwargs)

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
            # Judged on the whole tensor, which every rank holds alike, so all ranks agree.
            entry.partly_written = entry.full.is_floating_point() and bool(entry.full.isnan().any())
            if entry.shard_numel is None:
                entry.kept = entry.full
            else:
                entry.kept = local_slice(entry.full, entry.shard_numel, self.rank)
            entry.full = None
        self.in_use = []


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
