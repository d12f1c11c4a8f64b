"""The rank-consistency guard and collective timeouts (zerocompile/guard.py).

One spawned group of 2 ranks runs every distributed case in turn and reports what each rank saw;
the cases that break a group's connections use a subgroup of their own with a short timeout, so
the world group stays usable for the next case. The comparison and its messages are also tested
on hand-built schedules, without any process group.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import Linears
from ranks import run_cases, run_on_ranks
from zerocompile import guard
from zerocompile.guard import MarkerEntry, Schedule, first_difference

WORLD_SIZE = 2
SHORT_TIMEOUT = timedelta(seconds=3)
PEER_WAIT = timedelta(seconds=2)  # instead of 30 s, for the case where a peer never shows up
EAGER = {"compiler": "eager"}


class RankBranch(Linears):
    """With `branch_on_rank`, rank 0 applies a layer the other ranks skip: the bug the guard is for."""

    def __init__(self, branch_on_rank: bool) -> None:
        super().__init__(body=(8, 8), extra=(8, 8), head=(8, 1))
        self.branch_on_rank = branch_on_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.body(x))
        if not self.branch_on_rank or dist.get_rank() == 0:
            x = self.extra(x)
        return self.head(x).square().mean()


def _compiled(stage: int, branch_on_rank: bool, group: dist.ProcessGroup | None = None) -> nn.Module:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = zc.shard(RankBranch(branch_on_rank), stage=stage, group=group)
    return torch.compile(model, backend="zero", options=EAGER)


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))


def _identical(rank: int) -> dict:
    """Two training steps on identical ranks: the guard runs once per graph and finds nothing.
    Counted by every `record_stats()` block open, the outer one too."""
    with guard.record_stats() as outer:
        with guard.record_stats() as stats:
            compiled = _compiled(3, branch_on_rank=False)
            for _ in range(2):
                compiled(_batch(rank)).backward()
    return {"checks": stats.checks, "bytes_written": stats.bytes_written, "outer": outer == stats}


def _diverging(stage: int, rank: int) -> dict:
    compiled = _compiled(stage, branch_on_rank=True)
    try:
        compiled(_batch(rank)).backward()
    except Exception as error:  # what the user sees, Dynamo's wrapping included
        return {"error": str(error), "type": _root_cause(error)}
    return {"error": None}


def _root_cause(error: BaseException) -> str:
    """The backend's own error type: Dynamo re-raises it as BackendCompilerFailed, not chained."""
    return type(getattr(error, "inner_exception", error)).__name__


def _stalled_peer(rank: int, where: str) -> dict:
    """Rank 1 stops taking part — it sleeps past the timeout before its forward, or leaves the
    group before its backward — and rank 0's collectives must fail with the explained error."""
    group = dist.new_group([0, 1], timeout=SHORT_TIMEOUT)
    compiled = _compiled(3, branch_on_rank=False, group=group)
    compiled(_batch(rank)).backward()  # compiles and runs once on both ranks
    try:
        if rank == 1 and where == "forward":
            time.sleep(SHORT_TIMEOUT.total_seconds() + 3)
        loss = compiled(_batch(rank))
        if rank == 1 and where == "backward":
            dist.destroy_process_group(group)  # as if the process had exited: its connections close
            return {"left": True}
        loss.backward()
    except Exception as error:
        # Exceptions lose their __cause__ when pickled back to the test: report the chain here.
        cause = error.__cause__
        return {"error": str(error), "type": type(error).__name__, "cause": type(cause).__name__ if cause else None}
    return {"error": None}


