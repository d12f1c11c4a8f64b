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
reduces it together with its own gradient in one collective.

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

import dataclasses
from typing import Any, NamedTuple

import torch

from .lowering import all_reduce_bucket, gather_bucket, reduce_scatter_bucket
from .stages import stage_policy

# Marker arguments after the tensor: what the passes need to lower it, nothing else, so graphs are
# rewritten without asking a process group: the group's name and size, and how it reduce-scatters.
# `param` is the parameter's FQN (for people and tools reading graphs); the dtypes are mixed
# precision's: gather (and compute) in `compute_dtype`, reduce gradients in `reduce_dtype`; None
# means the shard's.


@torch.library.custom_op("zerocompile::unshard", mutates_args=())
def unshard(
    shard: torch.Tensor,
    shape: list[int],
    stage: int,
    group_name: str,
    world_size: int,
    reduce_scatter: str,
    param: str = "",
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    local: bool = False,
    pending: torch.Tensor | None = None,
    gather_quant_block: int = 0,
    reduce_quant_block: int = 0,
    replica_group: str = "",
    replicas: int = 1,
    replica_quant_block: int = 0,
    secondary_group: str = "",
    secondary_size: int = 1,
    secondary_quant_block: int = 0,
) -> torch.Tensor:
    if local or not stage_policy(stage).shards_parameters:
        return shard.to(compute_dtype or shard.dtype, copy=True)
    return gather_bucket([shard], [shape], group_name, world_size, reduce_scatter, compute_dtype, gather_quant_block)[0]


@unshard.register_fake
def _unshard_fake(
    shard: torch.Tensor,
    shape: list[int],
    stage: int,
    group_name: str,
    world_size: int,
    reduce_scatter: str,
    param: str = "",
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    local: bool = False,
    pending: torch.Tensor | None = None,
    gather_quant_block: int = 0,
    reduce_quant_block: int = 0,
    replica_group: str = "",
    replicas: int = 1,
    replica_quant_block: int = 0,
    secondary_group: str = "",
    secondary_size: int = 1,
    secondary_quant_block: int = 0,
) -> torch.Tensor:
    dtype = compute_dtype or shard.dtype
    if local or not stage_policy(stage).shards_parameters:
        return torch.empty_like(shard, dtype=dtype)
    return shard.new_empty(shape, dtype=dtype)


@torch.library.custom_op("zerocompile::reduce_grad", mutates_args=())
def reduce_grad(
    grad: torch.Tensor,
    shard_numel: int,
    stage: int,
    group_name: str,
    world_size: int,
    reduce_scatter: str,
    param: str = "",
    reduce_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype | None = None,
    quant_block: int = 0,
    replica_group: str = "",
    replicas: int = 1,
    replica_quant_block: int = 0,
) -> torch.Tensor:
    if stage_policy(stage).reduction == "all_reduce":
        return all_reduce_bucket(
            [grad.contiguous()], group_name, world_size, reduce_dtype, grad_dtype, quant_block, replica_group, replicas,
            replica_quant_block,
        )[0]
    return reduce_scatter_bucket(
        [grad.contiguous()], [shard_numel], group_name, world_size, reduce_scatter, reduce_dtype, grad_dtype,
        quant_block, replica_group, replicas, replica_quant_block,
    )[0]


@reduce_grad.register_fake
def _reduce_grad_fake(
    grad: torch.Tensor,
    shard_numel: int,
    stage: int,
    group_name: str,
    world_size: int,
    reduce_scatter: str,
    param: str = "",
    reduce_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype | None = None,
    quant_block: int = 0,
    replica_group: str = "",
    replicas: int = 1,
    replica_quant_block: int = 0,
) -> torch.Tensor:
    dtype = grad_dtype or grad.dtype
    if stage_policy(stage).reduction == "all_reduce":
        return torch.empty_like(grad, dtype=dtype, memory_format=torch.contiguous_format)
    return grad.new_empty(shard_numel, dtype=dtype)


def _unshard_setup_context(ctx, inputs, output) -> None:
    marker = UnshardArgs(*inputs)
    ctx.shard_numel = marker.shard.numel()
    ctx.shard_dtype = marker.shard.dtype
    ctx.marker = marker._replace(pending=None)
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
    reduced = reduce_grad(
        grad, ctx.shard_numel, m.stage, m.group_name, m.world_size, m.reduce_scatter, m.param, m.reduce_dtype,
        ctx.shard_dtype, m.reduce_quant_block, m.replica_group, m.replicas, m.replica_quant_block,
    )
    return reduced, *not_differentiable


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)

