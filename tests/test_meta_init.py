"""A model built on the meta device and sharded with `shard(init=...)` equals, bitwise, the same
model built whole and initialised with `model.apply(init)` from group rank 0's random state.

Each rank compares what it keeps (its padded slice, or at stage 0 the whole tensor) with the slice
of a reference built the ordinary way in the same process: equality is exact because both draw the
same numbers from the same generator in the same order, and slicing moves values unchanged. The
generator's state afterwards must match too: an extra or missing draw would shift every later
model's values. Ranks seeded differently (by rank, or some not seeded at all) still hold slices of
rank 0's model, and each gets its own generator state back. One spawn per world size runs every
case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import UnevenMLP
from ranks import run_cases, run_on_ranks
from test_hf_models import build_model as build_hf_model
from zerocompile.meta_init import local_slice
from zerocompile.sharded_parameters import shard_of_parameter
from zerocompile.tools.gpt import GPT, SIZES

pytestmark = pytest.mark.core

STAGES = (0, 1, 2, 3)
MODELS = ("tied_gpt", "uneven_mlp", "batchnorm", "parent_rescales", "gpt2", "llama")


class BatchNormNet(nn.Module):
    """Running statistics are buffers that only reset_running_stats() gives values on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.norm = nn.BatchNorm1d(6)


class ParentRescales(nn.Module):
    """Its init reads a child's values after the child's own call: they must come back from the
    ranks' slices (GPT-2's attention overwrites its child's weight instead, which needs no values)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(7, 5)

    @staticmethod
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight)
            nn.init.normal_(module.bias)
        if isinstance(module, ParentRescales):
            module.fc.weight.mul_(0.5).add_(module.fc.bias[:1])


def _build(name: str) -> nn.Module:
    if name == "tied_gpt":
        return GPT(SIZES["tiny"])
    if name == "uneven_mlp":
        return UnevenMLP()
    if name == "batchnorm":
        return BatchNormNet()
    if name == "parent_rescales":
        return ParentRescales()
    return build_hf_model(name)


def _init_of(name: str, model: nn.Module):
    """What the user passes as `init`: None means each module's own reset_parameters()."""
    if name == "tied_gpt":
        return GPT._init_weights
    if name == "parent_rescales":
        return ParentRescales.init
    if name in ("gpt2", "llama"):
        return model._init_weights
    return None


def _apply_reference_init(name: str, model: nn.Module) -> None:
    init = _init_of(name, model)
    if init is None:
        model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    else:
        with torch.no_grad():
            model.apply(init)


# How the ranks seed before shard(): all alike (1), each its own (seed = rank), or only rank 0 (1;
# the others keep whatever state their previous case left).
SEEDINGS = ("alike", "by_rank", "unseeded")


def _seed(seeding: str, rank: int) -> int | None:
    if seeding == "alike" or (seeding == "unseeded" and rank == 0):
        return 1
    return rank if seeding == "by_rank" else None


def _compare(name: str, stage: int, rank: int, world_size: int, seeding: str = "alike") -> list[str]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _build(name)
    seed, rank0_seed = _seed(seeding, rank), _seed(seeding, 0)
    if seed is not None:
        torch.manual_seed(seed)
    rng_before = torch.random.get_rng_state()
    follows_rank0 = torch.equal(rng_before, torch.Generator().manual_seed(rank0_seed).get_state())
    problems = [] if follows_rank0 == (seeding == "alike" or rank == 0) else ["generators not seeded as the case means"]
    zc.shard(model, stage=stage, init=_init_of(name, model))
    rng_after = torch.random.get_rng_state()

    torch.manual_seed(0)
    reference = _build(name)
    torch.manual_seed(rank0_seed)
    _apply_reference_init(name, reference)
    # Alike: advanced as rank 0's; differing: its own state back.
    expected_after = torch.random.get_rng_state() if follows_rank0 else rng_before
    if not torch.equal(rng_after, expected_after):
        problems.append("random draws differ in number" if follows_rank0 else "own generator state not given back")

    expected = dict(reference.named_parameters())
    for fqn, param in model.named_parameters():
        info = param._zero
        want = expected[fqn] if stage == 0 else local_slice(expected[fqn].detach().reshape(-1), info.shard_numel, rank)
        shard = shard_of_parameter(param)  # what the DTensor parameter's rows live in, padded
        if shard.device.type != "cpu" or not torch.equal(shard.detach(), want):
            problems.append(fqn)
    expected_buffers = dict(reference.named_buffers())
    for fqn, buffer in model.named_buffers():
        if buffer.is_meta or not torch.equal(buffer, expected_buffers[fqn]):
            problems.append(fqn)
    return problems


def _cases(world_size: int) -> list[tuple[str, str, int]]:
    """Every model at every stage seeded alike; with more than one rank, seeded differently at the
    stages that shard parameters."""
    cases = [("alike", name, stage) for name in MODELS for stage in STAGES]
    if world_size > 1:
        cases += [(seeding, name, stage) for seeding in SEEDINGS[1:] for name in MODELS for stage in (1, 2, 3)]
    return cases


