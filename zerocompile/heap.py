"""Give the CPU heap's free pages back to the kernel every few optimizer steps.

On CPU, every step allocates and frees the same large buffers (gathered buckets, gloo's
coalesced-gather scratch, packed shards, all_to_all outputs, activations). glibc serves those of
up to 32 MB from its heap once its dynamic mmap threshold has risen, their order differs from step
to step, freed holes are not always reused, and the pages of a hole stay resident: a rank's
memory creeps with no live tensor behind it. Measured on the 12M GPT at stage 3 (2 gloo ranks,
batch 4, 2026-11-25), each step's peak RSS went from 604 to 1400 MB on one rank between steps 20
and 300. glibc gives free pages in the middle of its heap back only through `malloc_trim` (what a PyTorch
maintainer advises for glibc's retained pages, pytorch/pytorch#41486). After
every step that kept the peaks flat (560 -> 588 MB) but cost 20 % of that small model's steps/s
(the next step faults every returned page in again); every `TRIM_EVERY` steps keeps them within
8 % (584 -> 629 MB) at no measurable cost (2.8 steps/s either way).

The heap belongs to the process: one optimizer step post-hook per process trims while any model
sharded on a CPU group with `trim_heap=True` is alive. Where glibc's `malloc_trim` is missing it
does nothing, and an accelerator's allocator keeps its own pool, untouched.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

TRIM_EVERY = 10


class HeapTrimmer:
    """Calls `trim` after every `every`-th optimizer step (of any optimizer in the process) while a
    watched model is alive."""

    def __init__(self, trim: Callable[[], None], every: int = TRIM_EVERY) -> None:
        self._trim = trim
        self._every = every
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._steps = 0
        self.trims = 0
        self._hook = register_optimizer_step_post_hook(torch._dynamo.disable(self._after_optimizer_step))

    def watch(self, model: nn.Module) -> None:
        self._models.add(model)

    def close(self) -> None:
        self._hook.remove()

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._models:
            return
        self._steps += 1
        if self._steps % self._every == 0:
            self._trim()
            self.trims += 1


def _glibc_malloc_trim() -> Callable[[], None] | None:
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator has its own ways
        return None
    malloc_trim.argtypes = [ctypes.c_size_t]
    return lambda: malloc_trim(0)


_trimmer: HeapTrimmer | None = None


def trim_heap_while_alive(model: nn.Module) -> HeapTrimmer | None:
    """Trim this process's heap every `TRIM_EVERY` optimizer steps while `model` lives; the
    process's trimmer, or None where the heap cannot be trimmed."""
    global _trimmer
    if _trimmer is None:
        trim = _glibc_malloc_trim()
        if trim is None:
            return None
        _trimmer = HeapTrimmer(trim)
    _trimmer.watch(model)
    return _trimmer
