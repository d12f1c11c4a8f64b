"""Marker ops: `zero::unshard` (shard -> full parameter) and its backward `zero::reduce_grad`.

They are opaque to Dynamo and AOTAutograd, so a traced graph shows exactly where each parameter is
used and where each gradient is produced; the graph passes then replace them with collectives
placed according to the stage. Their eager kernels run the same collectives blocking
(`zerocompile.passes.lowering`), so uncompiled code and graph-broken fragments stay correct.

Stage 0 uses the same markers with the parameter left whole: `unshard` is the identity (a copy in
eager mode, removed in graphs) and `reduce_grad` an all-reduce.
"""

from __future__ import annotations

import torch

from typing import NamedTuple

from .lowering import all_reduce_mean, gather_full, reduce_scatter_mean


@torch.library.custom_op("zero::unshard", mutates_args=())
def unshard(shard: torch.Tensor, shape: list[int], stage: int, group_name: str, param: str = "") -> torch.Tensor:
    if stage == 0:
        return shard.clone()
    return gather_full(shard, shape, group_name)


@unshard.register_fake
def _unshard_fake(shard: torch.Tensor, shape: list[int], stage: int, group_name: str, param: str = "") -> torch.Tensor:
    if stage == 0:
        return torch.empty_like(shard)
    return shard.new_empty(shape)


@torch.library.custom_op("zero::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, shard_numel: int, stage: int, group_name: str, param: str = "") -> torch.Tensor:
    if stage == 0:
        return all_reduce_mean(grad.contiguous(), group_name)
    return reduce_scatter_mean(grad.contiguous(), shard_numel, group_name)


@reduce_grad.register_fake
def _reduce_grad_fake(
    grad: torch.Tensor, shard_numel: int, stage: int, group_name: str, param: str = ""
) -> torch.Tensor:
    if stage == 0:
        return torch.empty_like(grad, memory_format=torch.contiguous_format)
    return grad.new_empty(shard_numel)


def _unshard_setup_context(ctx, inputs, output) -> None:
    marker = UnshardArgs(*inputs)
    ctx.shard_numel = marker.shard.numel()
    ctx.marker = marker


def _unshard_backward(ctx, grad: torch.Tensor):
    marker = ctx.marker
    return reduce_grad(grad, ctx.shard_numel, marker.stage, marker.group_name, marker.param), None, None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)

UNSHARD = torch.ops.zero.unshard.default
REDUCE_GRAD = torch.ops.zero.reduce_grad.default


class UnshardArgs(NamedTuple):
    """Arguments of `zero::unshard`; `param` is the parameter's FQN, for people reading graphs."""

    shard: torch.fx.Node
    shape: list[int]
    stage: int
    group_name: str
    param: str = ""


class ReduceGradArgs(NamedTuple):
    """Arguments of `zero::reduce_grad`."""

    grad: torch.fx.Node
    shard_numel: int
    stage: int
    group_name: str
    param: str = ""


def unshard_args(node: torch.fx.Node) -> UnshardArgs:
    return UnshardArgs(*node.args, **node.kwargs)


def reduce_grad_args(node: torch.fx.Node) -> ReduceGradArgs:
    return ReduceGradArgs(*node.args, **node.kwargs)


def is_unshard(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is UNSHARD


def is_reduce_grad(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is REDUCE_GRAD
