"""Rank-consistency guard: ranks compare their collective schedules before a compiled graph runs.

ZeRO's collectives only line up if every rank issues the same ones in the same order. A model that
branches on `dist.get_rank()` or on rank-local data traces a different graph on some rank, and the
ranks then hang in mismatched collectives (or, worse, exchange wrongly shaped buffers). So
`zero_backend` describes each Dynamo graph's schedule — its marker nodes in order (which
parameter, full shape, stage, group, dtypes, whether its gradient is reduced) plus the settings
that steer the lowering — and the ranks of each group compare descriptions before anything runs.
The lowered schedule is a deterministic function of that description, and unlike the lowered
graph it is seen on every compile, Inductor/AOT cache hit or not.

The exchange goes through the group's c10d store, not a collective: a collective could itself be
mismatched and hang. A graph is named by its Dynamo frame (e.g. "0/1", the same on ranks running
the same code), the Dynamo session (how many of the spans between `torch._dynamo.reset()`s, which
restart the frame numbers, this rank has compared schedules in over the group) and how often this
rank compiled that frame in the session (both counted with `store.add`, so they start afresh with
every process group too). Counting per session keeps the
ranks aligned after a rank-local recompile: counted over the group's life, the rank that compiled
frame "0/1" alone stayed one compile ahead on "0/1" after every later reset, so each later "0/1"
waited `PEER_WAIT` and was compared with nothing. Each rank
`set`s its description under that name, `wait`s a bounded time for the other ranks', and compares;
every rank reads the same descriptions and so raises the same error.

A rank may legitimately compile a frame alone, or late: rank-local input shapes (variable-length
batches) make ranks recompile for dynamic shapes at different steps, while their collectives
still match. So a peer that does not show up within `PEER_WAIT` is not an error: this rank warns
and goes on without the comparison (the peer compares against this rank's description when it
gets there). Ranks that really diverged then fail in the next collective, after the process
group's timeout, with the error below.

This module also turns a collective that failed at run time (a rank died or stalled past the
timeout) into an error saying which graph, rank and stage, and how to change the timeout.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._dynamo.callback import callback_handler
from torch.distributed.distributed_c10d import _get_process_group_store, _resolve_process_group

from zerocompile.distributed import process_group_timeout
from zerocompile.passes.markers import is_reduce_grad, is_unshard, reduce_grad_args, unshard_args
from zerocompile.passes.stages import stage_policy
from zerocompile.rank_deaths import describe_dead_ranks, looks_like_a_lost_peer

log = logging.getLogger(__name__)

_KEY_PREFIX = "zerocompile-guard"
# How long a rank waits for the others to compile the same frame: ranks reach a frame's compile
# within a second or two of each other when they run the same code.
PEER_WAIT = timedelta(seconds=30)
_DIVERGENCE_FIX = (
    "Every rank must trace the same graph: do not branch on dist.get_rank() or rank-local data "
    "inside the compiled model"
)


class RankMismatchError(RuntimeError):
    """Ranks traced different collective schedules, or some rank never compiled the graph."""


class CollectiveFailedError(RuntimeError):
    """A collective inside a zero-compiled graph failed: another rank died or stalled."""


@dataclasses.dataclass(frozen=True)
class MarkerEntry:
    """One marker of a Dynamo graph, as far as it decides the collectives lowered from it."""

    marker: str  # "unshard" or "reduce_grad"
    param: str
    shape: list[int]  # full shape (unshard); the shard's element count (reduce_grad)
    stage: int
    group: str
    compute_dtype: str | None = None
    reduce_dtype: str | None = None
    local: bool = False  # no_sync's local copy: no gather, gradient kept locally
    pending: bool = False  # carries an accumulated gradient into this reduction
    grad_reduced: bool = False  # unshard: the backward reduces this parameter's gradient
    kept_copy: bool = False  # reads the copy a no_sync block kept: no gather, gradient reduced

    def describe(self) -> str:
        """What this rank does for the marker, in words: "gathers 'fc.weight' [16, 16] at stage 3"."""
        dtypes = "".join(
            f", {name} {value}"
            for name, value in (("compute", self.compute_dtype), ("reduce", self.reduce_dtype))
            if value is not None
        )
        if self.marker == "reduce_grad":
            return f"reduces the gradient of '{self.param}' ({self.shape[0]} elements per rank) at stage {self.stage}{dtypes}"
        action = "uses its local copy of" if self.local else "uses its kept copy of" if self.kept_copy else ("gathers" if stage_policy(self.stage).shards_parameters else "uses")
        extras = dtypes + (", gradient reduced" if self.grad_reduced else ", no gradient")
        extras += ", with a pending accumulated gradient" if self.pending else ""
        return f"{action} '{self.param}' {self.shape} at stage {self.stage}{extras}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What one rank compiled for one group: the settings that shape the lowering and the markers."""

    compile_id: str  # Dynamo's frame/attempt: which graph of the other ranks this one is compared with
    settings: dict[str, Any]
    markers: list[MarkerEntry]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> Schedule:
        data = json.loads(text)
        return Schedule(data["compile_id"], data["settings"], [MarkerEntry(**m) for m in data["markers"]])


