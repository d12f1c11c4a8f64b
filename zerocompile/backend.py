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
import operator
from pathlib import Path
from typing import Any, Callable

import torch._functorch.config
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
import torch.fx as fx
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import dynamo_timed
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import CompileContext
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils import _pytree as pytree

from zerocompile import guard
from zerocompile.config import COMPILE_TIME_FIELDS, ZeroConfig, refuse_concurrent_gloo_gathers
from zerocompile.distributed import runs_on_gloo
from zerocompile.gathered import is_gathered
from zerocompile import dump, graph_records, torch_support, upstream_fixes
from zerocompile.passes import analysis, ledger
from zerocompile.passes.ledger import GraphLedger
from zerocompile.passes.lower_markers import lower_markers
from zerocompile.passes.marker_args import UnshardArgs
from zerocompile.passes.markers import is_reduce_grad, is_unshard, reduce_grad_args, unshard_args
from zerocompile.passes.merge_unshards import merge_repeated_unshards
from zerocompile.passes.gloo_release import hold_until_gloo_releases
from zerocompile.passes.one_in_flight import wait_before_each_collective
from zerocompile.passes.recompute_gathers import KEPT, tag_gathers_for_recompute
from zerocompile.passes.recording import meta_like
from zerocompile.passes.secondary_shards import regather_from_secondary_shards
from zerocompile.sharded_parameters import ShardInfo, shard_info
from zerocompile.sharding import WHILE_SHARDED
from zerocompile.upstream_fixes import keep_every_iteration_of_split_loops, remove_loop_split_fix


