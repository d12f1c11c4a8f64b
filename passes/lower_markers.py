"""Replace the marker ops of a partitioned forward or backward graph with collectives, per stage.

Runs on each graph AOTAutograd hands to the compiler (after partitioning), so the rewrite sees the
forward and the backward separately. Each bucket of `unshard`s becomes one gather (on gloo a
coalesced all-gather with a wait per parameter, on every other backend one flat all-gather, one
wait and one copy out) + slice + view, and each bucket of `reduce_grad`s pack + reduce-scatter (or
all-reduce) + wait, traced from the same functions the markers run eagerly (`lowering.py`).
Where they go is the stage's policy (`stages.py`):

- a marker of a stage that does not shard parameters is dropped (the parameter is whole; cast
  for mixed precision), and so is a `local` `unshard` at any stage (no_sync: a full local copy);
- `gathers_at_forward_start`: gathers of graph inputs move to the start of the forward (with
  prefetch, issued `prefetch` buckets ahead and each waited on just before its first use);
- `reduces_at_backward_end`: reductions read only by the output move to the end of the backward;
- otherwise gathers go just before their use (the backward's re-gathers too, placed by the
  partitioner at first use), above the pointwise and reduction nodes that lead up to it
  (`_gather_after_the_last_kernel_call`), and reductions where the gradient is produced, below
  the pointwise and reduction nodes that follow it (`_reduce_before_the_next_kernel_call`); values
  die after their last use, which Inductor's buffer reuse and FX's generated `del`s both honour.

Every inserted node carries `meta["val"]`, a fake tensor of the graph's own fake mode (`recording`).

We bucket here rather than with Inductor's `bucket_all_gathers_fx` / `bucket_reduce_scatters_fx`:
those merge `reduce_scatter_tensor`, not gloo's all-to-all reduce-scatter, and the eager
compiler's path has no such pass.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable

import torch
import torch.fx as fx

from .lowering import all_reduce_bucket, gather_bucket, reduce_scatter_bucket
from .marker_args import UnshardArgs
from .markers import is_reduce_grad, is_unshard, reduce_grad_args, unshard_args
from .recording import record_ops
from .stages import stage_policy


def lower_markers(
    graph: fx.Graph, bucket_bytes: int = 0, prefetch: int = 0, decompositions: dict | None = None
) -> dict[str, int]:
    """Rewrite every marker in `graph` in place; returns counts of what was lowered.

    bucket_bytes: markers next to each other in graph order share one collective until a bucket
        holds this many bytes of full tensors (0: one collective per parameter).
    prefetch: issue each gather this many buckets ahead of its use, and leave each reduction in
        flight until the next one starts (0: every collective is waited on at once).
    decompositions: the compiler's decomposition table, applied to the inserted nodes (Inductor
        expects post-grad graphs already decomposed, e.g. no aten._to_copy).
    """
    counts = {"gathers": 0, "reductions": 0, "identities": 0, "gather_buckets": 0, "reduction_buckets": 0}
    _place_by_stage(graph)
    tracer = functools.partial(_splice, decompositions=decompositions)
    for node in [n for n in graph.nodes if is_unshard(n) and unshard_args(n).whole is not None]:
        _forward_whole_parameter(node, tracer)
        counts["identities"] += 1
    gathers, gathers_up_front = [], []
    for bucket in _buckets([n for n in graph.nodes if is_unshard(n)], bucket_bytes, _can_gather_early):
        markers = [unshard_args(n) for n in bucket]
        first = markers[0]
        shapes = [m.shape for m in markers]
        # Such gathers of graph inputs were moved to the top by _place_by_stage.
        up_front = stage_policy(first.stage).gathers_at_forward_start and _can_gather_early(bucket[0])
        spliced = tracer(
            bucket,
            bucket[0],
            lambda *shards: gather_bucket(
                list(shards), shapes, first.group_name, first.world_size, first.reduce_scatter, first.compute_dtype,
                first.gather_quant_block,
            ),
        )
        (gathers_up_front if up_front else gathers).append(spliced)
        counts["gathers"] += len(bucket)
    reductions = []
    for bucket in _buckets([n for n in graph.nodes if is_reduce_grad(n)], bucket_bytes, _can_reduce_late):
        markers = [reduce_grad_args(n) for n in bucket]
        first = markers[0]
        if stage_policy(first.stage).reduction == "all_reduce":
            fn = lambda *grads: all_reduce_bucket(list(grads), first)  # noqa: E731
        else:
            numels = [m.shard_numel for m in markers]
            fn = lambda *grads: reduce_scatter_bucket(list(grads), numels, first)  # noqa: E731
        reductions.append(tracer(bucket, bucket[-1], fn))
        counts["reductions"] += len(bucket)
    counts["gather_buckets"] = len(gathers) + len(gathers_up_front)
    counts["reduction_buckets"] = len(reductions)
    for bucket in gathers:
        _gather_after_the_last_kernel_call(bucket)
    spliced_reductions = {node for bucket in reductions for node in bucket}
    for bucket in reductions:
        _reduce_before_the_next_kernel_call(bucket, spliced_reductions)
    if prefetch:
        _wait_gathers_at_first_use(gathers_up_front)
        _issue_gathers_early(_in_wait_order(gathers_up_front), prefetch)
        _issue_gathers_early(gathers, prefetch)
        _wait_reductions_late(reductions)
    graph.lint()
    return counts


def _full_bytes(node: fx.Node) -> int:
    value = node.meta["val"] if is_unshard(node) else node.args[0].meta["val"]
    return value.numel() * value.element_size()


def _can_gather_early(node: fx.Node) -> bool:
    """A gather may move up to its bucket's first member only if its shard is a graph input."""
    return unshard_args(node).shard.op == "placeholder"


