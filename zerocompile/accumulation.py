"""Gradient accumulation: reduce every micro-step (the default) or `with no_sync(model):`.

Reducing every micro-step needs nothing special: each backward reduces its gradient into the
shards' `.grad`, where autograd sums the micro-steps (1/N of the gradient held at stages 1-3).

`no_sync` trades memory for traffic, as DDP's and FSDP's do. On entry each rank gathers a full
local copy of every parameter once (stage 0: the parameter itself, no copy) and the module
properties hand out those copies through `unshard(..., local=True)` markers: the micro-steps inside
send nothing, and each full gradient accumulates unreduced in its copy's `.grad`. On exit the
copies' gradients become *pending*; either `reduce_gradients(model)` reduces them at once, one
collective per bucket (the same `lowering` functions and arguments the compiled backward uses),
or the next forward with gradients on hands each pending gradient to its parameter's marker
(`pending=`), and that backward reduces its own gradient plus the pending one in a single
collective, overlapped with the backward as every reduction is. The copies themselves are *kept*
for that forward, whose markers take them as `full=` along with the pending gradients: it reads
them instead of gathering and its backward only reduces, and they die with it. Copies nothing
took are dropped when the parameters change (an optimizer step, a load, `.to()`) or by
`reduce_gradients`, after which nothing needs them. `no_sync(model, replicas_only=True)` (hybrid
sharding) keeps no copies: its markers leave out the replica keywords, so the backwards reduce
inside the shard group only, and `reduce_gradients` averages the accumulated shards across the
replicas.

What a property hands out depends on the parameter's `AccumulationSlot`, which holds its local copy,
kept copy and pending gradient as tensors: Dynamo guards only on whether each is set, and compiles
one graph per mode (synced, inside `no_sync`, synced on the kept copies with pending gradients),
each once. While no slot of a model holds any (`GradientSync.quiet`, the usual case), the
properties skip their slots: Dynamo then traces and guards one flag per module instead of the slot
attributes of every parameter (a
48-layer GPT's 580 parameters, Dynamo's tracing: 8.1-8.7 s -> 6.7-8.0 s). Nothing per-instance
(no FQN) is read while tracing, so same-shaped modules (the blocks of a graph-broken or regionally
compiled model) share one compiled graph instead of each compiling its own.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from zerocompile.dtensor_parameters import link_of
from zerocompile.passes.lowering import all_reduce_bucket, gather_bucket, reduce_scatter_bucket, replica_mean
from zerocompile.passes.marker_args import ReduceGradArgs, reduction_of
from zerocompile.passes.markers import UNSHARD
from zerocompile.passes.stages import stage_policy
from zerocompile.sharded_modules import module_state


class AccumulationSlot:
    """One parameter's `no_sync` state, shared by every module holding it (tied parameters).

    local: inside `no_sync`, its full local copy (a leaf; it requires grad if the parameter does).
    pending: its gradient accumulated inside `no_sync`, waiting for the next synced backward.
    kept: after `no_sync`, the block's copy (detached), which the next forward with gradients on
        reads in place of gathering the parameter (dropped unread before an optimizer step).
    """

    def __init__(self) -> None:
        self.local: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None

    def marker(self, shard: nn.Parameter, markers: tuple, keywords: dict[str, Any]) -> torch.Tensor:
        """The marker a module property returns for `shard`; `markers` are the marker's arguments
        after the shard, in `UnshardArgs` order (the backend fills in the FQN), `keywords` its
        optional ones (quantisation, replica group)."""
        if self.local is not None:
            return UNSHARD(self.local, *markers, local=True, **keywords)
        if (self.pending is not None or self.kept is not None) and torch.is_grad_enabled():
            # Taken, so exactly one backward (the next with gradients on) adds the pending
            # gradient, and the copy dies with that backward rather than living through the
            # optimizer step (measured: +338 MiB of peak RSS on a 40M Llama under tcmalloc). A
            # second use in that forward (a tied weight) gathers as usual.
            per_call = {"pending": self.pending, "full": self.kept}
            self.pending = self.kept = None
            return UNSHARD(shard, *markers, **{k: v for k, v in per_call.items() if v is not None}, **keywords)
        return UNSHARD(shard, *markers, **keywords)


class GradientSync:
    """Per `shard()` call: every distinct sharded Parameter by its FQN (tied ones once) and its slot."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.params = params
        self.slots = {fqn: AccumulationSlot() for fqn in params}
        # `not self.waiting()`, kept as one attribute Dynamo guards: cleared on entering no_sync,
        # renewed on leaving it and before each optimizer step (a forward takes pending gradients).
        self.quiet = True
        # Inside `no_sync(model, replicas_only=True)`: markers reduce inside the shard group only.
        self.replicas_deferred = False
        # FQNs whose gradients hold micro-steps not averaged across replicas yet.
        self.replica_pending: set[str] = set()
        _ALL.add(self)

    def holds_copies(self) -> bool:
        return any(slot.local is not None for slot in self.slots.values())

    def _settle(self) -> None:
        """Renew `quiet`: whether no slot holds a copy, a kept copy or a pending gradient."""
        self.quiet = not self.waiting() and all(slot.kept is None for slot in self.slots.values())

    def drop_kept_copies(self) -> None:
        """Forget the copies kept after a no_sync block: the parameters are about to change (an
        optimizer step, a load), or nothing will read them (the gradients were reduced)."""
        for slot in self.slots.values():
            slot.kept = None
        self._settle()

    def waiting(self) -> list[str]:
        """FQNs whose gradients no synced backward has reduced yet."""
        return [
            fqn
            for fqn, slot in self.slots.items()
            if slot.local is not None or slot.pending is not None or fqn in self.replica_pending
        ]

    def enter_replicas_deferred(self) -> None:
        """From now on until `exit_replicas_deferred`, backwards reduce inside the shard group only."""
        self.quiet = False
        self.replicas_deferred = True

    def exit_replicas_deferred(self) -> None:
        """Every trainable parameter with replicas now waits for its average across them."""
        self.replicas_deferred = False
        self.replica_pending.update(
            fqn for fqn, param in self.params.items() if param.requires_grad and param._zero.replicas > 1
        )
        self._settle()

    def enter_no_sync(self) -> None:
        """Gather a full local copy of each parameter (its accumulated gradient, if any, kept):
        exact, in the master dtype, one all-gather per edge bucket (`edge_bucket_bytes`); a
        copy kept since the last block is taken as it is (nothing stepped the parameters since)."""
        self.quiet = False
        with torch.no_grad():
            fulls = {fqn: param.detach() for fqn, param in self.params.items() if not param._zero.policy.shards_parameters}
            fulls.update((fqn, slot.kept) for fqn, slot in self.slots.items() if slot.kept is not None)
            sharded = [(fqn, param) for fqn, param in self.params.items() if fqn not in fulls]
            for bucket in _buckets(sharded, _gather_key, lambda item: item[1]._zero.numel * item[1].element_size()):
                infos = [param._zero for _, param in bucket]
                info = infos[0]
                gathered = gather_bucket(
                    [param.detach() for _, param in bucket], [list(i.shape) for i in infos], info.group_name,
                    info.world_size, info.reduce_scatter,
                )
                fulls.update((fqn, full) for (fqn, _), full in zip(bucket, gathered))
            for fqn, param in self.params.items():
                slot = self.slots[fqn]
                local = fulls[fqn].requires_grad_(param.requires_grad)  # stage 0: the parameter itself
                local._zero_copy_of = fqn  # how the backend names the marker that uses it
                local.grad, slot.pending = slot.pending, None
                slot.local, slot.kept = local, None

    def reduce_pending(self) -> None:
        """Reduce every pending gradient into its parameter's (sharded) gradient, now: one
        collective per edge bucket of gradients (`edge_bucket_bytes`), as the graphs' reductions do (the
        mean over the group, in `reduce_dtype`, quantised and across replicas as configured)."""
        waiting = [
            (slot, self.params[fqn], _reduction(fqn, self.params[fqn], slot.pending))
            for fqn, slot in self.slots.items()
            if slot.pending is not None
        ]
        for bucket in _buckets(waiting, _reduce_key, lambda item: item[2].grad.numel() * item[2].grad.element_size()):
            first = bucket[0][2]
            grads = [args.grad for _, _, args in bucket]
            with torch.no_grad():
                if stage_policy(first.stage).reduction == "all_reduce":
                    reduced = all_reduce_bucket(grads, first)
                else:
                    reduced = reduce_scatter_bucket(grads, [args.shard_numel for _, _, args in bucket], first)
            for (slot, param, _), grad in zip(bucket, reduced):
                slot.pending = None
                link = link_of(param)
                if link is not None:
                    link.add_gradient(grad)
                elif param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
        self._average_across_replicas()
        self.drop_kept_copies()

    def _average_across_replicas(self) -> None:
        """The replica-pending gradients averaged across their replicas in place, one collective
        per bucket, as the graphs' reductions end (`lowering.replica_mean`: int8 where the config
        quantises what crosses nodes). A synced micro-step's part, equal on every replica
        already, keeps its value."""
        waiting = []
        for fqn, param in self.params.items():
            if fqn in self.replica_pending:
                link = link_of(param)
                grad = param.grad if link is None else link.padded_grad()
                if grad is not None:
                    waiting.append((param, _reduction(fqn, param, grad)))
        self.replica_pending.clear()
        for bucket in _buckets(waiting, _replica_key, lambda item: item[1].grad.numel() * item[1].grad.element_size()):
            grads = [args.grad for _, args in bucket]
            with torch.no_grad():
                flat = torch.cat([grad.reshape(-1) for grad in grads]) if len(grads) > 1 else grads[0].reshape(-1)
                averaged = replica_mean(flat, bucket[0][1])
                for grad, part in zip(grads, averaged.split([grad.numel() for grad in grads])):
                    grad.copy_(part.view_as(grad))

    def exit_no_sync(self) -> None:
        """End the block: the copies' gradients become pending, and each sharded parameter's copy
        is kept (detached) for the next forward with gradients on, which reads it instead of
        gathering the parameter, so its backward only reduces (its gradient with the pending one,
        one collective, overlapped with that backward)."""
        for fqn, slot in self.slots.items():
            if slot.local is None:
                continue
            if slot.local.grad is not None:
                slot.pending = slot.local.grad
            if self.params[fqn]._zero.policy.shards_parameters:
                slot.kept = slot.local.detach()
            slot.local = None
        self._settle()