@dataclasses.dataclass
class GuardStats:
    """How often the guard ran inside a `record_stats()` block and what it cost."""

    checks: int = 0  # graph x group exchanges compared
    unanswered: int = 0  # exchanges in which some peer had not compiled the same frame in time
    seconds: float = 0.0  # wall time inside the exchanges, waiting for slower ranks included
    bytes_written: int = 0  # schedule JSON this rank put into the store


# The GuardStats of the `record_stats()` blocks open in this context (as `record_graphs()`'s lists).
_OPEN_STATS: contextvars.ContextVar[tuple[GuardStats, ...]] = contextvars.ContextVar(
    "zerocompile_guard_stats", default=()
)


@contextlib.contextmanager
def record_stats() -> Iterator[GuardStats]:
    """Counts the exchanges of the compiles run inside the block (blocks nest: each counts them);
    outside any block nothing is counted."""
    stats = GuardStats()
    token = _OPEN_STATS.set((*_OPEN_STATS.get(), stats))
    try:
        yield stats
    finally:
        _OPEN_STATS.reset(token)


def _count(checks: int = 0, unanswered: int = 0, seconds: float = 0.0, bytes_written: int = 0) -> None:
    for stats in _OPEN_STATS.get():
        stats.checks += checks
        stats.unanswered += unanswered
        stats.seconds += seconds
        stats.bytes_written += bytes_written


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _requires_grad(node: fx.Node) -> bool:
    value = node.meta.get("example_value")
    return bool(getattr(value, "requires_grad", False))


def marker_entries(graph: fx.Graph) -> list[MarkerEntry]:
    """The graph's markers in graph order, which is the order `lower_markers` buckets them in."""
    entries = []
    for node in graph.nodes:
        if is_unshard(node):
            m = unshard_args(node)
            entries.append(
                MarkerEntry(
                    "unshard", m.param, list(m.shape), m.stage, m.group_name, _dtype_name(m.compute_dtype),
                    _dtype_name(m.reduce_dtype), m.local, m.pending is not None,
                    # Whether the backward reduces it is decided here, by autograd on this output.
                    _requires_grad(node) and not m.local, m.full is not None,
                )
            )
        elif is_reduce_grad(node):
            m = reduce_grad_args(node)
            entries.append(
                MarkerEntry(
                    "reduce_grad", m.param, [m.shard_numel], m.stage, m.group_name,
                    reduce_dtype=_dtype_name(m.reduce_dtype),
                )
            )
    return entries


def first_difference(schedules: list[Schedule]) -> str | None:
    """Why `schedules` (index = group rank) do not describe the same collectives, or None if they do.

    Every rank runs this on the same list and so words the same message. Rank 0's schedule is the
    reference; the first rank that differs from it is named, with the first differing collective.
    """
    reference = schedules[0]
    for rank, schedule in enumerate(schedules[1:], start=1):
        if schedule.settings != reference.settings:
            changed = sorted(k for k in reference.settings.keys() | schedule.settings.keys()
                             if reference.settings.get(k) != schedule.settings.get(k))
            sides = "; ".join(
                f"rank {r} {', '.join(f'{k}={s.settings.get(k)!r}' for k in changed)}"
                for r, s in ((0, reference), (rank, schedule))
            )
            return (
                f"ranks compiled with different settings ({sides}): pass the same torch.compile "
                "options and ZeroConfig on every rank, and run the same torch version"
            )
        if schedule.markers == reference.markers:
            continue
        ours, theirs = reference.markers, schedule.markers
        index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        if index < len(ours) and index < len(theirs):
            detail = f"collective {index + 1} differs — rank 0 {ours[index].describe()}, rank {rank} {theirs[index].describe()}"
        else:
            longer, extra_rank = (ours, 0) if len(ours) > len(theirs) else (theirs, rank)
            detail = (
                f"rank 0 has {len(ours)} collectives, rank {rank} {len(theirs)}; the first extra one, "
                f"collective {index + 1}: rank {extra_rank} {longer[index].describe()}"
            )
        return detail
    return None


@dataclasses.dataclass(frozen=True)
class GraphContext:
    """Where a compiled graph sits among the ranks, for run-time error messages."""

    compile_id: str
    group_name: str
    rank: int
    world_size: int
    global_ranks: tuple[int, ...]  # of each group rank, for naming a dead rank's records
    stages: tuple[int, ...]
    timeout: timedelta