def _can_reduce_late(node: fx.Node) -> bool:
    """A reduction may move down to its bucket's last member only if just the output reads it."""
    return all(user.op == "output" for user in node.users)


def _served(marker: fx.Node) -> tuple[str, int]:
    """(FQN, bytes this rank holds of it: its shard, or the whole tensor if the stage keeps it whole)."""
    if is_unshard(marker):
        shard = unshard_args(marker).shard.meta["val"]
        return unshard_args(marker).param, shard.numel() * shard.element_size()
    reduce = reduce_grad_args(marker)
    grad = reduce.grad.meta["val"]
    numel = reduce.shard_numel if stage_policy(reduce.stage).shards_parameters else grad.numel()
    return reduce.param, numel * grad.element_size()


def _bucket_key(node: fx.Node) -> tuple:
    """Markers may share a collective only with the same stage, groups, dtypes and quantisation."""
    if is_unshard(node):
        marker = unshard_args(node)
        return (
            marker.stage, marker.group_name, marker.world_size, marker.reduce_scatter, node.meta["val"].dtype,
            marker.gather_quant_block,
        )
    marker = reduce_grad_args(node)
    return (
        marker.stage, marker.group_name, marker.world_size, marker.reduce_scatter, marker.reduce_dtype,
        node.args[0].meta["val"].dtype, marker.grad_dtype, marker.quant_block, marker.replica_group, marker.replicas,
        marker.replica_quant_block,
    )


def _buckets(markers: list[fx.Node], bucket_bytes: int, movable: Callable[[fx.Node], bool]) -> list[list[fx.Node]]:
    """Consecutive markers with one bucket key, up to `bucket_bytes` of full tensors each; a marker
    that cannot move to where its bucket's collective goes stays alone."""
    buckets: list[list[fx.Node]] = []
    size = 0
    for node in markers:
        current = buckets[-1] if buckets else None
        if (
            current is not None
            and movable(node)
            and movable(current[0])
            and _bucket_key(current[0]) == _bucket_key(node)
            and size + _full_bytes(node) <= bucket_bytes
        ):
            current.append(node)
            size += _full_bytes(node)
        else:
            buckets.append([node])
            size = _full_bytes(node)
    return buckets


