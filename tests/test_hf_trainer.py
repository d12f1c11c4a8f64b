"""Hugging Face's `Trainer` fine-tunes a pretrained model through `zerocompile.hf.ZeroTrainer` as it
does through DDP: the runs of benchmarks/finetune.py (the recipe of docs/finetune.md), each launched
as a user launches it (torchrun, accelerate launch, or plain python for one rank).

A small Llama with random weights, saved by `save_pretrained` in 3 files; 20 optimizer steps of 2
sequences per rank, 2 micro-steps each, gradients clipped to norm 1.0, AdamW with the linear
schedule, on 2 gloo ranks. Losses are compared step by step with `Trainer`+DDP's. At 2 ranks the
gradient sums are the same two numbers added, but the clipping norm is summed over shards, not
whole tensors, and a resumed run on one rank sums a step's 4 sequences in one batch: fp32
rounding (ulp 4.8e-7 at a loss of 5.5) compounds through 20 AdamW steps, measured at most 9.5e-7.
1e-5 allows for that and would miss no real error: a wrongly scaled gradient, a skipped clip or a
lost optimizer state moves the losses by 1e-3 and more within a few steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerocompile.tools.spawn import free_loopback_port

ROOT = Path(__file__).resolve().parent.parent
LOSS_TOLERANCE = 1e-5
TIMEOUT = 300.0
RESUMED_FROM = 10


def _launch(launcher: list[str], tmp: Path, name: str, *train_args: str) -> dict:
    """One benchmarks.finetune run, its output in a log file; its report."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    report = tmp / f"{name}.json"
    command = [*launcher, "-m", "benchmarks.finetune", "train", "--pretrained", str(tmp / "pretrained"),
               "--compiler", "eager", "--out", str(tmp / name), "--report", str(report), *train_args]  # fmt: skip
    log = tmp / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=TIMEOUT)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    output = log.read_text()
    assert process.returncode == 0, output[-6000:]
    return json.loads(report.read_text())


def _torchrun(nproc: int) -> list[str]:
    port = free_loopback_port()
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}"]


def _accelerate(nproc: int) -> list[str]:
    # `--multi_gpu` is accelerate's torchrun launcher; with no GPU the ranks run on the CPU over gloo
    # (its `--cpu` launcher starts more than one process only through MPI).
    port = free_loopback_port()
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}",
            "--main_process_ip=127.0.0.1", f"--main_process_port={port}"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("finetune")
    subprocess.run([sys.executable, "-m", "benchmarks.finetune", "prepare", "--size", "tiny", "--out", str(tmp / "pretrained")],
                   cwd=ROOT, check=True, timeout=TIMEOUT)  # fmt: skip
    assert len(list((tmp / "pretrained").glob("model-*.safetensors"))) >= 2
    checkpoint = str(tmp / "zero3" / f"checkpoint-{RESUMED_FROM}")
    return {
        "ddp": _launch(_torchrun(2), tmp, "ddp", "--mode", "ddp"),
        "zero3": _launch(_torchrun(2), tmp, "zero3", "--mode", "zero", "--stage", "3"),
        # The same global batch of 4 sequences per micro-step on one rank.
        "resumed_one_rank": _launch([sys.executable], tmp, "resumed_one_rank", "--mode", "zero", "--stage", "3",
                                    "--per-device", "4", "--resume", checkpoint),  # fmt: skip
        "resumed_stage2": _launch(_torchrun(2), tmp, "resumed_stage2", "--mode", "zero", "--stage", "2", "--resume", checkpoint),
        "accelerate": _launch(_accelerate(2), tmp, "accelerate", "--mode", "zero", "--stage", "3"),
        "ddp_lora": _launch(_torchrun(2), tmp, "ddp_lora", "--mode", "ddp", "--lora", "--lr", "1e-2"),
        "zero3_lora": _launch(_torchrun(2), tmp, "zero3_lora", "--mode", "zero", "--stage", "3", "--lora", "--lr", "1e-2"),
        # The adapter-only checkpoint, resumed on one rank (same global batch) at stage 2.
        "resumed_lora": _launch([sys.executable], tmp, "resumed_lora", "--mode", "zero", "--stage", "2", "--lora", "--lr", "1e-2",
                                "--per-device", "4", "--resume", str(tmp / "zero3_lora" / f"checkpoint-{RESUMED_FROM}")),  # fmt: skip
    }


def _largest_difference(losses: list[float], expected: list[float]) -> float:
    assert len(losses) == len(expected) == 20, (len(losses), len(expected))
    return max(abs(a - b) for a, b in zip(losses, expected))


def test_stage3_trains_like_ddp(runs):
    assert runs["zero3"]["world_size"] == 2
    assert _largest_difference(runs["zero3"]["losses"], runs["ddp"]["losses"]) <= LOSS_TOLERANCE


def test_evaluation_like_ddp(runs):
    """`evaluate()` at steps 10 and 20 runs the compiled sharded model in eval mode."""
    zero, ddp = runs["zero3"]["eval_losses"], runs["ddp"]["eval_losses"]
    assert len(zero) == len(ddp) == 2
    assert max(abs(a - b) for a, b in zip(zero, ddp)) <= LOSS_TOLERANCE


def test_save_model_loads_with_from_pretrained(runs):
    """`save_model`'s directory, read by `from_pretrained`, equals the gathered trained weights."""
    assert runs["zero3"]["saved_error"] == 0.0


