"""Buffers like DDP's `broadcast_buffers=True`: a forward first overwrites each rank's buffers with
group rank 0's, so BatchNorm's running statistics and any other buffer evolve as under DDP.

Which forwards do is DDP's rule, kept exactly: the first forward, and every forward after one that
prepared a gradient reduction (gradients enabled, outside `no_sync`). So with accumulation the
first micro-step of each window takes rank 0's buffers and the later ones keep their own, and a
training forward right after a `no_grad` evaluation does not broadcast.

The sharded model's `forward` is wrapped to do it (an instance attribute, so the class and its
signature are the model's own). Not a forward hook: `torch.compile(model)` runs a module's hooks
outside the compiled forward, so a hook's broadcast became a graph of its own, a second compiled
region per step. Inside `forward`, Dynamo traces it into the model's graph: a functional
broadcast, its wait and a `copy_` into the buffer, which AOTAutograd keeps as a mutation of that
graph input, so the broadcast runs inside the compiled step (and shows in the graphs and the
ledger); whether it is due is a Python flag Dynamo guards on, so a graph with and one without the
broadcast are compiled once each. Uncompiled, the same code runs eagerly. Buffers are flattened
into one tensor per device and dtype, one broadcast each, as DDP coalesces its own.
With `broadcast_buffers=False` buffers are broadcast once, by `shard()`, and then stay each rank's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerocompile.accumulation import GradientSync

funcol = torch.ops._c10d_functional


def broadcast_buffers_in_forward(model: nn.Module, group: dist.ProcessGroup, sync: GradientSync) -> None:
    """Wrap `model.forward` if it has buffers to keep in step over more than one rank."""
    if dist.get_world_size(group) == 1 or next(model.buffers(), None) is None:
        return
    forward = model.forward
    rule = BufferSync(group.group_name, sync)

    @functools.wraps(forward)
    def forward_from_rank0s_buffers(*args: Any, **kwargs: Any) -> Any:
        if rule.due:
            _take_group_rank0s_buffers(model, rule.group_name)
        output = forward(*args, **kwargs)
        rule.forward_done()
        return output

    model.forward = forward_from_rank0s_buffers


class BufferSync:
    """One sharded model's DDP buffer rule (see the module docstring)."""

    def __init__(self, group_name: str, sync: GradientSync) -> None:
        self.group_name = group_name
        self.sync = sync
        self.due = True  # DDP broadcasts at the first forward

    def forward_done(self) -> None:
        self.due = torch.is_grad_enabled() and not self.sync.holds_copies()


def _take_group_rank0s_buffers(module: nn.Module, group_name: str) -> None:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for buffer in module.buffers():
        groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
    with torch.no_grad():
        for buffers in groups.values():
            flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
            synced = funcol.wait_tensor(funcol.broadcast(flat, 0, group_name))  # src: the group's rank 0
            for buffer, values in zip(buffers, synced.split([buffer.numel() for buffer in buffers])):
                buffer.copy_(values.view_as(buffer))