def _issue_gathers_early(buckets: list[list[fx.Node]], distance: int) -> None:
    """Start bucket k's all-gather right after bucket k-distance's wait, so it runs during the
    compute in between; its wait stays just before its first use. Only gathers of graph inputs
    move (stage-3 backward re-gathers and all forward gathers)."""
    for k, bucket in enumerate(buckets[1:], start=1):
        issue, waits, _unpack = _split_at_wait(bucket)
        if any(arg.op != "placeholder" for node in issue for arg in node.all_input_nodes if arg not in issue):
            continue
        # The first `distance` buckets are all issued up front, one after another.
        anchor = _split_at_wait(buckets[k - distance])[1][-1] if k >= distance else _split_at_wait(buckets[k - 1])[0][-1]
        position = {node: i for i, node in enumerate(anchor.graph.nodes)}
        if position[anchor] > position[waits[0]]:
            continue  # its own wait comes first (first uses out of bucket order): stay in place
        for node in issue:
            anchor.append(node)
            anchor = node


def _gather_after_the_last_kernel_call(bucket: list[fx.Node]) -> None:
    """Move a spliced gather (issue, waits, views) up past the pointwise, reduction and view nodes
    right before it, to just after the node before them that runs as a call of its own (a
    matmul, attention, a collective, a custom op) or a graph input.

    Inductor's C++ backend writes neighbouring pointwise and reduction nodes into one kernel and
    ends the kernel at every extern node, and a gather's issue and waits are extern nodes: placed
    just before a weight's use, the wait split the computation leading up to it (a LayerNorm's
    statistics from its affine part, the positions' arange from the embedding) into kernels of
    their own. On the 12m GPT at stage 3 the forward compiled 12 kernels against plain
    torch.compile's 10 (the same saved tensors), and every extra kernel is a compiler run and a
    pass over the activations. The cost is a few fused nodes: with prefetch the issue sits earlier
    anyway and only the wait moves, giving up the overlap with them; without, the gathered buffer
    is also allocated that much earlier. A no-op for a gather already after such a node, and it
    never moves above a node the gather reads.
    """
    members = set(bucket)
    inputs = {arg for node in bucket for arg in node.all_input_nodes if arg not in members}
    stop = bucket[0].prev
    while stop.op == "call_function" and stop not in inputs and _fused_into_kernels(stop):
        stop = stop.prev
    anchor = stop.next
    if anchor is bucket[0]:
        return
    for node in bucket:
        anchor.prepend(node)


def _reduce_before_the_next_kernel_call(bucket: list[fx.Node], spliced: set[fx.Node]) -> None:
    """Move a spliced reduction (pack, collective, waits, unpacking) down past the pointwise,
    reduction and view nodes right after it, to just before the next node that runs as a call of
    its own, reads the reduction, or belongs to another reduction (`spliced`: buckets keep their
    order, so `_wait_reductions_late` finds each one's collective before the next one's start).

    The mirror of `_gather_after_the_last_kernel_call`: placed just after a bucket's last gradient
    is produced, the pack (an extern node) split that gradient's kernel from the computation
    after it (an MLP's bias-gradient sum from the LayerNorm backward that follows), so the 12m
    GPT's stage-3 backward compiled more kernels than plain torch.compile's. The cost is a few
    fused nodes of delay before the collective starts, and the bucket's gradients live that much
    longer. A no-op for a reduction already before such a node (one moved to the backward's end
    sits before the output).
    """
    members = set(bucket)
    stop = bucket[-1].next
    while (
        stop.op == "call_function"
        and stop not in spliced
        and not any(arg in members for arg in stop.all_input_nodes)
        and _fused_into_kernels(stop)
    ):
        stop = stop.next
    if stop is bucket[-1].next:
        return
    for node in bucket:
        stop.prepend(node)


