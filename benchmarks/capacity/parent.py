"""The parent's side of a configuration: wait for memory or skip, spawn the ranks with the
environment asked for, watch MemAvailable while they run, summarise what they measured."""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerocompile.tools import spawn

from .job import Job, capacity_rank
from .measure import GB, GiB, mem_available
from .prediction import RESERVE_BYTES, SAFETY, ModelFacts, calibrated_peak, fits, predicted_peak

# glibc unmaps every freed allocation over 64 kB at once: RSS follows live tensors.
EXACT_RSS_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def malloc_text() -> str:
    """EXACT_RSS_ENVIRONMENT as the reports print it."""
    return " ".join(f"{k}={v}" for k, v in EXACT_RSS_ENVIRONMENT.items())


def job_environment(args: argparse.Namespace) -> dict[str, str]:
    """What the capacity and --big ranks add to the environment: nothing, unless --exact-rss."""
    return dict(EXACT_RSS_ENVIRONMENT) if args.exact_rss else {}


def wait_for_memory(needed_total: float, wait_seconds: float) -> tuple[bool, int]:
    """Whether `needed_total` bytes fit now, polling MemAvailable up to `wait_seconds`."""
    return _wait_for_available(lambda available: fits(needed_total, available), wait_seconds)


def _wait_for_available(enough: Callable[[int], bool], wait_seconds: float) -> tuple[bool, int]:
    """Whether MemAvailable is `enough`, polling it up to `wait_seconds`; and its last reading."""
    deadline = time.monotonic() + wait_seconds
    while True:
        available = mem_available()
        if enough(available) or time.monotonic() >= deadline:
            return enough(available), available
        time.sleep(min(30.0, max(1.0, deadline - time.monotonic())))


class _Aborted(Exception):
    """MemAvailable fell under the reserve while ranks ran."""


def spawn_ranks(
    function: Callable[..., Any], nprocs: int, args: tuple, environment: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run `function(rank, *args)` in `nprocs` spawned processes, watching MemAvailable.

    Returns {"status": "ok" | "failed" | "aborted", "results": what each rank returned (when ok),
    "min_mem_available": bytes, "seconds": s, "error": ...}. If MemAvailable falls under
    RESERVE_BYTES, our ranks are killed (by their pids) before the machine's other users are hurt.
    The ranks run on the C library's malloc, nothing preloaded: the table is glibc's footprint.
    """
    start = time.perf_counter()
    lowest = mem_available()
    watched = {"max_total_rss": 0, "hwm_per_rank": [0] * nprocs}

    def outcome(status: str, **extra: Any) -> dict[str, Any]:
        return {"status": status, "min_mem_available": lowest, "seconds": time.perf_counter() - start, **watched, **extra}

    def watch(pids: list[int]) -> None:
        nonlocal lowest
        lowest = min(lowest, mem_available())
        _watch(pids, watched)
        if lowest < RESERVE_BYTES:
            raise _Aborted(
                f"MemAvailable fell to {lowest / GB:.2f} GB: the ranks were killed to protect the machine "
                f"(their RSS then: {watched['max_total_rss'] / GB:.2f} GB in total at most, peaks per rank "
                + ", ".join(f"{hwm / GB:.2f}" for hwm in watched["hwm_per_rank"]) + " GB)"
            )

    try:
        results = spawn.spawn_ranks(function, nprocs, args, env=environment, preload=None, watch=watch)
    except _Aborted as aborted:
        return outcome("aborted", error=str(aborted))
    except spawn.RanksFailed as error:
        return outcome("failed", error=f"{type(error).__name__}: {error}")
    return outcome("ok", results=results)


def _watch(pids: list[int], watched: dict[str, Any]) -> None:
    """The ranks' RSS as the parent sees it (/proc/PID/status): the largest total, each rank's VmHWM."""
    total = 0
    for rank, pid in enumerate(pids):
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.MULTILINE))
        total += int(fields.get("VmRSS", 0)) * 1024
        watched["hwm_per_rank"][rank] = max(watched["hwm_per_rank"][rank], int(fields.get("VmHWM", 0)) * 1024)
    watched["max_total_rss"] = max(watched["max_total_rss"], total)


def run_job(
    job: Job,
    facts: ModelFacts,
    wait_seconds: float,
    measured: list[dict[str, Any]] = (),
    environment: dict[str, str] | None = None,
    min_free: float | None = None,
) -> dict[str, Any]:
    """One configuration: predicted (from `measured` runs of its mode when there are any), then
    run or skipped, summarised over its ranks."""
    calibrated = calibrated_peak(job.mode, facts, job.ranks, list(measured))
    predicted = calibrated if calibrated is not None else predicted_peak(job.mode, facts, job.ranks)
    row: dict[str, Any] = {
        **dataclasses.asdict(job),
        "phi": facts.phi,
        "predicted_peak_per_rank_bytes": predicted,
        "predicted_from": "measured runs" if calibrated is not None else "formula",
        "predicted_total_bytes": predicted * job.ranks,
    }
    if min_free is None:
        ok, available = wait_for_memory(predicted * job.ranks, wait_seconds)
    else:  # --big-force: only MemAvailable >= min_free; the watchdog and the OOM score guard the rest
        ok, available = _wait_for_available(lambda available: available >= min_free, wait_seconds)
    row["mem_available_before"] = available
    if not ok:
        needs = (
            f"needs ~{predicted * job.ranks / GB:.1f} GB ({job.ranks} x {predicted / GB:.2f} GB, x{SAFETY} margin + "
            f"{RESERVE_BYTES / GiB:.1f} GiB reserve)"
            if min_free is None
            else f"waits for {min_free / GB:.0f} GB free"
        )
        row.update(status="skipped", reason=f"skipped: {needs}, MemAvailable {available / GB:.1f} GB")
        return row
    outcome = spawn_ranks(capacity_rank, job.ranks, (job,), environment)
    row.update(
        min_mem_available=outcome["min_mem_available"],
        seconds=round(outcome["seconds"], 1),
        watched_max_total_rss=outcome["max_total_rss"],
    )
    if outcome["status"] != "ok":
        row.update(status=outcome["status"], reason=outcome["error"])
        return row
    per_rank = outcome["results"][0]
    errors = [f"rank {m['rank']}: {m['error']}" for m in per_rank if "error" in m]
    peak_rank = max(per_rank, key=lambda m: m["peak_rss"])
    row.update(
        status="failed" if errors else "ok",
        peak_rss_bytes=peak_rank["peak_rss"],
        bytes_per_param=peak_rank["peak_rss"] / facts.phi,
        peak_phase=peak_rank["peak_phase"],
        per_rank=per_rank,
    )
    if errors:
        row["reason"] = "; ".join(errors)
    else:
        row["losses"] = [sum(step) / len(step) for step in zip(*(m["losses"] for m in per_rank))]
    return row
