"""Checkpoints: resume at another stage and world size as if never interrupted; exports; EMA.

One spawned run per world size: 2 ranks train 3 steps at stage 3, save, and go on (the
uninterrupted reference), then resume the checkpoint at stages 3 and 2; 4 ranks resume at stage 3,
1 rank at stage 0. Each resumed run sees the same global batches, so its next 3 losses and final
full parameters must equal the reference's. The tests then assert on the reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import MODELS, global_batch, local_batch
from ranks import run_cases, run_on_ranks
from training import train
from zerocompile.passes.stages import padded_numel
from zerocompile.tools.convert import convert

pytestmark = pytest.mark.core

NAMES = ("uneven_mlp", "tied_gpt")  # padded shards (empty ones at N=4), and tied weights
SAVED_AT = 3
RESUMED_STEPS = 3
EMA_STEPS = 10
DECAY = 0.9
TOLERANCE = 1e-6
RESUMES = {2: (3, 2), 4: (3,), 1: (0,)}  # world size -> stages resumed at


def _build(name: str, stage: int, seed: int = 0) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, zc.EMA]:
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = zc.shard(MODELS[name](), stage=stage)
    # eps well above rounding noise: the attention's key bias has an exactly-zero gradient (softmax
    # ignores a shift shared by all keys), so it gets pure rounding noise, which AdamW with its
    # default eps=1e-8 normalises into updates of up to lr; resumed at another world size the
    # gradients are summed in another order and that noise alone moved the key bias by 1.0e-6.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    return model, compiled, optimizer, zc.EMA(model, DECAY)


def _train(name: str, parts: tuple, steps: range, rank: int, world_size: int) -> list[float]:
    """Losses of the global batch (mean over ranks of their slices' losses), step by step."""
    _model, compiled, optimizer, ema = parts
    batches = (local_batch(name, step, rank, world_size) for step in steps)
    totals = torch.tensor(train(compiled, optimizer, batches, after_step=ema.update), dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals / world_size).tolist()


def _eval_forward(name: str, model: nn.Module, compile: bool = False) -> torch.Tensor:
    """The GPT's logits (more to compare than a loss), the MLP's loss, on a batch no step saw."""
    module = model.gpt if name == "tied_gpt" else model
    if compile:
        module = torch.compile(module, backend="zero", options={"compiler": "eager"})
    with torch.no_grad():
        batch = global_batch(name, 99)
        return module(batch[:, :-1]) if name == "tied_gpt" else module(batch)


def saving_run(rank: int, world_size: int, root: str) -> dict:
    """Stage 3: train, save at step 3 (recording the exports), go on to step 6 (the reference)
    and to step 10 with an unsharded EMA of the gathered parameters beside the sharded one."""
    report = {}
    for name in NAMES:
        parts = model, _compiled, optimizer, ema = _build(name, 3)
        _train(name, parts, range(SAVED_AT), rank, world_size)
        zc.save(Path(root, name), model, optimizer, ema, step=SAVED_AT, rng=torch.get_rng_state())
        saved = {
            "full": zc.full_state_dict(model),
            "ema": ema.full_state_dict(),
            "eval": _eval_forward(name, model, compile=True),
            "rng": torch.get_rng_state(),
        }
        losses = _train(name, parts, range(SAVED_AT, SAVED_AT + RESUMED_STEPS), rank, world_size)
        reference = {"losses": losses, "params": zc.full_state_dict(model), "ema": ema.full_state_dict()}
        unsharded_ema = {k: v.clone() for k, v in zc.full_state_dict(model, rank0_only=False).items()}
        sharded_ema = zc.EMA(model, DECAY)
        for step in range(SAVED_AT + RESUMED_STEPS, SAVED_AT + RESUMED_STEPS + EMA_STEPS):
            _train(name, parts, range(step, step + 1), rank, world_size)
            sharded_ema.update()
            for key, value in zc.full_state_dict(model, rank0_only=False).items():
                unsharded_ema[key].mul_(DECAY).add_(value, alpha=1 - DECAY)
        ema_check = {"sharded": sharded_ema.full_state_dict(), "unsharded": unsharded_ema, **_ema_bytes(model, sharded_ema)}
        report[name] = {"saved": saved, "reference": reference, "ema_check": ema_check}
        dist.barrier()
    report["resumed"] = resuming_run(rank, world_size, root)
    return report if rank == 0 else {}


def _ema_bytes(model: nn.Module, ema: zc.EMA) -> dict[str, int]:
    params = {id(p): p for p in model.parameters()}.values()
    full = sum(p._zero.numel * p.element_size() for p in params)
    padded = sum(padded_numel(p._zero.shape, p._zero.world_size) * p.element_size() for p in params)
    return {"ema_bytes": ema.nbytes, "full_bytes": full, "padded_bytes": padded}


def resuming_run(rank: int, world_size: int, root: str) -> dict:
    """{(model, stage): what the run resumed from the checkpoint did, or its traceback}."""

    def resumed(name: str, stage: int) -> dict:
        # Another seed and EMA decay: everything that matters must come from the checkpoint.
        parts = model, _compiled, optimizer, ema = _build(name, stage, seed=1)
        ema.decay = 0.5
        extra = zc.load(Path(root, name), model, optimizer, ema)
        losses = _train(name, parts, range(SAVED_AT, SAVED_AT + RESUMED_STEPS), rank, world_size)
        return {
            "losses": losses,
            "params": zc.full_state_dict(model),
            "ema": ema.full_state_dict(),
            "extra": extra,
            **_ema_bytes(model, ema),
        }

    cases = [(name, stage) for name in NAMES for stage in RESUMES[world_size]]
    return run_cases((case, lambda case=case: resumed(*case)) for case in cases)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("checkpoints")
    saving = run_on_ranks(2, saving_run, str(root), timeout=600)[0]
    resumed = {2: saving.pop("resumed")}
    for world_size in (4, 1):
        resumed[world_size] = run_on_ranks(world_size, resuming_run, str(root), timeout=600)[0]
    return {"root": root, "saving": saving, "resumed": resumed}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())


