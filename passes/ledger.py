"""The ledger of a lowered graph: every collective with the parameters it serves, its bytes, what
computes while it is in flight, and where each gathered buffer dies — predicted from the graph alone.

Read-only: nothing here changes a graph. Bytes sent are what one rank writes to the network for a
collective under the algorithms we emit: an all-gather sends its shard to N−1 peers, an all-to-all
(our gloo reduce-scatter) and a native reduce-scatter (N−1)/N of their input, an all-reduce
2(N−1)/N of it (ring); a broadcast (buffers) (N−1)/N of it, the mean over ranks. Quantised
collectives count their int8 rows (codes and the scales' bytes) as sent.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.distributed import distributed_c10d as c10d

from . import analysis

funcol = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    op: str  # what the collective does for ZeRO: all_gather, reduce_scatter or all_reduce
    params: list[str]  # FQNs of the parameters this collective serves
    param_bytes: list[int]  # bytes of each that this rank holds (shard, or whole at stage 0)
    dtype: str
    input_bytes: int
    sent_bytes: int  # predicted bytes this rank sends
    bucket: int  # index of the collective: every bucket of parameters is one collective
    position: int
    wait_position: int
    overlaps: list[str]  # compute nodes running while the collective is in flight
    freed_after: str | None  # gathers: the last node using the gathered buffer
    freed_position: int | None
    detail: str = ""  # how it is sent when that is not the op itself


@dataclasses.dataclass(frozen=True)
class GraphLedger:
    kind: str
    world_size: int
    node_count: int
    entries: list[LedgerEntry]
    gathered_bytes: int
    reduced_bytes: int
    sent_bytes: int
    peak_gathered_bytes: int  # kept parameters included (in a backward, from its start)
    peak_unreduced_grad_bytes: int
    # (first position, last position, bytes): the memory timeline of the graph
    gathered_intervals: list[tuple[int, int, int]]
    unreduced_grad_intervals: list[tuple[int, int, int]]
    # Gathered parameters kept between forward and backward (saved by a forward, received by a
    # backward, not gathered again): stages 1-2 every one the backward reads, stage 3 those its
    # memory_budget keeps; and their bytes.
    kept_params: list[str]
    kept_bytes: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _world_size(node: fx.Node) -> int:
    if node.target in analysis.GATHERS:
        return node.args[1]
    if node.target is funcol.reduce_scatter_tensor.default:
        return node.args[2]
    if node.target is funcol.all_to_all_single.default:
        return len(node.args[1])
    if "zero_world_size" in node.meta:
        return node.meta["zero_world_size"]
    # An all-reduce the model itself issues names only its group: ask the group.
    return c10d._get_group_size_by_name(node.args[2])


def _sent_bytes(op: str, input_bytes: int, world_size: int) -> int:
    if op == "all_gather":
        return (world_size - 1) * input_bytes
    if op == "all_reduce":
        return 2 * (world_size - 1) * input_bytes // world_size
    if op == "broadcast":  # the root sends (N-1)x, the others nothing: per rank on average
        return (world_size - 1) * input_bytes // world_size
    return (world_size - 1) * input_bytes // world_size


_QUANTISED = "int8 blocks + fp32 scales"
# The second half of stage 0's quantised all-reduce: it gathers reduced gradients, not parameters.
_MEANS = f"{_QUANTISED}: the reduced gradient's all-gather (stage 0's all-reduce)"


def _detail(collective: analysis.Collective, is_reduction: bool, of_gradients: bool) -> str:
    if collective.dtype == torch.int8:
        if collective.op == "all_gather" and of_gradients:
            return _MEANS
        return f"{_QUANTISED}, all_to_all + sum" if is_reduction else _QUANTISED
    return "all_to_all + sum on gloo" if is_reduction else ""


def graph_ledger(graph: fx.Graph, kind: str) -> GraphLedger:
    """The ledger of one lowered forward or backward graph."""
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    gathered_intervals = analysis.gathered_live_intervals(graph, analysis.nbytes)
    unreduced_intervals = analysis.unreduced_grad_intervals(graph, analysis.nbytes)
    gather_ends: dict[int, int] = {}  # a coalesced gather's buffers die one by one: the last
    for start, end, _ in gathered_intervals:
        gather_ends[start] = max(end, gather_ends.get(start, end))
    entries = []
    world_size = 1
    for collective in analysis.collectives(graph):
        node = nodes[collective.position]
        world_size = _world_size(node)
        wait = max(analysis.waits_of(node), key=position.__getitem__)  # the last one: done when all are
        in_flight = nodes[position[node] + 1 : position[wait]]
        # What in flight depends on the collective: graph order is topological, so every path
        # from it to a node in flight stays in flight (one pass over the window, not a walk of the whole graph).
        depends = {node}
        for other in in_flight:
            if any(arg in depends for arg in other.all_input_nodes):
                depends.add(other)
        last_use = gather_ends.get(collective.position)
        # On gloo a gradient bucket's reduce-scatter is an all_to_all whose receiver sums the
        # chunks (lowering.reduce_scatter_bucket): a reduce-scatter to the reader, same bytes.
        # So is a quantised one on any backend.
        is_reduction = collective.op == "all_to_all" and node.meta.get("zero_params")
        entries.append(
            LedgerEntry(
                op="reduce_scatter" if is_reduction else collective.op,
                detail=_detail(collective, is_reduction, bool(node.meta.get("zero_reduction"))),
                params=[name for name, _ in node.meta.get("zero_params", [])],
                param_bytes=[held for _, held in node.meta.get("zero_params", [])],
                dtype=str(collective.dtype).removeprefix("torch."),
                input_bytes=collective.bytes,
                sent_bytes=_sent_bytes(collective.op, collective.bytes, world_size),
                bucket=len(entries),
                position=position[node],
                wait_position=position[wait],
                overlaps=[n.name for n in in_flight if n not in depends and n.op == "call_function"],
                freed_after=nodes[last_use].name if last_use is not None else None,
                freed_position=last_use,
            )
        )
    kept = analysis.kept_params(graph)
    return GraphLedger(
        kind=kind,
        world_size=world_size,
        node_count=len(nodes),
        entries=entries,
        gathered_bytes=sum(e.input_bytes * world_size for e in entries if e.op == "all_gather" and e.detail != _MEANS),
        reduced_bytes=sum(e.input_bytes for e in entries if e.op not in ("all_gather", "broadcast") or e.detail == _MEANS),
        sent_bytes=sum(e.sent_bytes for e in entries),
        peak_gathered_bytes=analysis.peak_alive(gathered_intervals),
        peak_unreduced_grad_bytes=analysis.peak_alive(unreduced_intervals),
        gathered_intervals=gathered_intervals,
        unreduced_grad_intervals=unreduced_intervals,
        kept_params=list(kept),
        kept_bytes=sum(kept.values()),
    )