def _reduction(fqn: str, param: nn.Parameter, grad: torch.Tensor) -> ReduceGradArgs:
    """The `reduce_grad` arguments of `grad` for the sharded parameter `param`: what its markers'
    backward would reduce it with."""
    info = param._zero
    return reduction_of(info.marker_args(param.dtype)._replace(param=fqn), grad, info.shard_numel, param.dtype)


def replicated(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of these sharded parameters has replicas (hybrid sharding)."""
    return any(param._zero.replicas > 1 for param in params if getattr(param, "_zero", None) is not None)


# The smallest bucket of the collectives at a block's edges (the copies' gather on entry, the
# reductions after it). The graphs' `bucket_bytes` is small so that each bucket's collective
# overlaps the compute beside it; at the edges nothing runs beside them, and each collective's
# fixed cost is all there is to save, for transient buffers of up to twice this many bytes while
# one runs (a reduction's packed gradients and what it receives).
# Measured on 2 gloo CPU ranks, a 40M Llama (152 MiB of fp32 parameters): entry 120-127 ms in
# 4 MiB buckets, 91-106 in 16, 90-92 in 64, 85-110 in one; reduce_gradients 135 / 119 / 115 / 119.
EDGE_BUCKET_BYTES = 64 << 20


def edge_bucket_bytes(param: nn.Parameter) -> int:
    """The bucket size of `param`'s collectives at a block's edges: its `bucket_bytes`, raised to
    `EDGE_BUCKET_BYTES` (0, one collective per parameter, stays 0)."""
    bucket_bytes = param._zero.config.bucket_bytes
    return max(bucket_bytes, EDGE_BUCKET_BYTES) if bucket_bytes else 0


def _gather_key(item: tuple[str, nn.Parameter]) -> tuple:
    """What the parameters one all-gather takes share."""
    param = item[1]
    info = param._zero
    return info.group_name, info.world_size, info.reduce_scatter, param.dtype, param.device, edge_bucket_bytes(param)


def _reduce_key(item: tuple) -> tuple:
    """What the gradients one reduction takes share: their `reduce_grad` arguments but their own."""
    args = item[2]
    return args._replace(grad=None, shard_numel=0, param=""), args.grad.dtype, args.grad.device, edge_bucket_bytes(item[1])


def _replica_key(item: tuple) -> tuple:
    """What the gradients one average across replicas takes share."""
    param, args = item
    return args.replica_group, args.replicas, args.replica_quant_block, args.grad.dtype, args.grad.device, edge_bucket_bytes(param)


def _buckets(items: list, key: Callable[[Any], tuple], nbytes: Callable[[Any], int]) -> Iterator[list]:
    """`items` in runs of equal `key` (its last element the bucket size in bytes), each cut where
    another item would take it past that size (0: one item per bucket). The order is kept."""
    bucket: list = []
    bucket_key, size = None, 0
    for item in items:
        item_key, item_bytes = key(item), nbytes(item)
        if bucket and (item_key != bucket_key or size + item_bytes > item_key[-1]):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        bucket_key = item_key
        size += item_bytes
    if bucket:
        yield bucket


# Every model's GradientSync, for the optimizer step check; weak, so models can be freed.
_ALL: weakref.WeakSet[GradientSync] = weakref.WeakSet()


def check_nothing_pending(optimizer: torch.optim.Optimizer) -> None:
    """Before a step: gradients not reduced yet would be silently left out of it, and inside
    no_sync the micro-steps use copies of the parameters gathered on entry, which a step would
    leave stale."""
    busy = []
    for sync in _ALL:
        fqns = sync.waiting()
        if not sync.quiet:
            sync.drop_kept_copies()  # the step changes the parameters they copy
        if fqns:
            busy.append((sync, fqns))
    if not busy:  # the usual case: a step costs no more than this
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for sync, fqns in busy:
        waiting = [fqn for fqn in fqns if id(sync.params[fqn]) in stepped]
        if waiting:
            raise RuntimeError(
                f"parameters {waiting[:3]} have gradients accumulated under zerocompile.no_sync(model) "
                "that no synced backward has reduced yet: run the last micro-step's forward and "
                "backward outside the no_sync block, or call zerocompile.reduce_gradients(model) "
                "after the block, then step the optimizer"
            )


@contextlib.contextmanager
def no_sync(model: nn.Module, replicas_only: bool = False) -> Iterator[None]:
    """Accumulate gradients locally in the backwards inside; they are reduced once afterwards.

    Memory while inside: a full copy of every parameter (none at stage 0) and a full gradient of
    every trainable parameter on each rank, i.e. stage 0's footprint. Traffic: at stages 1-3 one
    all-gather of the parameters on entry, nothing in the micro-steps. Then either run the last
    micro-step after the block (its forward reads the copies the block kept and its backward
    reduces its own gradients with the accumulated ones, one reduction pass overlapped with that
    backward) or run every micro-step inside and call `reduce_gradients(model)` after the block
    (the same pass, blocking). Either way the block's gather plus that pass is what DDP's
    all-reduce sends. The copies stay until that micro-step's backward (or the optimizer step,
    a load, `.to()`, `reduce_gradients`): stage 0's footprint lasts through it. Nested
    blocks act as one. Covers every sharded module in `model` (parts sharded by separate `shard()`
    calls included).

    `replicas_only=True` (hybrid sharding, `shard_size=`): defer only the average across
    replicas, the traffic between nodes. The backwards inside still reduce-scatter each gradient
    inside its shard group, so memory stays sharded; `reduce_gradients(model)` after the block
    averages the accumulated shards across the replicas once (FSDP2's HSDP with
    `set_requires_all_reduce(False)`).
    """
    syncs = _syncs_of(model, "no_sync")
    if replicas_only:
        yield from _replicas_deferred(syncs)
        return
    if any(sync.replicas_deferred for sync in syncs):
        raise RuntimeError(
            "zerocompile.no_sync(model) inside a no_sync(model, replicas_only=True) block: the "
            "gradients there are already reduced inside their shard groups; use one kind of block"
        )
    entered = []
    try:
        for sync in syncs:
            if not sync.holds_copies():  # else an enclosing no_sync block holds them
                entered.append(sync)
                sync.enter_no_sync()
        yield
    finally:
        for sync in entered:
            sync.exit_no_sync()


def _replicas_deferred(syncs: list[GradientSync]) -> Iterator[None]:
    """`no_sync(model, replicas_only=True)`'s body: refusals first, then the block."""
    if not any(replicated(sync.params.values()) for sync in syncs):
        raise ValueError(
            "zerocompile.no_sync(model, replicas_only=True) defers the average across replicas of hybrid "
            "sharding, and this model has none: shard it with shard_size= (ranks per shard group), "
            "or use no_sync(model) to defer every reduction"
        )
    local = [fqn for sync in syncs for fqn, slot in sync.slots.items() if slot.local is not None or slot.pending is not None]
    if local:
        raise RuntimeError(
            f"zerocompile.no_sync(model, replicas_only=True) while parameters {local[:3]} hold gradients "
            "of a no_sync(model) block not reduced yet: call zerocompile.reduce_gradients(model) "
            "after that block first, or use one kind of block"
        )
    entered = [sync for sync in syncs if not sync.replicas_deferred]
    try:
        for sync in entered:
            sync.enter_replicas_deferred()
        yield
    finally:
        for sync in entered:
            sync.exit_replicas_deferred()


