"""Every optimizer `torch.optim` exports, at every stage: it trains equal to DDP, or it is refused
before its first step changes anything, by an error naming it, why, and what works instead.

An elementwise optimizer updates each element from that element's own history, so on a shard it
does exactly what it does on the full parameter. One that combines elements across parameters
(LBFGS's dot products) would, on the flat 1-D shards of stages 1-3, silently compute something
else. Two that read a parameter's shape step there as their `zerocompile.optim` equivalents: Muon
(which orthogonalises each update as a matrix) and Adafactor (which factors its second moment by
rows and columns). The model here holds only matrices, so every parameter is
one such an optimizer treats by its shape, and none divides evenly, so every shard is padded.

The optimizers are found in `torch.optim.__all__`, not listed, so one a new torch adds is measured
too; the table of them in docs/api.md must then match what was measured here.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import zerocompile as zc
import zerocompile.optim
from models import local_batch
from ranks import run_cases, run_on_ranks

STAGES = (0, 1, 2, 3)
STEPS = 3
WORLD_SIZE = 2
# Both sides apply the same optimizer to gradients that differ only in the order the 2 ranks'
# contributions are summed (DDP's all-reduce, our all_to_all and sum). Measured (eager compiler,
# 2 ranks, 3 steps, 2026-11-25): 0.0 for every optimizer and stage that trains. 1e-6 leaves room
# for another summation order and is far below what the refused ones do unguarded: Adafactor
# running unfactored on the shards moved these parameters 7.1e-3 from DDP's, LBFGS 0.25.
TOLERANCE = 1e-6
# LBFGS stops early on tests of its flat gradient and direction, which at stages 1-3 hold only one
# rank's shards: ranks stopping after different numbers of closures would wait forever on each
# other's collectives. Tolerances that never stop it keep the ranks in step, so the measurement
# finishes whatever LBFGS does; 4 iterations keep it short.
SETTINGS: dict[str, dict] = {"LBFGS": {"max_iter": 4, "tolerance_grad": -1.0, "tolerance_change": -1.0}}
# Built before shard() it is passed in, as docs/api.md asks of an optimizer that already holds state:
# Adagrad makes its state when built (test_adagrad_built_before_shard_... covers leaving it out).
ORDERS = ("built before shard(), passed in", "built after shard()")
# What users build after shard() instead of torch's Muon (whose constructor refuses flat shards,
# "Muon only supports 2D parameters", before a hook of ours could take it over) and Adafactor (whose
# first step on shards is refused, test_torch_optimizer_built_after_shard_is_refused_...).
BUILT_AFTER_SHARD = {torch.optim.Muon: zerocompile.optim.Muon, torch.optim.Adafactor: zerocompile.optim.Adafactor}
TABLE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def torch_optimizers() -> list[type[torch.optim.Optimizer]]:
    exported = (getattr(torch.optim, name) for name in torch.optim.__all__)
    return [
        value
        for value in exported
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer
    ]


OPTIMIZERS = [optimizer.__name__ for optimizer in torch_optimizers()]


class UnevenMatrices(nn.Module):
    """tests/models.py's UnevenMLP without biases: 7x13, 13x11 and 11x3 weights only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13, bias=False)
        self.fc2 = nn.Linear(13, 11, bias=False)
        self.fc3 = nn.Linear(11, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x))))).square().mean()


@dataclasses.dataclass(frozen=True)
class Refused:
    """A ValueError or TypeError, raised by the optimizer's constructor, by shard() (given the
    optimizer), or by its step."""

    when: str  # "construction", "shard" or "step"
    message: str
    changed_nothing: bool  # parameters as shard() left them, no optimizer state


def _build(optimizer_class: type[torch.optim.Optimizer], model: nn.Module) -> torch.optim.Optimizer:
    return optimizer_class(model.parameters(), **SETTINGS.get(optimizer_class.__name__, {}))


def _train(forward: Callable, optimizer: torch.optim.Optimizer, rank: int) -> None:
    for step in range(STEPS):
        batch = local_batch("uneven_mlp", step, rank, WORLD_SIZE)

        def loss_and_gradients() -> torch.Tensor:
            optimizer.zero_grad()
            loss = forward(batch)
            loss.backward()
            return loss

        optimizer.step(loss_and_gradients)  # every torch optimizer takes a closure; LBFGS needs one