def check_ranks_agree(graph: fx.Graph, settings: dict[str, Any], compile_id: str) -> GraphContext | None:
    """Compare this graph's collective schedule with the other ranks' of each group it uses.

    Raises `RankMismatchError` on every rank that compares if they differ; warns if some rank does
    not compile the same frame within `PEER_WAIT` (see the module docstring). Returns where the
    graph sits (its first group's), or None when there is nothing to compare: no markers, no
    process group, a one-rank group, or a "fake" group (tracing and graph tests: its other ranks
    do not exist, and its store holds nothing).
    """
    entries = marker_entries(graph)
    if not entries or not dist.is_initialized():
        return None
    context = None
    for group_name in sorted({entry.group for entry in entries}):
        group = _resolve_process_group(group_name)
        if dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
            continue
        schedule = Schedule(compile_id, settings, [entry for entry in entries if entry.group == group_name])
        _exchange_and_compare(group, group_name, schedule)
        context = context or GraphContext(
            compile_id, group_name, dist.get_rank(group), dist.get_world_size(group),
            tuple(dist.get_process_group_ranks(group)), tuple(sorted({entry.stage for entry in entries})),
            process_group_timeout(group),
        )
    return context


def _exchange_and_compare(group: dist.ProcessGroup, group_name: str, schedule: Schedule) -> None:
    started = time.perf_counter()
    store = _get_process_group_store(group)  # already prefixed by the group's name
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    frame = f"{_dynamo_session(group, store, rank)}/{schedule.compile_id}"
    occurrence = store.add(f"{_KEY_PREFIX}/count/{frame}/rank{rank}", 1)
    name = f"Dynamo frame {schedule.compile_id} (compile #{occurrence} of it)"
    keys = [f"{_KEY_PREFIX}/{frame}#{occurrence}/rank{r}" for r in range(world_size)]
    payload = schedule.to_json()
    store.set(keys[rank], payload)
    _count(bytes_written=len(payload))
    try:
        store.wait(keys, min(PEER_WAIT, process_group_timeout(group)))
    except RuntimeError:  # a TCPStore times out with DistStoreError, a FileStore with RuntimeError
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        _count(unanswered=1, seconds=time.perf_counter() - started)
        log.warning(
            "zerocompile: rank %d of group '%s' compiled %s; ranks %s have not compiled it within %s, so its "
            "collectives were not compared with theirs. Fine if they compile it later (rank-local input "
            "shapes make ranks recompile at different steps); if they never do, the ranks run different "
            "code and the next collective fails after the process group's timeout.",
            rank, group_name, name, missing, PEER_WAIT,
        )
        return
    schedules = [schedule if r == rank else Schedule.from_json(store.get(keys[r])) for r in range(world_size)]
    difference = first_difference(schedules)
    _count(checks=1, seconds=time.perf_counter() - started)
    log.debug("rank %d: %s of group '%s' agrees on %d markers", rank, name, group_name, len(schedule.markers))
    if difference is not None:
        raise RankMismatchError(
            f"ranks traced different collective schedules for {name}, group '{group_name}': "
            f"{difference}. {_DIVERGENCE_FIX}."
        )


def _dynamo_session(group: dist.ProcessGroup, store: dist.Store, rank: int) -> int:
    """How many Dynamo sessions this rank has compared schedules in over `group`.

    `torch._dynamo.reset()` clears Dynamo's compile-callback registry, so a `_SessionMarker` that
    is gone from it means a new session. The marker, which dies with its session, remembers the
    number each group has for it; the count goes on in the group's store (which dies with the group,
    as the keys it numbers do).
    """
    marker = next((c for c in callback_handler.start_callbacks if isinstance(c, _SessionMarker)), None)
    if marker is None:
        marker = _SessionMarker()
        callback_handler.register_start_callback(marker)
    if group not in marker.numbers:
        marker.numbers[group] = store.add(f"{_KEY_PREFIX}/sessions/rank{rank}", 1)
    return marker.numbers[group]


class _SessionMarker:
    """Registered only to be found again (see `_dynamo_session`); holds this session's number in
    each group that compared schedules in it."""

    def __init__(self) -> None:
        self.numbers: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()

    def __call__(self, _args: Any) -> None:
        pass


def explain_collective_failures(run: Callable, context: GraphContext, kind: str) -> Callable:
    """`run` (a compiled graph), raising `CollectiveFailedError` from a failed collective's error.

    Only errors that look like a lost or late peer (a `dist.DistError`, or a timeout / closed
    connection in the message) are explained; any other error passes through untouched. A peer
    that died on this host is named first, with its signal and where it was (`rank_deaths`).
    """

    @functools.wraps(run)
    def run_explaining_failures(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except CollectiveFailedError:
            raise
        except RuntimeError as error:
            if not looks_like_a_lost_peer(error):
                raise
            stages = ", ".join(map(str, context.stages))
            deaths = describe_dead_ranks(context.global_ranks, context.rank)
            raise CollectiveFailedError(
                (f"{deaths}.\n" if deaths else "")
                + f"a collective in the {kind} of the zero-compiled graph of Dynamo frame "
                f"{context.compile_id} (stage {stages}) failed on rank {context.rank} of "
                f"{context.world_size} in group '{context.group_name}': another rank died or stalled "
                f"for longer than the process group's timeout ({context.timeout}). Look at the other "
                "ranks' output for the first error; if a rank is legitimately slow (a long compile, "
                "I/O), raise the timeout with zerocompile.init_distributed(timeout=datetime.timedelta"
                "(minutes=...)) or dist.init_process_group(..., timeout=...). Original error: "
                f"{error}"
            ) from error

    return run_explaining_failures
