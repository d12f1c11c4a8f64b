"""The arguments of each marker op, declared once: a record per op, from which the rest is derived.

`UnshardArgs` and `ReduceGradArgs` name every argument of `zerocompile::unshard` and
`zerocompile::reduce_grad` in order, with its type and default. `op_schema` turns a record into
the op's schema, which `markers.py` defines the op with; its kernels, fake kernels and autograd
formula read their arguments through the record, and so do the passes a marker node's
(`markers.unshard_args`); `markers.MarkerArgs`, what a parameter's markers share, is the unshard
record less its per-call arguments. Adding an argument is one line here: give it a default, so
that markers without it keep their graphs.

This module defines no op, so `lowering`, which the ops' kernels call, can take a marker's
arguments without an import cycle.
"""

# No `from __future__ import annotations`: `op_schema` reads the records' annotations as types.
from typing import NamedTuple, Union

import torch
import torch.fx

from .stages import stage_policy

# A tensor argument: the tensor when the op runs, the node that makes it when a pass reads a graph.
TensorArg = Union[torch.Tensor, torch.fx.Node]

# Marker arguments after the tensor: what the passes need to lower it, nothing else, so graphs are
# rewritten without asking a process group: the group's name and size, and how it reduce-scatters.
# `param` is the parameter's FQN (for people and tools reading graphs); the dtypes are mixed
# precision's: gather (and compute) in `compute_dtype`, reduce gradients in `reduce_dtype`; None
# means the shard's.


class UnshardArgs(NamedTuple):
    """Arguments of `zerocompile::unshard`; `param` is the parameter's FQN, for people reading graphs."""

    shard: TensorArg
    shape: list[int]
    stage: int
    group_name: str
    world_size: int
    reduce_scatter: str  # how the group reduce-scatters (a `lowering` *_REDUCE_SCATTER)
    param: str = ""
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    local: bool = False  # the input is a full local copy (no_sync): no gather, no reduction
    pending: TensorArg | None = None  # a gradient accumulated without sync, reduced with this one
    gather_quant_block: int = 0  # > 0: gathered int8-quantised in blocks of this many elements
    reduce_quant_block: int = 0  # > 0: its gradient reduced int8-quantised (`ReduceGradArgs.quant_block`)
    replica_group: str = ""  # hybrid sharding: its reduced gradient is then averaged over this group
    replicas: int = 1  # ... of this many ranks (1: no replicas, plain sharding)
    replica_quant_block: int = 0  # > 0: that average int8-quantised (`ReduceGradArgs.replica_quant_block`)
    secondary_group: str = ""  # hpZ: the stage-3 backward re-gathers over this group (`secondary_shards`)
    secondary_size: int = 1  # ... of this many ranks (1: no secondary shards)
    secondary_quant_block: int = 0  # > 0: that re-gather int8-quantised
    full: TensorArg | None = None  # a full local copy (no_sync's, kept after the block) read in place of a gather

    @property
    def reads_local_copy(self) -> bool:
        """The forward reads a full local copy (`local`, or `full`): no gather, none in the backward."""
        return self.local or self.full is not None

    @property
    def whole(self) -> TensorArg | None:
        """What already is the full parameter, so nothing is gathered: the kept copy (`full`), a
        local copy (`local`), or the shard of a stage that keeps parameters whole; else None."""
        if self.full is not None:
            return self.full
        return self.shard if self.local or not stage_policy(self.stage).shards_parameters else None


class ReduceGradArgs(NamedTuple):
    """Arguments of `zerocompile::reduce_grad`."""

    grad: TensorArg
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


def reduction_of(marker: "UnshardArgs", grad: TensorArg, shard_numel: int, grad_dtype: torch.dtype | None) -> ReduceGradArgs:
    """The `reduce_grad` arguments of `grad`, the gradient of a parameter whose `unshard` markers
    take `marker` (an `UnshardArgs`, or `markers.MarkerArgs`: the same names): its stage, groups,
    dtypes and quantisation, landing in `grad_dtype` (its shard's)."""
    return ReduceGradArgs(
        grad, shard_numel, marker.stage, marker.group_name, marker.world_size, marker.reduce_scatter, marker.param,
        marker.reduce_dtype, grad_dtype, marker.reduce_quant_block, marker.replica_group, marker.replicas,
        marker.replica_quant_block,
    )


# The schema type of each annotation the records use: what torch.library would infer from a
# function annotated alike (an int is a SymInt, so shapes may be symbolic).
_SCHEMA_TYPES = {
    TensorArg: "Tensor",
    TensorArg | None: "Tensor?",
    list[int]: "SymInt[]",
    int: "SymInt",
    str: "str",
    bool: "bool",
    torch.dtype | None: "ScalarType?",
}


def op_schema(record: type[NamedTuple]) -> str:
    """The schema of the op whose arguments `record` declares (every op here returns one tensor),
    e.g. `(Tensor grad, SymInt shard_numel, ..., str param="", ...) -> Tensor`."""
    arguments = []
    for name, annotation in record.__annotations__.items():
        argument = f"{_SCHEMA_TYPES[annotation]} {name}"
        if name in record._field_defaults:
            default = record._field_defaults[name]
            argument += f'="{default}"' if isinstance(default, str) else f"={default}"
        arguments.append(argument)
    return f"({', '.join(arguments)}) -> Tensor"
