"""torch's own state-dict tools on a sharded model: `model.state_dict()` holds a DTensor per
sharded parameter (full shape, this rank's `torch.chunk` rows, the shard's own storage), so DCP's
`get_model_state_dict` / `set_model_state_dict` round-trip exactly, full or sharded, into a
model sharded at another stage, into an unsharded model and into FSDP2's `fully_shard` model and
back; `torch.save(model.state_dict())` loads back into the model. Uneven rows (a rank with no rows
at N = 4), a tied weight and a 0-d parameter included."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import zerocompile as zc
from models import TiedGPT, UnevenMLP
from ranks import run_cases, run_on_ranks

FULL = StateDictOptions(full_state_dict=True)


class ScaledMLP(UnevenMLP):
    """UnevenMLP (fc3.weight has 3 rows: at N = 4 one rank holds none) and a 0-d temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.temperature


MODELS = {"scaled_mlp": ScaledMLP, "uneven_mlp": UnevenMLP, "tied_gpt": TiedGPT}


def _difference(state: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> float:
    assert state.keys() == full.keys(), (sorted(state), sorted(full))
    return max((state[k].detach().cpu() - full[k]).abs().max().item() for k in full)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=FULL)


def _cases(rank: int, world_size: int) -> dict:
    def case(name: str, stage: int) -> dict:
        build = MODELS[name]
        torch.manual_seed(1)
        full = build().state_dict()
        torch.manual_seed(2)  # other weights than `full`
        model = zc.shard(build(), stage=stage)
        model.load_state_dict(full)
        report = {"full": _difference(_full(model), full)}

        state = model.state_dict()
        params = dict(model.named_parameters(remove_duplicate=False))
        layouts = {}
        for key, value in state.items():
            if isinstance(value, DTensor):
                param = params[key]
                local = value.to_local()
                expected = full[key].chunk(world_size)[rank] if full[key].dim() and rank < len(full[key].chunk(world_size)) else None
                layouts[key] = (
                    tuple(value.shape) == tuple(full[key].shape),
                    expected is None or torch.equal(local, expected),
                    local.numel() == 0 or local.data_ptr() == zc.sharded_parameters.shard_of_parameter(param).data_ptr(),
                    list(value.placements) == [Shard(0)] if full[key].dim() else True,
                )
        report["layouts"] = layouts

        # Sharded state dict into a model sharded at another stage; full into stage 3.
        torch.manual_seed(3)
        other = zc.shard(build(), stage=3 if stage != 3 else 1)
        set_model_state_dict(other, get_model_state_dict(model))
        report["sharded_to_other_stage"] = _difference(_full(other), full)
        torch.manual_seed(4)
        again = zc.shard(build(), stage=3)
        set_model_state_dict(again, dict(full), options=FULL)  # DCP puts its DTensors into the dict it is given
        report["full_to_sharded"] = _difference(_full(again), full)

        # Into an unsharded model, and into FSDP2's and back.
        torch.manual_seed(5)
        plain = build()
        set_model_state_dict(plain, _full(model), options=FULL)
        report["into_unsharded"] = _difference(plain.state_dict(), full)
        if all(p.dim() for p in plain.parameters()):  # fully_shard refuses 0-d parameters
            torch.manual_seed(6)
            fsdp = build()
            for module in [m for m in fsdp.modules() if isinstance(m, nn.Linear)]:
                fully_shard(module)
            fully_shard(fsdp)
            set_model_state_dict(fsdp, get_model_state_dict(model))
            report["into_fully_shard"] = _difference(_full(fsdp), full)
            torch.manual_seed(7)
            back = zc.shard(build(), stage=stage)
            set_model_state_dict(back, get_model_state_dict(fsdp))
            report["from_fully_shard"] = _difference(_full(back), full)

        # torch.save of the state dict, loaded back on this rank.
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        torch.manual_seed(8)
        saved = zc.shard(build(), stage=stage)
        saved.load_state_dict(torch.load(buffer, weights_only=False))
        report["torch_save"] = _difference(_full(saved), full)

        with zc.gathered(model):
            report["gathered_plain"] = not any(isinstance(v, DTensor) for v in model.state_dict().values())
        return report

    return run_cases(((name, stage), lambda name=name, stage=stage: case(name, stage)) for name in MODELS for stage in (1, 2, 3))


@pytest.mark.parametrize("world_size", (2, 4))
def test_dcp_state_dicts_round_trip_exactly(world_size: int) -> None:
    reports = run_on_ranks(world_size, _cases)
    for rank, report in enumerate(reports):
        for key, outcome in report.items():
            assert not isinstance(outcome, str), (rank, key, outcome)
            for what, value in outcome.items():
                if what == "layouts":
                    assert value and all(all(checks) for checks in value.values()), (rank, key, value)
                elif what == "gathered_plain":
                    assert value, (rank, key)
                else:
                    assert value == 0.0, (rank, key, what, value)
