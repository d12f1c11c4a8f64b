"""Optimizer state off the compute device's memory: on disk (`offload="disk"`, ZeRO-Infinity's
optimizer offload to NVMe) or in host memory with the update on the CPU (`offload="cpu"`,
ZeRO-Offload).

Of the 16 bytes a parameter costs under fp32 AdamW, the 8 of its two moments are touched once per
step, by the optimizer only. With offload each rank keeps every piece of optimizer state shaped like
its parameter shard (AdamW's `exp_avg` and `exp_avg_sq`, SGD's momentum, Muon's momentum,
Adafactor's vector variance) in one flat store laid out bucket by bucket, and the optimizer's own
`step()` runs one bucket of parameters at a time. Scalars (`step`) and statistics smaller than the
parameter (Adafactor's row and column means) stay where the optimizer keeps them.

`DiskState` (offload="disk"): the store is one preallocated file under `offload_dir`, mapped into
memory; each bucket's state is read ahead while the one before updates (`MADV_WILLNEED`) and dropped
from the process behind it (`MADV_DONTNEED`, then writeback started), so a rank holds one or two
buckets of state at a time, never all of it. The step runs where the parameters are (on an
accelerator the bucket's state is copied there and back).

`HostState` (offload="cpu"): the store is host memory (pinned when the parameters are on an
accelerator); per bucket the parameter shards and gradients are copied to host buffers, the step
runs on the CPU on those copies, and the parameters are copied back; two buffers alternate so the
copies of one bucket overlap the update of another. On CPU parameters it moves nothing useful (the
state already is in host memory) but runs the same code, which is how its exactness is tested here.

With `offload_masters` and a `param_dtype` narrower than the parameters, the store also keeps each
parameter's master weights (its fp32 shard) and the shard in memory takes `param_dtype`: each step
updates the masters (their gradients cast up from `param_dtype`) and writes the shards from them.
Whatever reads or writes the weights at full precision (checkpoints, `full_state_dict`, weights
files, `gathered`, EMA) goes through `full_precision` and `master_written`.

The state tensors the step sees are views of the store (users' `optimizer.state` shows them as
DTensor views, `zerocompile.dtensor_parameters`), so `state_dict()`, `zc.save` and `zc.load` read
and write it in place; torch's `load_state_dict` is followed by moving what it installed back into
the store (`move_all_into_store`, hooked by `zerocompile.sharding`). The arithmetic is the
optimizer's own, on the same values: a step with offloaded state equals one in memory bit for bit
(every supported optimizer updates each parameter from its own state; Muon and Adafactor exchange
per bucket what they exchanged per step).

The file is reserved whole by `shard()`, before anything changes, and removed when the optimizer
is collected; files of dead processes are removed by the next `shard()` offloading to the same
directory (`zerocompile.offload_files`).

The mapping's one hazard: a read error of the disk under a mapped page is a SIGBUS, not a Python
exception (the rank dies; the others learn it through `zerocompile.rank_deaths`).
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from zerocompile.offload_files import remove_file, reserve_file
from zerocompile.sharded_parameters import shard_of_parameter, written_count
from zerocompile.user_warnings import warn_at_caller

# Offloaded state bytes per bucket of the streamed step. Each bucket is one call of the optimizer's
# step (foreach temporaries of about one bucket) and, for Muon/Adafactor, one exchange.
STEP_BUCKET_BYTES = 64 * 2**20
# Where each staged tensor starts in HostState's buffers: aligned for vectorised copies.
_STAGING_ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class _Region:
    """Where one state tensor of one parameter lies in the file."""

    dtype: torch.dtype
    offset: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Shards:
    """What offload needs to know of the parameters before `shard()` has made their shards."""

    local_numel: Callable[[torch.Tensor], int]  # elements of the parameter's shard on this rank
    full_ndim: Callable[[torch.Tensor], int]  # dims of the parameter as written
    device: torch.device  # where the parameters will live
    describe: Callable[[torch.Tensor], str]  # the parameter's name, for errors
    # `offload_masters`: the dtype the shards in memory take where the store keeps their masters.
    compute_dtype: torch.dtype | None = None

    def keeps_master(self, param: torch.Tensor) -> bool:
        """Whether the store keeps `param`'s master weights (a floating-point parameter wider than
        the compute dtype)."""
        dtype = self.compute_dtype
        return dtype is not None and param.is_floating_point() and dtype.itemsize < param.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """Consecutive parameters (each group's share) stepped together, and the file bytes
    [start, end) their offloaded state occupies."""

    params_by_group: tuple[tuple[torch.Tensor, ...], ...]
    start: int
    end: int

    def params(self) -> list[torch.Tensor]:
        return [param for params in self.params_by_group for param in params]


class OffloadedState:
    """One optimizer's state kept off the compute device's memory on this rank, in one flat store
    laid out bucket by bucket, and the step that streams it. `DiskState` keeps the store in a
    file, `HostState` in host memory."""

    # The key of `zc.model_state_bytes` under which the store's bytes are counted.
    held_as: str

    def __init__(self, optimizer: torch.optim.Optimizer, shards: Shards, step_device: torch.device) -> None:
        """Probe which state `optimizer` keeps shaped like its parameters, stepping on
        `step_device`, and lay it out for the parameters' `shards`."""
        if "step" in vars(optimizer):
            raise ValueError(
                "the optimizer's step() was wrapped on the object (a learning-rate scheduler built before "
                "zerocompile.shard() does that), so its steps would bypass the streamed step of offload: "
                "build the LR scheduler after shard()"
            )
        self._describe = shards.describe
        self._groups_layout = _groups_layout(optimizer)
        kinds = _offloaded_kinds(optimizer, shards.full_ndim, step_device)
        self.regions: dict[torch.Tensor, dict[str, _Region]] = {}
        # Parameters whose fp32 master weights the store keeps (`offload_masters`), and where.
        self.masters: dict[torch.Tensor, _Region] = {}
        self.compute_dtype = shards.compute_dtype
        offset = 0

        def region(dtype: torch.dtype, numel: int) -> _Region:
            nonlocal offset
            placed = _Region(dtype, offset, numel)
            offset = _page_aligned(offset + placed.nbytes)
            return placed

        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if shards.keeps_master(param):
                    self.masters[param] = region(param.dtype, shards.local_numel(param))
                self.regions[param] = {
                    key: region(dtype, shards.local_numel(param))
                    for key, dtype in kinds[(index, shards.full_ndim(param), param.dtype)]
                }
        self.nbytes = offset
        self.state_bytes = sum(region.nbytes for regions in self.regions.values() for region in regions.values())
        self.master_bytes = sum(region.nbytes for region in self.masters.values())
        self._buckets = _buckets(
            optimizer, {p: [*self.regions[p].values(), *filter(None, [self.masters.get(p)])] for p in self.regions}
        )
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        # Each master's parameter's `_version` when the store last wrote it: a write by anyone else
        # shows as a newer version.
        self._versions: dict[torch.Tensor, int] = {}

    def _flat(self, region: _Region) -> torch.Tensor:
        """The store's elements of `region`, as a 1-D tensor of its dtype."""
        raise NotImplementedError

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer` (the one this was made for) step in buckets from the store, and move
        any state it holds there."""
        optimizer.__class__ = _streaming_class(type(optimizer))
        optimizer._patch_step_function()  # the step hooks wrap each class's own `step`
        optimizer._zero_offloaded = self
        self.move_all_into_store(optimizer)
        with torch.no_grad():
            # Bucket by bucket, so the fp32 shards go as their masters are written and the file's
            # pages leave behind them: at most a bucket more than the narrowed shards is held.
            for bucket in self._buckets:
                for param in [param for param in bucket.params() if param in self.masters]:
                    self.master(param).copy_(param.detach().reshape(self.master(param).shape))
                    param.data = param.detach().to(self.compute_dtype)
                    # Weak: the optimizer owns the store, and a cycle through the parameters would
                    # keep its file past the optimizer's end (until a garbage collection, or for
                    # good in a rank that ends with os._exit).
                    param._zero_masters = weakref.ref(self)
                    self._versions[param] = written_count(param)
                self._written(bucket)
        self.release()

    def _written(self, bucket: _Bucket) -> None:
        """What follows writing `bucket`'s bytes of the store outside a step (nothing, unless the
        store is a file)."""

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The store's master weights of `param` (its shard's shape, the parameter's own dtype)."""
        return self._cached_view(param, "master", self.masters[param])

    def current_master(self, param: torch.Tensor) -> torch.Tensor:
        """`master(param)`, after taking in what was written into the parameter outside the
        store since the store last wrote it (the user's `copy_`, a module's `load_state_dict`)."""
        if written_count(param) != self._versions[param]:
            warn_at_caller(
                f"parameter {self._describe(param)} was written outside zerocompile's loaders since the last step: "
                f"its {self.masters[param].dtype} master weights in the offload store take the written values, "
                f"rounded to {self.compute_dtype}. zerocompile.load and load_weights keep full precision"
            )
            with torch.no_grad():
                self.master(param).copy_(param.detach())
            self._versions[param] = written_count(param)
        return self.master(param)

    def master_written(self, param: torch.Tensor) -> None:
        """`param`'s shard taken from its master weights, which were just written."""
        self._write_shard(param, self.master(param))

    def _write_shard(self, param: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> None:
        """`param`'s shard written from `source` (its master, or a copy of it), and that write
        recorded as the store's own."""
        with torch.no_grad():
            param.copy_(source, non_blocking=non_blocking)
        if param in self.masters:
            self._versions[param] = written_count(param)

    def move_all_into_store(self, optimizer: torch.optim.Optimizer) -> None:
        """`move_into_store` for every parameter, then `release`."""
        self.move_into_store(optimizer, list(self.regions))
        self.release()

    def view(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        """The store's tensor for `param`'s state `key` (its shard's shape), or None where that
        state stays where the optimizer keeps it."""
        region = self.regions.get(param, {}).get(key)
        return None if region is None else self._cached_view(param, key, region)

    def _cached_view(self, param: torch.Tensor, key: str, region: _Region) -> torch.Tensor:
        cached = self._views.get((id(param), key))
        if cached is None:
            flat = self._flat(region)
            cached = self._views[(id(param), key)] = flat.view(param.shape) if param.numel() == region.numel else flat
        return cached

    def move_into_store(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        """Every offloaded state tensor of `params` that lives elsewhere copied into the store and
        replaced there by the store's view (state made by the optimizer's first step, or loaded)."""
        for param in params:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key in self.regions[param]:
                value, target = state.get(key), self.view(param, key)
                if value is None or value is target:
                    continue
                if not isinstance(value, torch.Tensor) or value.shape != target.shape or value.dtype != target.dtype:
                    raise RuntimeError(
                        f"optimizer state {key!r} of parameter {self._describe(param)} is "
                        f"{_what(value)}, where offload laid out {tuple(target.shape)} {target.dtype} "
                        "at shard(): the optimizer changed its state's kind after shard()"
                    )
                target.copy_(value)
                state[key] = target

    def release(self) -> None:
        """Drop from this process's memory what the store need not keep there (nothing, unless
        the store is a file)."""

    def traffic(self) -> dict[str, Any]:
        """What the store holds and what a step moves, for the dump (`zerocompile dump`)."""
        raise NotImplementedError

    def step(self, optimizer: torch.optim.Optimizer, base_step: Callable[[torch.optim.Optimizer], Any]) -> None:
        """`base_step` (the optimizer's own step) run on one bucket of parameters at a time."""
        if _groups_layout(optimizer) != self._groups_layout:
            raise RuntimeError(
                "the optimizer's param groups changed after zerocompile.shard() with offload, which laid out "
                "their state: build the optimizer with all its groups before shard()"
            )
        self._before_step()
        for param in self.masters:
            self.current_master(param)
        groups = optimizer.param_groups
        everything = [group["params"] for group in groups]
        try:
            for number in range(len(self._buckets)):
                self._step_bucket(optimizer, number, base_step)
        finally:
            for group, params in zip(groups, everything):
                group["params"] = params
        self.release()

    def _before_step(self) -> None:
        """What must hold before a step changes anything."""

    def _step_bucket(self, optimizer: torch.optim.Optimizer, number: int, base_step: Callable[[torch.optim.Optimizer], Any]) -> None:
        """`base_step` on the parameters of bucket `number` (the ones after it are still to come)."""
        raise NotImplementedError

    def _step_stand_ins(
        self, optimizer: torch.optim.Optimizer, bucket: _Bucket, stand_ins: dict[torch.Tensor, torch.Tensor],
        base_step: Callable[[torch.optim.Optimizer], Any],
    ) -> None:
        """`base_step` on tensors standing in for the bucket's parameters (host copies, masters),
        with the parameters' state re-keyed to them and back."""
        for group, params in zip(optimizer.param_groups, bucket.params_by_group):
            group["params"] = [stand_ins[param] for param in params]
        state = optimizer.state
        optimizer.state = defaultdict(dict, {stand_ins[p]: state[p] for p in stand_ins if p in state})
        try:
            base_step(optimizer)
        finally:
            stepped, optimizer.state = optimizer.state, state
        for param, stand_in in stand_ins.items():
            if stand_in in stepped:
                state[param] = stepped[stand_in]

    def _stand_in_master(self, param: torch.Tensor, master: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
        """`master` (or its copy on the step's device) made to stand in for `param` in the step:
        `grad` in the master's dtype, and what zerocompile.optim reads of the parameter."""
        master.grad = None if grad is None else grad.to(master.dtype)
        master.requires_grad_(param.requires_grad)
        master._zero = getattr(param, "_zero", None)
        return master

    @staticmethod
    def _stood_in(stand_in: torch.Tensor) -> None:
        """A master that stood in for its parameter, back to plain values (no gradient held)."""
        stand_in.grad = None
        stand_in.requires_grad_(False)


class DiskState(OffloadedState):
    """`offload="disk"`: the store is a file, mapped; each bucket's state is read ahead while the
    one before updates, and dropped from the process behind it."""

    held_as = "optimizer_on_disk"

    def __init__(self, optimizer: torch.optim.Optimizer, shards: Shards, directory: str | os.PathLike) -> None:
        """The layout (`OffloadedState`; the step runs on the parameters' device), and the file
        reserved under `directory`: an error naming the fix (and nothing left behind) if the
        directory cannot hold it. The file lives as long as this object (the optimizer holds it)."""
        super().__init__(optimizer, shards, shards.device)
        self._file = reserve_file(Path(directory), self.nbytes)
        self._map = mmap.mmap(self._file.fileno(), max(self.nbytes, mmap.PAGESIZE)) if self.nbytes else None
        weakref.finalize(self, remove_file, self._file, self._map)

    @property
    def path(self) -> Path:
        return Path(self._file.name)

    def _flat(self, region: _Region) -> torch.Tensor:
        return torch.frombuffer(self._map, dtype=region.dtype, count=region.numel, offset=region.offset)

    def traffic(self) -> dict[str, Any]:
        """The state (and masters) on disk, read once and written once by each step."""
        return {
            "where": "on disk", "file": str(self.path), "state_bytes": self.state_bytes, "master_bytes": self.master_bytes,
            "buckets": len(self._buckets), "moved_bytes_per_step": 2 * (self.state_bytes + self.master_bytes),
            "moves": "the state read from the file and written back",
        }  # fmt: skip

    def release(self) -> None:
        """Drop every mapped page of the file from this process (the data stays in the file). At a
        step's end this also drops what the kernel's fault-around (64 KiB around each page fault)
        mapped in buckets already dropped."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED, 0, self.nbytes)

    def _before_step(self) -> None:
        """Wait until the last step's state is on the disk, before this step changes anything.

        Pages whose writeback failed are dropped by the kernel as if written, and read back stale
        later: a silent wrong answer. fdatasync reports such a failure; by the next step the
        writeback started behind each bucket is mostly done, so the wait is short unless the disk is
        slower than the step."""
        if self._map is None:
            return
        try:
            os.fdatasync(self._file.fileno())
        except OSError as error:
            raise RuntimeError(
                f"the optimizer state of the last step could not be written to {self.path} ({error.strerror}): the "
                "state on disk is no longer trustworthy, so this process must not step again. Restart from the "
                "last checkpoint (zc.load), with offload_dir on a healthy disk"
            ) from error

    def _step_bucket(self, optimizer: torch.optim.Optimizer, number: int, base_step: Callable[[torch.optim.Optimizer], Any]) -> None:
        bucket = self._buckets[number]
        if number + 1 < len(self._buckets):
            self._advise(mmap.MADV_WILLNEED, self._buckets[number + 1])
        params = bucket.params()
        staged = self._stage_on_device(optimizer, params)
        stand_ins = {param: self._master_on_device(param) if param in self.masters else param for param in params}
        self._step_stand_ins(optimizer, bucket, stand_ins, base_step)
        for param, key, host in staged:
            host.copy_(optimizer.state[param][key])
            optimizer.state[param][key] = host
        with torch.no_grad():
            for param in [param for param in params if param in self.masters]:
                stand_in, master = stand_ins[param], self.master(param)
                if stand_in is not master:
                    master.copy_(stand_in)
                self._stood_in(stand_in)
                self._write_shard(param, stand_in)  # from the step's device, not back from the file
        self.move_into_store(optimizer, params)
        self._drop(bucket)

    def _master_on_device(self, param: torch.Tensor) -> torch.Tensor:
        master = self.master(param)
        if param.device != master.device:
            master = master.to(param.device)
        return self._stand_in_master(param, master, param.grad)

    def _stage_on_device(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
        """Copies of the file's state on the parameters' accelerator for the step (none on the CPU)."""
        staged = []
        for param in params:
            if param.device.type == "cpu":
                continue
            state = optimizer.state.get(param, {})
            for key in self.regions[param]:
                host = state.get(key)
                if host is not None:
                    state[key] = host.to(param.device, non_blocking=False)
                    staged.append((param, key, host))
        return staged

    def _written(self, bucket: _Bucket) -> None:
        self._drop(bucket)

    def _drop(self, bucket: _Bucket) -> None:
        if self._advise(mmap.MADV_DONTNEED, bucket):
            # Start writing the bucket back now rather than when the kernel's dirty limits force it.
            os.posix_fadvise(self._file.fileno(), bucket.start, bucket.end - bucket.start, os.POSIX_FADV_DONTNEED)

    def _advise(self, advice: int, bucket: _Bucket) -> bool:
        """`madvise` over the bucket's bytes of the file; False where it has none."""
        if bucket.end == bucket.start:
            return False
        self._map.madvise(advice, bucket.start, bucket.end - bucket.start)
        return True


class HostState(OffloadedState):
    """`offload="cpu"` (ZeRO-Offload): the store is host memory (pinned where the parameters are on
    an accelerator) and the update runs on the CPU. Per bucket the parameter shards and their
    gradients are copied to host buffers, the optimizer's own step updates those copies with the
    state in the store, and the parameters are copied back. Two buffers alternate, so on an
    accelerator the next bucket's copies to the host and this bucket's copy back run while the CPU
    updates. Without `offload_masters` the parameters on the device stay the only copy of the
    weights between steps; with it the store's masters step in place (only the gradients are
    copied to the host) and the shards are copied back from them."""

    held_as = "optimizer_on_host"

    def __init__(self, optimizer: torch.optim.Optimizer, shards: Shards) -> None:
        """The layout (`OffloadedState`; the step runs on the CPU, so that is where the state is
        learnt and kept), the store and two staging buffers allocated (zeroed)."""
        super().__init__(optimizer, shards, torch.device("cpu"))
        pinned = shards.device.type != "cpu"
        self._store = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        # Each bucket's parameters (but those whose masters step in the store) and gradients, at
        # _STAGING_ALIGNMENT-aligned offsets.
        self._staging_layout = {}
        self._shard_bytes = {
            param: shards.local_numel(param) * (self.compute_dtype if param in self.masters else param.dtype).itemsize
            for param in self.regions
        }
        largest = 0
        for bucket in self._buckets:
            offset = 0
            for param in bucket.params():
                nbytes = self._shard_bytes[param]
                copied = 0 if param in self.masters else nbytes  # a master steps in the store itself
                self._staging_layout[param] = (offset, _aligned(offset + copied))
                offset = _aligned(offset + copied) + _aligned(nbytes)
            largest = max(largest, offset)
        self._staging = [torch.zeros(largest, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._copied_back: list[torch.Event | None] = [None, None]  # per buffer: where its last copy back ends
        # Bucket number -> its stand-ins and staged gradients by parameter, and the event their
        # copies to the host end at.
        self._staged: dict[int, tuple[dict[torch.Tensor, torch.Tensor], dict[torch.Tensor, torch.Tensor], torch.Event | None]] = {}
        self._device = shards.device

    def _flat(self, region: _Region) -> torch.Tensor:
        return self._store[region.offset : region.offset + region.nbytes].view(region.dtype)

    def traffic(self) -> dict[str, Any]:
        """The state in host memory; each step copies the shards and gradients there, the shards back."""
        shard_bytes = sum(self._shard_bytes.values())
        copied_out = sum(nbytes for param, nbytes in self._shard_bytes.items() if param not in self.masters)
        return {
            "where": "in host memory", "state_bytes": self.state_bytes, "master_bytes": self.master_bytes,
            "buckets": len(self._buckets), "moved_bytes_per_step": 2 * shard_bytes + copied_out,
            "moves": "gradients and the parameter shards without masters there copied to the host, the shards back",
        }  # fmt: skip

    def _before_step(self) -> None:
        """The last step's copies of masters to the parameters read the store: they end before
        this step writes it."""
        for event in self._copied_back:
            if event is not None:
                event.synchronize()

    def _step_bucket(self, optimizer: torch.optim.Optimizer, number: int, base_step: Callable[[torch.optim.Optimizer], Any]) -> None:
        bucket = self._buckets[number]
        if number == 0:
            self._stage(number)
        if number + 1 < len(self._buckets):
            self._stage(number + 1)
        stand_ins, grads, arrived = self._staged.pop(number)
        if arrived is not None:
            arrived.synchronize()
        for param, grad in grads.items():
            if param in self.masters:
                self._stand_in_master(param, stand_ins[param], grad)
            else:
                stand_ins[param].grad = grad
        self._step_stand_ins(optimizer, bucket, stand_ins, base_step)
        for param, stand_in in stand_ins.items():
            self._write_shard(param, stand_in, non_blocking=True)
            if param in self.masters:
                self._stood_in(stand_in)
        self._copied_back[number % 2] = self._record()
        self.move_into_store(optimizer, list(stand_ins))

    def _stage(self, number: int) -> None:
        """Copy bucket `number`'s parameters and gradients into staging buffer `number % 2` (once its last
        copy back has ended) as host tensors standing in for them in the step."""
        buffer = self._staging[number % 2]
        if self._copied_back[number % 2] is not None:
            self._copied_back[number % 2].synchronize()
        stand_ins, grads = {}, {}
        for param in self._buckets[number].params():
            start, grad_start = self._staging_layout[param]
            nbytes = self._shard_bytes[param]
            if param.grad is not None:
                grads[param] = buffer[grad_start : grad_start + nbytes].view(param.dtype).view(param.shape)
                grads[param].copy_(param.grad, non_blocking=True)
            if param in self.masters:  # the master in the store is what steps: nothing to copy
                stand_ins[param] = self.master(param)
                continue
            stand_in = buffer[start : start + nbytes].view(param.dtype).view(param.shape)
            stand_in.copy_(param.detach(), non_blocking=True)
            stand_in.requires_grad_(param.requires_grad)
            # zerocompile.optim's optimizers read which shard of which parameter they step.
            stand_in._zero = getattr(param, "_zero", None)
            stand_ins[param] = stand_in
        self._staged[number] = (stand_ins, grads, self._record())

    def _record(self) -> torch.Event | None:
        """An event at the end of the work queued so far on the parameters' accelerator (None on
        the CPU, whose copies are done when they return)."""
        if self._device.type == "cpu":
            return None
        event = torch.Event(device=self._device)
        event.record()
        return event


def full_precision(param: torch.Tensor) -> torch.Tensor:
    """`param`'s values at full precision: its master weights where an offload store keeps them
    (`offload_masters`), else its shard (a DTensor parameter answers with its flat shard)."""
    shard = shard_of_parameter(param)
    store = _masters_store(shard)
    return shard if store is None else store.current_master(shard)


def master_written(param: torch.Tensor) -> None:
    """After `full_precision(param)` was written: the parameter's shard made to match (nothing
    where the parameter is its own full precision)."""
    shard = shard_of_parameter(param)
    store = _masters_store(shard)
    if store is not None:
        store.master_written(shard)


def _masters_store(param: torch.Tensor) -> OffloadedState | None:
    """The store keeping `param`'s master weights while its optimizer lives."""
    store = getattr(param, "_zero_masters", None)
    return None if store is None else store()


def offloaded_state(optimizer: torch.optim.Optimizer) -> OffloadedState | None:
    """The optimizer's offloaded state, if `shard(..., offload=...)` moved it."""
    return getattr(optimizer, "_zero_offloaded", None)


class _StreamsOffloadedState:
    """What an optimizer with its state offloaded becomes: its own step, bucket by bucket."""

    _zero_offloaded: OffloadedState

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._zero_offloaded.step(self, _own_step(type(self).__mro__[2]))
        except BaseException:  # no step post-hook runs: users' groups and state back before it leaves
            if "_zero_local_step" in self.__dict__:
                self._zero_local_step.after(self)
            raise
        return loss


@functools.cache
def _streaming_class(cls: type) -> type:
    return type(cls.__name__, (_StreamsOffloadedState, cls), {"__qualname__": cls.__qualname__, "__module__": cls.__module__})


def _own_step(cls: type) -> Callable[[torch.optim.Optimizer], Any]:
    """The step of optimizer class `cls` without torch's step hooks (they run once, around the
    whole streamed step)."""
    step = cls.step
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


def _groups_layout(optimizer: torch.optim.Optimizer) -> list[list[int]]:
    return [[id(p) for p in group["params"]] for group in optimizer.param_groups]


def _offloaded_kinds(
    optimizer: torch.optim.Optimizer, full_ndim: Callable[[torch.Tensor], int], device: torch.device
) -> dict[tuple[int, int, torch.dtype], list[tuple[str, torch.dtype]]]:
    """For each (param group, parameter dims, dtype) the optimizer holds: the state keys (and
    dtypes) it makes shaped like the parameter, learnt by stepping a small stand-in parameter of
    those dims in that group's settings (the optimizer's own code, on a state of its own)."""
    kinds = {}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            ndim = full_ndim(param)
            if (index, ndim, param.dtype) not in kinds:
                kinds[(index, ndim, param.dtype)] = _probe(optimizer, index, ndim, param.dtype, device)
    return kinds


def _probe(optimizer: torch.optim.Optimizer, index: int, ndim: int, dtype: torch.dtype, device: torch.device) -> list[tuple[str, torch.dtype]]:
    stand_in = torch.zeros((3, 5, 7, 11, 13)[:ndim], dtype=dtype, device=device, requires_grad=True)
    stand_in.grad = torch.full_like(stand_in, 0.5)
    groups, state = optimizer.param_groups, optimizer.state
    optimizer.param_groups = [{**groups[index], "params": [stand_in]}]
    optimizer.state = defaultdict(dict)
    try:
        _own_step(type(optimizer))(optimizer)
        made = optimizer.state[stand_in]
    except Exception as error:
        raise TypeError(
            f"offload could not learn which state {type(optimizer).__name__} keeps (a step of a "
            f"{ndim}-D stand-in parameter in param group {index} raised {type(error).__name__}: {error}); "
            "offload supports torch.optim's elementwise optimizers and zerocompile.optim's"
        ) from error
    finally:
        optimizer.param_groups, optimizer.state = groups, state
    return [
        (key, value.dtype)
        for key, value in made.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == stand_in.shape
    ]


def _page_aligned(offset: int) -> int:
    return -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE


def _aligned(offset: int) -> int:
    """`offset` rounded up to _STAGING_ALIGNMENT bytes: every dtype's view may start there."""
    return -(-offset // _STAGING_ALIGNMENT) * _STAGING_ALIGNMENT


def _buckets(optimizer: torch.optim.Optimizer, regions: dict[torch.Tensor, list[_Region]]) -> list[_Bucket]:
    """The parameters in the optimizer's order, cut into buckets of about STEP_BUCKET_BYTES of
    offloaded state and masters (`regions`, each parameter's; the file is laid out in that order,
    so each bucket's bytes are one range)."""
    buckets: list[_Bucket] = []
    current: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    start = end = 0

    def close() -> None:
        nonlocal current, start
        buckets.append(_Bucket(tuple(tuple(params) for params in current), start, end))
        current, start = [[] for _ in optimizer.param_groups], end

    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            current[index].append(param)
            for region in regions[param]:
                end = _page_aligned(region.offset + region.nbytes)
            if end - start >= STEP_BUCKET_BYTES:
                close()
    if any(current):
        close()
    return buckets


def _what(value: Any) -> str:
    return f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
