"""`hold_until_gloo_releases`: a collective's tensors are freed by Python only after gloo let go.

Issue 56's exit abort: a gloo worker thread that drops the last reference to a tensor whose Python
object torch preserved takes the GIL; during interpreter shutdown that ends the thread inside a
noexcept destructor and aborts a finished process ("terminate called without an active
exception", `passes/gloo_release.py`). The pass on hand-built graphs (no process group), the op on
a one-rank gloo group, and the pass in Inductor's code of a stage-3 model.
"""

from __future__ import annotations

import operator
import re
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.utils import run_and_get_code

import zerocompile as zc
from test_in_flight import Layers
from zerocompile.passes.gloo_release import hold_until_gloo_releases

aten = torch.ops.aten
funcol = torch.ops._c10d_functional
RELEASE = torch.ops.zerocompile.await_gloo_release.default

pytestmark = pytest.mark.core  # which thread frees a collective's tensors is torch's choice


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def test_the_tensors_the_graph_made_are_held_after_the_last_wait() -> None:
    graph = fx.Graph()
    shard, grad = graph.placeholder("shard"), graph.placeholder("grad")
    shard.meta["val"], grad.meta["val"] = meta(4), meta(8)
    packed = graph.call_function(aten.mul.Tensor, (grad, 2.0))
    packed.meta["val"] = meta(8)
    reduce = graph.call_function(funcol.reduce_scatter_tensor.default, (packed, "avg", 2, "0"))
    gather = graph.call_function(funcol.all_gather_into_tensor_coalesced.default, ([shard], 2, "0"))
    full = graph.call_function(operator.getitem, (gather, 0))
    wait_reduce = graph.call_function(funcol.wait_tensor.default, (reduce,))
    wait_full = graph.call_function(funcol.wait_tensor.default, (full,))
    for node, value in ((reduce, meta(4)), (full, meta(8)), (wait_reduce, meta(4)), (wait_full, meta(8))):
        node.meta["val"] = value
    use = graph.call_function(aten.add.Tensor, (wait_full, wait_full))
    graph.output((use, wait_reduce))

    assert hold_until_gloo_releases(graph) == 2

    graph.lint()
    order = list(graph.nodes)
    releases = [node for node in order if node.target is RELEASE]
    by_waits = {tuple(node.args[0][1:]): node for node in releases}
    # The reduction's own input is held (the graph made it); a placeholder is the caller's.
    assert set(by_waits) == {(packed, wait_reduce), (wait_full,)}
    for held, release in by_waits.items():
        probe = release.args[0][0]
        assert probe.target is aten.empty.memory_format and probe.meta["val"].numel() == 0
        assert order.index(held[-1]) < order.index(probe) < order.index(release)
        assert release.meta["val"] is None


def test_a_graph_without_collectives_is_left_as_it_is() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(aten.mul.Tensor, (x, x)))
    before = list(graph.nodes)

    assert hold_until_gloo_releases(graph) == 0
    assert list(graph.nodes) == before


def test_nothing_removes_the_release_though_nobody_reads_it() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = meta(4)
    gathered = graph.call_function(funcol.all_gather_into_tensor.default, (x, 2, "0"))
    gathered.meta["val"] = meta(8)
    waited = graph.call_function(funcol.wait_tensor.default, (gathered,))
    waited.meta["val"] = meta(8)
    graph.output(graph.call_function(aten.relu.default, (waited,)))
    hold_until_gloo_releases(graph)

    graph.eliminate_dead_code()

    assert len(graph.find_nodes(op="call_function", target=RELEASE)) == 1


def test_a_tensor_gloo_held_is_freed_on_the_main_thread_after_the_release(single_rank) -> None:
    """Without the release call about half of these tensors are freed by a gloo worker thread
    (measured: 4 of 10), the path that aborts a process at exit."""
    group = dist.group.WORLD.group_name
    main = threading.get_ident()
    freed_on: list[bool] = []
    for _ in range(20):
        sent = torch.randn(1 << 16)
        weakref.finalize(sent, lambda: freed_on.append(threading.get_ident() == main))
        received = funcol.wait_tensor(funcol.all_gather_into_tensor(sent, 1, group))

        RELEASE([torch.empty(0, dtype=torch.uint8), sent, received])

        assert (sent._use_count(), received._use_count()) == (1, 1)
        del sent, received
    time.sleep(0.1)  # a worker thread freeing one would run its finalizer by now
    assert freed_on == [True] * 20


ISSUE = re.compile(r"^\s*(\w+) = torch\.ops\._c10d_functional\.(?!wait_tensor)\w+\.default\(")
GETITEM = re.compile(r"^\s*(\w+) = (\w+)\[\d+\]$")
RELEASE_CALL = re.compile(r"torch\.ops\.zerocompile\.await_gloo_release\.default\(\[(.*)\]\)$")


@pytest.mark.parametrize("bucket_bytes", [0, None], ids=["per-parameter", "bucketed"])
def test_inductor_code_waits_for_gloo_to_let_go_of_every_collective(single_rank, bucket_bytes: int | None) -> None:
    """In the code Inductor generates, a release call after every collective names its output
    buffer (a coalesced one's: its getitem), so Python frees none of them before gloo has, and
    gloo's work (inputs first, then outputs) is gone before the graph goes on."""
    model = zc.shard(Layers(), 3, bucket_bytes=bucket_bytes)
    compiled = torch.compile(model, backend="zero")

    _, codes = run_and_get_code(lambda: compiled(torch.randn(4, 16)).backward())

    for code in codes:
        collective_of: dict[str, str] = {}
        released: list[set[str]] = []
        for line in code.splitlines():
            if issue := ISSUE.match(line):
                collective_of[issue[1]] = issue[1]
            elif (item := GETITEM.match(line)) and item[2] in collective_of:
                collective_of[item[1]] = item[2]
            elif call := RELEASE_CALL.search(line):
                released.append({collective_of[name] for name in call[1].split(", ") if name in collective_of})
        issued = set(collective_of.values())
        assert issued and len(released) == len(issued), code
        assert set().union(*released) == issued, code
