"""DDP habits on a sharded model: `model.load_state_dict(full_state_dict)` with the full state dict
every rank already holds keeps this rank's slice of each tensor (no communication), with torch's
strict semantics and tied names as usual; the model's own sharded state dict still round-trips.
`model.state_dict()` holds DTensors of the full shapes, as FSDP2's does."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import zerocompile as zc
from models import TiedGPT, UnevenMLP
from ranks import run_cases, run_on_ranks


def _largest_difference(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> float:
    """On this rank: the full parameters and buffers against `full` (every rank checks its slice)."""
    with zc.gathered(model):
        mine = dict(model.named_parameters()) | dict(model.named_buffers())
        return max((mine[k].detach() - full[k]).abs().max().item() for k in mine)


def _load_cases(rank: int, world_size: int) -> dict:
    report = {}
    for name, build in (("uneven_mlp", UnevenMLP), ("tied_gpt", TiedGPT)):
        torch.manual_seed(1)
        full = build().state_dict()  # what every rank of a DDP job holds

        def loaded(stage: int) -> dict:
            torch.manual_seed(2)  # other weights than `full`
            model = zc.shard(build(), stage=stage)
            result = model.load_state_dict(full)
            error = _largest_difference(model, full)
            own = {k: v.clone() for k, v in model.state_dict().items()}
            model.load_state_dict(own)  # its own shards: unchanged
            with zc.gathered(model):
                model.load_state_dict(full)  # full parameters inside gathered(): as they are
            return {
                "error": error,
                "after_gathered_error": _largest_difference(model, full),
                "missing": result.missing_keys,
                "unexpected": result.unexpected_keys,
            }

        report.update(run_cases(((name, stage), lambda stage=stage: loaded(stage)) for stage in (0, 1, 2, 3)))
    torch.manual_seed(2)
    model = zc.shard(UnevenMLP(), stage=3)
    torch.manual_seed(1)
    full = UnevenMLP().state_dict()
    errors = {}
    for case, state in (
        ("missing", {k: v for k, v in full.items() if k != "fc2.bias"}),
        ("wrong_shape", {**full, "fc2.weight": torch.zeros(3, 3)}),
    ):
        try:
            model.load_state_dict(state)
            errors[case] = None
        except RuntimeError as error:
            errors[case] = str(error)
    report["errors"] = errors
    return report


def test_load_state_dict_takes_full_tensors_at_every_stage() -> None:
    for world_size in (2, 4):
        report = run_on_ranks(world_size, _load_cases)[0]
        for key, outcome in report.items():
            if key == "errors":
                continue
            assert not isinstance(outcome, str), outcome
            assert outcome["error"] == 0.0 and outcome["after_gathered_error"] == 0.0, (world_size, key, outcome)
            assert outcome["missing"] == [] and outcome["unexpected"] == [], (key, outcome)
        assert "Missing key(s)" in report["errors"]["missing"] and "fc2.bias" in report["errors"]["missing"]
        assert "size mismatch for fc2.weight" in report["errors"]["wrong_shape"], report["errors"]


def test_state_dict_of_a_sharded_model_holds_dtensors_of_the_full_shapes(single_rank, tmp_path: Path) -> None:
    """What torch's DCP tools read (tests/test_dcp_state_dicts.py runs them on ranks); zerocompile's
    own readers still get the sharded Parameters (their checkpoints load back)."""
    model = zc.shard(UnevenMLP(), stage=3)
    whole = zc.shard(UnevenMLP(), stage=0)
    expected = {k: tuple(v.shape) for k, v in UnevenMLP().state_dict().items()}
    state = model.state_dict()
    assert all(isinstance(v, DTensor) for v in state.values()), {k: type(v) for k, v in state.items()}
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert not any(isinstance(v, DTensor) for v in whole.state_dict().values())  # stage 0 holds whole parameters
    with zc.gathered(model):
        assert not any(isinstance(v, DTensor) for v in model.state_dict().values())  # full parameters there

    before = zc.full_state_dict(model)
    zc.save(tmp_path / "checkpoint", model)
    zc.load(tmp_path / "checkpoint", model)
    zc.save_weights(model, tmp_path / "model.safetensors")
    after = zc.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