CASES = [(n, w, s) for n in NAMES for w, stages in RESUMES.items() for s in stages]


@pytest.mark.parametrize("name,world_size,stage", CASES)
def test_resume_continues_as_if_never_interrupted(reports, name: str, world_size: int, stage: int) -> None:
    outcome = reports["resumed"][world_size][(name, stage)]
    assert not isinstance(outcome, str), outcome
    reference = reports["saving"][name]["reference"]
    loss_error = max(abs(a - b) for a, b in zip(outcome["losses"], reference["losses"]))
    assert loss_error <= TOLERANCE, f"losses after resuming differ by {loss_error:.3g}"
    assert _max_difference(outcome["params"], reference["params"]) <= TOLERANCE
    assert _max_difference(outcome["ema"], reference["ema"]) <= TOLERANCE
    assert outcome["extra"]["step"] == SAVED_AT
    assert torch.equal(outcome["extra"]["rng"], reports["saving"][name]["saved"]["rng"])


@pytest.mark.parametrize("name", NAMES)
def test_full_state_dict_and_convert_agree_and_load_into_the_plain_model(reports, tmp_path, name: str) -> None:
    saved = reports["saving"][name]["saved"]
    checkpoint = reports["root"] / name
    plain = MODELS[name]()
    assert list(saved["full"]) == list(plain.state_dict())
    plain.load_state_dict(saved["full"], strict=True)
    unsharded = MODELS[name]()  # loaded here, with no process group: N' = 1, not even sharded
    zc.load(checkpoint, unsharded)
    assert _max_difference(unsharded.state_dict(), saved["full"]) == 0

    convert(checkpoint, tmp_path / "full.pt", "torch")
    converted = torch.load(tmp_path / "full.pt", weights_only=True)
    assert list(converted) == list(saved["full"])
    assert all(torch.equal(converted[k], saved["full"][k]) for k in converted)
    plain = MODELS[name]()
    plain.load_state_dict(converted, strict=True)
    plain_output = _eval_forward(name, plain)
    assert (plain_output - saved["eval"]).abs().max().item() <= 1e-5

    from safetensors import safe_open

    convert(checkpoint, tmp_path / "full.safetensors")
    with safe_open(str(tmp_path / "full.safetensors"), framework="pt") as f:
        tied = json.loads(f.metadata()["zerocompile.tied"])
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert set(stored) | set(tied) == set(saved["full"]) and not set(stored) & set(tied)
    assert all(torch.equal(stored[k], saved["full"][k]) for k in stored)
    if name == "tied_gpt":
        assert tied == {"gpt.lm_head.weight": "gpt.wte.weight"}

    convert(checkpoint, tmp_path / "ema.pt", "torch", ema=True)
    ema = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert all(torch.equal(ema[k], saved["ema"][k]) for k in saved["ema"])


@pytest.mark.parametrize("name", NAMES)
def test_sharded_ema_equals_unsharded_ema(reports, name: str) -> None:
    check = reports["saving"][name]["ema_check"]
    assert _max_difference(check["sharded"], check["unsharded"]) <= TOLERANCE


@pytest.mark.parametrize("world_size", (2, 4))
def test_ema_holds_one_nth(reports, world_size: int) -> None:
    for name in NAMES:
        outcome = reports["resumed"][world_size][(name, 3)]
        assert not isinstance(outcome, str), outcome
        # One shard of each parameter: 1/N of it padded as shard() pads (empty shards at N=4 too).
        assert outcome["ema_bytes"] * world_size == outcome["padded_bytes"] >= outcome["full_bytes"]
