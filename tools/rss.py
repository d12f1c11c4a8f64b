"""This process's memory as the kernel counts it (/proc/self/status, Linux): what bench, soak and
capacity measure."""

from __future__ import annotations

import re
from pathlib import Path


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