class CompiledGraph:
    """What one lowered forward/backward graph does; kept for inspection by `record_graphs()`.

    Holds a copy of the graph as `lower_markers` left it (Inductor's later passes rewrite the
    original) and works out the facts on first access: measured, analysing every graph at
    compile time cost 2.5 s of a 12m GPT's stage-3 compile, for facts only tests and tools read.
    """

    def __init__(self, kind: str, compile_id: str, graph: fx.Graph) -> None:
        self.kind = kind  # "forward", "backward" or "inference"
        self.compile_id = compile_id  # Dynamo's frame/attempt: one per graph-break fragment
        self.graph = graph

    _FACTS = ("code", "ledger", "saved_gathered", "peak_gathered_numel", "peak_unreduced_grad_numel")

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (e.g. sent back from a spawned rank) as its facts: the graph's fake tensors
        do not pickle."""
        return {"kind": self.kind, "compile_id": self.compile_id, **{name: getattr(self, name) for name in self._FACTS}}

    @functools.cached_property
    def code(self) -> str:
        return self.graph.python_code("self").src

    @functools.cached_property
    def ledger(self) -> GraphLedger:
        with dynamo_timed("zerocompile.graph_ledger", metadata={"graph": self.kind}):
            return ledger.graph_ledger(self.graph, self.kind)

    @functools.cached_property
    def saved_gathered(self) -> list[str]:
        """Forward outputs that are gathered parameters."""
        return [n.name for n in analysis.saved_gathered_values(self.graph)] if self.kind == "forward" else []

    @functools.cached_property
    def peak_gathered_numel(self) -> int:
        return analysis.peak_gathered_numel(self.graph)

    @functools.cached_property
    def peak_unreduced_grad_numel(self) -> int:
        return analysis.peak_unreduced_grad_numel(self.graph)


def zero_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None) -> Callable:
    """`torch.compile(model, backend="zero", options={...})` lands here, once per Dynamo graph."""
    # Each of our steps is timed as Dynamo's own phases are: in torch._dynamo.utils.compile_times(),
    # as chromium events in TORCH_TRACE (tlparse's timeline) and in the PyTorch profiler.
    with dynamo_timed("zerocompile.dynamo_graph_passes", log_pt2_compile_event=True):
        _refuse_unsharded_parameters(gm, example_inputs)
        _name_unshard_markers(gm, example_inputs)
        groups = [c10d._resolve_process_group(name) for name in _groups_of(gm.graph)]
        config = _config_of(example_inputs).with_options(options)
        for group in groups:
            refuse_concurrent_gloo_gathers(config, group)
        directory = dump.dump_dir(config.dump_dir)
        dump.emit_graph(directory, "dynamo", "before", "merge_repeated_unshards", gm.graph)
        merge_repeated_unshards(gm.graph)
        gm.recompile()
        dump.emit_graph(directory, "dynamo", "after", "merge_repeated_unshards", gm.graph)
    with dynamo_timed("zerocompile.check_ranks_agree", log_pt2_compile_event=True):
        context = _check_ranks_agree(gm.graph, config) if config.check_ranks else None
    # Bound now: the backward is lowered at its first call, maybe on an autograd thread.
    one_in_flight = any(map(runs_on_gloo, groups))  # see passes.one_in_flight
    lowering = Lowering(
        directory, config.bucket_bytes, config.prefetch, one_in_flight, records=graph_records.open_records()
    )
    if config.compiler == "eager":
        lower = functools.partial(_lower_and_run_eagerly, lowering=lowering, context=context)
        partition = functools.partial(_partition, directory=directory, memory_budget=config.memory_budget)
        compiled = aot_autograd(fw_compiler=lower, bw_compiler=lower, partition_fn=partition)(gm, example_inputs)
        return _explained(compiled, context, "forward")
    from torch._inductor.compile_fx import compile_fx

    from torch._inductor.decomposition import select_decomp_table

    # int8 dequantisation would lose elements otherwise; only graphs of sharded models need it.
    WHILE_SHARDED.patch(keep_every_iteration_of_split_loops, remove_loop_split_fix)

    lowering = dataclasses.replace(lowering, decompositions=select_decomp_table())
    config_patches = torch_support.inductor_config_patches({
        "joint_custom_pre_pass": TagGathersForRecompute(directory, config.memory_budget),
        "post_grad_custom_pre_pass": LowerMarkers(lowering),
        # Inductor's peak-memory reordering sinks each all-gather to its wait, undoing the prefetch
        # order lower_markers chose (which already bounds the gathered memory): keep our order.
        "reorder_for_peak_memory": False,
        # torch 2.15's simple overlap (on by default; absent before) hoists collectives ahead of
        # their use, past that order and past one_in_flight's: 4 all-gathers of a stage-3 forward
        # in flight at once on gloo (test_in_flight), where two at once corrupt its heap.
        "aten_distributed_optimizations.enable_simple_overlap": False,
    })
    if directory is None and not lowering.records:
        return _explained(compile_fx(gm, example_inputs, config_patches=config_patches), context, "forward")
    # A hit in AOTAutograd's or Inductor's graph cache would skip our passes, so write no dump and
    # leave `record_graphs()` empty: compile afresh when dumping or recording (the C++ kernels
    # still come from Inductor's cache when their source is unchanged).
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = compile_fx(gm, example_inputs, config_patches={**config_patches, "fx_graph_cache": False})
    return _explained(compiled, context, "forward")


def _check_ranks_agree(graph: fx.Graph, config: ZeroConfig) -> guard.GraphContext | None:
    """The rank-consistency guard on the merged Dynamo graph, with every setting that steers how
    its markers are lowered (and the torch version, whose passes and decompositions do too)."""
    settings = {
        "bucket_bytes": config.bucket_bytes,
        "prefetch": config.prefetch,
        "compiler": config.compiler,
        "memory_budget": config.memory_budget,
        # The markers carry the block sizes, but one rank sending int8 rows where another sends
        # floats would garble both: compared here with the other settings.
        "gather_quant": config.gather_quant,
        "reduce_quant": config.reduce_quant,
        "quant_block": config.quant_block,
        "quant_scope": config.quant_scope,
        "torch": torch_support.RELEASE,
    }
    compile_id = CompileContext.current_compile_id()
    return guard.check_ranks_agree(graph, settings, str(compile_id) if compile_id is not None else "outside Dynamo")


def _explained(compiled: Callable, context: guard.GraphContext | None, kind: str) -> Callable:
    """`compiled`, whose failed collectives raise an error naming the graph, rank and timeout.

    Wraps what the backend returns, i.e. the forward. The backward is wrapped only on the eager
    path (its `bw_compiler` is ours); Inductor's backward comes out of AOTAutograd, or straight from
    its cache, with no hook of ours around the callable.
    """
    return compiled if context is None else guard.explain_collective_failures(compiled, context, kind)


def _groups_of(graph: fx.Graph) -> set[str]:
    groups = {unshard_args(node).group_name for node in graph.nodes if is_unshard(node)}
    return groups | {reduce_grad_args(node).group_name for node in graph.nodes if is_reduce_grad(node)}


def _config_of(example_inputs: list[Any]) -> ZeroConfig:
    """The compile-time settings of the model(s) whose parameters the graph takes.

    Each parameter carries its model's settings (`ShardInfo.config`); a graph holding parameters
    of models sharded with different ones (a wrapper calling both inside one compiled region)
    could follow only one of them, so it is refused.
    """
    by_settings: dict[tuple, list[ShardInfo]] = {}
    for value in example_inputs:
        info = shard_info(value) if isinstance(value, torch.Tensor) else None
        if info is not None:
            by_settings.setdefault(_compile_time_settings(info.config), []).append(info)
    if len(by_settings) > 1:
        described = "; ".join(
            f"{', '.join(repr(info.fqn) for info in infos[:3])}{' ...' if len(infos) > 3 else ''} with "
            + ", ".join(f"{name}={value!r}" for name, value in zip(COMPILE_TIME_FIELDS, settings))
            for settings, infos in by_settings.items()
        )
        raise ValueError(
            f"one compiled graph holds parameters of models sharded with different compile-time settings "
            f"({described}): compile each model on its own (torch.compile(model, backend='zero') per "
            "model), or shard them with the same settings"
        )
    return next(iter(by_settings.values()))[0].config if by_settings else ZeroConfig()


def _compile_time_settings(config: ZeroConfig) -> tuple:
    return tuple(getattr(config, name) for name in COMPILE_TIME_FIELDS)


def _refuse_unsharded_parameters(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Parameters that are not shards: full inside a `gathered()` block, or never sharded."""
    for value in example_inputs:
        if isinstance(value, nn.Parameter) and is_gathered(value):
            raise RuntimeError(
                "a model compiled with backend='zero' was called inside `with zerocompile.gathered(...)` "
                f"(parameter '{shard_info(value).fqn}' is full there): call the uncompiled model inside the "
                "block, or the compiled one after it"
            )
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


