"""benchmarks/finetune.py's DeepSpeed modes train as its other routes do: the DeepSpeed config either
says "auto" (Trainer fills it from the same `TrainingArguments`) or the other routes' value, for
clipping, batch, accumulation and precision; the optimizer and schedule are Trainer's own, from the
same arguments as DDP's; the ZeRO stage is the one asked. Without DeepSpeed (and without ranks):
`TrainingArguments(deepspeed=...)` would import it, so the keywords are read instead."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import finetune

pytestmark = pytest.mark.fast

DEEPSPEED_ROWS = [(label, mode) for label, mode in finetune.COMPARED if "deepspeed" in mode]


def _options(mode: list[str]) -> argparse.Namespace:
    return finetune.parser().parse_args(["train", "--pretrained", "p", "--out", "o", "--report", "r", *mode])


def test_rows_cover_both_stages_at_each_micro_batching_and_lora() -> None:
    settings = {(o.stage, o.per_device, o.accum, o.lora) for o in (_options(mode) for _label, mode in DEEPSPEED_ROWS)}
    # 2 x 2 beside FSDP2 and ZeroTrainer's first rows, 4 x 1 and 2 x 4 beside ZeroTrainer's
    full = {(stage, per_device, accum, False) for stage in (2, 3) for per_device, accum in ((2, 2), (4, 1), (2, 4))}
    assert settings == full | {(3, per_device, accum, True) for per_device, accum in ((2, 2), (4, 1), (2, 4))}
    labels = [label for label, _mode in finetune.COMPARED]
    assert {"Trainer + DDP, LoRA", "ZeroTrainer, stage 3, LoRA"} <= set(labels)


@pytest.mark.parametrize("label, mode", DEEPSPEED_ROWS, ids=[label for label, _mode in DEEPSPEED_ROWS])
def test_deepspeed_trains_as_ddp(label: str, mode: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import TrainingArguments

    monkeypatch.setattr(finetune.torch.cuda, "is_available", lambda: False)  # CPU ranks, as the table's
    options = _options(mode)
    ddp = argparse.Namespace(**{**vars(options), "mode": "ddp"})
    ours, theirs = finetune.training_arguments(options), finetune.training_arguments(ddp)
    config = ours.pop("deepspeed")
    # use_cpu=True would make accelerate drop the DeepSpeed config and train with DDP instead
    assert ours.pop("use_cpu") is False
    theirs.pop("use_cpu")
    # the state the benchmark makes, which counts the ranks (accelerate's own counts one without a GPU)
    assert ours.pop("accelerator_config") == {"use_configured_state": True}
    # the same lr, clipping, batch, accumulation, seed, optimizer (Trainer's default AdamW) as DDP's
    assert "deepspeed" not in theirs and ours == theirs
    args = TrainingArguments(**theirs, use_cpu=True)

    assert config["zero_optimization"]["stage"] == options.stage
    # No sections of DeepSpeed's own: Trainer builds AdamW and the schedule from `args`, as for DDP.
    assert "optimizer" not in config and "scheduler" not in config
    assert args.optim.startswith("adamw") and not args.fp16 and not args.bf16
    expected = {
        # absent, DeepSpeed would not clip as the other routes do
        ("gradient_clipping",): args.max_grad_norm,
        ("train_micro_batch_size_per_gpu",): args.per_device_train_batch_size,
        ("gradient_accumulation_steps",): args.gradient_accumulation_steps,
        ("fp16", "enabled"): False,
        ("bf16", "enabled"): False,
    }
    for path, value in expected.items():
        node = config
        for key in path:
            assert key in node, f"{'.'.join(path)} missing: DeepSpeed's default, not the other routes' {value}"
            node = node[key]
        assert node in ("auto", value), f"{'.'.join(path)} = {node!r}, the other routes' is {value!r}"
    # world size x micro-batch x accumulation: Trainer's own product, whatever the world size
    assert config["train_batch_size"] == "auto"


def test_deepspeed_accelerator_for_deepspeed_runs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finetune.torch.cuda, "is_available", lambda: False)  # CPU ranks, as here
    for index, (label, mode) in enumerate(finetune.COMPARED):
        variables = finetune.run_environment(mode, "work", index)
        assert variables.get("DS_ACCELERATOR") == ("cpu" if "deepspeed" in mode else None), label


def test_missing_deepspeed_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what `find_spec` reads as not installed
    with pytest.raises(SystemExit, match=r'pip install "zerocompile\[peers\]"'):
        finetune.require_deepspeed()
