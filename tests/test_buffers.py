"""Buffers like DDP: with `broadcast_buffers=True` (the default, as DDP's) BatchNorm's running
statistics on every rank equal DDP's on that rank, through plain steps, a `no_grad` evaluation and
an accumulation window (DDP's rule of which forwards broadcast); with False they equal
DDP(broadcast_buffers=False)'s. The broadcast is inside the compiled graph (the ledger shows it).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocompile as zc
from models import BatchNormMLP
from ranks import run_cases, run_on_ranks
from training import train

LR = 0.5  # plain SGD: a wrongly scaled gradient moves the parameters visibly
# Running statistics are means and variances of the same float32 activations on both sides, as
# are the parameters after SGD on the same averaged gradients: equal up to summation order.
TOLERANCE = 1e-6


def _batch(step: int, rank: int) -> torch.Tensor:
    # Each rank's data has its own scale, so unsynchronised running statistics drift apart.
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + rank)


def _schedule(model: nn.Module, forward, optimizer: torch.optim.Optimizer, no_sync, rank: int) -> None:
    """Two steps, a no_grad evaluation, a step, an accumulation window of two micro-steps."""
    train(forward, optimizer, (_batch(step, rank) for step in range(2)))
    model.eval()
    with torch.no_grad():
        forward(_batch(7, rank))
    model.train()
    train(forward, optimizer, [_batch(2, rank)])
    with no_sync():
        forward(_batch(3, rank)).backward()
    forward(_batch(4, rank)).backward()
    optimizer.step()
    optimizer.zero_grad()


def _case(stage: int, broadcast: bool, compiler: str, rank: int) -> dict:
    torch.manual_seed(0)
    reference = BatchNormMLP(6, 9, 3, torch.relu)
    ddp = nn.parallel.DistributedDataParallel(reference, broadcast_buffers=broadcast)
    _schedule(reference, ddp, torch.optim.SGD(reference.parameters(), lr=LR), ddp.no_sync, rank)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = zc.shard(BatchNormMLP(6, 9, 3, torch.relu), stage=stage, broadcast_buffers=broadcast)
    compiled = torch.compile(model, backend="zero", options={"compiler": compiler})
    with zc.record_graphs() as graphs:
        _schedule(model, compiled, torch.optim.SGD(model.parameters(), lr=LR), lambda: zc.no_sync(model), rank)

    buffers = {name: (b.float() - dict(reference.named_buffers())[name].float()).abs().max().item() for name, b in model.named_buffers()}
    with zc.gathered(model):  # (its exit re-broadcasts buffers: read them before)
        parameters = max((p - dict(reference.named_parameters())[n]).abs().max().item() for n, p in model.named_parameters())
    # Whether each graph holding a broadcast also computes the model (its Linear layers' addmm).
    broadcasts = [
        "addmm" in g.code for g in graphs if any(e.op == "broadcast" for e in g.ledger.entries)
    ]
    return {"buffers": buffers, "parameters": parameters, "broadcasts": broadcasts}


def buffer_cases(
    rank: int, world_size: int, compiler: str, stages: tuple[int, ...], broadcasts: tuple[bool, ...] = (True, False)
) -> dict:
    return run_cases(
        ((compiler, stage, broadcast), lambda s=stage, b=broadcast: _case(s, b, compiler, rank))
        for stage in stages
        for broadcast in broadcasts
    )


def _check(report: dict) -> None:
    for key, outcome in report.items():
        assert not isinstance(outcome, str), f"{key}: {outcome}"
        assert max(outcome["buffers"].values()) <= TOLERANCE, (key, outcome)
        assert outcome["parameters"] <= TOLERANCE, (key, outcome)
        _compiler, _stage, broadcast = key
        assert bool(outcome["broadcasts"]) == broadcast, (key, outcome)
        # In the model's own graph, not in a compiled region of its own before it.
        assert all(outcome["broadcasts"]), (key, outcome)


@pytest.mark.parametrize("world_size, stages", [(2, (0, 1, 2, 3)), (4, (0, 3))])
def test_buffers_follow_ddp_at_every_stage(world_size: int, stages: tuple[int, ...]) -> None:
    for report in run_on_ranks(world_size, buffer_cases, "eager", stages):
        _check(report)


def test_buffers_follow_ddp_under_inductor() -> None:
    for report in run_on_ranks(2, buffer_cases, "inductor", (3,), (True,)):
        _check(report)

