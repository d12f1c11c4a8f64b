"""Read-only facts about a lowered graph: its collectives, and which values are gathered parameters.

Nothing here rewrites a graph. The backend records these facts for every graph it compiles, and the
tests use them to prove what the stages promise (e.g. a stage-3 forward saves no gathered tensor).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
from typing import Callable

import torch
import torch.fx as fx

from .lowering import pack, unpack
from .recompute_gathers import KEPT, is_view_or_cast

funcol = torch.ops._c10d_functional
COLLECTIVES = {
    funcol.all_gather_into_tensor_coalesced.default: "all_gather",
    funcol.all_gather_into_tensor.default: "all_gather",
    funcol.reduce_scatter_tensor.default: "reduce_scatter",
    funcol.all_to_all_single.default: "all_to_all",
    funcol.all_reduce.default: "all_reduce",
    funcol.broadcast.default: "broadcast",  # buffers, as DDP's broadcast_buffers
}


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    position: int  # index of the node in the graph
    numel: int  # elements of the input tensor (of all of them, coalesced)
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return self.numel * self.dtype.itemsize


GATHERS = (funcol.all_gather_into_tensor.default, funcol.all_gather_into_tensor_coalesced.default)


def _is_gather(node: fx.Node) -> bool:
    """An all-gather of parameters (not the all-gather half of a quantised all-reduce)."""
    return node.op == "call_function" and node.target in GATHERS and not node.meta.get("zero_reduction")


def _spliced(node: fx.Node) -> bool:
    """A node `lower_markers` inserted for a collective (packing, quantisation, unpacking)."""
    return "zero_params" in node.meta


def collectives(graph: fx.Graph) -> list[Collective]:
    found = []
    for position, node in enumerate(graph.nodes):
        if node.op == "call_function" and node.target in COLLECTIVES:
            inputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            values = [n.meta["val"] for n in inputs]
            found.append(Collective(COLLECTIVES[node.target], position, sum(v.numel() for v in values), values[0].dtype))
    return found


def outputs_of(collective: fx.Node) -> list[fx.Node]:
    """The tensors a collective produces: itself, or each output (getitem) of a coalesced one."""
    return [user for user in collective.users if user.target is operator.getitem] or [collective]


def waits_of(collective: fx.Node) -> list[fx.Node]:
    """The wait_tensor nodes of a collective, one per output."""
    return [user for output in outputs_of(collective) for user in output.users if user.target is funcol.wait_tensor.default]


def kept_inputs(graph: fx.Graph) -> list[fx.Node]:
    """A backward's inputs that are gathered parameters its forward saved (not gathered again):
    the placeholders carrying `recompute_gathers.KEPT`, which the partitioner copies from the
    joint graph's saved node."""
    return [node for node in graph.find_nodes(op="placeholder") if KEPT in node.meta]


def gathered_values(graph: fx.Graph) -> set[fx.Node]:
    """Every value that is a gathered parameter: the all-gather, its waits, kept inputs
    (`kept_inputs`), and their views/casts."""
    values: set[fx.Node] = set()
    frontier = [node for node in graph.nodes if _is_gather(node)] + kept_inputs(graph)
    while frontier:
        node = frontier.pop()
        values.add(node)
        # Dequantisation (int8 gathers) is compute, but of the gather's own: still the parameter.
        frontier.extend(
            user
            for user in node.users
            if user not in values
            and (user.target is funcol.wait_tensor.default or is_view_or_cast(user) or _spliced(user))
        )
    return values


def saved_gathered_values(graph: fx.Graph) -> list[fx.Node]:
    """Graph outputs that are gathered parameters (a forward saving them for the backward)."""
    gathered = gathered_values(graph)
    outputs: list[fx.Node] = []
    fx.node.map_arg(graph.output_node().args[0], outputs.append)
    return [out for out in outputs if out in gathered]


