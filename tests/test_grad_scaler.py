"""fp16 with a loss scaler: `zc.ShardedGradScaler` makes every rank skip an overflowing step together.

At stages 1-3 a rank's gradients are its shards, so an inf reaches only the rank that owns its
element. torch's `GradScaler` then skips the step there and takes it everywhere else; the ranks
part silently. One spawned group of 2 ranks trains `param_dtype=torch.float16` (fp32 master
shards, gradients reduced in fp32) against DDP with torch's `GradScaler` on a twin that computes
in fp16 the same way, with a first loss scale so large that the first steps overflow, and then
puts an inf into one rank's gradient shard.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

import zerocompile as zc
from models import ComputesIn, UnevenMLP, local_batch
from ranks import run_cases, run_on_ranks
from training import train
from zerocompile.sharded_parameters import shard_info

STEPS = 6
# The loss's own gradient is the scale, in fp16, whose largest finite value is 65504 < 2**16: so
# the steps at 2**18 and 2**17 are skipped, 2**15 trains and grows back to 2**16 after 2 good
# steps, which is skipped again (the scale after each step, measured: 2**17, 2**16, 2**15,
# 2**15, 2**16, 2**15).
SCALER_SETTINGS = {"init_scale": 2.0**18, "growth_interval": 2}
LR = 0.5
# Measured 0.0 (2026-11-25): the same fp16 arithmetic and an fp32 average of two ranks' gradients
# either way. The bound leaves room for other summation orders, far below one step's change.
TOLERANCE = 1e-6


def _train(
    model: nn.Module, forward: Callable, scaler: torch.amp.GradScaler, rank: int, world_size: int
) -> list[tuple[float, float]]:
    """(loss, loss scale after the step) of each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scales = []
    batches = (local_batch("uneven_mlp", step, rank, world_size) for step in range(STEPS))
    losses = train(forward, optimizer, batches, scaler=scaler, after_step=lambda: scales.append(scaler.get_scale()))
    return list(zip(losses, scales))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with zc.gathered(model, writeback=False):
        return {fqn: p.detach().clone() for fqn, p in model.named_parameters()}


def _sharded(stage: int) -> tuple[nn.Module, Callable]:
    torch.manual_seed(0)
    model = zc.shard(UnevenMLP(), stage=stage, param_dtype=torch.float16, reduce_dtype=torch.float32)
    return model, torch.compile(model, backend="zero", options={"compiler": "eager"})


def parity(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    torch.manual_seed(0)
    twin = UnevenMLP()
    ddp = nn.parallel.DistributedDataParallel(ComputesIn(twin, torch.float16))
    ddp_history = _train(twin, ddp, torch.amp.GradScaler("cpu", **SCALER_SETTINGS), rank, world_size)
    torch._dynamo.reset()
    model, compiled = _sharded(stage)
    history = _train(model, compiled, zc.ShardedGradScaler("cpu", **SCALER_SETTINGS), rank, world_size)
    full = _full(model)
    error = max((full[fqn] - p).abs().max().item() for fqn, p in twin.named_parameters())
    return {"history": history, "ddp_history": ddp_history, "error": error}


def step_with_an_inf_on_rank_1(rank: int, world_size: int, scaler_class: type[torch.amp.GradScaler]) -> dict[str, Any]:
    """One step at stage 3 whose gradient shard on rank 1 holds an inf (in fc1.weight, an element
    that rank owns): did this rank's parameters change, and the loss scale after the step."""
    torch._dynamo.reset()
    model, compiled = _sharded(stage=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = scaler_class("cpu", init_scale=2.0**8)
    scaler.scale(compiled(local_batch("uneven_mlp", 0, rank, world_size))).backward()
    weight = model.fc1._parameters["weight"]
    assert shard_info(weight).shard_offset < shard_info(weight).numel, "rank 1 owns real elements of fc1.weight"
    if rank == 1:
        weight.grad.to_local()[0, 0] = float("inf")  # the first of this rank's rows
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    return {"stepped": changed, "scale": scaler.get_scale()}


def grad_scaler_report(rank: int, world_size: int) -> dict[Any, Any]:
    cases: dict[Any, Callable[[], Any]] = {
        ("parity", 0): lambda: parity(rank, world_size, stage=0),
        ("parity", 3): lambda: parity(rank, world_size, stage=3),
        ("inf", "ShardedGradScaler"): lambda: step_with_an_inf_on_rank_1(rank, world_size, zc.ShardedGradScaler),
        ("inf", "torch's GradScaler"): lambda: step_with_an_inf_on_rank_1(rank, world_size, torch.amp.GradScaler),
    }
    return run_cases(cases.items())


@pytest.fixture(scope="module")
def report() -> list[dict[Any, Any]]:
    return run_on_ranks(2, grad_scaler_report, timeout=300)


def _case(report: list[dict[Any, Any]], key: Any) -> list[Any]:
    cases = [rank_report[key] for rank_report in report]
    for rank, case in enumerate(cases):
        assert isinstance(case, dict), f"rank {rank} failed:\n{case}"
    return cases


@pytest.mark.parametrize("stage", (0, 3))
def test_fp16_with_sharded_grad_scaler_trains_like_ddp_with_torchs(report, stage: int) -> None:
    for rank, case in enumerate(_case(report, ("parity", stage))):
        scales = [SCALER_SETTINGS["init_scale"]] + [scale for _loss, scale in case["ddp_history"]]
        skipped = [after < before for before, after in zip(scales, scales[1:])]
        assert any(skipped) and not all(skipped), f"some steps skipped, some taken: {scales}"
        assert case["history"] == case["ddp_history"], f"rank {rank}: losses and loss scales step by step"
        assert case["error"] <= TOLERANCE, f"rank {rank}"


def test_an_inf_in_one_ranks_shard_makes_every_rank_skip_the_step(report) -> None:
    cases = _case(report, ("inf", "ShardedGradScaler"))
    assert [case["stepped"] for case in cases] == [False, False]
    assert [case["scale"] for case in cases] == [2.0**7, 2.0**7], "every rank backed the scale off"


def test_torchs_grad_scaler_agrees_too_on_dtensor_gradients(report) -> None:
    """The parameters' gradients are DTensors, whose found-inf check DTensor reduces over the mesh:
    torch's own GradScaler now skips on every rank too (on flat shards rank 0 stepped and kept its
    scale while rank 1 skipped). ShardedGradScaler stays for its flat, one-collective path."""
    cases = _case(report, ("inf", "torch's GradScaler"))
    assert [case["stepped"] for case in cases] == [False, False]
    assert [case["scale"] for case in cases] == [2.0**7, 2.0**7]
