"""Marker ops: `zerocompile::unshard` (shard -> full parameter) and its backward `zerocompile::reduce_grad`.

They are opaque to Dynamo and AOTAutograd, so a traced graph shows exactly where each parameter is
used and where each gradient is produced; the graph passes then replace them with collectives
placed according to the stage. Their eager kernels run the same collectives blocking
(`zerocompile.passes.lowering`), so uncompiled code and graph-broken fragments stay correct.

Stage 0 uses the same markers with the parameter left whole: `unshard` is the identity (a copy in
eager mode, removed in graphs) and `reduce_grad` an all-reduce (`stages.py` says which stage does
what).

Gradient accumulation without sync (`zerocompile.no_sync`) adds two optional arguments, so those
graphs say what they do too: `local=True` marks an input that already is a full local copy of the
parameter (an identity, like stage 0, whose gradient is *not* reduced: it accumulates in the copy's
`.grad`), and `pending=` carries such an accumulated gradient into the next synced backward, which
reduces it together with its own gradient in one collective. That backward's marker may also take
`full=`, the block's copy of the parameter, kept after the block: its forward reads the copy instead
of gathering (nor does its backward re-gather), while its gradient is still reduced into the shard's.

Quantised collectives (`ZeroConfig.gather_quant` / `reduce_quant`) are two more optional
arguments, the block sizes (0: exact): the eager kernels quantise too, so compiled and uncompiled
code compute the same values. Hybrid sharding (`ZeroConfig.shard_size`) adds the replica group
and its size: `group_name` is then the shard group, and a reduced gradient is averaged across the
replica group too. hpZ (`ZeroConfig.secondary_shard_size`) adds the secondary group, which only
the joint-graph pass `secondary_shards` reads. The average across replicas and hpZ's re-gather
have block sizes of their own (`ZeroConfig.quant_scope`: quantise only what crosses nodes). Optional arguments are passed only when not their
default, so graphs without these features read as before.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from .lowering import all_reduce_bucket, gather_bucket, reduce_scatter_bucket
from .marker_args import ReduceGradArgs, UnshardArgs, op_schema, reduction_of
from .stages import stage_policy

# Each kernel takes its arguments as the dispatcher passes them (trailing defaults left out) and
# reads them through its op's record, which fills the defaults back in.


@torch.library.custom_op("zerocompile::unshard", mutates_args=(), schema=op_schema(UnshardArgs))
def unshard(*args: Any, **kwargs: Any) -> torch.Tensor:
    m = UnshardArgs(*args, **kwargs)
    if m.whole is not None:
        return m.whole.to(m.compute_dtype or m.whole.dtype, copy=True)
    return gather_bucket(
        [m.shard], [m.shape], m.group_name, m.world_size, m.reduce_scatter, m.compute_dtype, m.gather_quant_block
    )[0]


@unshard.register_fake
def _unshard_fake(*args: Any, **kwargs: Any) -> torch.Tensor:
    m = UnshardArgs(*args, **kwargs)
    if m.whole is not None:
        return torch.empty_like(m.whole, dtype=m.compute_dtype or m.whole.dtype)
    return m.shard.new_empty(m.shape, dtype=m.compute_dtype or m.shard.dtype)


@torch.library.custom_op("zerocompile::reduce_grad", mutates_args=(), schema=op_schema(ReduceGradArgs))
def reduce_grad(*args: Any, **kwargs: Any) -> torch.Tensor:
    m = ReduceGradArgs(*args, **kwargs)
    if stage_policy(m.stage).reduction == "all_reduce":
        return all_reduce_bucket([m.grad.contiguous()], m)[0]
    return reduce_scatter_bucket([m.grad.contiguous()], [m.shard_numel], m)[0]


@reduce_grad.register_fake
def _reduce_grad_fake(*args: Any, **kwargs: Any) -> torch.Tensor:
    m = ReduceGradArgs(*args, **kwargs)
    dtype = m.grad_dtype or m.grad.dtype
    if stage_policy(m.stage).reduction == "all_reduce":
        return torch.empty_like(m.grad, dtype=dtype, memory_format=torch.contiguous_format)
    return m.grad.new_empty(m.shard_numel, dtype=dtype)


def _unshard_setup_context(ctx, inputs, output) -> None:
    marker = UnshardArgs(*inputs)
    ctx.shard_numel = marker.shard.numel()
    ctx.shard_dtype = marker.shard.dtype
    ctx.marker = marker._replace(pending=None, full=None)
    ctx.save_for_backward(marker.pending)


def _unshard_backward(ctx, grad: torch.Tensor):
    """The gradient reduced in reduce_dtype, landing in the shard's (master) dtype.

    A local copy's gradient is not reduced: it lands whole in the copy's `.grad`, where autograd
    accumulates it. A pending gradient is added (in the master dtype) before the one reduction.
    """
    m = ctx.marker
    (pending,) = ctx.saved_tensors
    not_differentiable = (None,) * (len(UnshardArgs._fields) - 1)
    if m.local:
        return grad.to(ctx.shard_dtype), *not_differentiable
    if pending is not None:
        grad = (pending + grad).to(m.reduce_dtype or grad.dtype)
    reduced = reduce_grad(*reduction_of(m, grad, ctx.shard_numel, ctx.shard_dtype))
    return reduced, *not_differentiable


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)

UNSHARD = torch.ops.zerocompile.unshard.default
REDUCE_GRAD = torch.ops.zerocompile.reduce_grad.default


# What every marker passes positionally, through `reduce_dtype`; the arguments after it are keywords
# passed only when not their default, so the graphs of a model without those features read as before.
_POSITIONAL = UnshardArgs._fields[1 : UnshardArgs._fields.index("reduce_dtype") + 1]
# A marker's own arguments rather than its parameter's: its tensors and no_sync's flag.
_PER_CALL = ("shard", "local", "pending", "full")
_PARAMETER_ARGS = tuple(name for name in UnshardArgs._fields if name not in _PER_CALL)
# The arguments that average a reduced gradient across hybrid sharding's replicas: a marker
# without them reduces inside its shard group only (`zerocompile.no_sync(replicas_only=True)`).
REPLICA_KEYWORDS = ("replica_group", "replicas", "replica_quant_block")


class MarkerArgs(
    collections.namedtuple(
        "MarkerArgs",
        _PARAMETER_ARGS,
        defaults=[UnshardArgs._field_defaults[name] for name in _PARAMETER_ARGS if name in UnshardArgs._field_defaults],
    )
):
    """A parameter's `zerocompile::unshard` arguments but the per-call ones (its tensors and
    no_sync's `local`), by `UnshardArgs`' names, order and defaults: what `shard()` decides for a
    parameter (`ShardInfo.marker_args`) and hands to every marker its modules emit."""

    __slots__ = ()

    def call(self) -> tuple[tuple, dict[str, Any]]:
        """`(args, keywords)` of `unshard(shard, *args, **keywords)`: positional through
        `reduce_dtype`, then the keywords that are not their default."""
        values = self._asdict()
        args = tuple(list(self.shape) if name == "shape" else values[name] for name in _POSITIONAL)
        keywords = {
            name: value
            for name, value in values.items()
            if name not in _POSITIONAL and value != self._field_defaults[name]
        }
        return args, keywords

    def unshard(self, shard: torch.Tensor) -> torch.Tensor:
        """The marker on `shard` (eager: its kernel, the blocking collective)."""
        args, keywords = self.call()
        return UNSHARD(shard, *args, **keywords)


def unshard_args(node: torch.fx.Node) -> UnshardArgs:
    return UnshardArgs(*node.args, **node.kwargs)


def reduce_grad_args(node: torch.fx.Node) -> ReduceGradArgs:
    return ReduceGradArgs(*node.args, **node.kwargs)


def is_unshard(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is UNSHARD


def is_reduce_grad(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is REDUCE_GRAD