@functools.cache
def _ddp_parameters(optimizer_class: type[torch.optim.Optimizer], rank: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = UnevenMatrices()
    _train(nn.parallel.DistributedDataParallel(model), _build(optimizer_class, model), rank)
    return {fqn: p.detach().clone() for fqn, p in model.named_parameters()}


def _sharded_outcome(optimizer_class: type[torch.optim.Optimizer], stage: int, order: str, rank: int) -> float | Refused:
    """The largest difference from DDP's parameters after training, or the refusal."""
    torch.manual_seed(0)  # no Dynamo reset: a fresh model of a stage already compiled reuses its graphs
    model = UnevenMatrices()
    optimizer = _build(optimizer_class, model) if order == ORDERS[0] else None
    as_built = [p.detach().clone() for p in model.parameters()]
    try:
        zc.shard(model, stage=stage, optimizer=optimizer)
    except (ValueError, TypeError) as error:
        unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), as_built, strict=True))
        return Refused("shard", str(error), changed_nothing=unchanged and not hasattr(model, "_zero_config"))
    as_sharded = [p.detach().clone() for p in model.parameters()]
    try:
        optimizer = optimizer or _build(BUILT_AFTER_SHARD.get(optimizer_class, optimizer_class), model)
    except (ValueError, TypeError) as error:
        return Refused("construction", str(error), changed_nothing=True)
    try:
        _train(torch.compile(model, backend="zero", options={"compiler": "eager"}), optimizer, rank)
    except (ValueError, TypeError) as error:
        unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), as_sharded, strict=True))
        return Refused("step", str(error), changed_nothing=unchanged and not optimizer.state)
    reference = _ddp_parameters(optimizer_class, rank)  # after: SparseAdam cannot train under DDP either
    with zc.gathered(model):
        return max((p.detach() - reference[fqn]).abs().max().item() for fqn, p in model.named_parameters())


def measure_every_optimizer(rank: int, world_size: int) -> dict[tuple[str, int, str], float | Refused | str]:
    """{(optimizer, stage, order): outcome, or the traceback of any other failure}."""
    return run_cases(
        ((optimizer_class.__name__, stage, order), lambda c=optimizer_class, s=stage, o=order: _sharded_outcome(c, s, o, rank))
        for optimizer_class in torch_optimizers()
        for stage in STAGES
        for order in ORDERS
    )


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, int, str], float | Refused | str]:
    return run_on_ranks(WORLD_SIZE, measure_every_optimizer)[0]


def _verdict(outcomes: dict, optimizer: str, stage: int) -> str:
    """docs/api.md's word for the measured outcome of both orders."""
    both = [outcomes[(optimizer, stage, order)] for order in ORDERS]
    if all(isinstance(outcome, float) and outcome <= TOLERANCE for outcome in both):
        return "= DDP"
    if all(isinstance(outcome, Refused) for outcome in both):
        return "refused"
    return f"neither: {both}"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_trains_like_ddp_or_is_refused_before_stepping(outcomes, optimizer: str, stage: int) -> None:
    works_at_stage_0 = _verdict(outcomes, optimizer, 0) == "= DDP"
    for order in ORDERS:
        outcome = outcomes[(optimizer, stage, order)]
        assert not isinstance(outcome, str), f"{order}: {outcome}"
        if isinstance(outcome, float):
            assert outcome <= TOLERANCE, f"{order}: parameters differ from DDP's by {outcome:.3g}"
            continue
        assert outcome.changed_nothing, f"{order}: refused only after stepping: {outcome.message}"
        assert optimizer in outcome.message, f"{order}: {outcome.message}"
        if outcome.when in ("shard", "step"):  # ours; a constructor's refusal is torch's own (no hook reaches it)
            assert "elementwise" in outcome.message, f"{order}: {outcome.message}"
            # What works must be what was measured: stage 0 is offered exactly where it trains.
            assert ("works at stage 0" in outcome.message) == works_at_stage_0, f"{order}: {outcome.message}"


def test_adagrad_built_before_shard_and_not_passed_in_is_told_to_pass_it(single_rank) -> None:
    """Adagrad makes its state when built, so without `optimizer=` its state is the full
    parameter's: refused before the step, naming it and the fix (it has not stepped)."""
    model = UnevenMatrices()
    optimizer = torch.optim.Adagrad(model.parameters())
    zc.shard(model, stage=3)
    model(local_batch("uneven_mlp", 0, 0, 1)).backward()
    with pytest.raises(RuntimeError, match=r"\(Adagrad\) stepped before zerocompile.shard\(\), or made its state when built.*optimizer=optimizer"):
        optimizer.step()


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adafactor])
def test_torch_optimizer_built_after_shard_is_refused_naming_ours(single_rank, optimizer_class) -> None:
    """torch's Adafactor built on the shards would run unfactored: its first step is refused
    before anything changes, naming zerocompile's equivalent."""
    model = zc.shard(UnevenMatrices(), stage=3)
    optimizer = optimizer_class(model.parameters())
    model(local_batch("uneven_mlp", 0, 0, 1)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=rf"torch.optim.{optimizer_class.__name__} cannot step.*zerocompile.optim.{optimizer_class.__name__}"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and not optimizer.state


def test_documented_table_is_what_was_measured(outcomes) -> None:
    measured = {
        optimizer: [_verdict(outcomes, optimizer, stage) for stage in STAGES] for optimizer in OPTIMIZERS
    }
    documented = {
        row[0].strip("` "): [cell.strip() for cell in row[1 : 1 + len(STAGES)]]
        for row in (line.strip().strip("|").split("|") for line in TABLE_PAGE.read_text().splitlines())
        if row and re.fullmatch(r"\s*`\w+`\s*", row[0]) and row[0].strip("` ") in OPTIMIZERS
    }
    rows = "\n".join(f"| `{name}` | {' | '.join(cells)} |" for name, cells in measured.items())
    assert documented == measured, f"docs/api.md's optimizer table should read:\n{rows}"
