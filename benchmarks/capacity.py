"""Capacity: the peak memory per rank of a whole training job, per mode, and what fits in 8 GiB.

Every configuration (mode, GPT size, N ranks) runs in N freshly spawned gloo ranks on 127.0.0.1,
one process per rank, and each rank reports its peak resident set (VmHWM) over the job's whole
life: interpreter and torch start-up, building the model, sharding and initialising it, compiling,
and --steps training steps of fp32 AdamW (lr 3e-4) on one sequence of --tokens tokens per rank
(windows of the bundled prose, bytes as tokens, as `zerocompile train` reads it). Modes:

  ddp     the GPT built whole on the CPU (initialised by its constructor), DistributedDataParallel,
          torch.compile'd with the same compiler as the zero modes: "aot_eager" (AOTAutograd, FX
          graphs run op by op) for --compiler eager, Inductor for --compiler inductor
  fsdp2   built on the meta device, fully_shard on every Block and the root, to_empty("cpu"),
          then GPT._init_weights applied to the DTensor parameters under no_grad; eager (the
          route FSDP2's documentation prescribes)
  zero1..3  built on the meta device, zerocompile.shard(model, stage=s, init=GPT._init_weights)
          (only this rank's shards are ever allocated, one module's full parameters at a time),
          torch.compile(model, backend="zero", options={"compiler": --compiler})

--compiler defaults to eager: the graphs zerocompile's passes produce are the same, compiling
takes seconds instead of minutes on a 2-core machine, and the compile's own memory stays small;
Inductor (--compiler inductor) compiles with one worker thread in the rank itself
(compile_threads = 1), so its memory is counted in the rank's peak too. The ranks run with
glibc's default malloc: the table is what a user's job costs, allocator caching included
(--exact-rss: MALLOC_MMAP_THRESHOLD_=65536, so RSS follows live tensors instead).

Before a configuration starts, its need is predicted (`predicted_peak`: a start-up baseline plus
bytes per parameter by mode, plus the full tensors a step keeps alive) and multiplied by the N
ranks and a safety margin; when that exceeds the machine's MemAvailable (/proc/meminfo) less a
reserve for others, the configuration is skipped ("skipped: needs ~X GB") instead of run, so the
machine is never driven out of memory; --wait polls MemAvailable that long before giving up.
While ranks run, MemAvailable is watched, and if it falls under the reserve the ranks (and only
they) are killed and the configuration reported as aborted.

Reported per configuration: the peak RSS of the largest rank, bytes per parameter per rank
(peak / Φ) and the phase in which the peak was reached. Per mode and N, a least-squares line
peak = a + b·Φ through the measured sizes gives "the largest GPT that would train in 8 GiB per
rank": Φ = (8 GiB − a) / b (an extrapolation by a line; a and b are printed).

--load-check measures two memory promises of zerocompile's weights path, on the --load-size GPT
at N = --load-ranks and stage 3, with MALLOC_MMAP_THRESHOLD_=65536 in the ranks so every freed
tensor over 64 kB is unmapped at once and RSS follows live tensors. A one-rank job first writes the
model's weights to a temporary safetensors file (deleted afterwards). Then, per rank, the rise of
the peak RSS (VmHWM, reset by writing 5 to /proc/self/clear_refs) above the RSS just before:
  meta route   meta build; from just before shard(init=GPT._init_weights) to just after
               load_weights(model, file): bound 4Φ/N (its shards) + the largest module's own full
               parameters + 64 MB
  plain route  from just before the GPT is built whole on the CPU, through shard() and
               load_weights: expected to rise by at least 4Φ (the whole model existed)
  save         save_weights(model, file) of the meta-route model: the writing rank's rise, bound
               the largest tensor + 64 MB
A sampling thread also records the peaks of RssAnon and RssFile (file pages mapped into the
process, such as the safetensors file's mmap) separately, so a broken bound says where it broke.

--big is one real run: --big-ranks (8) ranks training the "1b" GPT at stage 3 from meta
initialisation for --steps steps on the same batch every step (so the loss must fall: the model
is learning it; AdamW lr --big-lr, smaller than the table's as a larger model needs), printing the loss of every step and the peak RSS of every rank and their total;
FSDP2 beside it only if its prediction fits the machine. Its predictions come from this run's
measured configurations, or from a previous report's (--calibrate capacity.json).

Prints markdown tables and writes JSON (--json) with the date, the machine (cores, RAM) and every
rank's measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from zerocompile import torch_support
from zerocompile.tools.arguments import positive_int
from zerocompile.tools import spawn
from zerocompile.tools.gpt import GPT, SIZES, GPTConfig
from zerocompile.tools.rss import reset_peak_rss
from zerocompile.tools.train import GlobalBatches, load_text

MB = 1e6
GB = 1e9
GiB = 2**30
LEARNING_RATE = 3e-4
FP32_BYTES = 4
MODES = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
DEFAULT_SIZES = ("50m", "200m", "400m")
DEFAULT_RANKS = (2, 4)
BUDGET_BYTES = 8 * GiB  # "the largest GPT that would train in 8 GiB per rank"
# glibc unmaps every freed allocation over 64 kB at once: RSS follows live tensors.
EXACT_RSS_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "65536"}
SLACK_BYTES = 64 * MB  # the "+ 64 MB" of the load and save bounds (10^6 bytes per MB)

# The prediction that decides whether a configuration may run (see `predicted_peak`).
BASELINE_BYTES = 500 * MB  # interpreter, torch, gloo: 0.34 GB measured per rank when a job starts
SAFETY = 1.15  # predicted total times this must fit in MemAvailable less RESERVE_BYTES
RESERVE_BYTES = 1.5 * GiB  # left to the machine's other users; the watchdog kills below it


# ---------------------------------------------------------------------------------------------
# Machine and model facts


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


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the memory bounds and predictions need of a GPT size, read off a meta-device build."""

    phi: int  # parameters, the tied embedding once
    largest_tensor_bytes: int  # the largest parameter in full
    largest_module_bytes: int  # the largest module's own (not its children's) full parameters


