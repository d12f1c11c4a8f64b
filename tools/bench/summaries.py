"""Every rank's measurements of a bench mode (or of the interleaved modes) made into the figures
bench.json reports: the slowest rank's step, compile time and where it went, the largest rank's
memory and bytes, the link's figures, and the optimizer step on disk against its bound."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from zerocompile.tools import link_budget
from zerocompile.tools.bench.modes import MODES

PHASES = ("forward", "backward", "optimizer")
# Columns of the compile-phase table: torch's `dynamo_timed` spans summed per column. A pass of ours
# shows as "zerocompile.<pass>"; the partition wrapped by our eager compiler is the partition's.
COMPILE_PHASES: dict[str, tuple[str, ...]] = {
    "Dynamo": ("bytecode_tracing", "build_guards"),
    "AOT trace": ("aot_collect_metadata", "aot_trace_joint_graph"),
    "partition": ("min_cut_rematerialization_partition", "zerocompile.min_cut_rematerialization_partition"),
    "zerocompile passes": (),  # every other zerocompile.* span
    "Inductor codegen": ("GraphLowering.codegen",),
}
_SPANS_OF_NAMED_COLUMNS = frozenset(span for spans in COMPILE_PHASES.values() for span in spans)
# The speed asked of optimizer state on disk: its optimizer step within this many times max(the same
# step in memory, the disk's floor).
OFFLOAD_BOUND = 1.3


def summarise(name: str, per_rank: list[dict[str, Any]], nodes: int = 1) -> dict[str, Any]:
    """One mode's figures from every rank's measurements (see `zerocompile bench --help`)."""
    errors = [f"rank {rank}: {m['error']}" for rank, m in enumerate(per_rank) if "error" in m]
    if errors:
        return {"mode": name, "status": "failed", "error": "; ".join(errors), "per_rank": per_rank}
    step_times = [max(steps) for steps in zip(*(m["step_times"] for m in per_rank))]
    median_step = statistics.median(step_times)
    first_step = max(m["first_step"] for m in per_rank)
    largest_held = max((m["held"] for m in per_rank), key=lambda held: sum(held.values()))
    return {
        "mode": name,
        "status": "ok",
        "step_time_s": median_step,
        "compile_time_s": first_step - median_step,
        "compile_cpu_s": max(m["compile_cpu"] for m in per_rank),
        "compile_phases_s": _compile_phases(per_rank),
        "compiled_cpp_files": max(m["compile_timers"].get("compile_file", [0, 0.0])[0] for m in per_rank),
        "first_step_s": first_step,
        "step_times_s": step_times,
        "peak_rss_bytes": max(m["peak_rss"] for m in per_rank),
        "rss_before_bytes": max(m["rss_before"] for m in per_rank),
        "rss_source": per_rank[0]["rss_source"],
        "device_peak_run_bytes": _largest(m["device_peak_run"] for m in per_rank),
        "device_peak_steps_bytes": _largest(m["device_peak_steps"] for m in per_rank),
        "load_avg_1min": per_rank[0]["load"],
        "sent_bytes_per_step": _largest(None if m["sent"] is None else statistics.median(m["sent"]) for m in per_rank),
        **_link_figures([m["waiting"] for m in per_rank], [m["link_sent"] for m in per_rank], nodes),
        "link_bytes_predicted": _link_prediction([m["predicted"] for m in per_rank], nodes),
        "model_state_bytes": largest_held,
        "dispatched_ops_per_step": per_rank[0]["dispatched"]["ops"],
        "device_kernels_per_step": per_rank[0]["dispatched"]["kernels"],
        "final_loss": statistics.fmean(m["losses"][-1] for m in per_rank),
        "losses": [statistics.fmean(step) for step in zip(*(m["losses"] for m in per_rank))],
        "optimizer_on_disk": _offload_figures(
            name,
            [m["disk"] for m in per_rank],
            _phase_medians([m["step_times"] for m in per_rank], [m["phases"] for m in per_rank]),
            side_by_side={},
        ),
        "per_rank": per_rank,
    }


def _phase_medians(step_times: list[list[float]], phases: list[list[tuple[float, float, float]]]) -> dict[str, float]:
    """From every rank's steps: per phase, the median over steps of the forward, backward and
    optimizer step of the rank slowest in each step (each phase's median on its own, so they need
    not add up to the step's median exactly)."""
    ranks = range(len(step_times))
    slowest = [max(ranks, key=lambda rank: step_times[rank][step]) for step in range(len(step_times[0]))]
    per_step = [phases[rank][step] for step, rank in enumerate(slowest)]
    return dict(zip(PHASES, (statistics.median(phase) for phase in zip(*per_step))))


def _offload_figures(
    name: str, disk: list[dict[str, Any] | None], phases: dict[str, float], side_by_side: dict[str, dict[str, float]]
) -> dict[str, Any] | None:
    """For mode `name` with its optimizer state on disk (every rank's disk figures from rank.py; None
    otherwise): the rank's figures with the largest floor, its optimizer phase (of `phases`, its
    medians) and, where the mode it offloads ran in the same interleave (`side_by_side`: their
    phase medians), that mode's optimizer phase in memory and the bound OFFLOAD_BOUND x
    max(in memory, floor) the phase on disk should be within."""
    if disk[0] is None:
        return None
    in_memory_mode = MODES[name].offload_of
    in_memory = side_by_side[in_memory_mode]["optimizer"] if in_memory_mode in side_by_side else None
    figures = max(disk, key=lambda rank: rank["floor_s"])
    bound = None if in_memory is None else OFFLOAD_BOUND * max(in_memory, figures["floor_s"])
    return {
        **figures,
        "optimizer_phase_s": phases["optimizer"],
        "in_memory_mode": in_memory_mode,
        "in_memory_optimizer_phase_s": in_memory,
        "bound_s": bound,
        "within_bound": None if bound is None else phases["optimizer"] <= bound,
    }


def _largest(values: Iterable[float | None]) -> float | None:
    """The largest rank's figure, or None where it was not measured (the same on every rank)."""
    measured = [value for value in values if value is not None]
    return max(measured) if measured else None


def _compile_phases(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per `COMPILE_PHASES` column and of the C++ compiles ("C++"), largest rank per column."""

    def columns(timers: dict[str, list]) -> dict[str, float]:
        seconds = {column: sum(timers.get(span, [0, 0.0])[1] for span in spans) for column, spans in COMPILE_PHASES.items()}
        seconds["zerocompile passes"] = sum(
            total
            for span, (_count, total) in timers.items()
            if span.startswith("zerocompile.") and span not in _SPANS_OF_NAMED_COLUMNS
        )
        seconds["C++"] = timers.get("compile_file", [0, 0.0])[1]
        return seconds

    each = [columns(m["compile_timers"]) for m in per_rank]
    return {column: max(rank[column] for rank in each) for column in each[0]}


def _link_prediction(predicted: list[dict[str, int] | None], nodes: int) -> list[int] | None:
    """The ledgers' bytes over the link per node from every rank's predicted bytes (rank.py; None for a
    mode without a ledger)."""
    if any(figures is None for figures in predicted):
        return None
    return link_budget.predicted_link_bytes(
        [figures["sent"] for figures in predicted], [figures["across_nodes"] for figures in predicted], nodes
    )


def _link_figures(waiting: list[list[float]], link_sent: list[list[int | None]], nodes: int) -> dict[str, Any]:
    """From every rank's steps: the median over steps of the longest any rank waited
    (`waiting_s`), and of the bytes each node sent over the link, as its first rank read them
    (`link_bytes_per_step`, one per node; None without a link)."""
    per_node = len(waiting) // nodes
    readings = [link_sent[node * per_node] for node in range(nodes)]
    return {
        "waiting_s": statistics.median(max(step) for step in zip(*waiting)),
        "link_bytes_per_step": None if readings[0][0] is None else [statistics.median(r) for r in readings],
    }


def summarise_interleaved(per_rank: list[dict[str, Any]], nodes: int = 1) -> dict[str, Any]:
    """Median over rounds of the slowest rank's step, per interleaved mode; and of that rank's
    forward, backward and optimizer step (`_phase_medians`); the mean loss over the ranks of every
    round; and for a mode with its optimizer state on disk, `_offload_figures`."""
    names = list(per_rank[0]["step_times"])
    rounds = range(len(per_rank[0]["step_times"][names[0]]))
    slowest = {name: [max(m["step_times"][name][i] for m in per_rank) for i in rounds] for name in names}
    phases = {
        name: _phase_medians([m["step_times"][name] for m in per_rank], [m["phases"][name] for m in per_rank])
        for name in names
    }
    disk = {name: _offload_figures(name, [m["disk"][name] for m in per_rank], phases[name], phases) for name in names}
    return {
        "modes": names,
        "step_time_s": {name: statistics.median(times) for name, times in slowest.items()},
        "step_times_s": slowest,
        "paired_ratio": {name: {other: _paired_ratio(slowest[name], slowest[other]) for other in names} for name in names},
        "phase_s": phases,
        "losses": {name: [statistics.fmean(step) for step in zip(*(m["losses"][name] for m in per_rank))] for name in names},
        "optimizer_on_disk": {name: figures for name, figures in disk.items() if figures is not None},
        "link": {
            name: {
                **_link_figures([m["waiting"][name] for m in per_rank], [m["link_sent"][name] for m in per_rank], nodes),
                "link_bytes_predicted": _link_prediction([m["predicted"][name] for m in per_rank], nodes),
            }
            for name in names
        },
        "load_avg_1min": per_rank[0]["load"],
    }


def _paired_ratio(times: list[float], others: list[float]) -> dict[str, float]:
    """Quartiles over rounds of one mode's step time divided by another's in the same round.

    A round's two steps ran back to back, so whatever else the machine did weighs on both: their
    ratio varies much less than either time does, and its spread says how far one run's ratio
    can be trusted.
    """
    ratios = [time / other for time, other in zip(times, others, strict=True)]
    if len(ratios) < 2:
        return {"p25": ratios[0], "median": ratios[0], "p75": ratios[0]}
    p25, median, p75 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"p25": p25, "median": median, "p75": p75}

