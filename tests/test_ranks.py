"""The test harness's rank pool (tests/ranks.py): ranks are reused, yet every job starts as a new
process would, and whatever went wrong in one job never reaches the next."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from ranks import run_on_ranks


def _spoil_the_process(rank: int, world_size: int) -> tuple[int, float]:
    import zerocompile as zc

    first_draw = torch.rand(1).item()
    os.environ["ZC_LEFT_BEHIND"] = "1"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    recorder = zc.record_graphs()
    recorder.__enter__().append("left behind")  # never closed, nor collected (that would close it):
    _spoil_the_process.left_open = recorder
    torch.manual_seed(1234)
    return os.getpid(), first_draw


def _what_a_job_finds(rank: int, world_size: int) -> dict:
    from zerocompile.graph_records import open_records

    return {
        "pid": os.getpid(),
        "first_draw": torch.rand(1).item(),
        "left_behind": os.environ.get("ZC_LEFT_BEHIND"),
        "test_variable": os.environ.get("ZC_RANKS_TEST"),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "recorders": open_records(),
    }


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")


def _say_then_die_on_rank_1(rank: int, world_size: int) -> None:
    print(f"rank {rank} says so on stderr", file=sys.stderr, flush=True)
    if rank == 1:
        _a_frame_the_stack_names()


def _a_frame_the_stack_names() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def test_the_next_job_reuses_the_ranks_and_finds_them_as_new() -> None:
    spoiled = run_on_ranks(2, _spoil_the_process)
    found = run_on_ranks(2, _what_a_job_finds)
    for (pid, first_draw), after in zip(spoiled, found):
        assert after["pid"] == pid, "a new process: the pool did not keep its ranks"
        assert after["first_draw"] == first_draw, "the job did not start from torch's default seed"
        assert after["left_behind"] is None and after["dtype"] == torch.float32 and after["grad"]
        assert after["recorders"] == ()


def test_a_failed_job_takes_its_ranks_with_it() -> None:
    before = [found["pid"] for found in run_on_ranks(2, _what_a_job_finds)]
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        run_on_ranks(2, _fail_on_rank_1)
    after = [found["pid"] for found in run_on_ranks(2, _what_a_job_finds)]
    assert not set(before) & set(after)


def test_a_changed_environment_starts_ranks_that_inherit_it(monkeypatch: pytest.MonkeyPatch) -> None:
    before = [found["pid"] for found in run_on_ranks(2, _what_a_job_finds)]
    monkeypatch.setenv("ZC_RANKS_TEST", "set by the test")
    after = run_on_ranks(2, _what_a_job_finds)
    assert not set(before) & {found["pid"] for found in after}
    assert [found["test_variable"] for found in after] == ["set by the test"] * 2


def test_a_rank_that_dies_of_a_signal_is_reported_with_its_stack(capfd: pytest.CaptureFixture) -> None:
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(2, _say_then_die_on_rank_1)
    message = str(failure.value)
    assert message.startswith("rank 1 failed") and "died of SIGSEGV" in message, message
    assert "Fatal Python error: Segmentation fault" in message, message
    assert "_a_frame_the_stack_names" in message, message
    said = capfd.readouterr().err
    assert "rank 0 says so on stderr" in said and "rank 1 says so on stderr" in said, said
