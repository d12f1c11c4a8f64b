"""Fine-tune a "pretrained" Llama with Hugging Face's `Trainer`: DDP, FSDP2, DeepSpeed ZeRO-2/3 or
zerocompile's `ZeroTrainer`, optionally with a PEFT LoRA adapter: docs/finetune.md's recipe and table.

FSDP2 is transformers' own (`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))`,
each rank loading its shards): accelerate's FSDP plugin enables FSDP only for GPU-like devices, and
on CPU ranks Trainer then trains with DDP without a word (DDP's reducer warnings in the log show it).
DeepSpeed is `TrainingArguments(deepspeed=deepspeed_config(stage))`, on CPU ranks with DS_ACCELERATOR=cpu
(over gloo); it is no dependency of zerocompile: `pip install "zerocompile[peers]"` installs it.

    python -m benchmarks.finetune compare --size medium --nproc 2 --steps 20  # docs/finetune.md's table
    python -m benchmarks.finetune prepare --size small --out /tmp/llama        # random weights, 2+ files
    torchrun --nproc_per_node 2 -m benchmarks.finetune train --pretrained /tmp/llama --mode zero \
        --stage 3 --out /tmp/run --report /tmp/run.json
    accelerate launch --multi_gpu --num_processes 2 -m benchmarks.finetune train ...   # the same

Nothing is downloaded: `prepare` writes a randomly initialised model with `save_pretrained`, and the
data are random tokens (seed 5; held out for evaluation: seed 6), so losses are comparable run to
run, not meaningful. Rank 0 writes the report: the loss of every optimizer step, the evaluation
loss every `--eval-steps`, the time from this module's import to the end of the first optimizer
step, tokens per second over the later steps, each rank's peak RSS (VmHWM) up to the first step's
end and over the later steps, and, for ZeroTrainer, how far `save_model`'s files (read back by
`from_pretrained`, or `PeftModel.from_pretrained` for an adapter) are from the gathered weights.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402  (the clock starts before the imports, which are part of the start)
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SIZES = {
    # test_hf_models' tiny Llama (the tests), initialised 5x wider than Llama's default so the
    # gradient norm (~2) exceeds the clip of 1.0 and clipping is exercised
    "tiny": dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, seq_len=16),
    # ~6M parameters: a quick look
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, seq_len=128),
    # docs/finetune.md's table: ~40M parameters, optimizer state large beside torch's own memory
    "medium": dict(vocab_size=16000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, seq_len=128),
}  # fmt: skip
SAMPLES = 96
LORA_TARGETS = ["q_proj", "v_proj"]


def prepare(size: str, out: str) -> None:
    """A randomly initialised Llama (seed 0) saved by `save_pretrained` in at least two files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(SIZES[size])
    seq_len = settings.pop("seq_len")
    config = LlamaConfig(**settings, max_position_embeddings=seq_len, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=max(nbytes // 2, 1))
    Path(out, "seq_len").write_text(str(seq_len))


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, seq_len: int, samples: int = SAMPLES, seed: int = 5) -> None:
        self.ids = torch.randint(0, vocab, (samples, seq_len), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def deepspeed_config(stage: int) -> dict[str, Any]:
    """The DeepSpeed config of the DeepSpeed modes: ZeRO `stage`, and "auto" wherever Trainer fills the
    value from `TrainingArguments`, so that DeepSpeed trains as the other routes do.

    Unlike DeepSpeed's defaults: the ZeRO stage (default 0); `gradient_clipping` "auto", the routes'
    `max_grad_norm`, which DeepSpeed's default (1.0 in 0.19.8, 0 = off in some older releases)
    matches only by chance; at stage 3, `stage3_gather_16bit_weights_on_model_save` (default off),
    so that `save_model` writes the model's files (in its own dtype, fp32 here) as the other routes
    do, not a DeepSpeed checkpoint.
    No "optimizer" and no "scheduler": Trainer then builds its own AdamW and linear schedule from
    `TrainingArguments`, the other routes' objects, where DeepSpeed's sections would build its own
    Adam (a C++ op compiled at first use) and its WarmupDecayLR."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "zero_optimization": zero, "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},  # fp32, as the other routes
    }  # fmt: skip


def training_arguments(options: argparse.Namespace) -> dict[str, Any]:
    """`TrainingArguments`' keywords for `options`: one set for all modes but compiled DDP's
    `torch_compile`, FSDP2's `save_only_model` and DeepSpeed's config, device and state. Keywords rather
    than the object, which with `deepspeed=` imports DeepSpeed: the fast test reads them without it."""
    extra: dict[str, Any] = {}
    if options.mode == "ddp-compile":
        extra = dict(torch_compile=True)
    use_cpu = not torch.cuda.is_available()
    if options.mode == "deepspeed":
        # use_cpu=True makes accelerate ignore the DeepSpeed config and train with DDP without a word;
        # DeepSpeed's device comes from DS_ACCELERATOR=cpu (see `run_environment`).
        extra, use_cpu = dict(deepspeed=deepspeed_config(options.stage)), False
        if not torch.cuda.is_available():
            extra["accelerator_config"] = {"use_configured_state": True}  # made by `_deepspeed_state_on_cpu`
    return dict(
        output_dir=options.out, per_device_train_batch_size=options.per_device, gradient_accumulation_steps=options.accum,
        max_grad_norm=1.0, max_steps=options.steps, logging_steps=1, save_steps=options.save_steps,
        learning_rate=options.lr, seed=0, report_to=[], use_cpu=use_cpu, disable_tqdm=True,
        # transformers cannot checkpoint the optimizer of a model it sharded at load time (it refuses).
        save_only_model=options.mode == "fsdp2", eval_strategy="steps" if options.eval_steps else "no", eval_steps=options.eval_steps or None,
        per_device_eval_batch_size=2, **extra,
    )  # fmt: skip


def require_deepspeed() -> None:
    """Stop with how to install DeepSpeed where it is missing: only the DeepSpeed modes need it."""
    import importlib.util

    from zerocompile.tools.bench.deepspeed_modes import INSTALL_HINT

    if importlib.util.find_spec("deepspeed") is None:
        raise SystemExit(f"DeepSpeed is not installed (benchmarks only): {INSTALL_HINT}")


def _deepspeed_state_on_cpu() -> None:
    """accelerate's state for DeepSpeed on CPU ranks, made before `TrainingArguments` takes it
    (`use_configured_state`). Made by TrainingArguments, it would find no backend without a GPU and
    count one process: DeepSpeed's "auto" `train_batch_size` would count one rank (DeepSpeed refuses
    it), and every rank would read the same batches."""
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as TrainingArguments sets it while it makes one
    PartialState(backend="gloo")


def _model(options: argparse.Namespace) -> torch.nn.Module:
    """ZeroTrainer's model comes sharded from `zc.from_pretrained` (each rank reads its shards, nothing
    initialised twice; a LoRA adapter attached on meta, so no rank holds the whole base); DDP's and
    FSDP2's and DeepSpeed's from transformers' `from_pretrained`, a LoRA adapter attached by PEFT to the
    whole base. DeepSpeed's is whole on every rank, as DDP's, until `deepspeed.initialize` partitions it
    (TrainingArguments made after the model: no `zero.Init` at load, and the adapter's values as DDP's)."""
    from transformers import AutoModelForCausalLM

    lora = None
    if options.lora:
        from peft import LoraConfig

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
        torch.manual_seed(0)  # the adapter's initial values, alike on every rank and in every mode
    if options.mode == "zero":
        import zerocompile as zc

        zc.init_distributed()
        return zc.from_pretrained(options.pretrained, stage=options.stage, lora=lora)
    if options.mode == "fsdp2":
        from transformers.distributed import DistributedConfig

        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        return AutoModelForCausalLM.from_pretrained(options.pretrained, distributed_config=DistributedConfig(fsdp_size=world_size))
    model = AutoModelForCausalLM.from_pretrained(options.pretrained)
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora)
    return model


class _Clock:
    """`TrainerCallback` timing each optimizer step's end; at the first, the peak RSS so far (start,
    load, compile) is noted and the peak restarted, so the steps after it are measured alone."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        from zerocompile.tools.measuring import reset_peak_rss, status_bytes

        clock = self

        class Callback(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                clock.step_ends.append(time.perf_counter())
                if len(clock.step_ends) == 1:
                    clock.first_step_peak = status_bytes("VmHWM")
                    reset_peak_rss()

        self.step_ends: list[float] = []
        self.first_step_peak = 0
        self.callback = Callback()


def train(options: argparse.Namespace) -> dict[str, Any] | None:
    from transformers import Trainer, TrainingArguments, default_data_collator

    from zerocompile.hf import ZeroTrainer
    from zerocompile.tools.measuring import status_bytes

    if options.mode == "deepspeed":
        require_deepspeed()
        if not torch.cuda.is_available():
            _deepspeed_state_on_cpu()
    seq_len = int(Path(options.pretrained, "seq_len").read_text())
    model = _model(options)
    dataset = RandomTokens(model.config.vocab_size, seq_len)
    clock = _Clock()
    held_out = RandomTokens(model.config.vocab_size, seq_len, samples=8, seed=6)
    common = dict(
        model=model, args=TrainingArguments(**training_arguments(options)), train_dataset=dataset, eval_dataset=held_out,
        data_collator=default_data_collator, callbacks=[clock.callback],
    )  # fmt: skip
    if options.mode == "zero":
        compile_options = {"compiler": options.compiler}
        # from_pretrained sharded it
        trainer = ZeroTrainer(**common, compile_options=compile_options, sync_each_micro_step=not options.no_sync)
    else:
        trainer = Trainer(**common)
        if options.mode == "deepspeed" and not trainer.is_deepspeed_enabled:
            raise RuntimeError("Trainer did not enable DeepSpeed: the row would measure another route")
    trainer.train(resume_from_checkpoint=options.resume)
    # Training's: the check of the saved files below holds two whole models on rank 0.
    peak = (clock.first_step_peak, status_bytes("VmHWM"))
    final = os.path.join(options.out, "final")
    trainer.save_model(final)
    saved_error = _saved_error(trainer.model, final, options) if options.mode == "zero" else None
    peaks = [None] * dist.get_world_size() if dist.is_initialized() else [None]
    if dist.is_initialized():
        dist.all_gather_object(peaks, peak)
    else:
        peaks = [peak]
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    tokens_per_step = options.per_device * options.accum * world_size * seq_len
    later = clock.step_ends[1:]
    report = {
        "mode": options.mode, "stage": options.stage if options.mode in ("zero", "deepspeed") else None, "lora": options.lora,
        "world_size": world_size, "out": options.out,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
        "eval_losses": [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry],
        "first_step_s": clock.step_ends[0] - STARTED if clock.step_ends else None,
        "tokens_per_s": (len(later) - 1) * tokens_per_step / (later[-1] - later[0]) if len(later) > 1 else None,
        "peak_rss": [first for first, _later in peaks],  # to the end of the first step
        "steady_rss": [later for _first, later in peaks],  # the later steps' peak
        "saved_error": saved_error,
    }  # fmt: skip
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(options.report).write_text(json.dumps(report))
        return report
    return None


def _saved_error(model: torch.nn.Module, final: str, options: argparse.Namespace) -> float | None:
    """Largest difference between what `save_model` wrote (read back as users read it) and the trained
    weights gathered from the shards; collective, the number on rank 0."""
    import zerocompile as zc

    if options.lora:
        from zerocompile.hf import trainable_state_dict

        trained = trainable_state_dict(model)
    else:
        trained = zc.full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    from transformers import AutoModelForCausalLM

    if options.lora:
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(options.pretrained), final)
    else:
        loaded = AutoModelForCausalLM.from_pretrained(final)
    state = loaded.state_dict()
    if set(trained) - set(state):
        raise AssertionError(f"not in the saved model: {sorted(set(trained) - set(state))[:5]}")
    return max((trained[name] - state[name]).abs().max().item() for name in trained)