def kept_params(graph: fx.Graph) -> dict[str, int]:
    """{FQN: bytes} of the gathered parameters kept between forward and backward: those a
    forward saves (returns), or those a backward receives (`kept_inputs`). Bytes are the kept
    value's; a parameter saved in two shapes (itself and its transpose) counts once, the larger."""
    gathered = gathered_values(graph)
    kept: dict[str, int] = {}
    for node in kept_inputs(graph) + saved_gathered_values(graph):
        fqn = _parameter_of(node, gathered)
        kept[fqn] = max(kept.get(fqn, 0), nbytes(node.meta["val"]))
    return kept


def _parameter_of(value: fx.Node, gathered: set[fx.Node]) -> str:
    """The FQN of the parameter a gathered value is: up through its gathered inputs to the meta
    of the joint graph's marker (`KEPT`) or to the collective's output for it (`zero_params`)."""
    while KEPT not in value.meta:
        if _is_gather(value):
            return value.meta["zero_params"][0][0]
        source = next(arg for arg in value.all_input_nodes if arg in gathered)
        if value.target is operator.getitem and (_is_gather(source) or source.target is _UNPACK):
            # Output i of a coalesced gather, or piece i of a flat gather's rows: parameter i.
            return source.meta["zero_params"][value.args[1]][0]
        value = source
    return value.meta[KEPT]


_UNPACK = unpack._opoverload


def _aliases(node: fx.Node) -> bool:
    """The node's value is its input's memory: a wait on it, a view, a getitem."""
    target = node.target
    return (
        target is operator.getitem
        or target is funcol.wait_tensor.default
        or (isinstance(target, torch._ops.OpOverload) and target.is_view)
    )


def flat_gather_parts(buffer: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the gathered buffer and its views, the per-parameter pieces `unpack` copies out of it in
    bucket order); no pieces for a buffer that is one parameter (coalesced, or a bucket of one)."""
    views, pieces, frontier = [], [], [buffer]
    while frontier:
        node = frontier.pop()
        views.append(node)
        for user in node.users:
            if user.target is _UNPACK:
                pieces.extend(sorted(user.users, key=lambda n: n.args[1]))
            elif _aliases(user) and _spliced(user):
                frontier.append(user)
    return views, pieces


def _numel(value: torch.Tensor) -> int:
    return value.numel()


def nbytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


def gathered_live_intervals(graph: fx.Graph, size: Callable[[torch.Tensor], int] = _numel) -> list[tuple[int, int, int]]:
    """(position of the all-gather, last position, size) of each gathered buffer: alive from the
    moment the collective is issued until the last use of it or of any view/copy of it. A
    coalesced all-gather has one buffer per parameter, each dying after its own last use. A
    backward's kept inputs (`kept_inputs`) are buffers too, alive from the graph's start.

    A gathered value belongs to the buffer its first gathered input belongs to, so the values
    form a forest rooted at the buffers: one walk down from each buffer (linear in the graph;
    testing every value against every buffer was quadratic, 1.8 s for a 48-layer forward)."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    gathered = gathered_values(graph)
    derived: dict[fx.Node, list[fx.Node]] = {}
    for node in gathered:
        first = next((arg for arg in node.all_input_nodes if arg in gathered), None)
        if first is not None:
            derived.setdefault(first, []).append(node)
    def chain_of(roots: list[fx.Node]) -> list[fx.Node]:
        chain, frontier = [], [root for root in roots if root in gathered]
        while frontier:
            value = frontier.pop()
            chain.append(value)
            frontier.extend(derived.get(value, ()))
        return chain

    def last_use(roots: list[fx.Node], chain: list[fx.Node]) -> int:
        return max((position[user] for n in chain for user in n.users), default=position[roots[0]])

    def largest(chain: list[fx.Node], default: fx.Node) -> int:
        # The largest form the parameter takes: the buffer itself, or, gathered as int8 codes,
        # its dequantised values (fp32 before a cast to the compute dtype).
        return max(
            (size(value.meta["val"]) for value in chain if isinstance(value.meta.get("val"), torch.Tensor)),
            default=size(default.meta["val"]),
        )

    intervals = []
    for node in graph.nodes:
        if not _is_gather(node):
            continue
        for buffer in outputs_of(node):
            views, pieces = flat_gather_parts(buffer)
            if not pieces:
                chain = chain_of([buffer])
                intervals.append((position[node], last_use([buffer], chain), largest(chain, buffer)))
                continue
            # A flat gather of several parameters: its buffer lives until `unpack` copies it out,
            # each parameter's copy until its own last use.
            intervals.append((position[node], last_use([buffer], views), size(buffer.meta["val"])))
            for piece in pieces:
                copies = chain_of([piece])
                intervals.append((position[node], last_use([piece], copies), largest(copies, piece)))
    # A backward's kept inputs are alive from its start; one buffer per parameter, though the
    # forward may have saved it in two shapes.
    kept: dict[str, list[fx.Node]] = {}
    for node in kept_inputs(graph):
        kept.setdefault(node.meta[KEPT], []).append(node)
    for inputs in kept.values():
        intervals.append((position[inputs[0]], last_use(inputs, chain_of(inputs)), max(size(node.meta["val"]) for node in inputs)))
    return intervals