def reduce_gradients(model: nn.Module) -> None:
    """Reduce now the gradients `no_sync` blocks accumulated in `model`: after the last
    micro-step's backward, in place of running that micro-step after the block (which overlaps
    this reduction with its backward), and drop the copies the blocks kept. One collective per
    bucket of gradients (`edge_bucket_bytes`: nothing overlaps it), as the compiled backward's
    reductions (the mean over the group, in `reduce_dtype`, quantised and averaged across
    replicas as configured), into
    each parameter's gradient (its shard at stages 1-3), added to what it holds; after a
    `replicas_only` block, each gradient averaged across replicas in place. Blocking, not
    overlapped with a backward; every rank must call it."""
    syncs = _syncs_of(model, "reduce_gradients")
    inside = [fqn for sync in syncs for fqn, slot in sync.slots.items() if slot.local is not None]
    inside += [fqn for sync in syncs if sync.replicas_deferred for fqn in sync.params]
    if inside:
        raise RuntimeError(
            f"zerocompile.reduce_gradients(model) was called inside a no_sync block (of parameters "
            f"{inside[:3]}, ...): call it after the block ends"
        )
    for sync in syncs:
        sync.reduce_pending()


def drop_kept_copies(model: nn.Module) -> None:
    """Forget the copies of parameters that `no_sync` blocks kept in `model` (sharded or not):
    its parameters are being changed otherwise than by an optimizer step (a load)."""
    for sync in _syncs_in(model):
        sync.drop_kept_copies()


def _syncs_in(model: nn.Module) -> list[GradientSync]:
    """The GradientSync of every `shard()` call whose modules `model` holds."""
    root = getattr(model, "_orig_mod", model)  # the torch.compile wrapper's model
    states = [state for m in root.modules() if (state := module_state(m)) is not None]
    return list({id(state.sync): state.sync for state in states}.values())


def _syncs_of(model: nn.Module, caller: str) -> list[GradientSync]:
    """`_syncs_in`, refusing a model without any."""
    syncs = _syncs_in(model)
    if not syncs:
        raise TypeError(
            f"zerocompile.{caller}() takes a model zerocompile.shard() sharded (or its torch.compile "
            f"wrapper), got an unsharded {type(getattr(model, '_orig_mod', model)).__name__}: call "
            "zerocompile.shard(model, stage=...) first"
        )
    return syncs