# The modes of docs/finetune.md's table: (label, train arguments). Micro-batches of 2 sequences,
# 2 per step; the "4 x 1" rows take the same 4 sequences per rank in one micro-batch, which shows
# what ZeroTrainer's reduction per micro-step costs. DeepSpeed's rows sit beside ZeroTrainer's of
# the same micro-batching; the LoRA rows at the end, full fine-tuning everywhere else.
COMPARED = (
    ("Trainer + DDP", ["--mode", "ddp"]),
    ("Trainer + DDP, `torch_compile=True`", ["--mode", "ddp-compile"]),
    ("Trainer + FSDP2 (transformers' `distributed_config`)", ["--mode", "fsdp2"]),
    ("ZeroTrainer, stage 3", ["--mode", "zero", "--stage", "3"]),
    ("ZeroTrainer, stage 2", ["--mode", "zero", "--stage", "2"]),
    ("Trainer + DeepSpeed ZeRO-3", ["--mode", "deepspeed", "--stage", "3"]),
    ("Trainer + DeepSpeed ZeRO-2", ["--mode", "deepspeed", "--stage", "2"]),
    ("Trainer + DDP, `torch_compile=True`, 4 x 1", ["--mode", "ddp-compile", "--per-device", "4", "--accum", "1"]),
    ("ZeroTrainer, stage 3, 4 x 1", ["--mode", "zero", "--stage", "3", "--per-device", "4", "--accum", "1"]),
    ("Trainer + DeepSpeed ZeRO-3, 4 x 1", ["--mode", "deepspeed", "--stage", "3", "--per-device", "4", "--accum", "1"]),
    ("Trainer + DeepSpeed ZeRO-2, 4 x 1", ["--mode", "deepspeed", "--stage", "2", "--per-device", "4", "--accum", "1"]),
    # 4 micro-steps of 2 per step: reducing each micro-step against once per optimizer step.
    ("Trainer + DDP, `torch_compile=True`, 2 x 4", ["--mode", "ddp-compile", "--accum", "4"]),
    ("ZeroTrainer, stage 3, 2 x 4", ["--mode", "zero", "--stage", "3", "--accum", "4"]),
    ("ZeroTrainer, stage 3, 2 x 4, `sync_each_micro_step=False`", ["--mode", "zero", "--stage", "3", "--accum", "4", "--no-sync"]),
    ("Trainer + DeepSpeed ZeRO-3, 2 x 4", ["--mode", "deepspeed", "--stage", "3", "--accum", "4"]),
    ("Trainer + DeepSpeed ZeRO-2, 2 x 4", ["--mode", "deepspeed", "--stage", "2", "--accum", "4"]),
    ("Trainer + DDP, LoRA", ["--mode", "ddp", "--lora"]),
    ("ZeroTrainer, stage 3, LoRA", ["--mode", "zero", "--stage", "3", "--lora"]),
    ("Trainer + DeepSpeed ZeRO-3, LoRA", ["--mode", "deepspeed", "--stage", "3", "--lora"]),
    *(
        (f"{route}, LoRA, {batching}", [*mode, "--lora", *micro_batching])
        for batching, micro_batching in (("4 x 1", ["--per-device", "4", "--accum", "1"]), ("2 x 4", ["--accum", "4"]))
        for route, mode in (
            ("Trainer + DDP", ["--mode", "ddp"]),
            ("ZeroTrainer, stage 3", ["--mode", "zero", "--stage", "3"]),
            ("Trainer + DeepSpeed ZeRO-3", ["--mode", "deepspeed", "--stage", "3"]),
        )
    ),
)


