"""DeepSpeed's ZeRO as `zerocompile bench` modes: the reference ZeRO, trained on the same GPT,
batches and AdamW as every other mode, in fp32 or (`-bf16`) as `zero3-bf16` trains.

DeepSpeed is a peer for the benchmark only (`pip install "zerocompile[peers]"`), imported when one
of its modes is built; on CPU ranks it needs `DS_ACCELERATOR=cpu` in the ranks' environment, which
`zerocompile bench` sets for the processes it starts (`rank_environment`). The engine joins the
process group the bench already started (gloo here). Settings that differ from DeepSpeed's
defaults, and why (`deepspeed_config`):

- `gradient_clipping` 0 (off): its default 1.0 clips where no other mode does (losses drift apart
  from the first step whose gradient norm passes 1);
- `train_micro_batch_size_per_gpu` the bench's rows per rank, `gradient_accumulation_steps` 1:
  DeepSpeed requires them to add up to the global batch;
- fp16 and bf16 off (the bench trains in fp32) and the client's torch AdamW, so every mode steps
  the same optimizer, where DeepSpeed's "optimizer" section would build its own Adam;
- `-bf16` modes: bf16 on, so the forward and backward run in bf16 over fp32 partitions stepped by
  the same AdamW, and `communication_data_type` bf16 (its default under bf16, written out): the
  gradients reduced in bf16 as `zero3-bf16`'s are (ZeroConfig.reduce_dtype None).

`-compile` modes call `engine.compile()` (torch.compile on the engine's module; DeepSpeed's hooks
stay outside the graphs). `deepcompile` modes turn on DeepCompile (`"compile": {"deepcompile":
true}`, DeepSpeed's compiler passes for ZeRO-3), which runs on CUDA only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from zerocompile.tools.gpt import GPT


class DeepSpeedMode(NamedTuple):
    """A DeepSpeed bench mode: its ZeRO stage, how it compiles (None: eager, "compile":
    `engine.compile()`, "deepcompile": DeepCompile) and whether it computes in bf16."""

    stage: int
    variant: str | None = None
    bf16: bool = False


# The stages and variants `zerocompile bench` offers, by mode name.
DEEPSPEED_MODES = {
    "deepspeed1": DeepSpeedMode(1),
    "deepspeed2": DeepSpeedMode(2),
    "deepspeed3": DeepSpeedMode(3),
    "deepspeed2-compile": DeepSpeedMode(2, "compile"),
    "deepspeed3-compile": DeepSpeedMode(3, "compile"),
    "deepspeed3-deepcompile": DeepSpeedMode(3, "deepcompile"),
    # Beside zero3-bf16 on a GPU (benchmarks/gpu_visit.py), where users run DeepSpeed in bf16.
    "deepspeed3-bf16": DeepSpeedMode(3, None, bf16=True),
    "deepspeed3-compile-bf16": DeepSpeedMode(3, "compile", bf16=True),
    "deepspeed3-deepcompile-bf16": DeepSpeedMode(3, "deepcompile", bf16=True),
}
INSTALL_HINT = 'pip install "zerocompile[peers]" (DeepSpeed 0.19)'


def deepspeed_config(mode: DeepSpeedMode, rows_per_rank: int) -> dict[str, Any]:
    """The DeepSpeed configuration of a bench mode (see the module docstring for each setting)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": rows_per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": mode.stage},
        "fp16": {"enabled": False},
        "bf16": {"enabled": mode.bf16},
    }
    if mode.bf16:
        config["communication_data_type"] = "bf16"
    if mode.variant == "deepcompile":
        config["compile"] = {"deepcompile": True}
    return config


# What bench.json's method says of the DeepSpeed modes, where a run has one.
DEEPSPEED_METHOD = (
    "DeepSpeed 0.19's engine (deepspeed.initialize) on the bench's process group, its ZeRO stage as named; "
    "unlike its defaults: gradient_clipping 0 (its 1.0 clips where no other mode does), the client's torch "
    "AdamW at the other modes' learning rate (not DeepSpeed's Adam), fp16/bf16 off (fp32 as every mode; -bf16: "
    "bf16 on and communication_data_type bf16, as zero3-bf16 computes and reduces), "
    "train_micro_batch_size_per_gpu = the rows per rank; DS_ACCELERATOR=cpu on CPU ranks; -compile: "
    "engine.compile(); state: the storages of its partitions, gradients and AdamW state, each once"
)


def accelerator_environment(device: torch.device | None) -> dict[str, str]:
    """What DeepSpeed's ranks need in their environment to train on `device` (None: the machine's
    default, a GPU if there is one): on the CPU, its CPU accelerator rather than its guess."""
    on_cpu = (device is None and not torch.cuda.is_available()) or (device is not None and device.type == "cpu")
    return {"DS_ACCELERATOR": "cpu"} if on_cpu else {}


def rank_environment(modes: list[str], device: torch.device | None) -> dict[str, str]:
    """What the ranks' environment needs for `modes`: DeepSpeed's accelerator where one is DeepSpeed's."""
    return accelerator_environment(device) if any(name in DEEPSPEED_MODES for name in modes) else {}


class DeepSpeedStep:
    """The engine's forward, backward and step as the bench's step calls them: `runner` returns the
    loss, `backward(loss)` is `engine.backward`, `step()` `engine.step()` (which clears the
    gradients too)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def runner(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.engine(inputs, targets)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


def build_engine(model: GPT, optimizer: torch.optim.Optimizer, mode: DeepSpeedMode, rows_per_rank: int) -> Any:
    """`deepspeed.initialize` on `model` with the bench's `optimizer`; refuses what cannot run,
    naming why, before DeepSpeed is imported."""
    device = next(model.parameters()).device
    if mode.variant == "deepcompile" and device.type != "cuda":
        raise RuntimeError(f"DeepCompile runs on CUDA only; the model is on {device}")
    try:
        import deepspeed
    except ImportError as error:
        raise RuntimeError(f"DeepSpeed is not installed ({error}): {INSTALL_HINT}") from error
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(mode, rows_per_rank))
    if mode.variant is not None:  # DeepCompile too runs only once `engine.compile()` is called
        engine.compile()
    return engine


def held_bytes(engine: Any) -> dict[str, int]:
    """Bytes of the tensors DeepSpeed holds for the model on this rank, each storage once:
    parameters (their ZeRO-3 partitions, and the fp32 partitions the optimizer steps), their
    gradients, and the inner optimizer's state."""
    seen: set[int] = set()

    def size(tensors: list[torch.Tensor | None]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    module: nn.Module = engine.module
    params = [getattr(p, "ds_tensor", p) for p in module.parameters()]
    zero = engine.optimizer
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        params += list(getattr(zero, name, []) or [])
    inner = getattr(zero, "optimizer", zero)
    state = [value for entry in inner.state.values() for value in entry.values() if isinstance(value, torch.Tensor) and value.dim() > 0]
    return {"params": size(params), "grads": size([p.grad for p in params]), "optimizer": size(state)}