UNSHARD = torch.ops.zerocompile.unshard.default
REDUCE_GRAD = torch.ops.zerocompile.reduce_grad.default


class UnshardArgs(NamedTuple):
    """Arguments of `zerocompile::unshard`; `param` is the parameter's FQN, for people reading graphs."""

    shard: torch.fx.Node
    shape: list[int]
    stage: int
    group_name: str
    world_size: int
    reduce_scatter: str  # how the group reduce-scatters (a `lowering` *_REDUCE_SCATTER)
    param: str = ""
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    local: bool = False  # the input is a full local copy (no_sync): no gather, no reduction
    pending: torch.fx.Node | None = None  # a gradient accumulated without sync, reduced with this one
    gather_quant_block: int = 0  # > 0: gathered int8-quantised in blocks of this many elements
    reduce_quant_block: int = 0  # > 0: its gradient reduced int8-quantised (`ReduceGradArgs.quant_block`)
    replica_group: str = ""  # hybrid sharding: its reduced gradient is then averaged over this group
    replicas: int = 1  # ... of this many ranks (1: no replicas, plain sharding)
    replica_quant_block: int = 0  # > 0: that average int8-quantised (`ReduceGradArgs.replica_quant_block`)
    secondary_group: str = ""  # hpZ: the stage-3 backward re-gathers over this group (`secondary_shards`)
    secondary_size: int = 1  # ... of this many ranks (1: no secondary shards)
    secondary_quant_block: int = 0  # > 0: that re-gather int8-quantised


# What every marker passes positionally, through `reduce_dtype`; the arguments after it are keywords
# passed only when not their default, so the graphs of a model without those features read as before.
_POSITIONAL = UnshardArgs._fields[1 : UnshardArgs._fields.index("reduce_dtype") + 1]


@dataclasses.dataclass(frozen=True)
class MarkerArgs:
    """A parameter's `zerocompile::unshard` arguments but its tensors (`shard`, `pending`) and
    no_sync's `local`: what `shard()` decides for a parameter (`ShardInfo.marker_args`) and hands to
    every marker its modules emit. Names, order and defaults are `UnshardArgs'`, the op's own
    (`tests/test_passes.py` holds them to its schema)."""

    shape: tuple[int, ...]
    stage: int
    group_name: str
    world_size: int
    reduce_scatter: str
    param: str = ""
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    gather_quant_block: int = 0
    reduce_quant_block: int = 0
    replica_group: str = ""
    replicas: int = 1
    replica_quant_block: int = 0
    secondary_group: str = ""
    secondary_size: int = 1
    secondary_quant_block: int = 0

    def call(self) -> tuple[tuple, dict[str, Any]]:
        """`(args, keywords)` of `unshard(shard, *args, **keywords)`: positional through
        `reduce_dtype`, then the keywords that are not their default."""
        args = tuple(list(self.shape) if name == "shape" else getattr(self, name) for name in _POSITIONAL)
        keywords = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in _POSITIONAL and getattr(self, field.name) != field.default
        }
        return args, keywords

    def unshard(self, shard: torch.Tensor) -> torch.Tensor:
        """The marker on `shard` (eager: its kernel, the blocking collective)."""
        args, keywords = self.call()
        return UNSHARD(shard, *args, **keywords)


class ReduceGradArgs(NamedTuple):
    """Arguments of `zerocompile::reduce_grad`."""

    grad: torch.fx.Node
    shard_numel: int
    stage: int
    group_name: str
    world_size: int
    reduce_scatter: str
    param: str = ""
    reduce_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None
    quant_block: int = 0  # > 0: reduced int8-quantised in blocks of this many elements (`lowering`)
    replica_group: str = ""  # hybrid sharding: then averaged over this group (`UnshardArgs`)
    replicas: int = 1
    replica_quant_block: int = 0  # > 0: that average int8-quantised too (what crosses nodes)


def unshard_args(node: torch.fx.Node) -> UnshardArgs:
    return UnshardArgs(*node.args, **node.kwargs)


def reduce_grad_args(node: torch.fx.Node) -> ReduceGradArgs:
    return ReduceGradArgs(*node.args, **node.kwargs)


def is_unshard(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is UNSHARD


def is_reduce_grad(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is REDUCE_GRAD