# Indexing ops Inductor lowers into kernels (loads and stores at computed indices) that no aten
# tag marks as such: the embedding and its backward's accumulating index_put, gathers, scatters.
_INDEXING_KERNELS = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "embedding", "index", "_unsafe_index", "_unsafe_masked_index", "index_put", "_unsafe_index_put",
        "_unsafe_masked_index_put_accumulate", "gather", "scatter_add",
    )
)


def _fused_into_kernels(node: fx.Node) -> bool:
    """The node's op is one Inductor generates into a kernel with its neighbours: a view, a
    pointwise op or a reduction (as aten tags them), an indexing op, a tensor made from no input
    (arange, full), or the getitem of a multi-output one."""
    if node.target is operator.getitem or not node.all_input_nodes:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in ("_c10d_functional", "zerocompile"):
        return False
    return (
        target.is_view
        or torch.Tag.pointwise in target.tags
        or torch.Tag.reduction in target.tags
        or target.overloadpacket in _INDEXING_KERNELS
    )


def _wait_gathers_at_first_use(buckets: list[list[fx.Node]]) -> None:
    """Gathers at the forward's start: each bucket's waits (and their slices and views) move down from the top of the forward
    to just before the first node reading one of its parameters; `_issue_gathers_early` then
    starts each gather `prefetch` buckets ahead, so later buckets arrive while the first layers
    compute. (All gathers in flight at once would cost no memory here, full parameters live
    through the step at these stages, but gloo corrupts its heap when two coalesced all-gathers
    run at once: see `zerocompile.config.refuse_concurrent_gloo_gathers`. With prefetch 1 one
    gather is in flight at a time.)"""
    if not buckets:
        return
    position = {node: i for i, node in enumerate(buckets[0][0].graph.nodes)}
    for bucket in buckets:
        _issue, waits, unpack = _split_at_wait(bucket)
        moved = [*waits, *unpack]
        readers = [user for node in moved for user in node.users if user not in moved]
        first_reader = min(readers, key=position.__getitem__)
        for node in moved:
            first_reader.prepend(node)


def _in_wait_order(buckets: list[list[fx.Node]]) -> list[list[fx.Node]]:
    if not buckets:
        return buckets
    position = {node: i for i, node in enumerate(buckets[0][0].graph.nodes)}
    return sorted(buckets, key=lambda bucket: position[_split_at_wait(bucket)[1][0]])


def _wait_reductions_late(buckets: list[list[fx.Node]]) -> None:
    """Wait for bucket k's reduction just before bucket k+1's starts: its collective runs during
    the backward compute in between, and at most two are in flight."""
    for earlier, later in zip(buckets, buckets[1:]):
        _issue, waits, unpack = _split_at_wait(earlier)
        moved = [*waits, *unpack]
        if any(user.op != "output" and user not in moved for node in moved for user in node.users):
            continue  # something in the graph reads the reduced gradient: it must be ready in place
        start = _split_at_wait(later)[0][0]
        for node in moved:
            start.prepend(node)


