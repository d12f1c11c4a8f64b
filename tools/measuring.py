"""What the tools and benchmarks read off this process and its device around a step: its memory as
the kernel counts it (/proc/self/status, Linux), the bytes it wrote and moved through the block
layer (/proc/self/io), and an accelerator's peak of allocated bytes."""

from __future__ import annotations

import re
from pathlib import Path

import torch


def status_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes: VmRSS (held now, allocator caches included), VmHWM
    (the peak since start or the last `reset_peak_rss`), RssAnon, ..."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no {field} in /proc/self/status: memory is measured on Linux only")
    return int(match.group(1)) * 1024


def reset_peak_rss() -> bool:
    """Start VmHWM again from the current RSS (5 into /proc/self/clear_refs); False where the
    kernel refuses, and VmHWM stays the peak since the process started."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def io_counters() -> dict[str, int]:
    """The fields of /proc/self/io: rchar and wchar (bytes passed to read- and write-like system
    calls, sockets included), read_bytes and write_bytes (what the block layer read and wrote
    for this process), ..."""
    fields = (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {name: int(value) for name, value in fields}


def written_bytes() -> int:
    """Bytes this process has passed to write-like system calls, sockets included: gloo's sends."""
    counters = io_counters()
    if "wchar" not in counters:
        raise RuntimeError("no wchar in /proc/self/io: bytes sent are measured on Linux only")
    return counters["wchar"]


def on_accelerator(device: torch.device) -> bool:
    """Whether `device` is the accelerator torch finds (whose allocator counts its bytes)."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator is not None and device.type == accelerator.type


def reset_device_peak(device: torch.device) -> None:
    """Start `device_peak` afresh from the bytes allocated now (on an accelerator)."""
    if on_accelerator(device):
        torch.accelerator.reset_peak_memory_stats(device)


def device_peak(device: torch.device) -> int | None:
    """The most bytes allocated at once on `device` since `reset_device_peak`; None where the
    accelerator's allocator does not serve `device` (the CPU: see peak RSS)."""
    return torch.accelerator.max_memory_allocated(device) if on_accelerator(device) else None


def finish_queued_work(device: torch.device) -> None:
    """Wait until `device` has run what was queued on it: an accelerator runs kernels after the
    call that launched them returns, and a phase's time must include them. The CPU runs them in
    the call."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