def model_facts(config: GPTConfig) -> ModelFacts:
    with torch.device("meta"):
        model = GPT(config)
    params = {id(p): p for p in model.parameters()}.values()
    module_bytes = [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()]
    return ModelFacts(
        phi=zc.full_numel(model),
        largest_tensor_bytes=max(p.numel() * p.element_size() for p in params),
        largest_module_bytes=max(module_bytes),
    )


def predicted_peak(mode: str, facts: ModelFacts, ranks: int) -> float:
    """The peak RSS one rank is expected to reach, in bytes, generously (it guards the machine),
    before any size of this mode has been measured (`calibrated_peak` takes over after).

    fp32 AdamW holds 16 bytes per parameter (parameters, gradients, two moments): whole for DDP
    (plus its 4Φ of gradient buckets), 1/N for the sharded modes. On top, per parameter, what a
    step keeps alive in full (stage 1 all parameters and gradients, stage 2 all parameters) and
    what the allocator keeps: calibrated on the 50m GPT (2 cores, glibc malloc, 2026-11-25), where
    the peaks above start-up were 23 B/param (DDP), 16/N + 15 (FSDP2), 16/N + 10.5 (stage 1),
    16/N + 8.5 (stage 2) and 16/N + 5 (stage 3) at N = 2 and 4; and a few modules in full. FSDP2's
    15 was mostly glibc's retained heap at that size (0.85 instead of 1.49 GB with RSS following
    live tensors) and fell to 16/N + 2.6 at 400m, so 8 stands for it here.
    """
    phi, n = facts.phi, ranks
    per_param = {
        "ddp": 25.0,
        "fsdp2": 16.0 / n + 8.0,
        "zero1": 16.0 / n + 12.0,
        "zero2": 16.0 / n + 10.0,
        "zero3": 16.0 / n + 6.0,
    }[mode]
    return BASELINE_BYTES + per_param * phi + 4 * facts.largest_module_bytes


def _state_per_param(mode: str, ranks: int) -> float:
    """Bytes of fp32 AdamW state per parameter per rank: 16, divided over the ranks but for DDP."""
    return 16.0 if mode == "ddp" else 16.0 / ranks


def calibrated_peak(mode: str, facts: ModelFacts, ranks: int, measured: list[dict[str, Any]]) -> float | None:
    """The peak predicted from this mode's measured runs (None if none ran).

    Where some N has two or more sizes measured, from their lines peak = a + b·Φ: the slope less
    the state (`_state_per_param`) is what a step needs beyond it per parameter (the rest). The
    prediction is the largest a plus, per parameter, the state at `ranks` and the rest at `ranks`:
    with lines at two or more N, the rest is fitted as r0 + r1/N (a part that scales with the whole
    model and one that scales with a rank's shard), else it is the one line's. With one size
    only, start-up RSS plus, per parameter, the state at `ranks` and the rest the largest measured
    size needed beyond its own state: fixed costs (compile state) then count per parameter, which
    errs high for a larger model, the safe side.
    """
    runs = [row for row in measured if row["mode"] == mode and row["status"] == "ok"]
    if not runs:
        return None
    lines = [(entry, entry["b_bytes_per_param"] - _state_per_param(mode, entry["ranks"]))
             for entry in fits_per_mode(runs) if entry["a_bytes"] is not None]
    if lines:
        # The lines' rests already hold the gathered window of the sizes measured, scaled by Φ.
        fixed = max(entry["a_bytes"] for entry, _ in lines)
        over_n = linear_fit([(1.0 / entry["ranks"], rest) for entry, rest in lines])
        rest = over_n[0] + over_n[1] / ranks if over_n is not None else max(rest for _, rest in lines)
        return fixed + (_state_per_param(mode, ranks) + max(rest, 0.0)) * facts.phi
    else:
        largest = max(row["phi"] for row in runs)
        fixed = max(m["marks"][0]["rss"] for row in runs for m in row["per_rank"])
        rest = max(
            (row["peak_rss_bytes"] - fixed) / row["phi"] - _state_per_param(mode, row["ranks"])
            for row in runs
            if row["phi"] == largest
        )
    return fixed + (_state_per_param(mode, ranks) + max(rest, 0.0)) * facts.phi + 4 * facts.largest_module_bytes