def _compare_all(rank: int, world_size: int) -> dict:
    return run_cases(
        [(case, lambda c=case: _compare(c[1], c[2], rank, world_size, c[0])) for case in _cases(world_size)]
    )


@pytest.fixture(scope="module", params=(1, 2, 4))
def report(request):
    return request.param, run_on_ranks(request.param, _compare_all)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", MODELS)
def test_meta_init_equals_apply_on_whole_model(report, name, stage):
    world_size, reports = report
    for rank, per_rank in enumerate(reports):
        problems = per_rank[("alike", name, stage)]
        assert problems == [], f"N={world_size} rank {rank}: {problems}"


@pytest.mark.parametrize("seeding", SEEDINGS[1:])
@pytest.mark.parametrize("stage", (1, 2, 3))
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("report", (2, 4), indirect=True)  # the same spawns as above
def test_ranks_seeded_differently_hold_group_rank0s_model(report, name, stage, seeding):
    """And each rank's generator afterwards: rank 0's advanced as by the plain init, the others'
    as they were before shard()."""
    world_size, reports = report
    for rank, per_rank in enumerate(reports):
        problems = per_rank[(seeding, name, stage)]
        assert problems == [], f"N={world_size} rank {rank}: {problems}"


# --- what must be refused, naming the tensor and the fix, with the model left on meta -----------


class HandMadeNorm(nn.Module):
    """nanoGPT's LayerNorm: its weight comes from torch.ones in __init__, no reset_parameters()."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, self.weight.shape, self.weight)


class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.ln = HandMadeNorm(4)


class WithMask(nn.Module):
    def __init__(self, mask_device: str | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4, device=mask_device)))


def _linear_only(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.reset_parameters()


def _meta(build) -> nn.Module:
    with torch.device("meta"):
        return build()


def _refusal(build, init, match: str):
    def case(rank: int) -> str:
        model = _meta(build)
        torch.manual_seed(0)
        try:
            zc.shard(model, stage=3, init=init)
        except (ValueError, RuntimeError) as error:
            left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta or hasattr(t, "_zero")]
            assert not left, f"changed before refusing: {left}"
            assert match in str(error), str(error)
            return str(error)
        raise AssertionError("not refused")

    return case


def _refusals(rank: int, world_size: int) -> dict:
    def half_written(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight[0].zero_()
            torch.nn.init.zeros_(module.bias)

    def real_buffer_kept() -> str:
        torch.manual_seed(0)
        model = _meta(lambda: WithMask(mask_device="cpu"))
        zc.shard(model, stage=3)
        assert torch.equal(model.mask, torch.tril(torch.ones(4, 4)))
        return "ok"

    cases = {
        "unwritten_param": _refusal(WithNorm, _linear_only, "'ln.weight' (4,)"),
        "unwritten_param_reset_route": _refusal(WithNorm, None, "'ln.weight' (4,)"),
        "meta_buffer": _refusal(WithMask, _linear_only, "'mask' (4, 4)"),
        "partly_written": _refusal(WithNorm, half_written, "'fc.weight' (4, 4)"),
        "real_buffer_kept": lambda rank: real_buffer_kept(),
    }
    return run_cases([(key, lambda case=case: case(rank)) for key, case in cases.items()])


@pytest.fixture(scope="module")
def refusals():
    return run_on_ranks(2, _refusals)


@pytest.mark.parametrize(
    "case", ["unwritten_param", "unwritten_param_reset_route", "meta_buffer", "partly_written", "real_buffer_kept"]
)
def test_meta_refusals(refusals, case):
    for rank, per_rank in enumerate(refusals):
        assert "Traceback" not in per_rank[case], f"rank {rank}: {per_rank[case]}"


def test_init_on_a_real_model_runs_apply_first(single_rank):
    torch.manual_seed(0)
    model = GPT(SIZES["tiny"])
    reference = GPT(SIZES["tiny"])
    reference.load_state_dict(model.state_dict())
    torch.manual_seed(5)
    zc.shard(model, stage=0, init=GPT._init_weights)
    torch.manual_seed(5)
    reference.apply(GPT._init_weights)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert dist.get_world_size() == 1


def test_one_modules_parameters_exist_in_full_at_a_time(single_rank, monkeypatch):
    """The walk's memory bound, counted rather than measured: at no point are more full tensors
    alive than the largest module's own parameters (a module's call only touches its own here)."""
    from zerocompile import meta_init

    alive: list[int] = []
    materialise = meta_init._ShardedWalk._materialise

    def counting(walk, entry, *, overwritten):
        materialise(walk, entry, overwritten=overwritten)
        alive.append(sum(e.full.numel() * e.full.element_size() for e in walk.in_use))

    monkeypatch.setattr(meta_init._ShardedWalk, "_materialise", counting)
    model = _meta(lambda: GPT(SIZES["tiny"]))
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules())
    zc.shard(model, stage=3, init=GPT._init_weights)
    assert alive and max(alive) == largest
