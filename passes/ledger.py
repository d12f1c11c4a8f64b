"""The ledger of a lowered graph: every collective with the parameters it serves, its bytes, what
computes while it is in flight, and where each gathered buffer dies — predicted from the graph alone.

Read-only: nothing here changes a graph. Bytes sent are what one rank writes to the network for a
collective under the algorithms we emit: an all-gather sends its shard to N−1 peers, an all-to-all
(our gloo reduce-scatter) and a native reduce-scatter (N−1)/N of their input, an all-reduce
2(N−1)/N of it (ring); a broadcast (buffers) (N−1)/N of it, the mean over ranks. Quantised
collectives count their int8 rows (codes and the scales' bytes) as sent. N is the size of the
group the collective runs on: with hybrid sharding the shard group's K for gathers and
reduce-scatters, the replica group's N/K for the all-reduce of reduced shards across replicas,
which is what crosses nodes when shard groups are nodes (`replica_sent_bytes`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.distributed import distributed_c10d as c10d

from . import analysis

funcol = torch.ops._c10d_functional


RING = "ring"  # each rank sends to its next neighbour in the group
PAIRWISE = "pairwise"  # each rank sends to every peer directly


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
    reduces: bool = False  # it reduces gradients (whatever its op: a quantised all-reduce gathers means)
    across_replicas: bool = False  # hybrid sharding: it runs on the replica group (across nodes)
    group_size: int = 1  # ranks of the group it runs on
    group_stride: int = 1  # its ranks are every group_stride-th (replica groups), else consecutive
    pattern: str = RING  # how its bytes travel between the group's ranks: RING or PAIRWISE

    def sent_across_nodes(self, ranks_per_node: int) -> int:
        """This rank's share of the bytes the collective sends between nodes, nodes being blocks of
        `ranks_per_node` consecutive ranks (a node's ranks together send the sum of their shares).

        A PAIRWISE collective (an all-to-all) sends the same bytes to each peer: the share of peers
        elsewhere. A RING one (all-gather, all-reduce, reduce-scatter: gloo's and NCCL's
        algorithms) sends everything to one neighbour, and a ring over a group spanning B nodes
        crosses between nodes on B of its G edges: B/G of what a rank sends (measured over two
        simulated nodes: a ring all-gather over 4 ranks in nodes of 2 moved 3 shards out of each
        node, not the 4 that "each peer gets its share" would)."""
        if self.group_size <= 1:
            return 0
        same_node = min(self.group_size, max(1, ranks_per_node // self.group_stride))
        if self.pattern == PAIRWISE:
            return self.sent_bytes * (self.group_size - same_node) // (self.group_size - 1)
        nodes = -(-self.group_size // same_node)
        return 0 if nodes == 1 else self.sent_bytes * nodes // self.group_size


@dataclasses.dataclass(frozen=True)
class GraphLedger:
    kind: str
    world_size: int
    node_count: int
    entries: list[LedgerEntry]
    gathered_bytes: int
    reduced_bytes: int
    sent_bytes: int
    replica_sent_bytes: int  # the part of sent_bytes sent across replicas (hybrid sharding; else 0)
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

    def sent_across_nodes(self, ranks_per_node: int) -> int:
        """Bytes this rank sends per run of the graph to ranks on other nodes (see `LedgerEntry`)."""
        return sum(entry.sent_across_nodes(ranks_per_node) for entry in self.entries)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def of_optimizer_step(cls, entries: list[LedgerEntry]) -> "GraphLedger":
        """The collectives an optimizer's `step()` issues outside the graphs (kind "optimizer"):
        no nodes, nothing gathered or kept; what they send counts with the graphs' per step."""
        return cls(
            kind="optimizer",
            world_size=max((entry.group_size for entry in entries), default=1),
            node_count=0,
            entries=entries,
            gathered_bytes=0,
            reduced_bytes=0,
            sent_bytes=sum(entry.sent_bytes for entry in entries),
            replica_sent_bytes=0,
            peak_gathered_bytes=0,
            peak_unreduced_grad_bytes=0,
            gathered_intervals=[],
            unreduced_grad_intervals=[],
            kept_params=[],
            kept_bytes=0,
        )


def _group_name(node: fx.Node) -> str:
    if node.target in (funcol.reduce_scatter_tensor.default, funcol.all_to_all_single.default):
        return node.args[3]
    return node.args[2]  # gathers (input, size, group), all_reduce and broadcast (input, op or src, group)


def _world_size(node: fx.Node) -> int:
    if node.target in analysis.GATHERS:
        return node.args[1]
    if node.target is funcol.reduce_scatter_tensor.default:
        return node.args[2]
    if node.target is funcol.all_to_all_single.default:
        return len(node.args[1])
    groups = node.meta.get("zero_groups", {})
    if node.args[2] in groups:
        return groups[node.args[2]][0]
    # An all-reduce the model itself issues names only its group: ask the group.
    return c10d._get_group_size_by_name(node.args[2])


def _group_stride(node: fx.Node) -> int:
    """1 for a group of consecutive ranks; K for hybrid sharding's replica groups (every K-th rank)."""
    return node.meta.get("zero_groups", {}).get(_group_name(node), (0, 1))[1]


def predicted_sent_bytes(op: str, input_bytes: int, world_size: int) -> int:
    if op == "all_gather":
        return (world_size - 1) * input_bytes
    if op == "all_reduce":
        return 2 * (world_size - 1) * input_bytes // world_size
    if op == "broadcast":  # the root sends (N-1)x, the others nothing: per rank on average
        return (world_size - 1) * input_bytes // world_size
    return (world_size - 1) * input_bytes // world_size


_QUANTISED = "int8 blocks + fp32 scales"


def _detail(collective: analysis.Collective, is_reduction: bool, of_gradients: bool, across_replicas: bool) -> str:
    if across_replicas:
        return "the reduced shard's mean across replicas"
    if collective.dtype == torch.int8:
        if collective.op == "all_gather" and of_gradients:
            # The second half of stage 0's quantised all-reduce: reduced gradients, not parameters.
            return f"{_QUANTISED}: the reduced gradient's all-gather (stage 0's all-reduce)"
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
        of_gradients = bool(node.meta.get("zero_reduction"))
        stride = _group_stride(node)
        across_replicas = stride > 1
        entries.append(
            LedgerEntry(
                op="reduce_scatter" if is_reduction else collective.op,
                detail=_detail(collective, is_reduction, of_gradients, across_replicas),
                reduces=of_gradients,
                across_replicas=across_replicas,
                group_size=world_size,
                group_stride=stride,
                pattern=PAIRWISE if collective.op in ("all_to_all", "broadcast") else RING,
                params=[name for name, _ in node.meta.get("zero_params", [])],
                param_bytes=[held for _, held in node.meta.get("zero_params", [])],
                dtype=str(collective.dtype).removeprefix("torch."),
                input_bytes=collective.bytes,
                sent_bytes=predicted_sent_bytes(collective.op, collective.bytes, world_size),
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
        world_size=next((e.group_size for e in entries if not e.across_replicas), 1),
        node_count=len(nodes),
        entries=entries,
        gathered_bytes=sum(e.input_bytes * e.group_size for e in entries if e.op == "all_gather" and not e.reduces),
        # Gradient bytes reduced inside the (shard) group; across replicas they are reduced again.
        reduced_bytes=sum(
            e.input_bytes
            for e in entries
            if not e.across_replicas and (e.op not in ("all_gather", "broadcast") or e.reduces)
        ),
        sent_bytes=sum(e.sent_bytes for e in entries),
        replica_sent_bytes=sum(e.sent_bytes for e in entries if e.across_replicas),
        peak_gathered_bytes=analysis.peak_alive(gathered_intervals),
        peak_unreduced_grad_bytes=analysis.peak_alive(unreduced_intervals),
        gathered_intervals=gathered_intervals,
        unreduced_grad_intervals=unreduced_intervals,
        kept_params=list(kept),
        kept_bytes=sum(kept.values()),
    )