def _name_unshard_markers(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Write each `unshard` marker's parameter FQN into its `param` argument.

    The module properties leave it out so that Dynamo does not guard on it (see
    `zerocompile.sharding`); the tensors the graph was traced with still know it. A graph Dynamo
    then reuses for another module of the same shapes (each block compiled on its own) keeps the
    names of the module it was traced for. Markers inside subgraphs (a checkpointed region is a
    higher-order op over one) are named through the operands the op passes in.
    """
    _name_markers_in(gm, dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)))


_PARAM_ARG = UnshardArgs._fields.index("param")


def _name_markers_in(gm: fx.GraphModule, values: dict[fx.Node, Any]) -> None:
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            values[node] = operator.attrgetter(node.target)(gm)
        elif is_unshard(node) and not unshard_args(node).param:
            value = values.get(unshard_args(node).shard)
            info = shard_info(value) if isinstance(value, torch.Tensor) else None
            fqn = info.fqn if info is not None else getattr(value, "_zero_copy_of", "")
            if len(node.args) > _PARAM_ARG:
                node.update_arg(_PARAM_ARG, fqn)
            else:
                node.update_kwarg("param", fqn)
        elif node.op == "call_function" and node.args and isinstance(values.get(node.args[0]), fx.GraphModule):
            body = values[node.args[0]]
            operands = [values.get(arg) if isinstance(arg, fx.Node) else arg for arg in node.args[1:]]
            _name_markers_in(body, dict(zip(body.graph.find_nodes(op="placeholder"), operands)))
    gm.recompile()


def _tag_and_dump(graph: fx.Graph, directory: str | None, memory_budget: int | None) -> None:
    with dynamo_timed("zerocompile.tag_gathers_for_recompute", log_pt2_compile_event=True):
        dump.emit_graph(directory, "joint", "before", "tag_gathers_for_recompute", graph)
        tag_gathers_for_recompute(graph, memory_budget)
        dump.emit_graph(directory, "joint", "after", "tag_gathers_for_recompute", graph)
    with dynamo_timed("zerocompile.regather_from_secondary_shards", log_pt2_compile_event=True):
        if regather_from_secondary_shards(graph):
            dump.emit_graph(directory, "joint", "after", "regather_from_secondary_shards", graph)


def _partition(
    joint: fx.GraphModule, joint_inputs: Any, *, directory: str | None, memory_budget: int | None, **kwargs: Any
):
    _tag_and_dump(joint.graph, directory, memory_budget)
    with dynamo_timed("zerocompile.min_cut_rematerialization_partition", log_pt2_compile_event=True):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _lower_and_run_eagerly(
    gm: fx.GraphModule, example_inputs: Any, *, lowering: Lowering, context: guard.GraphContext | None
) -> Callable:
    kind = _graph_kind(gm.graph)
    _lower_and_record(gm.graph, lowering)
    gm.recompile()
    # The forward is explained by zero_backend's wrapper around the whole compiled function.
    return make_boxed_func(_explained(gm.forward, context, kind) if kind == "backward" else gm.forward)


def _graph_kind(graph: fx.Graph) -> str:
    names = [n.name for n in graph.find_nodes(op="placeholder")]
    if any(name.startswith("tangents") for name in names):
        return "backward"
    return "forward" if any(name.startswith("primals") for name in names) else "inference"


@dataclasses.dataclass(frozen=True)
class Lowering:
    """The settings `lower_markers` runs with, and where its graphs are dumped."""

    directory: str | None
    bucket_bytes: int
    prefetch: int
    # A group on gloo: one collective in flight at a time (`passes.one_in_flight`), and each
    # collective's tensors held until gloo has let go of them (`passes.gloo_release`).
    one_in_flight: bool = False
    decompositions: dict | None = None  # Inductor's table on the Inductor path
    # The `record_graphs()` lists open where the compile started: each graph's record goes there.
    records: tuple[list[CompiledGraph], ...] = dataclasses.field(default=(), compare=False)


def _lower_and_record(graph: fx.Graph, lowering: Lowering) -> None:
    kind = _graph_kind(graph)
    with dynamo_timed("zerocompile.lower_markers", log_pt2_compile_event=True, metadata={"graph": kind}):
        dump.emit_graph(lowering.directory, kind, "before", "lower_markers", graph)
        lower_markers(graph, lowering.bucket_bytes, lowering.prefetch, lowering.decompositions)
        dump.emit_graph(lowering.directory, kind, "after", "lower_markers", graph)
    if lowering.one_in_flight:
        with dynamo_timed("zerocompile.wait_before_each_collective", log_pt2_compile_event=True, metadata={"graph": kind}):
            dump.emit_graph(lowering.directory, kind, "before", "wait_before_each_collective", graph)
            wait_before_each_collective(graph)
            dump.emit_graph(lowering.directory, kind, "after", "wait_before_each_collective", graph)
        with dynamo_timed("zerocompile.hold_until_gloo_releases", log_pt2_compile_event=True, metadata={"graph": kind}):
            dump.emit_graph(lowering.directory, kind, "before", "hold_until_gloo_releases", graph)
            hold_until_gloo_releases(graph)
            dump.emit_graph(lowering.directory, kind, "after", "hold_until_gloo_releases", graph)
    if not lowering.records and lowering.directory is None:
        # No record: only the structured trace (TORCH_TRACE, what tlparse reads) may want the ledger,
        # which `emit_ledger` works out only where that trace is on.
        dump.emit_ledger(None, kind, lambda: ledger.graph_ledger(graph, kind).to_json())
        return
    with dynamo_timed("zerocompile.record_graph", log_pt2_compile_event=True, metadata={"graph": kind}):
        record = CompiledGraph(kind, dump.compile_id(), _facts_only_copy(graph))
        dump.emit_ledger(lowering.directory, kind, lambda: record.ledger.to_json())
    for records in lowering.records:
        records.append(record)


# The node metadata the recorded facts are worked out from (see `analysis` and `ledger`).
_FACT_META = ("val", "zero_params", "zero_groups", "zero_reduction", KEPT)


def _facts_only_copy(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` whose nodes keep only the metadata the facts need, values as meta tensors.

    The graph's own values are fake tensors, which hold on to the compile's fake mode, and its
    nodes carry stack traces and module stacks. Records live as long as the `record_graphs()`
    lists that hold them: for a 12m GPT's two stage-3 graphs, dropping them freed 6.6 MiB of
    RssAnon with full copies and 4.9 MiB with these. Values with symbolic sizes stay as they are.
    """
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    with unset_fake_temporarily():
        for node in copy.nodes:
            node.meta = {key: node.meta[key] for key in _FACT_META if key in node.meta}
            if "val" in node.meta:
                node.meta["val"] = pytree.tree_map_only(torch.Tensor, _as_meta_tensor, node.meta["val"])
    return copy


def _as_meta_tensor(value: torch.Tensor) -> torch.Tensor:
    meta = meta_like(value)
    return value if meta is None else meta


def _passes_source_hash() -> str:
    """Of the passes and of the torch fixes the generated code depends on: a graph Inductor cached
    before either changed is compiled afresh."""
    digest = hashlib.sha256()
    for path in [*sorted(Path(analysis.__file__).parent.glob("*.py")), Path(upstream_fixes.__file__)]:
        digest.update(path.read_bytes())
    return digest.hexdigest()


class TagGathersForRecompute(CustomGraphPass):
    """Inductor joint-graph hook running `tag_gathers_for_recompute`."""

    def __init__(self, directory: str | None, memory_budget: int | None) -> None:
        self.directory = directory
        self.memory_budget = memory_budget

    def __call__(self, graph: fx.Graph) -> None:
        _tag_and_dump(graph, self.directory, self.memory_budget)

    def uuid(self) -> str:
        # The budget decides which gathers are tagged: a graph cached under another budget saves
        # other parameters.
        return f"tag_gathers_for_recompute-{self.memory_budget}-" + _passes_source_hash()


class LowerMarkers(CustomGraphPass):
    """Inductor post-grad hook running `lower_markers` on the forward and the backward graph."""

    def __init__(self, lowering: Lowering) -> None:
        self.lowering = lowering

    def __call__(self, graph: fx.Graph) -> None:
        _lower_and_record(graph, self.lowering)

    def uuid(self) -> str:
        # The lowering differs by backend (gloo builds its reduce-scatter from all-to-all).
        backend = dist.get_backend() if dist.is_initialized() else "none"
        settings = f"{self.lowering.bucket_bytes}-{self.lowering.prefetch}-{self.lowering.one_in_flight}"
        return f"lower_markers-{backend}-{settings}-" + _passes_source_hash()
