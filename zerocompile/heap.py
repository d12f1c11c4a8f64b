"""Keep a CPU rank's memory where its live tensors are: large tensors from a cache of mapped
blocks, and glibc's heap trimmed every few optimizer steps.

On CPU, every step allocates and frees the same large buffers (gathered buckets, gloo's scratch,
packed shards, all_to_all outputs, activations). Under glibc's malloc those of up to 32 MB come
from its heap once its dynamic mmap threshold has risen; the order differs from step to step
(gloo's threads), freed holes are not always reused, and a hole's pages stay resident: a rank's
memory creeps with no live tensor behind it. Measured on the 12M GPT at stage 3 (2 gloo ranks,
batch 4, untrimmed, 2026-11-27), one rank went from 605 to 1,390 MB between steps 20 and 300.
Trimming (`malloc_trim`, what a PyTorch maintainer advises for glibc's retained pages,
pytorch/pytorch#41486) every 10 steps held the creep to +2-11 MB but not below DDP's.

The cure is to keep those buffers out of glibc's heap: `csrc/cpu_block_cache.cpp`, installed as
c10's CPU allocator, maps every tensor of 128 KiB or more straight from the kernel and keeps
freed blocks for the next request of the same size. A step asks for the same sizes as the last,
so after the first few steps nothing new is mapped (the same run: 564 -> 564 MB, untrimmed).
What it keeps is bounded by the last steps' transient working set (see the source), and blocks
idle for `TRIM_EVERY` steps are unmapped. Smaller tensors still come from glibc, trimmed every
`TRIM_EVERY` steps.

Both belong to the process, as the heap does: while any model sharded on a CPU group with
`steady_heap=True` is alive, one optimizer step post-hook drives them; when the last such model
is collected the default CPU allocator is back. The cache is C++ built on first use with the
compiler Inductor's CPU code needs anyway (`CXX`, else `c++`), into `~/.cache/zerocompile`;
where it cannot be built or installed, a warning says why and only the trimming remains.
Accelerators keep their own allocators, untouched.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from zerocompile import torch_support

TRIM_EVERY = 10
SOURCE = Path(__file__).with_name("csrc") / "cpu_block_cache.cpp"


@dataclass(frozen=True)
class BlockCacheStats:
    """Bytes and block counts of the CPU block cache (counts since the process began)."""

    mapped_bytes: int
    cached_bytes: int
    in_use_bytes: int
    cap_bytes: int
    blocks_mapped: int
    blocks_reused: int


class BlockCache:
    """The ctypes face of `csrc/cpu_block_cache.cpp`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        self._lib.zc_block_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]

    def install(self) -> bool:
        return bool(self._lib.zc_block_cache_install())

    def uninstall(self) -> None:
        self._lib.zc_block_cache_uninstall()

    def installed(self) -> bool:
        return bool(self._lib.zc_block_cache_installed())

    def after_optimizer_step(self) -> None:
        self._lib.zc_block_cache_after_optimizer_step()

    def end_epoch(self) -> None:
        self._lib.zc_block_cache_end_epoch()

    def stats(self) -> BlockCacheStats:
        values = (ctypes.c_int64 * 6)()
        self._lib.zc_block_cache_stats(values)
        return BlockCacheStats(*values)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zerocompile"


def build_block_cache() -> BlockCache:
    """The block cache's library, compiled once per source, torch and compiler (kept under
    `~/.cache/zerocompile`, or a temporary directory where that cannot be made; ranks building at
    once each write their own file and rename it)."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"the block cache is built for Linux only, not {sys.platform}")
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set CXX)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + torch_support.RELEASE.encode() + compiler.encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_block_cache-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only home: this process's own directory will do
            target = Path(tempfile.mkdtemp(prefix="zerocompile-")) / target.name
        from torch.utils.cpp_extension import include_paths, library_paths  # 0.2 s: only to build

        (lib_dir,) = library_paths()
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        command = [
            compiler, "-O2", "-std=c++17", "-shared", "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{path}" for path in include_paths()),
            str(SOURCE), f"-L{lib_dir}", "-lc10", f"-Wl,-rpath,{lib_dir}", "-o", partial,
        ]  # fmt: skip
        try:
            built = subprocess.run(command, capture_output=True, text=True)
            if built.returncode != 0:
                raise RuntimeError(f"{compiler} failed on {SOURCE.name}:\n{built.stderr[-2000:]}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return BlockCache(ctypes.CDLL(str(target)))


class SteadyHeap:
    """After every optimizer step (of any optimizer in the process) while a watched model is
    alive: tell the block cache a step ended; every `every`-th step also end its epoch and call
    `trim`. When the last watched model is collected, uninstall the cache."""

    def __init__(self, trim: Callable[[], None] | None, cache: BlockCache | None, every: int = TRIM_EVERY) -> None:
        self._trim = trim
        self.cache = cache
        self._every = every
        self._alive = 0
        self._steps = 0
        self.trims = 0
        self._hook = register_optimizer_step_post_hook(torch._dynamo.disable(self._after_optimizer_step))

    def watch(self, model: nn.Module) -> None:
        if self._alive == 0 and self.cache is not None and not self.cache.install():
            warnings.warn(
                "zerocompile: another CPU allocator of higher priority is installed, so large CPU "
                "tensors stay in glibc's heap, whose free holes can make RSS creep (README: Memory "
                "that stays put)",
                stacklevel=3,
            )
            self.cache = None
        self._alive += 1
        weakref.finalize(model, self._forget)

    def close(self) -> None:
        self._hook.remove()
        if self._alive and self.cache is not None:
            self.cache.uninstall()

    def _forget(self) -> None:
        self._alive -= 1
        if self._alive == 0 and self.cache is not None:
            self.cache.uninstall()

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._alive:
            return
        self._steps += 1
        if self.cache is not None:
            self.cache.after_optimizer_step()
        if self._steps % self._every == 0:
            if self.cache is not None:
                self.cache.end_epoch()
            if self._trim is not None:
                self._trim()
            self.trims += 1


def _glibc_malloc_trim() -> Callable[[], None] | None:
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator has its own ways
        return None
    malloc_trim.argtypes = [ctypes.c_size_t]
    return lambda: malloc_trim(0)


def _block_cache_or_warning() -> BlockCache | None:
    try:
        return build_block_cache()
    except (OSError, RuntimeError) as error:
        warnings.warn(
            f"zerocompile: the CPU block cache could not be built ({error}); large CPU tensors "
            "stay in glibc's heap, whose free holes can make RSS creep (README: Memory that stays "
            "put). Set CXX to a C++17 compiler, or pass steady_heap=False.",
            stacklevel=4,
        )
        return None


_steady_heap: SteadyHeap | None = None


def keep_heap_steady_while_alive(model: nn.Module) -> SteadyHeap:
    """Serve this process's large CPU tensors from the block cache and trim glibc's heap every
    `TRIM_EVERY` optimizer steps while `model` lives; the process's `SteadyHeap`."""
    global _steady_heap
    if _steady_heap is None:
        _steady_heap = SteadyHeap(_glibc_malloc_trim(), _block_cache_or_warning())
    _steady_heap.watch(model)
    return _steady_heap