def run_environment(mode: list[str], work: str, index: int) -> dict[str, str]:
    """The variables set for one compared run of train arguments `mode`: a cold Inductor cache of its
    own, as a first run of a job has (its compile is part of its start), and for DeepSpeed without
    a GPU its CPU accelerator (over gloo) rather than its guess from the machine."""
    from zerocompile.tools.bench.deepspeed_modes import accelerator_environment

    variables = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(work, f"run{index}-inductor-cache")}
    return {**variables, **accelerator_environment(None)} if "deepspeed" in mode else variables


def compare(size: str, nproc: int, steps: int, work: str, allocator: str, only: list[str] | None = None, repeat: int = 1) -> str:
    """Each of COMPARED (those whose label one of the regular expressions `only` finds) in turn under torchrun on
    the same pretrained model and data, the ranks' malloc `allocator` (as `zerocompile bench`'s),
    all of them `repeat` times over: a Markdown table, each run's tokens/s in its row."""
    import subprocess
    import sys

    from zerocompile.tools.spawn import child_environment, find_allocator, free_loopback_port

    pretrained = os.path.join(work, "pretrained")
    prepare(size, pretrained)
    chosen = [(index, label, mode) for index, (label, mode) in enumerate(COMPARED) if not only or any(re.search(part, label) for part in only)]
    if any("deepspeed" in mode for _index, _label, mode in chosen):
        require_deepspeed()  # before the other runs, not after them
    results: dict[int, list[dict[str, Any]]] = {index: [] for index, _label, _mode in chosen}
    for index, label, mode in [entry for _ in range(repeat) for entry in chosen]:
        report = os.path.join(work, f"run{index}.json")
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_loopback_port()}", "-m", "benchmarks.finetune", "train", "--pretrained", pretrained,
            # No checkpoints and no evaluation: the steps alone (an evaluation compiles graphs of its own).
            "--steps", str(steps), "--save-steps", str(10 * steps), "--eval-steps", "0", "--out", os.path.join(work, f"run{index}"),
            "--report", report, *mode,
        ]  # fmt: skip
        env = child_environment(run_environment(mode, work, index), find_allocator(allocator))
        with open(os.path.join(work, f"run{index}.log"), "w") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True, env=env)
        results[index].append(json.loads(Path(report).read_text()))
    rows = []
    for index, label, _mode in chosen:
        result, speeds = results[index][-1], " / ".join(f"{run['tokens_per_s']:.0f}" for run in results[index])
        rows.append(
            f"| {label} | {result['first_step_s']:.1f} s | {max(result['peak_rss']) / 2**20:.0f} MiB "
            f"| {max(result['steady_rss']) / 2**20:.0f} MiB | {speeds} | {result['losses'][-1]:.4f} |"
        )
    header = (
        "| route | start to first step | peak RSS to the first step | peak RSS of the later steps | tokens/s "
        "| loss at the last step |\n|---|---|---|---|---|---|"
    )
    return "\n".join([header, *rows])


