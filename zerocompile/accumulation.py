"""Gradient accumulation: reduce every micro-step (the default) or `with no_sync(model):`.

Reducing every micro-step needs nothing special: each backward reduces its gradient into the
shards' `.grad`, where autograd sums the micro-steps (1/N of the gradient held at stages 1-3).

`no_sync` trades memory for traffic, as DDP's and FSDP's do. On entry each rank gathers a full
local copy of every parameter once (stage 0: the parameter itself, no copy) and the module
properties hand out those copies through `unshard(..., local=True)` markers: the micro-steps inside
send nothing, and each full gradient accumulates unreduced in its copy's `.grad`. On exit the
copies are dropped and their gradients become *pending*; the next forward with gradients on hands
each pending gradient to its parameter's marker (`pending=`), and that backward reduces its own
gradient plus the pending one in a single collective.

The markers' arguments come from this object, so Dynamo guards on its dicts and compiles one graph
per mode (synced, inside `no_sync`, synced with pending gradients), each once.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zerocompile.passes.markers import UNSHARD


class GradientSync:
    """Per `shard()` call: what its modules' properties return, by accumulation mode.

    params: every distinct sharded Parameter by its FQN (tied ones once).
    local: inside `no_sync`, each parameter's full local copy (a leaf; trainable ones require grad).
    pending: gradients accumulated inside `no_sync`, waiting for the next synced backward.
    """

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.params = params
        self.local: dict[str, torch.Tensor] = {}
        self.pending: dict[str, torch.Tensor] = {}
        _ALL.add(self)
        _install_step_check()

    def full_parameter(self, shard: nn.Parameter, markers: tuple) -> torch.Tensor:
        """The marker a module property returns for `shard`; `markers` are the marker's arguments
        after the shard, in `UnshardArgs` order, so `markers[3]` is the parameter's FQN."""
        fqn = markers[3]
        if fqn in self.local:
            return UNSHARD(self.local[fqn], *markers, local=True)
        if fqn in self.pending and torch.is_grad_enabled():
            # Popped, so exactly one backward (the next with gradients on) adds it.
            return UNSHARD(shard, *markers, pending=self.pending.pop(fqn))
        return UNSHARD(shard, *markers)

    def enter_no_sync(self) -> None:
        """Gather a full local copy of each parameter (its accumulated gradient, if any, kept)."""
        with torch.no_grad():
            for fqn, param in self.params.items():
                info = param._zero
                if info.stage == 0:
                    full = param.detach()  # whole already: the "copy" aliases it
                else:  # the marker's eager kernel: a blocking all-gather of this parameter
                    full = UNSHARD(param.detach(), list(info.shape), info.stage, info.group_name)
                local = full.requires_grad_(param.requires_grad)
                if fqn in self.pending:
                    local.grad = self.pending.pop(fqn)
                self.local[fqn] = local

    def exit_no_sync(self) -> None:
        """Drop the local copies, keeping their gradients as pending."""
        for fqn, local in self.local.items():
            if local.grad is not None:
                self.pending[fqn] = local.grad
        self.local.clear()


# Every model's GradientSync, for the optimizer step check; weak, so models can be freed.
_ALL: weakref.WeakSet[GradientSync] = weakref.WeakSet()


def _check_nothing_pending(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before a step: gradients not reduced yet would be silently left out of it, and inside
    no_sync the micro-steps use copies of the parameters gathered on entry, which a step would
    leave stale."""
    busy = [sync for sync in _ALL if sync.pending or sync.local]
    if not busy:  # the usual case: a step costs no more than this
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for sync in busy:
        waiting = [fqn for fqn in [*sync.pending, *sync.local] if id(sync.params[fqn]) in stepped]
        if waiting:
            raise RuntimeError(
                f"parameters {waiting[:3]} have gradients accumulated under zerocompile.no_sync(model) "
                "that no synced backward has reduced yet: run the last micro-step's forward and "
                "backward outside the no_sync block, then step the optimizer"
            )


@functools.cache
def _install_step_check() -> None:
    register_optimizer_step_pre_hook(_check_nothing_pending)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally in the backwards inside; the next synced backward reduces once.

    Memory while inside: a full copy of every parameter (none at stage 0) and a full gradient of
    every trainable parameter on each rank, i.e. stage 0's footprint. Traffic: at stages 1-3 one
    all-gather of the parameters on entry, nothing in the micro-steps, and the next synced step
    sends what any step sends. Nested blocks act as one. Covers every sharded module in `model`
    (parts sharded by separate `shard()` calls included).
    """
    root = getattr(model, "_orig_mod", model)  # the torch.compile wrapper's model
    syncs = {id(m._zero_sync): m._zero_sync for m in root.modules() if hasattr(m, "_zero_sync")}
    if not syncs:
        raise TypeError(
            f"zerocompile.no_sync() takes a model zerocompile.shard() sharded (or its torch.compile "
            f"wrapper), got an unsharded {type(root).__name__}: call zerocompile.shard(model, "
            "stage=...) first"
        )
    entered = []
    try:
        for sync in syncs.values():
            if not sync.local:  # else an enclosing no_sync block already holds its copies
                entered.append(sync)
                sync.enter_no_sync()
        yield
    finally:
        for sync in entered:
            sync.exit_no_sync()
