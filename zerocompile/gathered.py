"""`with zerocompile.gathered(model):` full parameters for a block of plain eager code.

Generation loops, custom initialisation or inspection want `module.weight` to be the whole
tensor, in place, under its own Parameter object. On entry every sharded parameter of `model` is
all-gathered in its master dtype and the Parameter's data becomes that full tensor; the modules
get their original classes back, so attribute access returns the Parameter itself (tied
parameters: one full tensor under every name). On exit group rank 0's full values are written
back (scattered into every rank's shard; at stage 0 broadcast into the whole parameter), buffers
are broadcast from it as `shard()` does, and the full tensors are dropped.

Every rank of the group must enter and leave the block together (entering and a write-back are
collectives). If the block raises on any rank, the ranks agree on that first and nothing is
written back anywhere: each rank's shards stay as they were before the block, and no rank waits
for a collective the failed one will never join.
"""

from __future__ import annotations

import dataclasses
from types import TracebackType

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d

from zerocompile.offload import full_precision, master_written
from zerocompile.sharded_modules import plain_class
from zerocompile.sharded_parameters import ShardInfo, parameter_owners, shard_info, user_parameter


def is_gathered(param: torch.Tensor) -> bool:
    """Whether `param` is full right now because a `gathered()` block holds it."""
    return getattr(param, "_zero_gathered", False)


@dataclasses.dataclass
class _Held:
    """One sharded parameter while its block runs."""

    param: nn.Parameter
    info: ShardInfo
    shard: torch.Tensor  # the shard storage
    # Its values at full precision, written back into in place: the shard, or its master weights
    # in an offload store (`offload_masters`).
    precise: torch.Tensor
    grad: torch.Tensor | None  # the shard's gradient, set aside
    places: list[tuple[nn.Module, str]]  # (module, attribute) holding it