def fits(needed_total: float, available: int) -> bool:
    return needed_total * SAFETY <= available - RESERVE_BYTES


# ---------------------------------------------------------------------------------------------
# What a rank measures


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    return {
        field: int(match.group(1)) * 1024
        for field in ("VmRSS", "VmHWM", "RssAnon", "RssFile")
        if (match := re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE))
    }


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns that RSS."""
    if not reset_peak_rss():
        raise RuntimeError("/proc/self/clear_refs refused: capacity cannot take the peak of each phase")
    return _status()["VmRSS"]


class Marks:
    """VmRSS and VmHWM after each phase of a rank's job; the phase in which the peak was reached."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: list[dict[str, Any]] = []

    def __call__(self, phase: str) -> None:
        status = _status()
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
        status = _status()
        for field in self.peaks:
            self.peaks[field] = max(self.peaks[field], status[field])

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# ---------------------------------------------------------------------------------------------
# One configuration in its own ranks


@dataclasses.dataclass(frozen=True)
class Job:
    mode: str
    size: str
    ranks: int
    steps: int
    tokens: int
    compiler: str
    seed: int = 0
    repeat_batch: bool = False  # train on the first batch every step (--big: the loss must fall)
    lr: float = LEARNING_RATE

    @property
    def config(self) -> GPTConfig:
        return SIZES[self.size]

    @property
    def sequence(self) -> int:
        """Tokens per sequence: --tokens, at most the model's block size."""
        return min(self.tokens, self.config.block_size)


