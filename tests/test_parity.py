"""Correctness is parity: every stage trains like DDP (same seed, same global batch).

Each world size spawns one gloo group that trains every model under DDP and under each stage, and
reports the largest differences; the tests then assert on that report, case by case.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocompile as zc
from models import MODELS, local_batch
from ranks import run_cases, run_on_ranks
from training import full_parameters, train

pytestmark = pytest.mark.core

STAGES = (0, 1, 2, 3)
STEPS = 5
EAGER_TOLERANCE = 1e-5
# Inductor's fused kernels round differently from DDP's eager ops, and AdamW divides each update
# by the root of its second moment, which magnifies ulp-level gradient differences where the
# gradient is tiny: measured (2026-11-25) on the tied GPT after 5 steps at lr 1e-3, parameters
# differ by 4.7e-6 to 5.0e-6 at every stage including 0 (no sharding, plain all-reduce), so that
# is the compiler's share, not ours; the MLP by at most 3e-8. 1e-5 is the tightest round bound
# above it. Scale bugs AdamW hides are caught by test_sgd_parity.py.
INDUCTOR_TOLERANCE = 1e-5


def _train(model: nn.Module, forward, name: str, rank: int, world_size: int) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return train(forward, optimizer, (local_batch(name, step, rank, world_size) for step in range(STEPS)))


def _reference(name: str, rank: int, world_size: int) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = MODELS[name]()
    ddp = nn.parallel.DistributedDataParallel(model)
    losses = _train(model, ddp, name, rank, world_size)
    return losses, {fqn: p.detach().clone() for fqn, p in model.named_parameters()}


def parity_report(
    rank: int, world_size: int, names: list[str], compiler: str, stages: tuple[int, ...] = STAGES
) -> dict:
    """{(model, stage): (loss error, parameter error) or the traceback of a failure}."""
    report = {}
    for name in names:
        ref_losses, ref_params = _reference(name, rank, world_size)

        def errors(stage: int) -> tuple[float, float]:
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = zc.shard(MODELS[name](), stage=stage)
            compiled = torch.compile(model, backend="zero", options={"compiler": compiler})
            losses = _train(model, compiled, name, rank, world_size)
            params = full_parameters(model)
            loss_error = max(abs(a - b) for a, b in zip(losses, ref_losses))
            param_error = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
            return loss_error, param_error

        report.update(run_cases(((name, stage), lambda stage=stage: errors(stage)) for stage in stages))
    return report


# Every model at every stage on 2 ranks; on 4, the stages whose graphs differ in kind (whole
# parameters, gathers kept for the backward, re-gathered). Stage 1 runs stage 2's graphs with its
# reductions moved to the backward's end, an order the number of ranks does not change; it runs at
# N = 4 in test_sgd_parity (both compilers). Suite time: each 4-rank case compiles on 4 processes
# sharing 2 cores.
EAGER_CASES = {2: STAGES, 4: (0, 2, 3)}


@pytest.fixture(scope="module")
def eager_reports() -> dict[int, dict]:
    return {n: run_on_ranks(n, parity_report, list(MODELS), "eager", stages)[0] for n, stages in EAGER_CASES.items()}


# Inductor runs the tied GPT (AdamW, tied embeddings, LayerNorm, attention) at stages 0 and 3 on 2
# ranks; stages 1-2 share stage 0's whole-parameter compute and stage 3's collectives, 4 ranks
# only change the shard sizes the same lowered graphs are built with, and the uneven MLP runs
# under Inductor at every stage, N = 2 and 4, in test_sgd_parity (plain SGD, the stricter
# comparison). Suite time: a cold Inductor compile of this GPT is 35 s of C++ compiling per rank
# (18 kernels), and 4 ranks on 2 cores take twice that: N = 4 cost ~60 s.
INDUCTOR_CASES = {2: (0, 3)}


@pytest.fixture(scope="module")
def inductor_reports() -> dict[int, dict]:
    return {n: run_on_ranks(n, parity_report, ["tied_gpt"], "inductor", stages)[0] for n, stages in INDUCTOR_CASES.items()}


def _assert_parity(outcome, tolerance: float) -> None:
    assert not isinstance(outcome, str), outcome
    loss_error, param_error = outcome
    assert loss_error <= tolerance, f"losses differ from DDP by {loss_error:.3g}"
    assert param_error <= tolerance, f"parameters differ from DDP by {param_error:.3g}"


@pytest.mark.parametrize("world_size,stage", [(n, stage) for n, stages in EAGER_CASES.items() for stage in stages])
@pytest.mark.parametrize("model", list(MODELS))
def test_eager_compiler_matches_ddp(eager_reports, model: str, stage: int, world_size: int) -> None:
    _assert_parity(eager_reports[world_size][(model, stage)], EAGER_TOLERANCE)


@pytest.mark.parametrize("world_size,stage", [(n, stage) for n, stages in INDUCTOR_CASES.items() for stage in stages])
def test_inductor_matches_ddp(inductor_reports, stage: int, world_size: int) -> None:
    _assert_parity(inductor_reports[world_size][("tied_gpt", stage)], INDUCTOR_TOLERANCE)
