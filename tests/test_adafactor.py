"""Adafactor on sharded parameters equals DDP with `torch.optim.Adafactor`, at stages 1-3, N = 2 and 4.

tests/matrix_optimizers.py's model (a tied-embedding GPT, a 7x13 matrix whose shards end mid-row, a
1x3 one smaller than 4 ranks), every parameter under Adafactor: matrices factored by rows and
columns, vectors not. Cases as there: plain (eager and Inductor), gradient accumulation over 4
micro-steps, clipping, and a `torch.optim.Adafactor` built and stepped before `shard()` and
handed to it. The wrong variant - each rank's partial sums used as they are, as if its shard were
the whole parameter - must fail the bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from zerocompile.dtensor_parameters import flat_state
import zerocompile.optim
from matrix_optimizers import MuonGPT, case_id, largest_difference, parity_report, report_of
from models import global_batch
from training import train

LR = 1e-2  # torch's default
# Both sides compute the same elementwise steps; the whole-parameter sums (the parameter's and the
# update's norms, each row's and column's mean square) add the same values in another order (ours:
# per shard, then across ranks; torch: over the whole tensor), and the gradients differ as in
# test_muon (summation order across ranks; stage 3 reduces the tied embedding's uses apart).
# Measured (2026-11-28, 5 steps): at most 2.4e-7 at N = 2 and 1.2e-7 at N = 4 (a few ulps of
# parameters of O(0.1-1)). 1e-5 leaves 40x room; the wrong variant below (a shard's sums taken as
# the whole parameter's) moved them 1.7e-2.
TOLERANCE = 1e-5


def _adafactor(model: nn.Module, ours: bool) -> list[torch.optim.Optimizer]:
    return [(zerocompile.optim.Adafactor if ours else torch.optim.Adafactor)(model.parameters(), lr=LR)]


def _factored_matrices_sharded_vectors(optimizers: list[torch.optim.Optimizer]) -> None:
    for param, state in flat_state(optimizers[0]).items():
        info = zc.sharded_parameters.shard_info(param)
        if len(info.shape) == 1:
            assert state["variance"].shape == (info.shard_numel,)
        else:
            assert state["row_var"].shape == (*info.shape[:-1], 1) and state["col_var"].shape == (1, info.shape[-1])


# A spread of cases per world size (each costs a compile on every rank), as in test_muon.
CASES = {
    2: [(1, "eager", "plain"), (3, "inductor", "plain"), (2, "eager", "accumulate"), (3, "eager", "taken_over")],
    4: [(3, "eager", "plain"), (2, "eager", "clip")],
}


def _sums_of_the_shard_alone(partial, pieces) -> None:
    for piece, sums in zip(pieces, partial):
        piece.sums = sums


def adafactor_report(rank: int, world_size: int) -> dict:
    wrong = {"unreduced": ("_all_reduce_sums", _sums_of_the_shard_alone)} if world_size == 2 else {}
    return parity_report(_adafactor, _factored_matrices_sharded_vectors, CASES[world_size], rank, world_size, wrong)


@pytest.fixture(scope="module")
def reports() -> dict[int, dict]:
    return {}


@pytest.mark.parametrize("world_size,case", [(n, case) for n, cases in CASES.items() for case in cases], ids=case_id)
def test_adafactor_equals_ddp(reports, world_size: int, case: tuple) -> None:
    outcome = report_of(reports, world_size, adafactor_report)[case]
    assert not isinstance(outcome, str), outcome
    assert outcome <= TOLERANCE, f"parameters differ from DDP + torch.optim.Adafactor by {outcome:.3g}"


def test_a_shards_sums_as_the_whole_parameters_fail_the_bound(reports) -> None:
    outcome = report_of(reports, 2, adafactor_report)["unreduced"]
    assert not isinstance(outcome, str), outcome
    assert outcome > 100 * TOLERANCE, f"the wrong variant came within {outcome:.3g} of DDP"


@pytest.mark.core
@pytest.mark.parametrize("stage", [0, 3])
def test_adafactor_steps_as_torchs_on_one_rank(single_rank, stage: int) -> None:
    """On one rank, whole (stage 0) and as padded flat shards (stage 3): torch.optim.Adafactor's
    steps, with weight decay, on every torch of the window (CI's core tier). Measured 1.2e-7
    (torch takes norms where we sum squares)."""
    torch.manual_seed(0)
    ours, theirs = MuonGPT(), MuonGPT()
    theirs.load_state_dict(ours.state_dict())
    zc.shard(ours, stage=stage)
    optimizers = [
        zerocompile.optim.Adafactor(ours.parameters(), lr=LR, weight_decay=0.01),
        torch.optim.Adafactor(theirs.parameters(), lr=LR, weight_decay=0.01),
    ]
    for step in range(4):  # the models' steps taken in turn
        for model, optimizer in zip((ours, theirs), optimizers):
            train(model, optimizer, [global_batch("tied_gpt", step)])
    with zc.gathered(ours):
        assert largest_difference(dict(ours.named_parameters()), dict(theirs.named_parameters())) <= 1e-6


@pytest.mark.fast
def test_the_ledger_counts_what_the_step_all_reduces(fake_two_ranks, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fake group of 2 (shapes only): the step's ledger has one entry per all-reduce the step
    issues, of the bytes it hands to it: 16x8 and 8x16 matrices (a norm, 16 row and 8 column sums
    each) and a vector (its norm) are 51 float32 values, then 3 update norms."""
    reduced: list[int] = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kw: reduced.append(tensor.nbytes) or all_reduce(tensor, **kw))
    model = zc.shard(nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8)), stage=3)
    adafactor = zerocompile.optim.Adafactor(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    adafactor.step()
    ledger = zerocompile.optim.step_ledger(adafactor)
    assert reduced == [entry.input_bytes for entry in ledger.entries] == [51 * 4, 3 * 4]
    assert [entry.sent_bytes for entry in ledger.entries] == [51 * 4, 3 * 4]  # ring: 2(N-1)/N of it
    assert ledger.sent_bytes == zerocompile.optim.exchange_bytes(adafactor) == 54 * 4
