"""torch's own habits on a sharded model give DDP's answer, because its parameters are DTensors of
the full shape: `torch.nn.utils.clip_grad_norm_` (2-norm and inf-norm, foreach on and off,
`error_if_nonfinite`) returns DDP's norm on every rank and clips alike, also where a rank holds no
rows of a parameter (no rank raises or hangs); nanoGPT's `p.dim() >= 2` grouping decays the
parameters it decays on the plain model; `sum(p.numel())` is Φ; DCP's `get_optimizer_state_dict`
(full and sharded) equals DDP's optimizer state and `set_optimizer_state_dict` resumes a run to
the same parameters. And the optimizer still steps plain tensors (no DTensor dispatch per op).

DDP here is the plain model on the whole batch (DDP averages the ranks' gradients of equal
shares: the same gradient). Tolerances: the sharded run reduces gradients in another order than
the plain one's single backward (float reassociation, ~1e-7 relative per step); AdamW over 4
steps stays within 1e-5 of the plain run's parameters, SGD within 1e-6."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import zerocompile as zc
from models import TiedGPT, UnevenMLP
from ranks import run_cases, run_on_ranks

STEPS = 4
BATCH = 8
FULL = StateDictOptions(full_state_dict=True)


class GatedMLP(UnevenMLP):
    """UnevenMLP with a (1, 3) gate and a (1,) bias: at N = 2 and 4 ranks 1.. hold no rows of them,
    and fc3.weight (3 rows) leaves rank 3 of 4 empty."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(torch.tanh(self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x))))))).square().mean()


MODELS = {"gated_mlp": GatedMLP, "tied_gpt": TiedGPT}


def _batch(name: str, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    if name == "tied_gpt":
        return torch.randint(0, 64, (BATCH, 9), generator=generator)
    return torch.randn(BATCH, 7, generator=generator)


def _decay_groups(model: nn.Module) -> list[dict]:
    """nanoGPT's configure_optimizers: decay where p.dim() >= 2."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _run(name: str, stage: int | None, optimizer: str, norm: float, foreach: bool, rank: int, world_size: int) -> dict:
    """STEPS steps clipped by torch's clip_grad_norm_; `stage` None: the plain model (DDP)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    if stage is not None:
        model = zc.shard(model, stage=stage)
    groups = _decay_groups(model)
    decayed = sorted(n for n, p in model.named_parameters() if any(p is q for q in groups[0]["params"]))
    make = {"adamw": lambda: torch.optim.AdamW(groups, lr=1e-2), "sgd": lambda: torch.optim.SGD(groups, lr=0.1)}
    opt = make[optimizer]()
    run = model if stage is None else torch.compile(model, backend="zero", options={"compiler": "eager"})
    share = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size) if stage is not None else slice(None)
    norms = []
    for step in range(STEPS):
        run(_batch(name, step)[share]).backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm, foreach=foreach)
        norms.append(total.item())  # a DTensor total: .item() must be the global value on every rank
        opt.step()
        opt.zero_grad()
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    return {
        "norms": norms,
        "params": params,
        "decayed": decayed,
        "numel": sum(p.numel() for p in model.parameters()),
        "optimizer_state": get_optimizer_state_dict(model, opt, options=FULL) if stage is not None else _plain_state(model, opt),
        "model": model,
        "opt": opt,
    }


def _plain_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _habit_cases(rank: int, world_size: int) -> dict:
    def case(name: str, stage: int, optimizer: str, norm: float, foreach: bool) -> dict:
        ddp = _run(name, None, optimizer, norm, foreach, rank, world_size)
        ours = _run(name, stage, optimizer, norm, foreach, rank, world_size)
        state = ours["optimizer_state"]["state"]
        differences = [
            (state[fqn][key].detach() - value).abs().max().item()
            for fqn, values in ddp["optimizer_state"].items()
            for key, value in values.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        ]
        state_error = max(differences, default=0.0)  # plain SGD keeps no state
        return {
            "norm_error": max(_relative(a, b) for a, b in zip(ours["norms"], ddp["norms"])),
            "param_error": max((ours["params"][n] - ddp["params"][n]).abs().max().item() for n in ddp["params"]),
            "state_error": state_error,
            "same_decay": ours["decayed"] == ddp["decayed"] and len(ddp["decayed"]) > 0,
            "numel": (ours["numel"], ddp["numel"]),
            "steps_plain_tensors": ours["opt"].__dict__.get("_zero_local_step") is not None
            and not any(isinstance(v, DTensor) for s in ours["opt"]._zero_local_step.flat_state.values() for v in s.values()),
        }

    cases = [
        ((name, stage, optimizer, norm, foreach), lambda a=(name, stage, optimizer, norm, foreach): case(*a))
        for name in MODELS
        for stage in (1, 2, 3)
        for optimizer, norm, foreach in (("adamw", 2.0, True), ("sgd", math.inf, False), ("adamw", math.inf, True), ("sgd", 2.0, False))
        if stage == 3 or norm == 2.0
    ]
    return run_cases(cases)


@pytest.mark.parametrize("world_size", (2, 4))
def test_torch_habits_give_ddps_answer(world_size: int) -> None:
    reports = run_on_ranks(world_size, _habit_cases)
    for rank, report in enumerate(reports):
        for key, outcome in report.items():
            assert not isinstance(outcome, str), (rank, key, outcome)
            optimizer = key[2]
            assert outcome["norm_error"] <= 1e-6, (rank, key, outcome)
            assert outcome["param_error"] <= (1e-5 if optimizer == "adamw" else 1e-6), (rank, key, outcome)
            assert outcome["state_error"] <= 1e-5, (rank, key, outcome)
            assert outcome["same_decay"], (rank, key)
            assert outcome["numel"][0] == outcome["numel"][1], (rank, key, outcome["numel"])
            assert outcome["steps_plain_tensors"], (rank, key)


def _resume_cases(rank: int, world_size: int) -> dict:
    """get_optimizer_state_dict (sharded and full) then set_optimizer_state_dict into a fresh sharded
    model and optimizer resumes to the uninterrupted run's parameters, exactly."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    def case(full: bool, stage: int) -> float:
        options = FULL if full else StateDictOptions()

        def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(0)
            model = zc.shard(GatedMLP(), stage=stage)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

        def steps(model: nn.Module, opt: torch.optim.Optimizer, numbers: range) -> None:
            share = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
            for step in numbers:
                model(_batch("gated_mlp", step)[share]).backward()
                opt.step()
                opt.zero_grad()

        model, opt = fresh()
        steps(model, opt, range(2))
        saved_model = {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}
        saved_opt = get_optimizer_state_dict(model, opt, options=options)
        saved_opt = {"state": {k: {n: t.clone() for n, t in s.items()} for k, s in saved_opt["state"].items()}, "param_groups": saved_opt["param_groups"]}
        steps(model, opt, range(2, 4))
        other, other_opt = fresh()
        set_model_state_dict(other, saved_model, options=options)
        set_optimizer_state_dict(other, other_opt, saved_opt, options=options)
        steps(other, other_opt, range(2, 4))
        return max((p.full_tensor() - q.full_tensor()).abs().max().item() for p, q in zip(model.parameters(), other.parameters()))

    return run_cases(((full, stage), lambda f=full, s=stage: case(f, s)) for full in (True, False) for stage in (1, 3))


@pytest.mark.parametrize("world_size", (2, 4))
def test_optimizer_state_dicts_resume_exactly(world_size: int) -> None:
    for rank, report in enumerate(run_on_ranks(world_size, _resume_cases)):
        for key, outcome in report.items():
            assert outcome == 0.0, (rank, key, outcome)
