"""`zc.clip_grad_norm_` against DDP + `torch.nn.utils.clip_grad_norm_`, 2- and inf-norm, stages 0-3.

One spawned group of 2 ranks trains a model whose every feature can break a sharded norm
(padded shards, a tied weight, a frozen layer, a one-element bias that some ranks hold only padding
of) with clipping on, under DDP and under each stage, and reports the norms of every step and the
final parameters; the tests assert on the report.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from ranks import run_cases, run_on_ranks
from test_parity import EAGER_TOLERANCE
from training import full_parameters, train

STEPS = 4
NORMS = (2.0, math.inf)
# Far below the gradients' norms (about 0.1-1), so every step clips.
MAX_NORM = 0.05
NORM_TOLERANCE = 1e-6
SETUPS = ("stage 0", "stage 1", "stage 2", "stage 3", "body 3, top 2", "body 0, top 3")


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return torch.relu(self.frozen(h)) + h


class Top(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mid = nn.Linear(7, 5)
        self.gate = nn.Linear(7, 5, bias=False)
        self.gate.weight = self.mid.weight  # tied: one Parameter in two modules
        self.head = nn.Linear(5, 1)  # its bias has one element

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(h)) * torch.sigmoid(self.gate(h))).square().mean()


class ClipModel(nn.Module):
    """Uneven sizes (padded shards), a tied weight, a frozen layer, a one-element bias."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.top = Top()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.top(self.body(x))


def _batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    return torch.randn(8, 5, generator=torch.Generator().manual_seed(2000 + step)).chunk(world_size)[rank]


def _train_clipped(model: nn.Module, forward, clip, norm_type: float, rank: int, world_size: int) -> dict:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    norms = []
    batches = (_batch(step, rank, world_size) for step in range(STEPS))
    train(forward, optimizer, batches, after_backward=lambda: norms.append(clip(model, MAX_NORM, norm_type).item()))
    return {"norms": norms, "params": full_parameters(model)}


def _torch_clip(model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)


def _sharded(setup: str) -> nn.Module:
    """`stage N`: the whole model at stage N; `body A, top B`: the body at stage A over the world,
    the top at stage B over a second group of the same ranks (norms of two groups, or of a group
    and whole stage-0 gradients, to combine)."""
    model = ClipModel()
    if setup.startswith("stage"):
        return zc.shard(model, stage=int(setup.split()[1]))
    body, top = (int(part.split()[1]) for part in setup.split(", "))
    zc.shard(model.body, stage=body)
    zc.shard(model.top, stage=top, group=dist.new_group(list(range(dist.get_world_size()))))
    return model


def clipping_report(rank: int, world_size: int) -> dict:
    """{("ddp", norm)}: DDP + torch's clipping; {(setup, norm)}: ours, or a failure's traceback."""
    report = {}
    for norm_type in NORMS:
        torch.manual_seed(0)
        model = ClipModel()
        ddp = nn.parallel.DistributedDataParallel(model)
        report[("ddp", norm_type)] = _train_clipped(model, ddp, _torch_clip, norm_type, rank, world_size)

    def clipped(setup: str, norm_type: float) -> dict:
        torch.manual_seed(0)
        model = _sharded(setup)
        compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
        return _train_clipped(model, compiled, zc.clip_grad_norm_, norm_type, rank, world_size)

    for setup in SETUPS:
        torch._dynamo.reset()  # once per setup: both norms train the same graphs
        report.update(run_cases(((setup, norm), lambda s=setup, n=norm: clipped(s, n)) for norm in NORMS))
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    """Every rank's report, at 2 ranks (rank 1's shard of the one-element head bias is padding)."""
    return run_on_ranks(2, clipping_report, timeout=300)


def _ours(report: dict, setup: str, norm_type: float) -> dict:
    outcome = report[(setup, norm_type)]
    assert not isinstance(outcome, str), outcome
    return outcome


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("setup", SETUPS)
def test_total_norm_equals_ddp_with_torch_clipping(reports, setup: str, norm_type: float) -> None:
    report = reports[0]
    ours, ddp = _ours(report, setup, norm_type), report[("ddp", norm_type)]
    assert all(norm > MAX_NORM for norm in ddp["norms"]), "the test must clip"
    assert ours["norms"] == pytest.approx(ddp["norms"], abs=NORM_TOLERANCE, rel=0)


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("setup", SETUPS)
def test_clipped_training_stays_in_parity_with_ddp(reports, setup: str, norm_type: float) -> None:
    report = reports[0]
    ours, ddp = _ours(report, setup, norm_type), report[("ddp", norm_type)]
    error = max((ours["params"][k] - ddp["params"][k]).abs().max().item() for k in ddp["params"])
    assert error <= EAGER_TOLERANCE, f"parameters differ from DDP by {error:.3g}"


@pytest.mark.parametrize("setup", SETUPS)
def test_every_rank_gets_the_same_norm(reports, setup: str) -> None:
    for norm_type in NORMS:
        norms = [_ours(report, setup, norm_type)["norms"] for report in reports]
        assert all(rank_norms == norms[0] for rank_norms in norms), norms


def test_unsharded_parameters_clip_exactly_as_torch() -> None:
    """No process group needed: without shards there is nothing to combine."""
    torch.manual_seed(0)
    ours, theirs = nn.Linear(6, 3), nn.Linear(6, 3)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 6)
    for model in (ours, theirs):
        model(x).square().sum().backward()
    for norm_type in NORMS:
        assert torch.equal(zc.clip_grad_norm_(ours, 0.1, norm_type), _torch_clip(theirs, 0.1, norm_type))
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))


@pytest.mark.parametrize("norm_type", (0, -1.0, -math.inf))
def test_norm_types_that_are_not_norms_are_refused(norm_type: float) -> None:
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(ValueError, match=r"norm_type > 0 .*got"):
        zc.clip_grad_norm_(model, 1.0, norm_type)
