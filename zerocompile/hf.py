"""`ZeroTrainer`: Hugging Face's `Trainer` with the model sharded by zerocompile instead of wrapped.

    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=..., zero_config=3)
    trainer.train()                      # torchrun / accelerate launch, as with DDP
    trainer.save_model("out")            # Hugging Face layout: from_pretrained("out") loads it

`Trainer` wraps a model in DDP through accelerate unless the model is already wrapped: `_wrap_model`
here hands it `torch.compile(model, backend="zero")` of the sharded model, so accelerate prepares the
optimizer and data only. The optimizer Trainer builds (`create_optimizer`, or `optimizers=`, or
`optimizer_cls_and_kwargs=` such as `zerocompile.optim.Muon`) then holds the shards, as DeepSpeed's
does. What DDP's route gets from accelerate and a sharded model needs differently is overridden:
the gradient norm over the shards (`zerocompile.clip_grad_norm_`), saving the weights collectively
(`save_weights`: rank 0 streams them into safetensors files, holding one shard at a time beyond its
own), and checkpoints through `zerocompile.save`/`load`, which reshard to another world size or stage.

Gradient accumulation reduces each micro-step's gradients into the shards by default (DeepSpeed's
way at stages 2 and 3), so memory stays sharded between micro-steps. Trainer asks for DDP's
`no_sync` on all but the last micro-step through accelerate, which does nothing for a model it did
not wrap; `sync_each_micro_step=False` does it with `zerocompile.no_sync` instead: one reduction per
optimizer step for a full parameter and gradient per rank while the micro-steps run. The loss is
the same as DDP's up to the order of floating-point sums.

Mixed precision comes from the shard's `param_dtype` (FSDP's and DeepSpeed's bf16: fp32 master
shards, bf16 compute and all-gathers). `bf16=True` sets it when ZeroTrainer shards the model;
accelerate's autocast, which DDP's route uses, never sees a model it does not prepare.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

try:
    import accelerate  # noqa: F401  (Trainer's, imported here to name the extra when missing)
    from transformers import Trainer
    from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
except ImportError as error:
    raise ImportError(
        f'zerocompile.hf needs transformers and accelerate ({error.name} is missing): pip install "zerocompile[hf]"'
    ) from error

from zerocompile.accumulation import no_sync, reduce_gradients, replicated
from zerocompile.checkpoint import gathered_state_dict, load, save
from zerocompile.clipping import clip_grad_norm_
from zerocompile.config import ZeroConfig, config_from_kwargs
from zerocompile.distributed import init_distributed
from zerocompile.sharded_parameters import shard_info
from zerocompile.sharding import shard
from zerocompile.weights import save_weights

# A Trainer checkpoint's zerocompile part (model and optimizer shards, resharded on load), beside
# the Hugging Face weights that `from_pretrained` reads.
ZERO_CHECKPOINT = "zerocompile"


def is_sharded(model: nn.Module) -> bool:
    return any(shard_info(param) is not None for param in model.parameters())


class ZeroTrainer(Trainer):
    """`transformers.Trainer` training a zerocompile-sharded model.

    `zero_config`: the stage (0-3) or a `ZeroConfig` to shard an unsharded `model` with (default:
    stage 3); a model `zerocompile.shard()` or `zerocompile.from_pretrained()` already sharded is used
    as it is. `compile_options`: `torch.compile(..., options=)` of the zero backend (e.g.
    `{"compiler": "eager"}`). Every other argument is `Trainer`'s.

    `sync_each_micro_step`: with `gradient_accumulation_steps` > 1, whether every micro-step's
    backward reduces its gradients into the shards (True, the default: memory stays sharded, one
    reduction per micro-step) or the micro-steps of each optimizer step run inside one
    `zerocompile.no_sync` block and `zerocompile.reduce_gradients` reduces what they accumulated
    after the last (False: one all-gather of the parameters on entering the block and one
    reduction per optimizer step, DDP's bytes, for a full copy of every parameter and a full
    gradient per rank during the micro-steps; docs/finetune.md has the bytes per stage). Named
    after accelerate's `sync_each_batch`, which means the same for DDP but defaults the other way
    (ZeRO is chosen for memory) and is not read here; one setting for the run rather than FSDP2's
    `set_requires_gradient_sync` per micro-step, since Trainer, not the caller, runs the micro-steps.

    `sync_replicas_each_micro_step`: under hybrid sharding (`shard_size=`), False defers only
    the average across replicas, the traffic between nodes: each micro-step still reduce-scatters
    inside its shard group (memory stays sharded) and the replicas average the accumulated shards
    once per optimizer step (`zerocompile.no_sync(model, replicas_only=True)`).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: Any = None,
        *positional: Any,
        zero_config: int | ZeroConfig | None = None,
        compile_options: dict[str, Any] | None = None,
        sync_each_micro_step: bool = True,
        sync_replicas_each_micro_step: bool = True,
        **kwargs: Any,
    ) -> None:
        if not sync_each_micro_step and not sync_replicas_each_micro_step:
            raise ValueError(
                "sync_each_micro_step=False already defers every reduction, the replicas' average "
                "included: drop sync_replicas_each_micro_step=False (or keep it alone to defer only that)"
            )
        if model is None:
            raise ValueError("ZeroTrainer needs `model=`: model_init (a new model per trial) is not supported")
        sharded = is_sharded(model)
        if sharded and zero_config is not None:
            raise ValueError(
                "the model is already sharded (by zerocompile.shard or zerocompile.from_pretrained): drop "
                "ZeroTrainer's zero_config=, or pass the unsharded model and let ZeroTrainer shard it"
            )
        if not sync_replicas_each_micro_step:
            if sharded:
                hybrid = replicated(model.parameters())
            else:
                hybrid = isinstance(zero_config, ZeroConfig) and zero_config.shard_size is not None
            if not hybrid:
                raise ValueError(
                    "sync_replicas_each_micro_step=False defers hybrid sharding's average across replicas, "
                    "and this model has no replicas: shard it with shard_size= (ZeroConfig(shard_size=...)), "
                    "or use sync_each_micro_step=False to defer every reduction"
                )
        if args is not None:
            _check_arguments(args, model, sharded)
        super().__init__(model, args, *positional, **kwargs)
        # A run without a launcher trains as one rank (accelerate starts no group for one process).
        init_distributed(device=self.args.device)
        if not sharded:
            config = zero_config if isinstance(zero_config, ZeroConfig) else ZeroConfig(stage=3 if zero_config is None else zero_config)
            if self.args.bf16 and config.param_dtype is None:
                config = config_from_kwargs(config, None, {"param_dtype": torch.bfloat16})
            shard(self.model, config)
        self._compile_options = dict(compile_options or {})
        self._compiled: nn.Module | None = None
        self.sync_each_micro_step = sync_each_micro_step
        self.sync_replicas_each_micro_step = sync_replicas_each_micro_step
        # The open `no_sync` block of the current optimizer step's micro-steps, if any.
        self._unsynced_micro_steps: contextlib.ExitStack | None = None

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """The compiled sharded model, for training and evaluation alike: accelerate then leaves it
        unwrapped (no DDP), as it leaves a model DeepSpeed or FSDP already wrapped."""
        if self._compiled is None:
            self._compiled = torch.compile(self.model, backend="zero", options=self._compile_options)
        return self._compiled

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`; a `no_sync` block left open by an error or a stop between micro-steps is
        closed on the way out, so its copies of the parameters cannot outlive a later `load`."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self._end_unsynced_micro_steps()

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Trainer's micro-step; with `sync_each_micro_step=False` and accumulation, the micro-steps
        of an optimizer step share one `zerocompile.no_sync` block (one gather of the parameters,
        not one per micro-step), and after the last one's backward their gradients are reduced
        once (`zerocompile.reduce_gradients`)."""
        every_step = self.sync_each_micro_step and self.sync_replicas_each_micro_step
        if every_step or self.args.gradient_accumulation_steps == 1:
            return super().training_step(model, inputs, num_items_in_batch)
        if self._unsynced_micro_steps is None:
            self._unsynced_micro_steps = contextlib.ExitStack()
            self._unsynced_micro_steps.enter_context(no_sync(self.model, replicas_only=self.sync_each_micro_step))
        loss = super().training_step(model, inputs, num_items_in_batch)
        # Trainer sets it before each micro-step: True on the one its optimizer step follows.
        if self.accelerator.sync_gradients:
            # Every micro-step in the block, then one blocking reduction, rather than the last
            # micro-step after the block on its kept copies (its reduction overlapped with its
            # backward): the docs' medium Llama, 2 ranks, accumulation 4 (2026-12-02), the same
            # tokens/s (695 against 684) at 1295 against 1643 MiB later-step peak RSS.
            self._end_unsynced_micro_steps()
            reduce_gradients(self.model)
        return loss

    def _end_unsynced_micro_steps(self) -> None:
        if self._unsynced_micro_steps is not None:
            block, self._unsynced_micro_steps = self._unsynced_micro_steps, None
            block.close()

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            grad_norm = clip_grad_norm_(self.model, float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model in the Hugging Face layout; every rank must call it (it gathers)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _is_peft(self.model):
            adapter = trainable_state_dict(self.model)  # rank 0's, whole; the others' is empty
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                self.model.save_pretrained(output_dir, state_dict=adapter)
        else:
            save_weights(self.model, output_dir)
            if self.args.should_save:
                self.model.config.save_pretrained(output_dir)
                if getattr(self.model, "generation_config", None) is not None and self.model.can_generate():
                    self.model.generation_config.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """A PEFT model's checkpoints hold its adapter and the adapter's state alone: resuming builds
        the base from its files again (`zerocompile.from_pretrained(path, lora=...)`)."""
        save(os.path.join(output_dir, ZERO_CHECKPOINT), self.model, self._inner_optimizer(), trainable_only=_is_peft(self.model))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The weights come back with the optimizer's state in `_load_optimizer_and_scheduler`, once
        Trainer has built the optimizer: here only that the checkpoint has them."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ZERO_CHECKPOINT)):
            raise ValueError(
                f"{resume_from_checkpoint} has no '{ZERO_CHECKPOINT}' directory: ZeroTrainer resumes from "
                "checkpoints it wrote (save_only_model=False). To start from weights alone, load them into "
                "the model (zerocompile.from_pretrained or zerocompile.load_weights) and train without "
                "resume_from_checkpoint"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load(os.path.join(checkpoint, ZERO_CHECKPOINT), self.model, self._inner_optimizer())
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        """accelerate's wrapper hides the optimizer zerocompile's checkpoints read and write."""
        return getattr(self.optimizer, "optimizer", self.optimizer)


def _check_arguments(args: Any, model: nn.Module, sharded: bool) -> None:
    """What Trainer's DDP route does through accelerate's wrapping of the model, which ZeroTrainer
    bypasses: refused with the setting that does it here, before anything is built."""
    if args.fp16:
        raise ValueError(
            "ZeroTrainer does not take fp16=True (a loss-scaled fp16 autocast): use bf16=True, which "
            "shards the model with param_dtype=torch.bfloat16 (fp32 master shards, bf16 compute)"
        )
    if args.bf16 and sharded and _param_dtype(model) is None:
        raise ValueError(
            "bf16=True, but the model was sharded without param_dtype, so it would train in fp32: shard it "
            "with param_dtype=torch.bfloat16 (zerocompile.from_pretrained(..., param_dtype=torch.bfloat16)) "
            "or pass it unsharded and let ZeroTrainer shard it"
        )
    if args.torch_compile:
        raise ValueError(
            "ZeroTrainer compiles the model itself with backend='zero': drop torch_compile=True "
            "(Inductor options go to ZeroTrainer(compile_options=...))"
        )


def _param_dtype(model: nn.Module) -> torch.dtype | None:
    for param in model.parameters():
        if (info := shard_info(param)) is not None:
            return info.config.param_dtype
    return None


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters (a LoRA adapter), whole, on rank 0 ({} elsewhere): gathered one at a
    time, never the frozen base. Collective."""
    return gathered_state_dict(model, lambda param: param, rank0_only=True, cpu=True, only=lambda param: param.requires_grad)