def _split_at_wait(bucket: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """A spliced bucket as (packing + collectives, its last waits, what reads them), in graph order.

    A bucket of two collectives in a row (hybrid sharding's mean across replicas after the
    reduce-scatter inside the node; stage 0's int8 all-reduce as a reduce-scatter and a gather)
    keeps the wait of the first in its issue part, since the second reads it: only the last
    waits count, so the collective that crosses nodes can stay in flight beside the backward."""
    all_waits = [n for n in bucket if n.target is torch.ops._c10d_functional.wait_tensor.default]
    # The walk stays inside the bucket: its nodes read only each other and the markers' inputs,
    # so no path leaves it and comes back (walking every ancestor made this quadratic: 0.8 s of a
    # 48-layer backward's lowering with 145 buckets).
    members = set(bucket)
    ancestors: set[fx.Node] = set()
    frontier = list(all_waits)
    while frontier:
        for arg in frontier.pop().all_input_nodes:
            if arg in members and arg not in ancestors:
                ancestors.add(arg)
                frontier.append(arg)
    waits = [n for n in all_waits if n not in ancestors]
    issue = [n for n in bucket if n in ancestors]
    return issue, waits, [n for n in bucket if n not in waits and n not in ancestors]


def _place_by_stage(graph: fx.Graph) -> None:
    placeholders = graph.find_nodes(op="placeholder")
    last_moved = placeholders[-1] if placeholders else None
    output = graph.output_node()
    for node in list(graph.nodes):
        if is_unshard(node) and _gathers_at_start(unshard_args(node)):
            last_moved.append(node)  # behind the previous one: gathers keep program order
            last_moved = node
        elif (
            is_reduce_grad(node)
            and stage_policy(reduce_grad_args(node).stage).reduces_at_backward_end
            and set(node.users) == {output}
        ):
            output.prepend(node)


def _gathers_at_start(marker: UnshardArgs) -> bool:
    return stage_policy(marker.stage).gathers_at_forward_start and not marker.reads_local_copy and marker.shard.op == "placeholder"


def _forward_whole_parameter(node: fx.Node, tracer: Callable) -> None:
    """The marker's input already is the full parameter (cast for mixed precision): the shard of
    an unsharded parameter, or the local copy it reads."""
    param = unshard_args(node).whole
    dtype = unshard_args(node).compute_dtype
    if dtype is not None and dtype != param.meta["val"].dtype:
        tracer([node], node, lambda p: [p.to(dtype)])
        return
    if any(user.op == "output" for user in node.users):
        # A graph output may not alias a graph input, so a parameter returned as such is copied.
        node.target = torch.ops.aten.clone.default
        node.args = (param,)
        return
    node.replace_all_uses_with(param)
    node.graph.erase_node(node)


def _marker_input(marker: fx.Node) -> fx.Node:
    """What a marker's collective (or identity) reads: the shard or the gradient, or for an
    `unshard` whose input already is the full parameter, that (`UnshardArgs.whole`)."""
    whole = unshard_args(marker).whole if is_unshard(marker) else None
    return marker.args[0] if whole is None else whole


def _splice(
    markers: list[fx.Node],
    anchor: fx.Node,
    fn: Callable[..., list[torch.Tensor]],
    *,
    decompositions: dict | None,
) -> list[fx.Node]:
    """Record `fn(*marker tensors)` (values in the graph's fake mode), insert the traced nodes before
    `anchor` and let its outputs replace the markers; returns the inserted nodes in order.

    Each new node's meta["zero_params"] lists (FQN, bytes this rank holds of it) for the
    parameters it serves, meta["zero_groups"] the (size, stride) of each group its collectives run
    on (the shard group: consecutive ranks, stride 1; with hybrid sharding also the replica group,
    every K-th rank), and a reduction's nodes meta["zero_reduction"]: the ledger reads them.
    """
    graph = anchor.graph
    args = [_marker_input(marker) for marker in markers]
    traced = record_ops(fn, [arg.meta["val"] for arg in args], decompositions)
    params = [_served(marker) for marker in markers]
    first = unshard_args(markers[0]) if is_unshard(markers[0]) else reduce_grad_args(markers[0])
    reduction = is_reduce_grad(markers[0])
    groups = {first.group_name: (first.world_size, 1)}
    if first.replicas > 1:
        groups[first.replica_group] = (first.replicas, first.world_size)
    for new_node in traced.nodes:
        new_node.meta["zero_params"] = params
        new_node.meta["zero_groups"] = groups
        if reduction:  # its collectives reduce gradients, whatever their op (a quantised all-reduce gathers)
            new_node.meta["zero_reduction"] = True
    before = anchor.prev
    with graph.inserting_before(anchor):
        outputs = graph.graph_copy(traced, dict(zip(traced.find_nodes(op="placeholder"), args)))
    inserted = []
    node = before.next
    while node is not anchor:
        inserted.append(node)
        node = node.next
    for marker, output in zip(markers, outputs):
        marker.replace_all_uses_with(output)
    for marker in markers:
        graph.erase_node(marker)
    return inserted