def peak_gathered_numel(graph: fx.Graph) -> int:
    """Largest number of gathered-parameter elements alive at once in the graph."""
    return peak_alive(gathered_live_intervals(graph))


def peak_gathered_bytes(graph: fx.Graph) -> int:
    return peak_alive(gathered_live_intervals(graph, nbytes))


def peak_alive(intervals: list[tuple[int, int, int]]) -> int:
    """Largest sum of sizes of (start, end, size) intervals alive at one position (some start).

    Sorted starts and ends with running sums: at t, what started at or before t minus what ended
    before it (an interval ending before it starts is never alive)."""
    alive = [(s, e, n) for s, e, n in intervals if s <= e]
    starts = sorted((s, n) for s, _, n in alive)
    ends = sorted((e, n) for _, e, n in alive)
    started, ended = list(itertools.accumulate((n for _, n in starts), initial=0)), list(
        itertools.accumulate((n for _, n in ends), initial=0)
    )
    start_keys, end_keys = [s for s, _ in starts], [e for e, _ in ends]
    return max(
        (
            started[bisect.bisect_right(start_keys, t)] - ended[bisect.bisect_left(end_keys, t)]
            for t in {s for s, _, _ in intervals}
        ),
        default=0,
    )


_REDUCTIONS = {funcol.reduce_scatter_tensor.default, funcol.all_to_all_single.default, funcol.all_reduce.default}


# Packing ops whose first argument is the list of tensors packed into the collective's buffer.
_PACKING_LISTS = {pack._opoverload, torch.ops.aten.cat.default}


def _gradient_producers(node: fx.Node) -> list[fx.Node]:
    """The nodes that computed the gradients a reduction reads, looking through views, padding,
    the concatenation of a bucket and its quantisation (each once)."""
    if node.op != "call_function":
        return [node]
    if _spliced(node):
        inputs = node.all_input_nodes
    elif node.target in _PACKING_LISTS:
        inputs = node.args[0]
    elif is_view_or_cast(node) and node.target is not operator.getitem:
        inputs = [node.args[0]]
    else:
        return [node]
    return list(dict.fromkeys(producer for arg in inputs for producer in _gradient_producers(arg)))


def unreduced_grad_intervals(graph: fx.Graph, size: Callable[[torch.Tensor], int] = _numel) -> list[tuple[int, int, int]]:
    """(producer position, reduction position, size) of each gradient awaiting its reduction."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    intervals = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _REDUCTIONS:
            intervals.extend(
                (position[producer], position[node], size(producer.meta["val"]))
                for producer in _gradient_producers(node.args[0])
            )
    return intervals


def peak_unreduced_grad_bytes(graph: fx.Graph) -> int:
    return peak_alive(unreduced_grad_intervals(graph, nbytes))


def peak_unreduced_grad_numel(graph: fx.Graph) -> int:
    """Largest number of full-gradient elements alive at once while waiting for their reduction.

    Stage 1 keeps every gradient until the end of the backward, so this is all of them; stages 2-3
    reduce each as soon as it is produced, so it stays near the largest layer's.
    """
    return peak_alive(unreduced_grad_intervals(graph))
