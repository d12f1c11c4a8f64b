"""Hold each collective's tensors until gloo has let go of them, so Python never lets go first.

For process groups on gloo. A gloo worker thread holds a collective's input and output tensors for a
moment after the collective completes: `wait_tensor` returns when the work is marked done, and the
worker drops its reference only afterwards. The compiled graph (Inductor's wrapper or the FX code of
the eager compiler) frees a tensor at its last use, often while gloo still holds it; torch then
keeps the tensor's Python object alive ("resurrects" it, PyObject preservation), and the gloo worker
thread that later drops the last reference must take the GIL to free that Python object. If the
interpreter is finalizing by then (the run ended right after a collective), CPython ends that
thread with `pthread_exit` inside the tensor's noexcept destructor, and the C++ runtime aborts the
finished process: "terminate called without an active exception" (SIGABRT). Upstream:
pytorch/pytorch#117762 (a C++ thread taking the GIL at interpreter shutdown crashes the process).
DDP never meets it: its buckets have no Python objects.

`hold_until_gloo_releases` puts, after the last wait of every collective, one call that takes the
tensors the graph made for it (its inputs that are not graph inputs, and its waited outputs) and
returns once gloo holds none of them: their C++ reference counts are back to that of a fresh
tensor passed in the same call (the probe, first in the list). Their last use is that call at the
earliest, so Python frees them after gloo, and by then gloo's work is gone: it frees its inputs
before its outputs (measured for all-gather, coalesced all-gather, reduce-scatter and all-to-all
on torch 2.11, 2.13 and 2.15), so an input Inductor passed as an inline `reinterpret_tensor` view
(a temporary this call cannot name) has been freed too, by the worker, while the call let go of the
GIL and the interpreter was alive. Past the call no gloo thread has anything left to free. The
wait is for bookkeeping after a collective that has completed: microseconds, nothing is sent.
"""

from __future__ import annotations

import time

import torch
import torch.fx as fx

from .analysis import waits_of
from .one_in_flight import is_collective

# Longer than any release takes; reaching it means something other than gloo holds a tensor, and
# waiting on would hang the step: the tensors are then freed as they would have been without us.
_GIVE_UP_SECONDS = 5.0


@torch.library.custom_op("zerocompile::await_gloo_release", mutates_args=())
def await_gloo_release(tensors: list[torch.Tensor]) -> None:
    """Return once no tensor of `tensors[1:]` has more C++ owners than `tensors[0]`, a fresh one."""
    probe, *held = tensors
    owners = probe._use_count()
    if all(tensor._use_count() <= owners for tensor in held):
        return
    deadline = time.monotonic() + _GIVE_UP_SECONDS
    while any(tensor._use_count() > owners for tensor in held) and time.monotonic() < deadline:
        time.sleep(0)  # lets go of the GIL: freeing an input's Python object, gloo's worker needs it


@await_gloo_release.register_fake
def _(tensors: list[torch.Tensor]) -> None:
    return None


# A call whose result nobody reads: without this, FX's and Inductor's dead-code elimination
# (torch._library.utils.is_impure) would drop it.
torch.fx.node.has_side_effect(torch.ops.zerocompile.await_gloo_release.default)


def _made_by_the_graph(node: object) -> bool:
    return isinstance(node, fx.Node) and node.op != "placeholder"


def hold_until_gloo_releases(graph: fx.Graph) -> int:
    """After the last wait of each collective, in place, a call to `await_gloo_release` on the
    tensors the graph made for it; returns how many calls were inserted.

    Run after `one_in_flight.wait_before_each_collective`, which settles where the waits are.
    """
    order = {node: index for index, node in enumerate(graph.nodes)}
    inserted = 0
    for collective in [node for node in graph.nodes if is_collective(node)]:
        waits = waits_of(collective)
        if not waits:
            continue
        sent = collective.args[0] if isinstance(collective.args[0], (list, tuple)) else [collective.args[0]]
        held = [node for node in sent if _made_by_the_graph(node)] + waits
        last_wait = max(waits, key=order.__getitem__)
        value = last_wait.meta["val"]
        with graph.inserting_after(last_wait):
            probe = graph.call_function(
                torch.ops.aten.empty.memory_format, ([0],), {"dtype": torch.uint8, "device": value.device}
            )
        probe.meta["val"] = _empty_like_value(value)
        with graph.inserting_after(probe):
            release = graph.call_function(torch.ops.zerocompile.await_gloo_release.default, ([probe, *held],))
        release.meta["val"] = None
        inserted += 1
    return inserted


def _empty_like_value(value: torch.Tensor) -> torch.Tensor:
    """The probe's meta value: a fake tensor of the graph's fake mode, or a meta tensor where the
    graph's values are meta tensors (a graph built by hand)."""
    fake_mode = getattr(value, "fake_mode", None)
    if fake_mode is None:
        return torch.empty(0, dtype=torch.uint8, device="meta")
    with fake_mode:
        return torch.empty(0, dtype=torch.uint8, device=value.device)
