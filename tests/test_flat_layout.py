"""The collective layout of every backend but gloo (NCCL's, the fake group's), run for real on gloo
ranks: each bucket's shards packed into one buffer, one all-gather, one wait, the parameters cut
out of the gathered rows; reductions by the native reduce-scatter.

The layout follows how a group reduce-scatters (`zerocompile.distributed.reduce_scatter_flavour`),
so the ranks patch that choice to the native one, as a GPU run would have it. Plain SGD against DDP
(a wrong scale or a parameter cut from the wrong columns moves the parameters at once), and int8
gathers against gloo's own layout, which sends the same int8 rows: the two must agree bit for bit.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import UnevenMLP, local_batch
from ranks import run_cases, run_on_ranks
from training import train
from zerocompile import sharding
from zerocompile.passes.lowering import NATIVE_REDUCE_SCATTER

STEPS = 4
LR = 0.1
# Both sides add the same N fp32 gradients, in another order (DDP's ring all-reduce, gloo's
# reduce-scatter here), so parameters may differ by a few ulps of the updates; test_sgd_parity's
# bound, 1e4 below what a wrongly scaled reduction moves.
FP32_TOLERANCE = 1e-6


def _train(model: nn.Module, forward, rank: int, world_size: int) -> list[float]:
    batches = (local_batch("uneven_mlp", step, rank, world_size) for step in range(STEPS))
    return train(forward, torch.optim.SGD(model.parameters(), lr=LR), batches)


def _zero(stage: int, native: bool, **settings) -> tuple[nn.Module, list[float]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    native_layout = mock.patch.object(sharding, "reduce_scatter_flavour", lambda group, device: NATIVE_REDUCE_SCATTER)
    with native_layout if native else contextlib.nullcontext():
        model = zc.shard(UnevenMLP(), stage=stage, **settings)
    compiled = torch.compile(model, backend="zero")
    return model, _train(model, compiled, dist.get_rank(), dist.get_world_size())


def _parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    with zc.gathered(model):
        return {fqn: p.detach().clone() for fqn, p in model.named_parameters()}


def flat_layout_report(rank: int, world_size: int) -> dict:
    """{case: largest parameter difference from its reference (and, of the int8 layouts, whether their
    losses are equal), or a traceback}."""
    torch.manual_seed(0)
    reference = UnevenMLP()
    _train(reference, nn.parallel.DistributedDataParallel(reference), rank, world_size)
    ddp = {fqn: p.detach() for fqn, p in reference.named_parameters()}

    def against_ddp(stage: int) -> float:
        # One bucket for the whole MLP: every parameter is cut out of shared rows.
        model, _ = _zero(stage, native=True, bucket_bytes=2**20)
        return max((p - ddp[f]).abs().max().item() for f, p in _parameters(model).items())

    def int8_layouts() -> tuple[float, bool]:
        """The largest parameter difference of the two layouts, and whether their losses are equal."""
        int8 = {"gather_quant": "int8", "reduce_quant": "int8", "quant_block": 16, "bucket_bytes": 2**20}
        native, native_losses = _zero(3, native=True, **int8)
        gloo, gloo_losses = _zero(3, native=False, **int8)
        mine, theirs = _parameters(native), _parameters(gloo)
        return max((mine[f] - theirs[f]).abs().max().item() for f in mine), native_losses == gloo_losses

    cases = [(f"stage {stage} vs ddp", lambda stage=stage: against_ddp(stage)) for stage in (1, 2, 3)]
    report = run_cases([*cases, ("stage 3 int8 vs gloo layout", int8_layouts)])
    torch._dynamo.reset()
    return report


@pytest.fixture(scope="module")
def reports() -> dict[int, dict]:
    return {n: run_on_ranks(n, flat_layout_report)[0] for n in (2, 4)}


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("stage", (1, 2, 3))
def test_flat_layout_matches_ddp(reports, world_size: int, stage: int) -> None:
    error = reports[world_size][f"stage {stage} vs ddp"]
    assert not isinstance(error, str), error
    assert error <= FP32_TOLERANCE, f"parameters differ from DDP's by {error:.3g}"


@pytest.mark.parametrize("world_size", (2, 4))
def test_flat_layout_int8_gathers_send_what_gloos_layout_sends(reports, world_size: int) -> None:
    outcome = reports[world_size]["stage 3 int8 vs gloo layout"]
    assert not isinstance(outcome, str), outcome
    error, losses_equal = outcome
    assert error == 0 and losses_equal
