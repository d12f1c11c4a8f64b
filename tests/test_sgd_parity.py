"""Parity that catches scale bugs: plain SGD against DDP at every stage, N = 2 and 4, both compilers,
gradients reduced in fp32 and in bf16.

AdamW divides each update by the root of its second moment, so a reduction that sums instead of
averaging (every gradient N times too large) or divides twice barely moves its parameters, and
test_parity's AdamW cases pass with such a bug. Plain SGD (no momentum) moves each parameter by
lr * gradient: a gradient off by any factor shows at once. The last test proves it: with the
lowering patched to sum instead of average, the same comparison fails by orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import UnevenMLP, local_batch
from ranks import run_cases, run_on_ranks
from training import train
from zerocompile.passes import lower_markers

STAGES = (0, 1, 2, 3)
STEPS = 5
LR = 0.1
# fp32: both sides add the same N fp32 gradients in another order (DDP's all-reduce vs our
# all_to_all and sum; Inductor also fuses the backward differently), so parameters may differ by a
# few ulps of the updates: measured (eager, 2026-11-25) 0 at N=2 and at most 1.9e-9 at N=4.
# 1e-6 leaves room for other summation orders and is 1e4 below what a summed reduction moves
# (measured 2.6e-2 after these 5 steps at N=2).
FP32_TOLERANCE = 1e-6
# bf16 reduce against DDP with a bf16 reduction hook: both round each gradient to bf16 (8 bits of
# mantissa) and average after the sum, but gloo's ring rounds each partial sum to bf16 while ours
# sums the N received chunks at once, so an update may differ by a bf16 ulp of the gradient:
# measured 0 at N=2 and at most 9.8e-5 at N=4. 1e-3 keeps 10x headroom and stays well below the
# summed reduction's 2.6e-2.
BF16_TOLERANCE = 1e-3
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def _train(model: nn.Module, forward, rank: int, world_size: int) -> None:
    batches = (local_batch("uneven_mlp", step, rank, world_size) for step in range(STEPS))
    train(forward, torch.optim.SGD(model.parameters(), lr=LR), batches)


def _bf16_reduce(state, bucket):  # unannotated: DDP checks annotations, which are strings here
    """DDP's bucket reduced in bf16, summed then averaged, as zerocompile's reduce_dtype does
    (torch's bf16_compress_hook refuses gloo)."""
    compressed = bucket.buffer().to(torch.bfloat16)
    reduced = dist.all_reduce(compressed, async_op=True).get_future()
    return reduced.then(lambda done: bucket.buffer().copy_(done.value()[0] / dist.get_world_size()))


def _reference(rank: int, world_size: int, reduce: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = UnevenMLP()
    ddp = nn.parallel.DistributedDataParallel(model)
    if reduce == "bf16":
        ddp.register_comm_hook(None, _bf16_reduce)
    _train(model, ddp, rank, world_size)
    return {fqn: p.detach().clone() for fqn, p in model.named_parameters()}


def _summing_instead_of_averaging(monkeypatch: pytest.MonkeyPatch, world_size: int) -> None:
    """The deliberately broken lowering: every reduced gradient N times too large."""
    for name in ("reduce_scatter_bucket", "all_reduce_bucket"):
        correct = getattr(lower_markers, name)

        def summing(*args, correct=correct, **kwargs):
            return [grad * world_size for grad in correct(*args, **kwargs)]

        monkeypatch.setattr(lower_markers, name, summing)


def sgd_report(rank: int, world_size: int, compiler: str, stages: tuple[int, ...], broken: bool = False) -> dict:
    """{(stage, reduce): largest parameter difference from DDP, or the traceback of a failure}."""
    report = {}
    for reduce, reduce_dtype in DTYPES.items():
        reference = _reference(rank, world_size, reduce)

        def difference(stage: int) -> float:
            with pytest.MonkeyPatch.context() as monkeypatch:
                if broken:
                    _summing_instead_of_averaging(monkeypatch, world_size)
                torch._dynamo.reset()
                torch.manual_seed(0)
                model = zc.shard(UnevenMLP(), stage=stage, reduce_dtype=reduce_dtype)
                _train(model, torch.compile(model, backend="zero", options={"compiler": compiler}), rank, world_size)
            with zc.gathered(model):
                return max((p.detach() - reference[fqn]).abs().max().item() for fqn, p in model.named_parameters())

        report.update(run_cases(((stage, reduce), lambda stage=stage: difference(stage)) for stage in stages))
    return report


@pytest.fixture(scope="module")
def reports() -> dict[tuple[str, int], dict]:
    return {
        (compiler, n): run_on_ranks(n, sgd_report, compiler, STAGES)[0]
        for compiler in ("eager", "inductor")
        for n in (2, 4)
    }


def _tolerance(reduce: str) -> float:
    return FP32_TOLERANCE if reduce == "fp32" else BF16_TOLERANCE


@pytest.mark.parametrize("reduce", list(DTYPES))
@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("compiler", ("eager", "inductor"))
def test_sgd_matches_ddp(reports, compiler: str, stage: int, world_size: int, reduce: str) -> None:
    error = reports[(compiler, world_size)][(stage, reduce)]
    assert not isinstance(error, str), error
    assert error <= _tolerance(reduce), f"parameters differ from DDP's by {error:.3g}"


def test_a_summed_reduction_fails_the_comparison() -> None:
    """Stage 0 (all-reduce) and 3 (reduce-scatter) with the lowering summing instead of averaging."""
    report = run_on_ranks(2, sgd_report, "eager", (0, 3), True)[0]
    for (stage, reduce), error in report.items():
        assert not isinstance(error, str), error
        assert error > 10 * _tolerance(reduce), (stage, reduce, error)
