"""The `torch.compile` backend "zero": Dynamo graph -> AOTAutograd -> our passes -> Inductor.

1. On the Dynamo graph: refuse unsharded parameters, merge repeated `unshard` markers.
2. AOTAutograd traces forward+backward into one joint graph; stage-3 gathers are tagged
   MUST_RECOMPUTE there and the min-cut partitioner splits it so the forward saves shards, not
   full parameters.
3. Each partitioned graph gets its markers lowered to collectives (`lower_markers`).
4. Inductor generates code (or, with options={"compiler": "eager"}, the graphs run op by op).

Steps 2-3 reach Inductor through its own extension points (`joint_custom_pre_pass`,
`post_grad_custom_pre_pass`) via `compile_fx(..., config_patches=...)`, which also puts our passes
in Inductor's cache key.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomGraphPass

from zerocompile.config import ZeroConfig
from zerocompile.passes import analysis
from zerocompile.passes.lower_markers import lower_markers
from zerocompile.passes.markers import is_reduce_grad, is_unshard, reduce_grad_args, unshard_args
from zerocompile.passes.merge_unshards import merge_repeated_unshards
from zerocompile.passes.recompute_gathers import tag_gathers_for_recompute
from zerocompile.sharding import config_for_group, shard_info


@dataclasses.dataclass
class CompiledGraph:
    """What one lowered forward/backward graph does; kept in `compiled_graphs` for inspection."""

    kind: str  # "forward", "backward" or "inference"
    code: str
    collectives: list[analysis.Collective]
    saved_gathered: list[str]  # forward outputs that are gathered parameters
    peak_gathered_numel: int
    peak_unreduced_grad_numel: int


compiled_graphs: list[CompiledGraph] = []


def zero_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None) -> Callable:
    """`torch.compile(model, backend="zero", options={...})` lands here, once per Dynamo graph."""
    _refuse_unsharded_parameters(gm, example_inputs)
    merge_repeated_unshards(gm.graph)
    gm.recompile()
    config = _config_of(gm.graph).with_options(options)
    if config.compiler == "eager":
        return aot_autograd(
            fw_compiler=_lower_and_run_eagerly,
            bw_compiler=_lower_and_run_eagerly,
            partition_fn=_partition,
        )(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(
        gm,
        example_inputs,
        config_patches={
            "joint_custom_pre_pass": TagGathersForRecompute(),
            "post_grad_custom_pre_pass": LowerMarkers(),
        },
    )


def _config_of(graph: fx.Graph) -> ZeroConfig:
    groups = {unshard_args(node).group_name for node in graph.nodes if is_unshard(node)}
    groups |= {reduce_grad_args(node).group_name for node in graph.nodes if is_reduce_grad(node)}
    configs = {config_for_group(name) for name in groups} - {None}
    return configs.pop() if len(configs) == 1 else ZeroConfig()


def _refuse_unsharded_parameters(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(value, nn.Parameter) and shard_info(value) is None:
            source = node.meta.get("grapharg")
            where = source.source.name if source is not None else node.name
            raise RuntimeError(
                f"backend='zero' got an unsharded parameter ({where}, shape {tuple(value.shape)}) in a "
                f"{dist.get_world_size()}-rank job: call zerocompile.shard(model, stage=...) before "
                "torch.compile(model, backend='zero')"
            )


def _partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
    tag_gathers_for_recompute(joint.graph)
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _lower_and_run_eagerly(gm: fx.GraphModule, example_inputs: Any) -> Callable:
    _lower_and_record(gm.graph)
    gm.recompile()
    return make_boxed_func(gm.forward)


def _lower_and_record(graph: fx.Graph) -> None:
    lower_markers(graph)
    placeholders = [n.name for n in graph.find_nodes(op="placeholder")]
    kind = "backward" if any(name.startswith("tangents") for name in placeholders) else "forward"
    compiled_graphs.append(
        CompiledGraph(
            kind=kind,
            code=graph.python_code("self").src,
            collectives=analysis.collectives(graph),
            saved_gathered=[n.name for n in analysis.saved_gathered_values(graph)] if kind == "forward" else [],
            peak_gathered_numel=analysis.peak_gathered_numel(graph),
            peak_unreduced_grad_numel=analysis.peak_unreduced_grad_numel(graph),
        )
    )


@functools.cache
def _passes_source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(analysis.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


class TagGathersForRecompute(CustomGraphPass):
    """Inductor joint-graph hook running `tag_gathers_for_recompute`."""

    def __call__(self, graph: fx.Graph) -> None:
        tag_gathers_for_recompute(graph)

    def uuid(self) -> str:
        return "tag_gathers_for_recompute-" + _passes_source_hash()


class LowerMarkers(CustomGraphPass):
    """Inductor post-grad hook running `lower_markers` on the forward and the backward graph."""

    def __call__(self, graph: fx.Graph) -> None:
        _lower_and_record(graph)

    def uuid(self) -> str:
        # The lowering differs by backend (gloo builds its reduce-scatter from all-to-all).
        backend = dist.get_backend() if dist.is_initialized() else "none"
        return f"lower_markers-{backend}-" + _passes_source_hash()
