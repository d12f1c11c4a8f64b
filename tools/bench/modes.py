"""The catalogue of what `zerocompile bench` compares: each mode (DDP, FSDP2, ZeroRedundancyOptimizer,
plain torch.compile, DeepSpeed's ZeRO, zerocompile's stages and settings) as a way to wrap a freshly seeded GPT and
make its optimizers, and the mode names the flags take."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import zerocompile as zc
from zerocompile.hybrid import ranks_per_node
from zerocompile.tools.arguments import names_from
from zerocompile.tools.bench.deepspeed_modes import DEEPSPEED_MODES, DeepSpeedStep, build_engine
from zerocompile.tools.bench.deepspeed_modes import held_bytes as deepspeed_held_bytes
from zerocompile.tools.bench.settings import Settings
from zerocompile.tools.gpt import GPT

LEARNING_RATE = 3e-4
MUON_LEARNING_RATE = 0.02  # modded-nanogpt's


@dataclasses.dataclass
class Prepared:
    """A mode made ready to train: what to call per step, its optimizers, what it holds."""

    runner: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizers: list[torch.optim.Optimizer]
    state_bytes: Callable[[], dict[str, int]]
    # A mode whose backward and step are not `loss.backward()` and each optimizer's `step()`: a
    # DeepSpeed engine's (`deepspeed_modes.DeepSpeedStep`).
    engine: DeepSpeedStep | None = None

    def backward(self, loss: torch.Tensor) -> None:
        if self.engine is None:
            loss.backward()
        else:
            self.engine.backward(loss)

    def step(self) -> None:
        """The optimizer step; gradients are cleared before the next forward (`zero_grad`)."""
        if self.engine is None:
            for optimizer in self.optimizers:
                optimizer.step()
        else:
            self.engine.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of training the model; `build(model, optimizer)` wraps a freshly seeded GPT (in
    place if it likes) and makes its optimizers of kind `optimizer` (see `_optimizers`).

    `offload_of`: for a mode that keeps its optimizer state on disk, the mode it offloads (the same
    training with that state in memory). Its `build` takes the directory for the state as a third
    argument, and its optimizer phase is compared with that mode's (see summaries.py's offload figures)."""

    name: str
    build: Callable[..., Prepared]
    offload_of: str | None = None
    takes_settings: bool = False  # `build(model, settings)`: the whole run's settings (DeepSpeed's batch)

    def prepare(self, model: GPT, settings: Settings) -> Prepared:
        """`build` with what the run chose: the optimizer kind, and the offload directory of a mode
        with its state on disk."""
        if self.takes_settings:
            return self.build(model, settings)
        if self.offload_of is None:
            return self.build(model, settings.optimizer)
        return self.build(model, settings.optimizer, settings.offload_dir)


OPTIMIZERS = ("adamw", "muon")


def _is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """What Muon optimizes in modded-nanogpt's recipe: the blocks' 2-D weights."""
    return name.startswith("blocks.") and len(zc.full_shape(param)) == 2


def _optimizers(model: nn.Module, kind: str, muon: type[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """fp32 AdamW over every parameter; or ("muon") `muon` over the hidden matrices and AdamW over
    the embeddings, norms and biases."""
    if kind == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)]
    named = list(model.named_parameters())
    return [
        muon([p for n, p in named if _is_hidden_matrix(n, p)], lr=MUON_LEARNING_RATE),
        torch.optim.AdamW([p for n, p in named if not _is_hidden_matrix(n, p)], lr=LEARNING_RATE),
    ]


class _FullTensorMuon(zc.optim.Muon):
    """Muon on FSDP2's DTensor shards as users write it (torch has nothing built in): the
    elementwise parts on the local shards, as `zc.optim.Muon` does, and each update's
    `full_tensor()` all-gathered and orthogonalised on every rank, which keeps its own rows."""

    def _orthogonalise(self, updates: list[tuple[torch.Tensor, torch.Tensor, dict]]) -> list[torch.Tensor]:
        from torch.distributed.tensor import distribute_tensor
        from torch.optim._muon import _zeropower_via_newtonschulz

        return [
            distribute_tensor(
                _zeropower_via_newtonschulz(update.full_tensor(), group["ns_coefficients"], group["ns_steps"], group["eps"]),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            )
            for param, update, group in updates
        ]


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _held_bytes(model: nn.Module, optimizer_states: list[dict[Any, dict[str, Any]]]) -> dict[str, int]:
    """Local parameter, gradient and optimizer-state bytes, counted as zc.model_state_bytes does."""
    params = list({id(p): p for p in model.parameters()}.values())
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            _local_bytes(value)
            for optimizer_state in optimizer_states
            for state in optimizer_state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        ),
    }