def _build(job: Job, marks: Marks) -> tuple[Callable[..., torch.Tensor], torch.optim.Optimizer]:
    """The mode's model, made ready to train; marks "built" and "sharded/initialised"."""
    torch.manual_seed(job.seed)
    if job.mode == "ddp":
        model = GPT(job.config)  # whole on the CPU; the constructor initialises it
        marks("built")
        wrapped = nn.parallel.DistributedDataParallel(model)
        marks("wrapped")
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=job.lr)
        backend = "aot_eager" if job.compiler == "eager" else "inductor"
        return torch.compile(wrapped, backend=backend), optimizer
    with torch.device("meta"):
        model = GPT(job.config)
    marks("built")
    if job.mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (job.ranks,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.apply(GPT._init_weights)
        marks("sharded/initialised")
        return model, torch.optim.AdamW(model.parameters(), lr=job.lr)
    stage = int(job.mode.removeprefix("zero"))
    zc.shard(model, stage=stage, init=GPT._init_weights)
    marks("sharded/initialised")
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    return torch.compile(model, backend="zero", options={"compiler": job.compiler}), optimizer


def _train(job: Job, marks: Marks) -> dict[str, Any]:
    runner, optimizer = _build(job, marks)
    rank = dist.get_rank()
    # Windows of the bundled prose (bytes as tokens), so the loss can fall; each rank its own row.
    batches = GlobalBatches(load_text(), job.ranks, job.sequence, seed=job.seed)
    losses = []
    inputs, targets = batches.next(slice(rank, rank + 1))
    for step in range(1, job.steps + 1):
        if step > 1 and not job.repeat_batch:
            inputs, targets = batches.next(slice(rank, rank + 1))
        optimizer.zero_grad(set_to_none=True)
        loss = runner(inputs, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        marks(f"step {step}" + (" (compiles)" if step == 1 else ""))
    return {"losses": losses}


def _rank_setup(ranks: int) -> None:
    # The ranks share the machine's cores: more threads than cores slows every rank down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    # Inductor compiles in this process (no worker pool whose memory the rank's RSS would miss).
    torch._inductor.config.compile_threads = 1
    # Should the machine run out of memory after all, the kernel's OOM killer takes our ranks first,
    # not the processes of the machine's other users.
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")
    zc.init_distributed()


def _finish(measured: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's measurements on rank 0 (None on the others)."""
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, measured)
    return per_rank if dist.get_rank() == 0 else None


def _capacity_rank(rank: int, job: Job) -> list[dict[str, Any]] | None:
    marks = Marks()
    _rank_setup(job.ranks)
    marks("started")
    try:
        measured = _train(job, marks)
    except Exception as error:  # reported; the other configurations still run
        measured = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    measured.update(
        rank=rank,
        peak_rss=_status()["VmHWM"],
        marks=marks.marks,
        peak_phase=marks.peak_phase() if marks.marks else None,
    )
    return _finish(measured)


# ---------------------------------------------------------------------------------------------
# The parent: predict, wait or skip, spawn, watch


def _wait_for_free(min_free: float, wait_seconds: float) -> tuple[bool, int]:
    """Whether MemAvailable reaches `min_free` bytes, polling up to `wait_seconds`."""
    deadline = time.monotonic() + wait_seconds
    while True:
        available = mem_available()
        if available >= min_free or time.monotonic() >= deadline:
            return available >= min_free, available
        time.sleep(min(30.0, max(1.0, deadline - time.monotonic())))


def _wait_for_memory(needed_total: float, wait_seconds: float) -> tuple[bool, int]:
    """Whether `needed_total` bytes fit now, polling MemAvailable up to `wait_seconds`."""
    deadline = time.monotonic() + wait_seconds
    while True:
        available = mem_available()
        if fits(needed_total, available) or time.monotonic() >= deadline:
            return fits(needed_total, available), available
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
        ok, available = _wait_for_memory(predicted * job.ranks, wait_seconds)
    else:  # --big-force: only MemAvailable >= min_free; the watchdog and the OOM score guard the rest
        ok, available = _wait_for_free(min_free, wait_seconds)
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
    outcome = spawn_ranks(_capacity_rank, job.ranks, (job,), environment)
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


# ---------------------------------------------------------------------------------------------
# The fit and the tables


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (a, b) of y = a + b·x through two or more points of distinct x; else None."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - b * mean_x, b


def fits_per_mode(rows: list[dict[str, Any]], budget: float = BUDGET_BYTES) -> list[dict[str, Any]]:
    """Per (mode, N): the line peak = a + b·Φ through the measured sizes and the Φ it allows in `budget`."""
    fitted = []
    for mode, ranks in dict.fromkeys((row["mode"], row["ranks"]) for row in rows):
        points = [(row["phi"], row["peak_rss_bytes"]) for row in rows
                  if row["mode"] == mode and row["ranks"] == ranks and row["status"] == "ok"]
        line = linear_fit(points)
        entry: dict[str, Any] = {"mode": mode, "ranks": ranks, "points": len(points), "a_bytes": None,
                                 "b_bytes_per_param": None, "largest_phi_in_budget": None}
        if line is not None:
            a, b = line
            entry.update(a_bytes=a, b_bytes_per_param=b)
            entry["largest_phi_in_budget"] = (budget - a) / b if b > 0 and budget > a else None
        fitted.append(entry)
    return fitted


def _params(phi: float) -> str:
    return f"{phi / 1e9:.2f}B" if phi >= 1e9 else f"{phi / 1e6:.0f}M"


def _cell(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        return f"{row['peak_rss_bytes'] / GB:.2f} GB ({row['bytes_per_param']:.1f} B/param)"
    if row["status"] == "skipped":
        return f"skipped: needs ~{row['predicted_total_bytes'] / GB:.0f} GB"
    return f"{row['status']}"


def capacity_table(report: dict[str, Any]) -> str:
    rows, fitted = report["runs"], report["fits"]
    settings, machine_ = report["settings"], report["machine"]
    sizes = list(dict.fromkeys(row["size"] for row in rows))
    phis = {row["size"]: row["phi"] for row in rows}
    lines = [
        f"`python -m benchmarks.capacity` on {machine_['node']} ({machine_['cores']} cores, {machine_['ram_bytes'] / GiB:.1f} GiB RAM, "
        f"torch {machine_['torch']}), {report['date']}: peak RSS (VmHWM) per rank over the whole job (start-up, "
        f"build, shard/init, compile, {settings['steps']} steps of fp32 AdamW on 1 x {settings['tokens']} tokens "
        f"per rank), the largest rank; compiler {settings['compiler']} (ddp: {settings['ddp_backend']}; fsdp2 "
        f"eager); malloc: {settings['malloc']}. Largest GPT in 8 GiB per rank: Φ = (8 GiB − a) / b from the least-squares "
        "line peak = a + b·Φ through the measured sizes (an extrapolation).",
        "",
        "| mode | N | " + " | ".join(f"{size} (Φ = {_params(phis[size])})" for size in sizes)
        + " | fit a + b·Φ | largest GPT in 8 GiB/rank |",
        "|---|---|" + "---|" * len(sizes) + "---|---|",
    ]
    by_key = {(row["mode"], row["ranks"], row["size"]): row for row in rows}
    notes = []
    for entry in fitted:
        mode, ranks = entry["mode"], entry["ranks"]
        cells = []
        for size in sizes:
            row = by_key.get((mode, ranks, size))
            cells.append("" if row is None else _cell(row))
            if row is not None and row["status"] in ("failed", "aborted"):
                notes.append(f"- {mode} N={ranks} {size} {row['status']}: {row.get('reason', '')[:400]}")
        if entry["a_bytes"] is None:
            fit_text, largest = f"- ({entry['points']} point{'s' * (entry['points'] != 1)})", "-"
        else:
            fit_text = f"{entry['a_bytes'] / GB:.2f} GB + {entry['b_bytes_per_param']:.2f} B·Φ ({entry['points']} pts)"
            largest = "-" if entry["largest_phi_in_budget"] is None else _params(entry["largest_phi_in_budget"])
        lines.append(f"| {mode} | {ranks} | " + " | ".join(cells) + f" | {fit_text} | {largest} |")
    lines += ["", "Where each peak was reached, and the prediction that gated the run:", "",
              "| mode | N | size | predicted GB/rank | peak GB/rank | peak reached in | min MemAvailable GB | run s |",
              "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        peak = f"{row['peak_rss_bytes'] / GB:.2f}" if row.get("peak_rss_bytes") else "-"
        lowest = f"{row['min_mem_available'] / GB:.1f}" if row.get("min_mem_available") else "-"
        lines.append(
            f"| {row['mode']} | {row['ranks']} | {row['size']} | {row['predicted_peak_per_rank_bytes'] / GB:.2f} | {peak} "
            f"| {row.get('peak_phase') or row['status']} | {lowest} | {row.get('seconds', '-')} |"
        )
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


# ---------------------------------------------------------------------------------------------
# --load-check


def _prepare_weights_rank(rank: int, size: str, seed: int, path: str) -> None:
    """A one-rank job: the GPT built on meta, sharded over a 1-rank group, its weights saved."""
    zc.init_distributed()  # a one-rank group (the spawner's WORLD_SIZE=1)
    with torch.device("meta"):
        model = GPT(SIZES[size])
    torch.manual_seed(seed)
    zc.shard(model, stage=3, init=GPT._init_weights)
    zc.save_weights(model, path)


def _load_rank(
    rank: int, route: str, size: str, ranks: int, seed: int, path: str, save_path: str
) -> list[dict[str, Any]] | None:
    """One rank of a load-check route (see the module docstring); rises in bytes over the RSS before."""
    _rank_setup(ranks)
    measured: dict[str, Any] = {"rank": rank}
    try:
        torch.manual_seed(seed)
        if route == "meta":
            with torch.device("meta"):
                model = GPT(SIZES[size])
            before, kinds_before = reset_peak(), _status()
            with Sampler() as during_shard:
                zc.shard(model, stage=3, init=GPT._init_weights)
            shard_peak = _status()["VmHWM"]
            reset_peak()
            with Sampler() as during_load:
                zc.load_weights(model, path)
        else:
            before, kinds_before = reset_peak(), _status()
            with Sampler() as during_shard:
                model = GPT(SIZES[size])  # whole on the CPU
                zc.shard(model, stage=3)
            shard_peak = _status()["VmHWM"]
            reset_peak()
            with Sampler() as during_load:
                zc.load_weights(model, path)
        load_peak = _status()["VmHWM"]
        after = _status()
        anon = max(during_shard.peaks["RssAnon"], during_load.peaks["RssAnon"])
        file = max(during_shard.peaks["RssFile"], during_load.peaks["RssFile"])
        measured.update(
            rss_before=before,
            anon_before=kinds_before["RssAnon"],
            file_before=kinds_before["RssFile"],
            rise_anon=anon - kinds_before["RssAnon"],
            rise_file=file - kinds_before["RssFile"],
            rise=max(shard_peak, load_peak) - before,
            rise_by_shard=shard_peak - before,
            rise_by_load=load_peak - before,
            rss_after=after["VmRSS"],
            shard_peaks=during_shard.peaks,
            load_peaks=during_load.peaks,
            shard_bytes=sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()),
        )
        if route == "meta":
            dist.barrier()
            save_before = reset_peak()
            with Sampler() as during_save:
                zc.save_weights(model, save_path)
            measured.update(save_rise=_status()["VmHWM"] - save_before, save_peaks=during_save.peaks,
                            save_rss_before=save_before)
    except Exception as error:
        measured.update(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
    return _finish(measured)


def load_check(size: str, ranks: int, seed: int, wait_seconds: float) -> dict[str, Any]:
    """The load and save memory bounds (module docstring); a dict for the JSON."""
    facts = model_facts(SIZES[size])
    phi = facts.phi
    bounds = {
        "meta": 4 * phi / ranks + facts.largest_module_bytes + SLACK_BYTES,
        "plain": 4 * phi,
        "save": facts.largest_tensor_bytes + SLACK_BYTES,
    }
    result: dict[str, Any] = {
        "size": size, "phi": phi, "ranks": ranks, "stage": 3, "malloc": _malloc_text(),
        "largest_module_bytes": facts.largest_module_bytes, "largest_tensor_bytes": facts.largest_tensor_bytes,
        "bounds": bounds,
    }
    # The plain route holds the whole model (4Φ) plus its shards on every rank, with slack.
    needed = ranks * (BASELINE_BYTES + 6 * phi) + 4 * phi
    ok, available = _wait_for_memory(needed, wait_seconds)
    if not ok:
        result.update(status="skipped", reason=f"skipped: needs ~{needed / GB:.1f} GB, MemAvailable {available / GB:.1f} GB")
        return result
    tmp = Path(tempfile.mkdtemp(prefix="zerocompile-capacity-weights-"))
    try:
        weights = tmp / "model.safetensors"
        outcome = spawn_ranks(_prepare_weights_rank, 1, (size, seed, str(weights)))
        if outcome["status"] != "ok":
            return {**result, "status": "failed", "reason": f"writing the weights file: {outcome['error']}"}
        result["file_bytes"] = weights.stat().st_size
        for route in ("meta", "plain"):
            outcome = spawn_ranks(
                _load_rank,
                ranks,
                (route, size, ranks, seed, str(weights), str(tmp / "saved.safetensors")),
                EXACT_RSS_ENVIRONMENT,
            )
            if outcome["status"] != "ok":
                return {**result, "status": "failed", "reason": f"{route} route: {outcome['error']}"}
            per_rank = outcome["results"][0]
            errors = [f"rank {m['rank']}: {m['error']}" for m in per_rank if "error" in m]
            if errors:
                return {**result, "status": "failed", "reason": f"{route} route: {'; '.join(errors)}", route: per_rank}
            result[route] = per_rank
        if (tmp / "saved.safetensors").read_bytes() != weights.read_bytes():
            result["saved_file_differs"] = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta_rise = max(m["rise"] for m in result["meta"])
    plain_rise = min(m["rise"] for m in result["plain"])
    save_rise = result["meta"][0]["save_rise"]  # group rank 0 writes
    result.update(
        status="ok",
        meta_rise=meta_rise,
        plain_rise=plain_rise,
        save_rise=save_rise,
        met={"meta": meta_rise <= bounds["meta"], "plain": plain_rise >= bounds["plain"], "save": save_rise <= bounds["save"]},
    )
    if all("rise_anon" in m for m in result["meta"]):
        result.update(
            meta_rise_anon=max(m["rise_anon"] for m in result["meta"]),
            meta_rise_file=max(m["rise_file"] for m in result["meta"]),
        )
    return result


def _malloc_text() -> str:
    return " ".join(f"{k}={v}" for k, v in EXACT_RSS_ENVIRONMENT.items())


def load_check_table(check: dict[str, Any]) -> str:
    head = (
        f"Load and save check: GPT {check['size']} (Φ = {check['phi']:,}), N = {check['ranks']}, stage 3, "
        f"{check['malloc']} in the ranks (RSS follows live tensors); rise = peak RSS (VmHWM, reset through "
        "/proc/self/clear_refs) above the RSS just before, the largest rank (plain route: the smallest); "
        f"largest module's own parameters {check['largest_module_bytes'] / MB:.1f} MB, largest tensor "
        f"{check['largest_tensor_bytes'] / MB:.1f} MB, 64 MB = 64·10^6 bytes. The rise split into anonymous "
        "memory and file-backed pages (RssAnon, RssFile; peaks of a thread sampling every 2 ms): the "
        "safetensors file's mmap counts in the latter."
    )
    if check["status"] != "ok":
        return f"{head}\n\n{check['status']}: {check.get('reason', '')}\n"
    bounds, met = check["bounds"], check["met"]

    def per_rank(route: str, *keys: str) -> str:
        return " / ".join(" ; ".join(f"{m[key] / MB:.0f}" for key in keys) for m in check[route])

    yes = {True: "yes", False: "**NO**"}
    lines = [
        head,
        "",
        "| measured | rise MB | bound MB | met | per rank: rise by shard ; by load MB | per rank: anonymous ; file-backed MB |",
        "|---|---|---|---|---|---|",
        f"| meta build → shard(init) → load_weights | {check['meta_rise'] / MB:.0f} | ≤ {bounds['meta'] / MB:.0f} "
        f"(4Φ/N + largest module + 64 MB) | {yes[met['meta']]} | {per_rank('meta', 'rise_by_shard', 'rise_by_load')} "
        f"| {per_rank('meta', 'rise_anon', 'rise_file')} |",
        f"| CPU build → shard → load_weights | {check['plain_rise'] / MB:.0f} | ≥ {bounds['plain'] / MB:.0f} (4Φ) | "
        f"{yes[met['plain']]} | {per_rank('plain', 'rise_by_shard', 'rise_by_load')} "
        f"| {per_rank('plain', 'rise_anon', 'rise_file')} |",
        f"| save_weights, writing rank | {check['save_rise'] / MB:.0f} | ≤ {bounds['save'] / MB:.0f} (largest tensor + "
        f"64 MB) | {yes[met['save']]} | other ranks: "
        + " / ".join(f"{m['save_rise'] / MB:.0f}" for m in check["meta"][1:])
        + " | |",
    ]
    if "meta_rise_anon" in check:
        lines += [
            "",
            f"Anonymous memory alone, meta route: {check['meta_rise_anon'] / MB:.0f} MB (largest rank), against the "
            f"same bound {bounds['meta'] / MB:.0f} MB: {yes[check['meta_rise_anon'] <= bounds['meta']]}; file-backed "
            f"pages mapped while load_weights read: up to {check['meta_rise_file'] / MB:.0f} MB per rank, this rank's "
            f"share of the {check['file_bytes'] / MB:.0f} MB file being {check['file_bytes'] / check['ranks'] / MB:.0f} MB.",
        ]
    if check.get("saved_file_differs"):
        lines.append("\nThe saved file differs from the one loaded.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# --big


def big_run(args: argparse.Namespace, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """--big-ranks ranks training the --big-size GPT at stage 3 from meta init; FSDP2 beside if it
    fits. Predicted from `measured` (this report's runs, or --calibrate's) when they hold the mode."""
    size, ranks = args.big_size, args.big_ranks
    facts = model_facts(SIZES[size])
    malloc = _malloc_text() if args.exact_rss else "default"
    result: dict[str, Any] = {"size": size, "phi": facts.phi, "ranks": ranks, "malloc": malloc, "runs": []}
    for mode in ("zero3", "fsdp2"):
        job = Job(mode, size, ranks, args.steps, args.tokens, args.compiler, args.seed, repeat_batch=True, lr=args.big_lr)
        wait = args.big_wait if mode == "zero3" else 0  # FSDP2 only if it fits right away
        min_free = args.big_min_free * GB if args.big_force and mode == "zero3" else None
        row = run_job(job, facts, wait, measured, _job_environment(args), min_free)
        if row["status"] == "ok":
            losses = row["losses"]
            row["finite_and_falling"] = all(map(math.isfinite, losses)) and all(
                later < earlier for earlier, later in zip(losses, losses[1:])
            )
        result["runs"].append(row)
        print(_big_line(row), flush=True)
    return result


def _big_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"--big {row['mode']}: {row.get('reason', row['status'])}"
    return f"--big {row['mode']}: losses {', '.join(f'{x:.4f}' for x in row['losses'])}; peak {row['peak_rss_bytes'] / GB:.2f} GB/rank"


def _loss_verdict(losses: list[float]) -> str:
    if not all(map(math.isfinite, losses)):
        return " (**not finite**)"
    falling = all(later < earlier for earlier, later in zip(losses, losses[1:]))
    return " (finite and falling)" if falling else " (finite, **not falling**)"


def big_table(big: dict[str, Any]) -> str:
    lines = [
        f"--big: GPT {big['size']} (Φ = {big['phi']:,}; fp32 parameters alone {4 * big['phi'] / GB:.1f} GB, "
        f"with AdamW 16Φ = {16 * big['phi'] / GB:.1f} GB per replica), {big['ranks']} ranks on this machine, "
        f"malloc {big.get('malloc', 'default')}:",
        "",
    ]
    for row in big["runs"]:
        predicted = (
            f"predicted {row['predicted_total_bytes'] / GB:.1f} GB total ({row['predicted_peak_per_rank_bytes'] / GB:.2f} "
            f"GB/rank, from {row['predicted_from']})"
        )
        if row["status"] != "ok":
            lines.append(f"- {row['mode']}: {row.get('reason', row['status'])} ({predicted})")
            continue
        per_rank = sorted(row["per_rank"], key=lambda m: m["rank"])
        total = sum(m["peak_rss"] for m in per_rank)
        lines += [
            f"- {row['mode']} ({row['compiler']} compiler, 1 x {row['tokens']} tokens per rank, the same batch every "
            f"step, AdamW lr {row.get('lr', LEARNING_RATE):g}, {row['seconds']:.0f} s; {predicted}): loss per step "
            + ", ".join(f"{x:.4f}" for x in row["losses"])
            + _loss_verdict(row["losses"])
            + "; peak RSS per rank " + ", ".join(f"{m['peak_rss'] / GB:.2f}" for m in per_rank) + " GB; "
            f"max {row['peak_rss_bytes'] / GB:.2f} GB, total {total / GB:.2f} GB; min MemAvailable during the run "
            f"{row['min_mem_available'] / GB:.1f} GB",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The command


def _listed(valid: tuple[str, ...] | list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in valid]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; valid: {','.join(valid)}")
        return names

    return parse


def _rank_list(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m benchmarks.capacity`."""
    parser.add_argument("--sizes", type=_listed(sorted(SIZES)), default=list(DEFAULT_SIZES),
                        help=f"GPT sizes, comma-separated (default {','.join(DEFAULT_SIZES)})")
    parser.add_argument("--ranks", type=_rank_list, default=list(DEFAULT_RANKS),
                        help=f"rank counts N, comma-separated (default {','.join(map(str, DEFAULT_RANKS))})")
    parser.add_argument("--modes", type=_listed(MODES), default=list(MODES), help=f"comma-separated (default {','.join(MODES)})")
    parser.add_argument("--no-table", action="store_true", help="skip the capacity table (only --load-check / --big)")
    parser.add_argument("--steps", type=positive_int, default=3, help="training steps per job (default 3)")
    parser.add_argument("--tokens", type=positive_int, default=64, help="tokens of the one sequence per rank (default 64)")
    parser.add_argument("--compiler", choices=("eager", "inductor"), default="eager",
                        help="zero modes' compiler; ddp compiles with aot_eager or inductor to match (default eager)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds to wait for MemAvailable before skipping a configuration (default 0)")
    parser.add_argument("--load-check", action="store_true", help="also measure the load_weights/save_weights memory bounds")
    parser.add_argument("--load-size", choices=sorted(SIZES), default="200m", help="GPT of the load check (default 200m)")
    parser.add_argument("--load-ranks", type=positive_int, default=2, help="ranks of the load check (default 2)")
    parser.add_argument("--big", action="store_true", help="also the one big run (stage 3; FSDP2 if it fits)")
    parser.add_argument("--big-size", choices=sorted(SIZES), default="1b", help="GPT of --big (default 1b)")
    parser.add_argument("--big-ranks", type=positive_int, default=8, help="ranks of --big (default 8)")
    parser.add_argument("--big-lr", type=float, default=5e-6,
                        help="AdamW learning rate of --big (default 5e-6). Adam's first steps move every parameter by "
                        "about lr whatever its gradient, so the loss moves by about lr times the gradient's L1 norm, "
                        "which grows with Φ: the table's 3e-4 overshot by the third step from 200m up (400m: 5.6 -> "
                        "8.5), and on the 1b GPT 5e-5 overshot at once (5.56 -> 8.95 -> 5.75 on one batch)")
    parser.add_argument("--big-force", action="store_true",
                        help="run --big's stage 3 when MemAvailable >= --big-min-free even if its prediction does not "
                        "fit (the watchdog still kills the ranks if MemAvailable runs low; FSDP2 stays gated)")
    parser.add_argument("--big-min-free", type=float, default=20.0, help="GB free that --big-force waits for (default 20)")
    parser.add_argument("--big-wait", type=float, default=1800.0,
                        help="seconds --big waits for enough MemAvailable before giving up (default 1800)")
    parser.add_argument("--exact-rss", action="store_true",
                        help="capacity and --big ranks unmap freed tensors at once (MALLOC_MMAP_THRESHOLD_=65536): "
                        "RSS follows live tensors instead of including glibc's retained heap")
    parser.add_argument("--calibrate", type=Path, default=None,
                        help="a previous capacity JSON whose runs predict --big's need (default: this run's)")
    parser.add_argument("--json", type=Path, default=None, help="write the whole report as JSON here")


def capacity(args: argparse.Namespace) -> dict[str, Any]:
    """Run what the flags ask for; the report (also printed, and written to --json)."""
    report: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {**machine(), "mem_available_at_start": mem_available()},
        "settings": {
            "steps": args.steps,
            "tokens": args.tokens,
            "batch": "1 sequence per rank",
            "optimizer": f"torch.optim.AdamW(lr={LEARNING_RATE}), fp32",
            "compiler": args.compiler,
            "ddp_backend": "aot_eager" if args.compiler == "eager" else "inductor",
            "malloc": _malloc_text() if args.exact_rss else "default",
            "budget_bytes": BUDGET_BYTES,
            "prediction": {"baseline_bytes": BASELINE_BYTES, "safety": SAFETY, "reserve_bytes": RESERVE_BYTES},
        },
        "runs": [],
        "fits": [],
    }
    m = report["machine"]
    print(f"python -m benchmarks.capacity on {m['node']} ({m['cores']} cores, {m['ram_bytes'] / GiB:.1f} GiB RAM, "
          f"MemAvailable {m['mem_available_at_start'] / GB:.1f} GB), {report['date']}", flush=True)
    if not args.no_table:
        for size in args.sizes:
            facts = model_facts(SIZES[size])
            for ranks in args.ranks:
                for mode in args.modes:
                    job = Job(mode, size, ranks, args.steps, args.tokens, args.compiler, args.seed)
                    row = run_job(job, facts, args.wait, report["runs"], _job_environment(args))
                    report["runs"].append(row)
                    print(_progress(row), flush=True)
        report["fits"] = fits_per_mode(report["runs"])
        print("\n" + capacity_table(report), flush=True)
    if args.load_check:
        report["load_check"] = load_check(args.load_size, args.load_ranks, args.seed, args.wait)
        print("\n" + load_check_table(report["load_check"]), flush=True)
    if args.big:
        calibration = report["runs"] or (json.loads(args.calibrate.read_text())["runs"] if args.calibrate else [])
        report["big"] = big_run(args, calibration)
        print("\n" + big_table(report["big"]), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", flush=True)
    return report


def _job_environment(args: argparse.Namespace) -> dict[str, str]:
    """What the capacity and --big ranks add to the environment: nothing, unless --exact-rss."""
    return dict(EXACT_RSS_ENVIRONMENT) if args.exact_rss else {}


def _progress(row: dict[str, Any]) -> str:
    head = f"{row['mode']:<6} N={row['ranks']} {row['size']:<5}"
    if row["status"] == "ok":
        return (f"{head} peak {row['peak_rss_bytes'] / GB:.2f} GB/rank ({row['bytes_per_param']:.1f} B/param, predicted "
                f"{row['predicted_peak_per_rank_bytes'] / GB:.2f}) at {row['peak_phase']}; losses "
                f"{', '.join(f'{x:.3f}' for x in row['losses'])}; {row['seconds']} s")
    return f"{head} {row['status']}: {row.get('reason', '')[:300]}"


def run(args: argparse.Namespace) -> int:
    """`python -m benchmarks.capacity`: 1 if a configuration failed or was aborted, else 0 (skips are not failures)."""
    report = capacity(args)
    statuses = [row["status"] for row in report["runs"]]
    statuses += [row["status"] for row in report.get("big", {}).get("runs", [])]
    if "load_check" in report:
        statuses.append(report["load_check"]["status"])
    return 1 if any(status in ("failed", "aborted") for status in statuses) else 0


if __name__ == "__main__":
    from benchmarks import harness

    sys.exit(harness.main("benchmarks.capacity"))