class gathered:
    """Context manager: inside, every sharded parameter of `model` is its full tensor.

    writeback: on a clean exit write group rank 0's full values (and buffers) back to every
        rank. False discards any change and sends nothing at exit (read-only use such as
        generation).

    The block is for eager code: a shard's gradient is set aside and restored (one computed
    inside the block is an error at exit), and calling a model compiled with backend="zero"
    inside it is refused.
    """

    def __init__(self, model: nn.Module, *, writeback: bool = True) -> None:
        self.model = model
        self.writeback = writeback
        self._held: list[_Held] = []
        self._classes: list[tuple[nn.Module, type]] = []

    def __enter__(self) -> nn.Module:
        owners = {p: places for p, places in parameter_owners(self.model).items() if shard_info(p) is not None}
        if not owners:
            raise RuntimeError(
                "gathered() got a model with no sharded parameters: call zerocompile.shard(model, stage=...) first"
            )
        nested = [shard_info(p).fqn for p in owners if is_gathered(p)]
        if nested:
            raise RuntimeError(
                f"parameters {nested[:3]} are already full inside an enclosing `with zerocompile.gathered(...)`: "
                "nested blocks are not supported; use the outer block, which already gives full parameters"
            )
        groups = {shard_info(p).group_name for p in owners}
        if len(groups) > 1:
            raise RuntimeError(
                f"gathered() got parameters sharded over several process groups {sorted(groups)}: "
                "call it once per sharded submodule"
            )
        try:
            with torch.no_grad():
                for param, places in owners.items():
                    info = shard_info(param)
                    precise = full_precision(param).detach()
                    full = info.gather(precise)
                    self._held.append(_Held(param, info, param.data, precise, param.grad, [(m, a) for _p, m, a in places]))
                    param.grad = None  # a shard-shaped gradient cannot sit on a full tensor
                    param.data = full
                    param._zero_gathered = True
                    for module, attr in self._held[-1].places:  # the full tensor, not the DTensor users hold
                        module._parameters[attr] = param
            modules = {id(m): m for held in self._held for m, _a in held.places}.values()
            self._classes = [(module, type(module)) for module in modules]
            for module, _ in self._classes:
                module.__class__ = plain_class(module)
            self.model._zero_gathered = True  # the mixed-precision input cast stands aside
        except BaseException:
            self._restore()
            raise
        return self.model

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        problems = [] if error is not None else self._problems()
        params = [held.param for held in self._held]
        failing: list[int] = []
        try:
            if self.writeback:
                group = c10d._resolve_process_group(self._held[0].info.group_name)
                failing = _ranks_failing(error is not None or bool(problems), group, self._held[0].shard.device)
                if not failing:
                    self._write_back(group)
        finally:
            self._restore()
        if self.writeback and not failing and error is None and not problems:
            for param in params:
                master_written(param)
        if problems:
            raise RuntimeError("; ".join(problems))
        if failing and error is None:
            raise RuntimeError(
                f"group ranks {failing} failed inside `with zerocompile.gathered(...)`: nothing was written "
                "back on any rank; every rank's shards are as they were before the block"
            )

    def _problems(self) -> list[str]:
        """What the block did that cannot be written back into the shards."""
        problems = []
        for held in self._held:
            param, info = held.param, held.info
            replaced = [f"{type(m).__name__}.{a}" for m, a in held.places if m._parameters.get(a) is not param]
            if replaced:
                problems.append(
                    f"parameter '{info.fqn}' was replaced ({replaced}) inside gathered(): change it in place "
                    "instead, e.g. `with torch.no_grad(): module.weight.copy_(new)`"
                )
            elif tuple(param.shape) != info.shape or param.dtype != held.precise.dtype:
                problems.append(
                    f"parameter '{info.fqn}' is now {tuple(param.shape)} {param.dtype}, but is sharded as "
                    f"{info.shape} {held.precise.dtype}: change its values, not its shape or dtype"
                )
            elif param.grad is not None:
                problems.append(
                    f"parameter '{info.fqn}' received a gradient inside gathered(), which was discarded: run "
                    "backward passes outside the block (the compiled model reduces them into the shards)"
                )
        return problems

    def _write_back(self, group: dist.ProcessGroup) -> None:
        """Group rank 0's full values into every rank's shard, and its buffers to every rank."""
        src = dist.get_global_rank(group, 0)
        world_size = dist.get_world_size(group)
        with torch.no_grad():
            for held in self._held:
                full = held.param.detach()
                if not held.info.policy.shards_parameters:
                    dist.broadcast(full, src=src, group=group)
                    held.precise.copy_(full)
                    continue
                rows = None
                if dist.get_rank(group) == 0:
                    # Only each rank's slice travels: a scatter sends Φ/N per rank where a broadcast sends Φ.
                    flat = full.reshape(-1)
                    padded = torch.cat([flat, flat.new_zeros(held.info.shard_numel * world_size - flat.numel())])
                    rows = list(padded.view(world_size, held.info.shard_numel))
                dist.scatter(held.precise, rows, src=src, group=group)
            for buffer in self.model.buffers():
                dist.broadcast(buffer, src=src, group=group)

    def _restore(self) -> None:
        """Shards, their gradients, Parameter objects and sharded classes back; full tensors dropped."""
        for held in self._held:
            held.param.data = held.shard
            held.param.grad = held.grad
            vars(held.param).pop("_zero_gathered", None)
            for module, attr in held.places:
                module._parameters[attr] = user_parameter(held.param)
        for module, sharded_class in self._classes:
            module.__class__ = sharded_class
        # Deleted rather than set False: compiled code guarded on its absence keeps matching.
        self.model.__dict__.pop("_zero_gathered", None)
        self._held, self._classes = [], []


def _ranks_failing(failed: bool, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Group ranks that report failure; every rank gets the same list (one small all-gather).

    The flags live on `device`, where the group's parameters are: the group's backend takes
    tensors there (an NCCL group has no backend for CPU tensors)."""
    mine = torch.tensor([int(failed)], dtype=torch.int32, device=device)
    flags = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, mine, group=group)
    return [rank for rank, flag in enumerate(flags) if flag.item()]
