"""torch's process-wide hooks that zerocompile needs, held only while a sharded model lives.

Some mistakes show only where torch offers nothing but global hooks: an optimizer stepping
shards it cannot step on, or with state made for the full parameters, or while gradients are
pending under `no_sync` (optimizer step pre-hook); a Parameter or submodule assigned on a module
of a sharded model (module registration hooks). `ProcessHooks` installs them with the first
sharded model and removes them, by their handles, when the last one is collected, with any patch
made through `patch` (the Inductor workaround of `zerocompile.upstream_fixes`, the death watch of
`zerocompile.rank_deaths`): a process that holds no sharded model runs none of our code.

While one lives, every optimizer's step passes through `_before_step` and `_after_step`: for one
that holds sharded parameters they run `StepAround` (the step on the flat shards of
`zerocompile.dtensor_parameters`) around the checks and the step. An optimizer is sorted once
(and again when its parameter groups change): one that holds no sharded parameter is dismissed by
a weak-dictionary lookup, and none of the checks walks it. One that holds sharded parameters of a
CPU model with `trim_heap` gets the heap trimmer as a step post-hook of its own (`zerocompile.heap`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from zerocompile.heap import StepTrimmer, glibc_malloc_trim

OptimizerCheck = Callable[[torch.optim.Optimizer], None]


StepArguments = Callable[[torch.optim.Optimizer, tuple, dict], "tuple[tuple, dict] | None"]


class StepAround:
    """What runs around the step of an optimizer that holds sharded parameters: `adopt` when it is
    first sorted (or its groups change), `before` ahead of the checks and the step (given the
    step's arguments, it may return others, as torch's step pre-hooks may: a closure wrapped),
    `after` once the step returned (or a check raised)."""

    def __init__(self, adopt: OptimizerCheck, before: StepArguments, after: OptimizerCheck) -> None:
        self.adopt, self.before, self.after = adopt, before, after


class _Sorted:
    """What `ProcessHooks` found an optimizer to hold, and the parameter groups it looked at."""

    def __init__(self, layout: tuple[int, ...], sharded: bool) -> None:
        self.layout = layout
        self.sharded = sharded


class ProcessHooks:
    """Global hooks installed while at least one sharded model is alive.

    `optimizer_checks` run before each step of an optimizer that holds a sharded parameter;
    `holds_sharded(param)` says whether a parameter is one, and `trims(param)` whether its model
    wants glibc's heap trimmed."""

    def __init__(
        self,
        optimizer_checks: tuple[OptimizerCheck, ...],
        step_around: StepAround,
        holds_sharded: Callable[[torch.Tensor], bool],
        trims: Callable[[torch.Tensor], bool],
        parameter_registration: Callable[[nn.Module, str, nn.Parameter], Any],
        module_registration: Callable[[nn.Module, str, nn.Module | None], Any],
    ) -> None:
        self._optimizer_checks = optimizer_checks
        self._around = step_around
        self._holds_sharded = holds_sharded
        self._trims = trims
        self._parameter_registration = parameter_registration
        self._module_registration = module_registration
        self._alive = 0
        self._handles: list[RemovableHandle] = []
        self._undo: dict[Callable[[], None], None] = {}  # ordered set of what `patch` installed
        self._sorted: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Sorted] = weakref.WeakKeyDictionary()
        self.trimmers: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepTrimmer] = weakref.WeakKeyDictionary()

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def hold(self, model: nn.Module) -> None:
        """Keep the hooks installed at least as long as `model` lives."""
        if self._alive == 0:
            self._handles = [
                register_optimizer_step_pre_hook(self._before_step),
                register_optimizer_step_post_hook(self._after_step),
                register_module_parameter_registration_hook(self._parameter_registration),
                register_module_module_registration_hook(self._module_registration),
            ]
        self._alive += 1
        weakref.finalize(model, self._release)

    def patch(self, install: Callable[[], None], remove: Callable[[], None]) -> bool:
        """`install()` now and `remove()` when the last sharded model is collected, if one lives;
        else nothing (False): nothing would remove it."""
        if self._alive == 0:
            return False
        install()
        self._undo[remove] = None
        return True

    def _release(self) -> None:
        self._alive -= 1
        if self._alive == 0:
            for handle in self._handles:
                handle.remove()
            for remove in self._undo:
                remove()
            self._handles, self._undo = [], {}
            self._sorted = weakref.WeakKeyDictionary()
            self.trimmers = weakref.WeakKeyDictionary()

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        layout = tuple(len(group["params"]) for group in optimizer.param_groups)
        known = self._sorted.get(optimizer)
        if known is None or known.layout != layout:
            known = self._sorted[optimizer] = self._sort(optimizer, layout)
        if not known.sharded:
            return None
        arguments = self._around.before(optimizer, args, kwargs)
        try:
            for check in self._optimizer_checks:
                check(optimizer)
        except BaseException:
            self._around.after(optimizer)
            raise
        return arguments

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        known = self._sorted.get(optimizer)
        if known is not None and known.sharded:
            self._around.after(optimizer)

    def _sort(self, optimizer: torch.optim.Optimizer, layout: tuple[int, ...]) -> _Sorted:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sharded = [p for p in params if self._holds_sharded(p)]
        if sharded:
            self._around.adopt(optimizer)
        trim = glibc_malloc_trim()
        if trim is not None and optimizer not in self.trimmers and any(self._trims(p) for p in sharded):
            trimmer = self.trimmers[optimizer] = StepTrimmer(trim)
            # A ctypes call Dynamo cannot trace, should the user compile `optimizer.step`.
            self._handles.append(optimizer.register_step_post_hook(torch._dynamo.disable(trimmer)))
        return _Sorted(layout, bool(sharded))