@pytest.mark.parametrize("resumed", ["resumed_one_rank", "resumed_stage2"])
def test_resume_at_another_world_size_or_stage(runs, resumed):
    """Steps 11-20 after resuming step 10's checkpoint (1 rank at stage 3; 2 ranks at stage 2) are the
    uninterrupted run's; steps 1-10 come from the checkpoint's log."""
    report = runs[resumed]
    assert report["world_size"] == (1 if resumed == "resumed_one_rank" else 2)
    assert _largest_difference(report["losses"], runs["zero3"]["losses"]) <= LOSS_TOLERANCE


def test_accelerate_launch_trains_like_torchrun(runs):
    assert runs["accelerate"]["world_size"] == 2
    assert _largest_difference(runs["accelerate"]["losses"], runs["zero3"]["losses"]) <= LOSS_TOLERANCE


def test_lora_adapter_trains_like_ddp_and_saves_as_peft(runs, tmp_path_factory):
    """A LoRA adapter on the stage-3 base (built on meta by `zc.from_pretrained(lora=)`, frozen,
    sharded) against PEFT on the whole base under DDP: losses, gradient norms and the trained
    adapter; the saved adapter, loaded by `PeftModel.from_pretrained`, equals the gathered one."""
    from safetensors.torch import load_file

    zero, ddp = runs["zero3_lora"], runs["ddp_lora"]
    assert _largest_difference(zero["losses"], ddp["losses"]) <= LOSS_TOLERANCE
    assert len(zero["grad_norms"]) == len(ddp["grad_norms"]) == 20
    assert max(abs(a - b) for a, b in zip(zero["grad_norms"], ddp["grad_norms"])) <= LOSS_TOLERANCE
    # The adapter moved the loss: a frozen base with an untrained adapter would not.
    assert zero["losses"][-1] < zero["losses"][0] - 1e-3
    assert zero["saved_error"] == 0.0
    trained = [load_file(Path(run["out"], "final", "adapter_model.safetensors")) for run in (zero, ddp)]
    assert trained[0].keys() == trained[1].keys() and len(trained[0]) == 8
    assert max((trained[0][k] - trained[1][k]).abs().max().item() for k in trained[0]) <= LOSS_TOLERANCE


def test_lora_checkpoint_holds_the_adapter_alone_and_resumes_elsewhere(runs):
    """A `save_steps` checkpoint of the LoRA run: its zerocompile part is the adapter and its AdamW
    state (no base), and it resumes on one rank at stage 2 to the uninterrupted run's losses."""
    # (Its bytes against the adapter's: tests/test_lora_meta.py, on an adapter large beside the metadata.)
    metadata = json.loads(Path(runs["zero3_lora"]["out"], f"checkpoint-{RESUMED_FROM}", "zerocompile", "zerocompile.json").read_text())
    assert metadata["trainable_only"] and metadata["buffers"] == []
    assert len(metadata["params"]) == 8 and all(".lora_" in entry["names"][0] for entry in metadata["params"]), metadata["params"]
    assert runs["resumed_lora"]["world_size"] == 1
    assert _largest_difference(runs["resumed_lora"]["losses"], runs["zero3_lora"]["losses"]) <= LOSS_TOLERANCE


# --- what ZeroTrainer refuses before anything is built, and the extra it names -----------------


@pytest.mark.fast
@pytest.mark.parametrize(
    "setting, match",
    [({"torch_compile": True}, "drop torch_compile=True"), ({"fp16": True}, "use bf16=True")],
)
def test_refuses_what_accelerate_would_have_done(tmp_path, setting, match):
    """Trainer's DDP route does these through accelerate's wrapping of the model, which ZeroTrainer
    bypasses: silently, the model would train uncompiled by zero, or in fp32."""
    from transformers import TrainingArguments

    from zerocompile.hf import ZeroTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **setting)
    with pytest.raises(ValueError, match=match):
        ZeroTrainer(model=_tiny_llama(), args=args)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    return LlamaForCausalLM(config)


def test_bf16_shards_with_bf16_compute(single_rank, tmp_path):
    """`bf16=True` becomes the shard's param_dtype (fp32 master shards, bf16 compute): accelerate's
    autocast, DDP's route to it, never sees a model ZeroTrainer keeps from it."""
    from transformers import TrainingArguments

    from zerocompile.hf import ZeroTrainer
    from zerocompile.sharded_parameters import shard_info

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=True)
    trainer = ZeroTrainer(model=_tiny_llama(), args=args)
    infos = [shard_info(p) for p in trainer.model.parameters()]
    assert all(info is not None and info.config.param_dtype == torch.bfloat16 for info in infos)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_sharded_without_bf16_refuses_bf16(single_rank, tmp_path):
    from transformers import TrainingArguments

    import zerocompile as zc
    from zerocompile.hf import ZeroTrainer

    model = zc.shard(_tiny_llama(), stage=3)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=True)
    with pytest.raises(ValueError, match="sharded without param_dtype"):
        ZeroTrainer(model=model, args=args)


@pytest.mark.fast
@pytest.mark.parametrize("missing", ["transformers", "accelerate"])
def test_missing_extra_is_named(missing):
    code = f"import sys; sys.modules[{missing!r}] = None\nimport zerocompile.hf"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode != 0
    assert f"({missing} is missing): pip install \"zerocompile[hf]\"" in result.stderr, result.stderr[-2000:]
