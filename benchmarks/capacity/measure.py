"""What the capacity benchmark reads of memory: the machine's (/proc/meminfo) and a rank's
(/proc/self/status), after each phase (`Marks`) and sampled in a thread (`Sampler`)."""

from __future__ import annotations

import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

from zerocompile import torch_support
from zerocompile.tools.measuring import reset_peak_rss, status_bytes

MB = 1e6
GB = 1e9
GiB = 2**30


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        number, *unit = rest.split()
        values[name] = int(number) * (1024 if unit == ["kB"] else 1)
    return values


def mem_available() -> int:
    return meminfo()["MemAvailable"]


def machine() -> dict[str, Any]:
    return {
        "node": platform.node(),
        "cores": os.cpu_count(),
        "ram_bytes": meminfo()["MemTotal"],
        "torch": torch_support.RELEASE,
        "python": platform.python_version(),
    }


def process_memory() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    return {field: status_bytes(field) for field in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns that RSS."""
    if not reset_peak_rss():
        raise RuntimeError("/proc/self/clear_refs refused: capacity cannot take the peak of each phase")
    return process_memory()["VmRSS"]


class Marks:
    """VmRSS and VmHWM after each phase of a rank's job; the phase in which the peak was reached."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: list[dict[str, Any]] = []

    def __call__(self, phase: str) -> None:
        status = process_memory()
        self.marks.append(
            {"phase": phase, "rss": status["VmRSS"], "hwm": status["VmHWM"], "s": round(time.perf_counter() - self.start, 2)}
        )

    def peak_phase(self) -> str:
        peak = self.marks[-1]["hwm"]
        return next(mark["phase"] for mark in self.marks if mark["hwm"] == peak)


class Sampler:
    """A thread sampling RssAnon and RssFile every few milliseconds: the peak of each apart.

    VmHWM is the peak of their sum; this says which kind of memory made it.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peaks = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def _sample(self) -> None:
        status = process_memory()
        for field in self.peaks:
            self.peaks[field] = max(self.peaks[field], status[field])

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
