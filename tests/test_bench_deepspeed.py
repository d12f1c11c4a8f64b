"""`zerocompile bench`'s DeepSpeed modes train as every other mode: the ZeRO stage named, clipping
off (DeepSpeed's default 1.0 would clip where no other mode does), fp32 or bf16 as zero3-bf16, the bench's own AdamW
object at the other modes' learning rate, the rows per rank the bench's batches give, and the
engine's backward and step in the bench's step. No DeepSpeed import and no ranks: the engine is
replaced by a recorder (the DeepSpeed runs themselves are the benchmark's, docs/results/)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from zerocompile.tools.bench import deepspeed_modes
from zerocompile.tools.bench.method import method
from zerocompile.tools.bench.modes import LEARNING_RATE, MODES, Prepared
from zerocompile.tools.bench.settings import Settings
from zerocompile.tools.bench.steps import RandomBatches
from zerocompile.tools.gpt import GPT

pytestmark = pytest.mark.fast


def _settings(optimizer: str = "adamw") -> Settings:
    return Settings(
        ranks=2, model_size="tiny", steps=1, warmup=1, batch_size=8, seed=0, modes=(), interleave=(), cache_root="",
        device=torch.device("cpu"), optimizer=optimizer,
    )  # fmt: skip


class RecordingEngine:
    """What the bench asks of a DeepSpeed engine, recorded."""

    def __init__(self, model: GPT) -> None:
        self.module, self.calls = model, []

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls.append("forward")
        return self.module(inputs, targets)

    def backward(self, loss: torch.Tensor) -> None:
        self.calls.append("backward")

    def step(self) -> None:
        self.calls.append("step")


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Each DeepSpeed mode's `build_engine` call, with a recorder for its engine."""
    calls = {}

    def build_engine(model, optimizer, mode, rows_per_rank):
        calls.update(model=model, optimizer=optimizer, mode=mode, rows=rows_per_rank)
        calls["engine"] = RecordingEngine(model)
        return calls["engine"]

    monkeypatch.setattr("zerocompile.tools.bench.modes.build_engine", build_engine)
    return calls


@pytest.mark.parametrize("name", list(deepspeed_modes.DEEPSPEED_MODES))
def test_each_mode_trains_as_the_others(name: str, built: dict) -> None:
    settings = _settings()
    torch.manual_seed(0)
    model = GPT(settings.config)
    MODES[name].prepare(model, settings)
    mode = deepspeed_modes.DEEPSPEED_MODES[name]
    assert built["model"] is model and built["mode"] == mode
    # The bench's AdamW, as every other mode's: its class, learning rate and every parameter.
    reference = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    assert type(built["optimizer"]) is torch.optim.AdamW
    assert built["optimizer"].defaults == reference.defaults
    assert built["optimizer"].param_groups[0]["params"] == list(model.parameters())
    # DeepSpeed's micro-batch is the rows each rank's batches hold.
    inputs, _targets = RandomBatches(settings.config, settings, 0, torch.device("cpu")).next()
    assert built["rows"] == inputs.shape[0]
    config = deepspeed_modes.deepspeed_config(mode, built["rows"])
    assert config["zero_optimization"] == {"stage": int(name[len("deepspeed")])}
    assert config["gradient_clipping"] == 0
    # fp32 as the other modes, or bf16 compute and reduction as zero3-bf16's (fp32 partitions).
    bf16 = name.endswith("-bf16")
    assert config["fp16"] == {"enabled": False} and config["bf16"] == {"enabled": bf16}
    assert config.get("communication_data_type") == ("bf16" if bf16 else None)
    assert config["gradient_accumulation_steps"] == 1
    assert "optimizer" not in config and "scheduler" not in config  # the client's AdamW, no schedule
    assert ("compile" in config) == ("deepcompile" in name)