def _plainly_held(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> Callable[[], dict[str, int]]:
    return lambda: _held_bytes(model, [optimizer.state for optimizer in optimizers])


def _ddp(compiled: bool) -> Callable[[GPT, str], Prepared]:
    def build(model: GPT, optimizer: str) -> Prepared:
        wrapped = DistributedDataParallel(model)
        optimizers = _optimizers(model, optimizer, torch.optim.Muon)
        runner = torch.compile(wrapped) if compiled else wrapped
        return Prepared(runner, optimizers, _plainly_held(model, optimizers))

    return build


def _plain_compile(backend: str, autocast_dtype: torch.dtype | None = None) -> Callable[[GPT, str], Prepared]:
    def build(model: GPT, optimizer: str) -> Prepared:
        optimizers = _optimizers(model, optimizer, torch.optim.Muon)
        compiled = torch.compile(model, backend=backend)
        runner = compiled if autocast_dtype is None else _under_autocast(compiled, autocast_dtype)
        return Prepared(runner, optimizers, _plainly_held(model, optimizers))

    return build


def _under_autocast(
    runner: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`runner` with its forward (and loss) under torch.autocast on the inputs' device; the
    backward, called on the loss afterwards, runs outside it as autocast prescribes."""

    def run(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(inputs.device.type, dtype=dtype):
            return runner(inputs, targets)

    return run


def _zero_redundancy(model: GPT, optimizer: str) -> Prepared:
    if optimizer != "adamw":
        raise ValueError(f"zero-redundancy runs AdamW only (ZeroRedundancyOptimizer partitions whole parameters), not {optimizer}")
    wrapped = DistributedDataParallel(model)
    redundancy = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=LEARNING_RATE)
    # `.optim` is the local AdamW over this rank's partition: the state it really holds.
    return Prepared(wrapped, [redundancy], lambda: _held_bytes(model, [redundancy.optim.state]))


def _fsdp2(
    compiled: bool, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), hybrid: bool = False
) -> Callable[[GPT, str], Prepared]:
    """FSDP2 over every rank; `hybrid`: HSDP, sharded inside each node and replicated across nodes
    (a 2-D mesh of the launcher's ranks per node), as zerocompile's shard_size="node"."""

    def build(model: GPT, optimizer: str) -> Prepared:
        device_type = next(model.parameters()).device.type
        if hybrid:
            per_node = ranks_per_node()
            shape = (dist.get_world_size() // per_node, per_node)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
            if compiled:
                # As torchtitan compiles FSDP2: each block on its own, FSDP2's hooks around it. The
                # whole model under torch.compile broke its graph at GPT.forward's loop over the
                # blocks and ran mostly eagerly.
                block.compile()
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        optimizers = _optimizers(model, optimizer, _FullTensorMuon)
        return Prepared(model, optimizers, _plainly_held(model, optimizers))

    return build


def _zero(stage: int, compiler: str = "inductor", **settings: Any) -> Callable[..., Prepared]:
    def build(model: GPT, optimizer: str, offload_dir: str | None = None) -> Prepared:
        """With `offload_dir`, the optimizers' state in files there (offload="disk")."""
        chosen = settings if offload_dir is None else {**settings, "offload": "disk", "offload_dir": offload_dir}
        if "offload" not in chosen:
            zc.shard(model, stage=stage, **chosen)
            optimizers = _optimizers(model, optimizer, zc.optim.Muon)
        else:
            # shard() lays out the offloaded state from the optimizers, so they come first: torch's
            # Muon, which shard() makes zerocompile's in place.
            optimizers = _optimizers(model, optimizer, torch.optim.Muon)
            zc.shard(model, stage=stage, optimizer=optimizers, **chosen)
        runner = torch.compile(model, backend="zero", options={"compiler": compiler})
        return Prepared(runner, optimizers, lambda: zc.model_state_bytes(model, optimizers))

    return build


def _deepspeed(name: str) -> Callable[[GPT, Settings], Prepared]:
    deepspeed_mode = DEEPSPEED_MODES[name]

    def build(model: GPT, settings: Settings) -> Prepared:
        if settings.optimizer != "adamw":
            raise ValueError(f"{name} runs AdamW only (DeepSpeed's ZeRO with Muon is not compared here), not {settings.optimizer}")
        (optimizer,) = _optimizers(model, "adamw", torch.optim.Muon)
        engine = build_engine(model, optimizer, deepspeed_mode, settings.batch_size // settings.ranks)
        stepper = DeepSpeedStep(engine)
        return Prepared(stepper.runner, [], lambda: deepspeed_held_bytes(engine), engine=stepper)

    return build


def _zero3_budget(share: float) -> Callable[[GPT, str], Prepared]:
    """Stage 3 with `memory_budget` this share of the model's gathered (fp32) bytes."""

    def build(model: GPT, optimizer: str) -> Prepared:
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        return _zero(3, memory_budget=int(full * share))(model, optimizer)

    return build


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in [
        Mode("ddp", _ddp(compiled=False)),
        Mode("ddp-compile", _ddp(compiled=True)),
        Mode("compile", _plain_compile("inductor")),
        Mode("zero-redundancy", _zero_redundancy),
        Mode("fsdp2", _fsdp2(compiled=False)),
        Mode("fsdp2-compile", _fsdp2(compiled=True)),
        *(Mode(f"zero{stage}", _zero(stage)) for stage in range(4)),
        *(Mode(f"zero{stage}-bf16", _zero(stage, param_dtype=torch.bfloat16)) for stage in range(4)),
        Mode("zero3-int8", _zero(3, gather_quant="int8", reduce_quant="int8")),
        Mode("zero2-int8", _zero(2, gather_quant="int8", reduce_quant="int8")),
        Mode("fsdp2-hsdp-compile", _fsdp2(compiled=True, hybrid=True)),
        Mode("zero3-hybrid", _zero(3, shard_size="node")),
        Mode("zero3-hybrid-int8", _zero(3, shard_size="node", reduce_quant="int8", quant_scope="cross_node")),
        Mode("zero3-hpz", _zero(3, secondary_shard_size="node")),
        Mode(
            "zero3-hpz-int8",
            _zero(3, secondary_shard_size="node", gather_quant="int8", reduce_quant="int8", quant_scope="cross_node"),
        ),
        Mode("zero3-budget", _zero3_budget(0.5)),
        Mode("zero3-keep", _zero3_budget(1.0)),
        Mode("compile-aot-eager", _plain_compile("aot_eager")),
        Mode("zero3-eager", _zero(3, compiler="eager")),
        Mode("zero3-offload", _zero(3), offload_of="zero3"),
        Mode("zero3-offload-cpu", _zero(3, offload="cpu")),
        Mode("compile-bf16", _plain_compile("inductor", autocast_dtype=torch.bfloat16)),
        # reduce_dtype: what zero3-bf16 reduces in (ZeroConfig.reduce_dtype None: the gradients' bf16).
        Mode(
            "fsdp2-compile-bf16",
            _fsdp2(compiled=True, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
        ),
        *(Mode(name, _deepspeed(name), takes_settings=True) for name in DEEPSPEED_MODES),
    ]
}


# --modes' names, comma-separated, each one of MODES.
mode_list = names_from(tuple(MODES), "mode(s)")


def interleave_list(text: str) -> list[str]:
    """--interleave's names: two or more different modes, or none ('none')."""
    if text.strip() == "none":
        return []
    names = mode_list(text)
    if len(names) < 2 or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"needs two or more different modes (or 'none'), got {text!r}")
    return names


def optimizer_description(kind: str) -> str:
    """The optimizers of kind `kind` as the summary names them, learning rates included."""
    if kind == "adamw":
        return f"fp32 AdamW(lr={LEARNING_RATE})"
    return f"fp32 Muon(lr={MUON_LEARNING_RATE}) for the blocks' matrices + AdamW(lr={LEARNING_RATE})"