def parser() -> argparse.ArgumentParser:
    """The command line: `prepare`, `compare` and `train` (whose options the tests parse too)."""
    from zerocompile.tools.spawn import add_allocator_argument

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("prepare", help="write a random 'pretrained' Llama")
    made.add_argument("--size", choices=sorted(SIZES), default="tiny")
    made.add_argument("--out", required=True)
    table = commands.add_parser("compare", help="DDP, FSDP2, DeepSpeed and ZeroTrainer side by side: a Markdown table")
    table.add_argument("--size", choices=sorted(SIZES), default="medium")
    table.add_argument("--nproc", type=int, default=2)
    table.add_argument("--steps", type=int, default=30)
    table.add_argument("--work", default=None, help="directory for the runs (default: a temporary one)")
    table.add_argument("--only", action="append", help="run the routes whose label this regular expression finds (repeatable)")
    table.add_argument("--repeat", type=int, default=1, help="run the routes in turn this many times over")
    add_allocator_argument(table)
    run = commands.add_parser("train", help="fine-tune it with Trainer (under torchrun or accelerate launch)")
    run.add_argument("--pretrained", required=True)
    run.add_argument("--mode", choices=("ddp", "ddp-compile", "fsdp2", "zero", "deepspeed"), required=True)
    run.add_argument("--stage", type=int, default=3, help="ZeroTrainer's ZeRO stage, or DeepSpeed's")
    run.add_argument("--compiler", choices=("eager", "inductor"), default="inductor")
    run.add_argument("--lora", action="store_true")
    run.add_argument("--steps", type=int, default=20)
    run.add_argument("--save-steps", type=int, default=10)
    run.add_argument("--eval-steps", type=int, default=10, help="evaluate every this many steps and at the end (0: never)")
    run.add_argument("--per-device", type=int, default=2)
    run.add_argument("--accum", type=int, default=2)
    run.add_argument("--no-sync", action="store_true", help="ZeroTrainer(sync_each_micro_step=False)")
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--resume", default=None)
    run.add_argument("--out", required=True)
    run.add_argument("--report", required=True)
    return parser


def main(argv: list[str] | None = None) -> None:
    options = parser().parse_args(argv)
    if options.command == "prepare":
        prepare(options.size, options.out)
    elif options.command == "compare":
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            print(compare(options.size, options.nproc, options.steps, options.work or scratch, options.allocator, options.only, options.repeat))
    else:
        train(options)
        if dist.is_initialized():
            dist.destroy_process_group()  # before the interpreter's teardown, as torch asks


if __name__ == "__main__":
    main()
