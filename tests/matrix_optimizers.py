"""Parity of optimizers that read whole matrices (tests/test_muon.py, tests/test_adafactor.py)
against DDP with torch's own, on a model with matrices sharding can get wrong.

A case is (stage, compiler, variant); each trains `STEPS` steps from the same seed and global
batches as DDP does. Variants: "plain"; "accumulate" (4 micro-steps, all but the last under
no_sync); "clip" (clip_grad_norm_ before every step); "taken_over" (torch's optimizers built and
stepped once before `shard()`, then handed to it). An optimizer factory `make(model, ours)` builds
the optimizers of a model: zerocompile's when `ours`, torch's otherwise.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable
from unittest import mock

import torch
from torch import nn

import zerocompile as zc
import zerocompile.optim
from models import global_batch, local_batch
from ranks import run_cases, run_on_ranks
from zerocompile.tools.gpt import GPT, SIZES

STEPS = 5
MICRO_STEPS = 4
MAX_NORM = 0.05  # below the gradients' norm (~0.4 here), so clipping scales every step

Factory = Callable[[nn.Module, bool], list[torch.optim.Optimizer]]


class MuonGPT(nn.Module):
    """tests/models.py's TiedGPT plus two matrices an optimizer must handle as matrices: 7x13 (91
    elements, so shards end mid-row at N = 2 and 4) and 1x3 (fewer elements than 4 ranks)."""

    def __init__(self, side_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.gpt = GPT(SIZES["tiny"])
        self.mix = nn.Linear(13, 7, bias=False)
        self.gate = nn.Linear(3, 1, bias=False)
        # The side input is made inside forward, where no mixed-precision input cast sees it: with
        # param_dtype it must be made in that dtype.
        self.side_dtype = side_dtype

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        features = (idx[:, :13].float() / 256).to(self.side_dtype)
        side = self.gate(torch.tanh(self.mix(features))[:, :3]).square().mean()
        return self.gpt(idx[:, :-1], idx[:, 1:]) + side


def train_step(forward, model, optimizers, step: int, rank: int, world_size: int, variant: str, no_sync) -> None:
    if variant == "accumulate":
        for micro in range(MICRO_STEPS):
            last = micro == MICRO_STEPS - 1
            with contextlib.nullcontext() if last else no_sync():
                batch = local_batch("tied_gpt", step * MICRO_STEPS + micro, rank, world_size)
                (forward(batch) / MICRO_STEPS).backward()
    else:
        forward(local_batch("tied_gpt", step, rank, world_size)).backward()
    if variant == "clip":
        clip = zc.clip_grad_norm_ if hasattr(model, "_zero_config") else torch.nn.utils.clip_grad_norm_
        clip(model if clip is zc.clip_grad_norm_ else model.parameters(), MAX_NORM)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def largest_difference(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max((ours[name] - reference[name]).abs().max().item() for name in reference)


def _ddp_parameters(make: Factory, variant: str, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MuonGPT()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizers = make(model, False)
    for step in range(STEPS):
        train_step(ddp, model, optimizers, step, rank, world_size, variant, ddp.no_sync)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _sharded_parameters(
    make: Factory, check_state: Callable[[list[torch.optim.Optimizer]], None], case: tuple, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    stage, compiler, variant = case
    torch._dynamo.reset()  # each case a model of its own: no recompile limit reached across cases
    torch.manual_seed(0)
    model = MuonGPT()
    first = 0
    if variant == "taken_over":
        # Built and stepped before shard(): one step on the whole global batch on every rank is
        # DDP's first step (the mean of the ranks' means), up to summation order.
        optimizers = make(model, False)
        model(global_batch("tied_gpt", 0)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        built = [type(optimizer) for optimizer in optimizers]
        zc.shard(model, stage=stage, optimizer=optimizers)
        assert [type(o) for o in optimizers] == [zerocompile.optim.SHARDED_EQUIVALENTS.get(t, t) for t in built]
        first = 1
    else:
        zc.shard(model, stage=stage)
        optimizers = make(model, True)
    compiled = torch.compile(model, backend="zero", options={"compiler": compiler})
    for step in range(first, STEPS):
        train_step(compiled, model, optimizers, step, rank, world_size, variant, lambda: zc.no_sync(model))
    check_state(optimizers)
    with zc.gathered(model):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def parity_report(
    make: Factory,
    check_state: Callable[[list[torch.optim.Optimizer]], None],
    cases: list[tuple],
    rank: int,
    world_size: int,
    wrong: dict[str, tuple[str, Any]],
) -> dict:
    """Inside a rank: {case: largest difference from DDP's parameters (or a traceback)}, and for
    each `wrong` name, the same for case (3, eager, plain) with `zerocompile.optim`'s attribute
    replaced by the broken variant."""
    variants = {"plain" if variant == "taken_over" else variant for _stage, _compiler, variant in cases} | {"plain"}
    references = {variant: _ddp_parameters(make, variant, rank, world_size) for variant in sorted(variants)}
    references["taken_over"] = references["plain"]

    def difference(case: tuple) -> float:
        return largest_difference(_sharded_parameters(make, check_state, case, rank, world_size), references[case[2]])

    def broken(attribute: str, replacement: Any) -> float:
        with mock.patch.object(zerocompile.optim, attribute, replacement):
            return difference((3, "eager", "plain"))

    report = run_cases((case, lambda case=case: difference(case)) for case in cases)
    report.update(run_cases((name, lambda patch=patch: broken(*patch)) for name, patch in wrong.items()))
    return report


def report_of(reports: dict[int, dict], world_size: int, report: Callable[..., dict], *args: Any) -> dict:
    """`report(rank, world_size, *args)` on `world_size` ranks, run when a test first asks for it
    and kept in `reports` (a module-scoped fixture's dict)."""
    if world_size not in reports:
        reports[world_size] = run_on_ranks(world_size, report, *args, timeout=1200)[0]
    return reports[world_size]


def case_id(value: Any) -> str:
    return str(value) if isinstance(value, int) else "-".join(map(str, value))
