"""Host work as a number: the kernel-like ops one training step dispatches, from torch.profiler.

On a GPU a step whose kernels are small is bound by the host's calls, one per kernel, copy or
collective, so their count is what per-parameter work inflates (a wait and a cast per parameter
instead of per bucket). `bench` reports it for every mode; a test pins stage 3's against plain
torch.compile's.

An op counts where it does work: a profiler event is kernel-like if it names an operator
(`namespace::name`, resolved in `torch.ops`) or an Inductor kernel (`cpp_fused_*`, `triton_*`),
is not a view, an allocation or a metadata query, and no event below it counts (`aten::to` is the
`aten::copy_` it runs; `aten::mm` with only `aten::resolve_conj` beneath is one). A collective
counts once: the copies a fake process group makes inside its call stand for transfers, not host
work. So does `split_with_sizes_copy` (FSDP2's and our copy out of gathered rows), one kernel on
CUDA and a copy per tensor on the CPU. Inductor's C++ kernels are seen only when compiled with `cpp.enable_kernel_profile`
(`kernel_profiling`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch.autograd.profiler_util import FunctionEvent

from zerocompile.tools.measuring import finish_queued_work

# Allocations and queries: no kernel runs.
_NOT_KERNELS = frozenset(
    {
        "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_", "aten::set_", "aten::lift_fresh",
        "aten::detach", "aten::detach_", "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero",
        "aten::result_type", "aten::is_same_size", "aten::_has_compatible_shallow_copy_type", "aten::resolve_conj",
        "aten::resolve_neg", "aten::record_stream", "aten::is_pinned", "aten::size", "aten::stride", "aten::numel",
        "aten::dim", "aten::contiguous", "aten::new_empty", "aten::new_empty_strided",
    }
)
_COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::", "record_param_comms", "nccl:", "gloo:")
# Ops one kernel runs on an accelerator, whose CPU kernels dispatch a copy per tensor: counted
# once, as the GPU step this count stands for launches them.
_ONE_KERNEL_ON_ACCELERATORS = frozenset({"aten::split_with_sizes_copy", "aten::_chunk_cat"})
_WAIT = "_c10d_functional::wait_tensor"


@functools.lru_cache(maxsize=None)
def _is_operator_view(name: str) -> bool | None:
    """Whether `name` ("ns::op") is a view op; None if it names no operator."""
    namespace, _, op = name.partition("::")
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return None
    overloads = [getattr(packet, overload) for overload in packet.overloads()]
    return any(overload.is_view for overload in overloads)


def _is_inductor_kernel(name: str) -> bool:
    return "cpp_fused" in name or (name.startswith("triton_") and "fused" in name)


def _kernel_like(name: str) -> bool:
    if _is_inductor_kernel(name):
        return True
    if name in _NOT_KERNELS or "::" not in name:
        return False
    return _is_operator_view(name) is False


def _is_collective(name: str) -> bool:
    return name.startswith(_COLLECTIVE_PREFIXES) and name != _WAIT


def count_kernel_like(events: list[FunctionEvent]) -> collections.Counter[str]:
    """{op or kernel name: times dispatched} over the profiler's CPU events (their tree)."""
    counts: collections.Counter[str] = collections.Counter()

    def visit(event: FunctionEvent) -> int:
        if _is_collective(event.name) or event.name in _ONE_KERNEL_ON_ACCELERATORS:
            counts[event.name] += 1
            return 1
        below = sum(visit(child) for child in event.cpu_children)
        if below or not _kernel_like(event.name):
            return below
        counts[event.name] += 1
        return 1

    for event in events:
        if event.cpu_parent is None and event.device_type == torch.autograd.DeviceType.CPU:
            visit(event)
    return counts


@contextlib.contextmanager
def kernel_profiling() -> Iterator[None]:
    """Inductor's generated C++ kernels record themselves in the profiler while compiled inside
    this block (a config patch of this thread's Inductor settings, undone on exit)."""
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        yield


def dispatched_per_step(step: Callable[[], None], device: torch.device) -> dict[str, object]:
    """Profile one call of `step` (warmed up, compiled already): kernel-like ops on the host, and
    on an accelerator the kernels its device ran. {"ops": n, "kernels": n or None, "top": [...]}."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    accelerator = device.type != "cpu"
    if accelerator:
        activities.append(torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.XPU)
    with torch.profiler.profile(activities=activities) as profile:
        step()
        finish_queued_work(device)
    events = profile.events()
    counts = count_kernel_like(events)
    kernels = (
        sum(1 for event in events if event.device_type != torch.autograd.DeviceType.CPU and event.cpu_parent is None)
        if accelerator
        else None
    )
    return {"ops": sum(counts.values()), "kernels": kernels, "top": counts.most_common(8)}