def test_the_step_is_the_engines(built: dict) -> None:
    settings = _settings()
    prepared = MODES["deepspeed3"].prepare(GPT(settings.config), settings)
    assert prepared.optimizers == []  # the engine steps and clears its gradients itself
    prepared.zero_grad()
    loss = prepared.runner(*RandomBatches(settings.config, settings, 0, torch.device("cpu")).next())
    prepared.backward(loss)
    prepared.step()
    assert built["engine"].calls == ["forward", "backward", "step"]


def test_other_modes_step_as_before() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    prepared = Prepared(model, [optimizer], dict)
    prepared.backward(model(torch.ones(1, 2)).sum())
    before = model.weight.detach().clone()
    prepared.step()
    assert torch.equal(model.weight.detach(), before - 1.0)
    prepared.zero_grad()
    assert model.weight.grad is None


def test_muon_is_refused_by_name(built: dict) -> None:
    settings = _settings("muon")
    with pytest.raises(ValueError, match=r"deepspeed3 runs AdamW only"):
        MODES["deepspeed3"].prepare(GPT(settings.config), settings)


def test_cpu_ranks_get_deepspeeds_cpu_accelerator_and_no_other_mode_does() -> None:
    cpu = torch.device("cpu")
    assert deepspeed_modes.rank_environment(["zero3", "deepspeed3"], cpu) == {"DS_ACCELERATOR": "cpu"}
    assert deepspeed_modes.rank_environment(["zero3", "ddp"], cpu) == {}
    assert deepspeed_modes.rank_environment(["deepspeed3"], torch.device("cuda", 0)) == {}


def test_without_deepspeed_the_mode_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    model = GPT(_settings().config)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(RuntimeError, match=r'DeepSpeed is not installed .*pip install "zerocompile\[peers\]"'):
        deepspeed_modes.build_engine(model, optimizer, deepspeed_modes.DeepSpeedMode(3), 4)
    with pytest.raises(RuntimeError, match=r"DeepCompile runs on CUDA only; the model is on cpu"):
        deepspeed_modes.build_engine(model, optimizer, deepspeed_modes.DeepSpeedMode(3, "deepcompile"), 4)


class _OnCuda(torch.nn.Module):
    """A model whose parameters report a CUDA device (no GPU needed: nothing runs on them)."""

    def parameters(self, recurse: bool = True):
        yield types.SimpleNamespace(device=torch.device("cuda", 0))


@pytest.mark.parametrize("name", list(deepspeed_modes.DEEPSPEED_MODES))
def test_build_engine_compiles_where_the_mode_says(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepCompile too needs `engine.compile()`: the config section alone leaves the engine eager."""
    mode = deepspeed_modes.DEEPSPEED_MODES[name]
    compiled = []
    engine = types.SimpleNamespace(compile=lambda: compiled.append(True))

    def initialize(model, optimizer, config):
        assert config == deepspeed_modes.deepspeed_config(mode, 4)
        return engine, optimizer, None, None

    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(initialize=initialize))
    assert deepspeed_modes.build_engine(_OnCuda(), None, mode, 4) is engine
    assert compiled == ([True] if mode.variant in ("compile", "deepcompile") else [])


def test_the_method_says_what_differs_from_deepspeeds_defaults() -> None:
    text = method(None, fake=False, link=False, offload=False, deepspeed=True)["deepspeed"]
    assert "gradient_clipping 0" in text and "torch AdamW" in text and "fp16/bf16 off" in text
    assert "deepspeed" not in method(None, fake=False, link=False, offload=False)


def test_a_default_run_leaves_deepspeed_out() -> None:
    """DeepSpeed is an optional peer: only a run that names its modes needs it installed."""
    import argparse

    from zerocompile.tools import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    modes = parser.parse_args([]).modes
    assert "zero3" in modes and not set(modes) & set(deepspeed_modes.DEEPSPEED_MODES)
    assert parser.parse_args(["--modes", "zero3,deepspeed3"]).modes == ["zero3", "deepspeed3"]