class _RecordingStore:
    """The group's store, recording the timeout of each `wait` the guard makes on it."""

    def __init__(self, store: dist.Store, waits: list[timedelta]) -> None:
        self._store, self._waits = store, waits

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._waits.append(timeout)
        self._store.wait(keys, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _recompiling_alone(rank: int) -> dict:
    """Rank 1's second batch has another length, so it alone recompiles (for a dynamic batch
    size); the collectives still match, and training must go on after a bounded wait."""
    waits: list[timedelta] = []
    real_store = guard._get_process_group_store
    # Ranks are not pytest tests: no fixture, but the same restoring patch.
    with pytest.MonkeyPatch.context() as patch, guard.record_stats() as stats:
        patch.setattr(guard, "PEER_WAIT", PEER_WAIT)
        patch.setattr(guard, "_get_process_group_store", lambda group: _RecordingStore(real_store(group), waits))
        compiled = _compiled(3, branch_on_rank=False)
        compiled(_batch(rank)).backward()
        compiled(torch.randn(3 if rank == 1 else 4, 8)).backward()
    return {"unanswered": stats.unanswered, "waits": waits}


def _recompiling_together_after_a_reset(rank: int) -> dict:
    """After `_recompiling_alone` (rank 1 compiled frame 0/1 alone) and a reset, both ranks train
    and recompile frame 0/1 together: the guard must compare every graph, waiting for nothing."""
    with pytest.MonkeyPatch.context() as patch, guard.record_stats() as stats:
        patch.setattr(guard, "PEER_WAIT", PEER_WAIT)
        compiled = _compiled(3, branch_on_rank=False)  # resets Dynamo
        compiled(_batch(rank)).backward()
        compiled(torch.randn(3, 8)).backward()
    return {"unanswered": stats.unanswered, "checks": stats.checks}


def guard_report(rank: int, world_size: int) -> dict:
    """Every case on this rank: its outcome, or the traceback of an unexpected failure."""
    peer_wait = guard.PEER_WAIT
    return run_cases(
        [
            ("identical", lambda: _identical(rank)),
            ("diverging stage 3", lambda: _diverging(3, rank)),
            ("diverging stage 2", lambda: _diverging(2, rank)),
            ("recompiling alone", lambda: _recompiling_alone(rank)),
            ("recompiling together after a reset", lambda: _recompiling_together_after_a_reset(rank)),
            ("stall in forward", lambda: _stalled_peer(rank, "forward")),
            ("exit before backward", lambda: _stalled_peer(rank, "backward")),
            ("globals afterwards", lambda: {"PEER_WAIT": (peer_wait, guard.PEER_WAIT)}),
        ]
    )


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_on_ranks(WORLD_SIZE, guard_report, timeout=120)


def _case(report: dict, name: str) -> dict:
    outcome = report[name]
    assert not isinstance(outcome, str), outcome
    return outcome


def test_identical_ranks_pass_the_guard_cheaply(reports) -> None:
    for report in reports:
        outcome = _case(report, "identical")
        # One training graph; the guard compared it once and wrote one small schedule.
        assert outcome["checks"] == 1
        assert 0 < outcome["bytes_written"] < 4096
        assert outcome["outer"], "the outer record_stats() block counted otherwise"


@pytest.mark.parametrize("stage", [3, 2])
def test_rank_dependent_branch_fails_on_every_rank_naming_the_collective(reports, stage: int) -> None:
    for rank, report in enumerate(reports):
        outcome = _case(report, f"diverging stage {stage}")
        assert outcome["error"] is not None, f"rank {rank} ran a diverging model without error"
        assert outcome["type"] == "RankMismatchError"
        message = outcome["error"]
        assert "collective 3 differs" in message, message
        assert f"rank 0 gathers 'extra.weight' [8, 8] at stage {stage}" in message, message
        assert f"rank 1 gathers 'head.weight' [1, 8] at stage {stage}" in message, message
        assert "do not branch on dist.get_rank()" in message


@pytest.mark.parametrize(
    ("case", "kind", "peer"),
    [
        ("stall in forward", "forward", "rank 1 is alive here"),
        # Its model was collected when it returned: it keeps no record, as a rank that ended normally.
        ("exit before backward", "backward", "rank 1 has no record here: on another host"),
    ],
)
def test_lost_peer_fails_with_an_explained_error(reports, case: str, kind: str, peer: str) -> None:
    survivor = _case(reports[0], case)
    message = survivor["error"]
    assert survivor["type"] == "CollectiveFailedError", message
    assert survivor["cause"] == "RuntimeError"  # the transport's own error stays chained
    assert f"in the {kind} of the zero-compiled graph of Dynamo frame 0/0" in message, message
    assert "stage 3" in message and "rank 0 of 2" in message
    assert f"timeout ({SHORT_TIMEOUT})" in message and "init_distributed(timeout=" in message
    # Named first: no rank died on this host (rank_deaths looked), and what became of the peer.
    assert message.startswith("no other rank of the group died on this host (") and peer in message, message


# The comparison itself, on hand-built schedules.

SETTINGS = {"bucket_bytes": 1024, "prefetch": 1, "compiler": "eager", "torch": "2.13.0"}


def _gather(param: str, shape: list[int], stage: int = 3) -> MarkerEntry:
    return MarkerEntry("unshard", param, shape, stage, "0", grad_reduced=True)


def test_a_rank_recompiling_alone_waits_a_bounded_time_and_trains_on(reports) -> None:
    rank0, rank1 = (_case(report, "recompiling alone") for report in reports)
    assert rank0["unanswered"] == 0, "rank 0 compiled nothing its peer did not"
    assert rank1["unanswered"] == 1, "rank 1's recompile has no counterpart on rank 0"
    # Bounded by what it asked the store for, not by how long that took on this machine.
    assert rank1["waits"] and all(wait <= PEER_WAIT for wait in rank1["waits"]), rank1["waits"]
    assert rank1["waits"][-1] == PEER_WAIT, rank1["waits"]


def test_after_a_reset_ranks_that_once_compiled_alone_compare_again(reports) -> None:
    for rank, report in enumerate(reports):
        outcome = _case(report, "recompiling together after a reset")
        assert outcome == {"unanswered": 0, "checks": 2}, f"rank {rank}: {outcome}"


def test_equal_schedules_agree() -> None:
    markers = [_gather("a.weight", [4, 4]), _gather("b.weight", [2, 4])]
    assert first_difference([Schedule("0/0", SETTINGS, markers), Schedule("0/1", SETTINGS, list(markers))]) is None


def test_first_differing_collective_is_named_with_both_ranks_parameters() -> None:
    ours = [_gather("a.weight", [4, 4]), _gather("b.weight", [2, 4])]
    theirs = [_gather("a.weight", [4, 4]), _gather("c.weight", [3, 4])]
    message = first_difference([Schedule("0/0", SETTINGS, ours), Schedule("0/0", SETTINGS, theirs)])
    assert message.startswith(
        "collective 2 differs — rank 0 gathers 'b.weight' [2, 4] at stage 3, gradient reduced, "
        "rank 1 gathers 'c.weight' [3, 4] at stage 3, gradient reduced"
    ), message


def test_a_difference_only_in_dtype_or_gradient_is_visible_in_the_message() -> None:
    ours = [_gather("a.weight", [4, 4])]
    theirs = [MarkerEntry("unshard", "a.weight", [4, 4], 3, "0", compute_dtype="bfloat16")]
    message = first_difference([Schedule("0/0", SETTINGS, ours), Schedule("0/0", SETTINGS, theirs)])
    assert "rank 1 gathers 'a.weight' [4, 4] at stage 3, compute bfloat16, no gradient" in message, message


def test_an_extra_collective_is_named_whichever_rank_has_it() -> None:
    short = [_gather("a.weight", [4, 4])]
    long = short + [MarkerEntry("reduce_grad", "z.bias", [2], 2, "0")]
    for schedules, extra_rank in (([long, short], 0), ([short, long], 1)):
        message = first_difference([Schedule("1/0", SETTINGS, s) for s in schedules])
        assert "collective 2" in message and "the first extra one" in message, message
        assert f"rank {extra_rank} reduces the gradient of 'z.bias' (2 elements per rank) at stage 2" in message


def test_the_first_rank_differing_from_rank_0_is_named() -> None:
    reference = [_gather("a.weight", [4, 4])]
    schedules = [Schedule("0/0", SETTINGS, reference)] * 2 + [Schedule("0/0", SETTINGS, [_gather("q", [1])])]
    assert "rank 2 gathers 'q' [1]" in first_difference(schedules)


def test_different_settings_are_named_with_the_fix() -> None:
    markers = [_gather("a.weight", [4, 4])]
    other = {**SETTINGS, "bucket_bytes": 0}
    message = first_difference([Schedule("0/0", SETTINGS, markers), Schedule("0/0", other, markers)])
    assert "rank 0 bucket_bytes=1024; rank 1 bucket_bytes=0" in message, message
    assert "same torch.compile options" in message


def test_schedules_survive_the_store_round_trip() -> None:
    schedule = Schedule("2/1", SETTINGS, [_gather("a.weight", [4, 4]), MarkerEntry("reduce_grad", "b", [3], 2, "7")])
    assert Schedule.from_json(schedule.to_json().encode()) == schedule


def test_check_ranks_is_a_compile_time_option() -> None:
    assert zc.ZeroConfig().check_ranks is True
    assert zc.ZeroConfig().with_options({"check_ranks": False}).check_ranks is False
    with pytest.raises(ValueError, match="check_ranks must be True or False"):
        zc.ZeroConfig(check_ranks="no")


def test_cases_leave_the_guard_module_as_they_found_it(reports) -> None:
    for rank, report in enumerate(reports):
        before, after = _case(report, "globals afterwards")["PEER_WAIT"]
        assert after == before, f"rank {rank}: guard.PEER_WAIT is {after} after the cases, {before} before"
