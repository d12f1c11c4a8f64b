"""Small graph helpers shared by the pass unit tests (their fake group is conftest's `group_name`)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed import distributed_c10d as c10d
from torch.fx.experimental.proxy_tensor import make_fx

from zerocompile.passes.lowering import ALL_TO_ALL_REDUCE_SCATTER, NATIVE_REDUCE_SCATTER
from zerocompile.passes.markers import is_reduce_grad, is_unshard

WORLD = 4


def on(group_name: str, textbook: bool = True) -> tuple[str, int, str]:
    """A marker's group arguments for a group of this process: its name, its size, and how it
    reduce-scatters (`textbook=False`: gloo's all-to-all + sum)."""
    flavour = NATIVE_REDUCE_SCATTER if textbook else ALL_TO_ALL_REDUCE_SCATTER
    return group_name, c10d._get_group_size_by_name(group_name), flavour


def trace(fn, *specs) -> fx.GraphModule:
    """make_fx `fn` on fake tensors; each spec is a shape tuple or (shape, dtype)."""
    with FakeTensorMode():
        args = []
        for spec in specs:
            shape, dtype = spec if isinstance(spec[0], tuple) else (spec, torch.float32)
            args.append(torch.empty(shape, dtype=dtype))
        return make_fx(fn)(*args)


def call_targets(graph: fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def markers_in(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_unshard(n) or is_reduce_grad(n)]


def node_index(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def output_args(graph: fx.Graph) -> list:
    return list(graph.output_node().args[0])
