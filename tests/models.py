"""The models the tests train: the parity suite's (MODELS), each exercising one thing sharding can
get wrong, and the others several test files share; and the batches they train on."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from zerocompile.tools.gpt import GPT, SIZES


class Linears(nn.Module):
    """Linear layers, named and sized (inputs, outputs) by keyword, made in that order (the order
    they draw their initial values from the seed in); a subclass says how its forward uses them."""

    def __init__(self, **shapes: tuple[int, int]) -> None:
        super().__init__()
        for name, (inputs, outputs) in shapes.items():
            self.add_module(name, nn.Linear(inputs, outputs))


class UnevenMLP(Linears):
    """(a) No parameter size divisible by 2 or 4: every shard is padded. With `loss=False` it
    returns its outputs instead of a loss (inference tests compare those)."""

    def __init__(self, loss: bool = True) -> None:
        super().__init__(fc1=(7, 13), fc2=(13, 11), fc3=(11, 3))
        self.loss = loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))
        return out.square().mean() if self.loss else out


class TiedGPT(nn.Module):
    """(b) GPT with tied input/output embeddings, LayerNorm and causal attention."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(SIZES["tiny"])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx[:, :-1], idx[:, 1:])


class FrozenAndBuffer(nn.Module):
    """(c) A frozen submodule (no gradient traffic) and a registered buffer (replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 10)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(10, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.head(torch.relu(self.frozen(x)) * self.scale)).mean()


class GraphBreak(Linears):
    """(d) A graph break between layers: two Dynamo graphs, each sharded on its own."""

    def __init__(self) -> None:
        super().__init__(first=(9, 14), second=(14, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.sigmoid(self.first(x))
        torch._dynamo.graph_break()
        return self.second(hidden).square().mean()


class ReusedWeight(Linears):
    """(e) One parameter used twice in a forward: gathered once, gradients summed, reduced once."""

    def __init__(self) -> None:
        super().__init__(square=(10, 10), out=(10, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.square(torch.tanh(self.square(x)))).abs().mean()


class CheckpointedMLP(nn.Module):
    """Residual MLP blocks, each under torch.utils.checkpoint: the backward recomputes them. Few
    kernels, so Inductor compiles it quickly (the checkpointed GPT is GPTConfig's switch)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(7, 12), nn.Tanh(), nn.Linear(12, 7)) for _ in range(3))
        self.head = nn.Linear(7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x).square().mean()


class BatchNormMLP(nn.Module):
    """A linear layer, BatchNorm (its running statistics are buffers), `activation` and a linear
    head; the output's mean square is the loss."""

    def __init__(self, features: int, hidden: int, outputs: int, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.body = nn.Linear(features, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, outputs)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.activation(self.norm(self.body(x)))).square().mean()


class ComputesIn(nn.Module):
    """DDP's twin of `zc.shard(module, param_dtype=dtype)`: fp32 master parameters cast to `dtype`
    once per forward, floating inputs cast to `dtype` (shard()'s input hook), compute in `dtype`."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = {fqn: p.to(self.dtype) for fqn, p in self.module.named_parameters()}
        return torch.func.functional_call(self.module, weights, (x.to(self.dtype),))


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update, as LoRA adapters do."""

    def __init__(self, features: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, features) / features**0.5)
        # Not zero (LoRA's usual start), so the adapters' first gradients are not zero either.
        self.lora_b = nn.Parameter(torch.randn(features, rank) / rank**0.5 * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoRAMLP(nn.Module):
    """(f) A frozen base (~197k parameters) with trainable adapters (~6k): only they reduce."""

    def __init__(self, features: int = 256, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear(features) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


# The parity suite's models (test_parity); LoRAMLP has its own tests (test_frozen).
MODELS = {
    "uneven_mlp": UnevenMLP,
    "tied_gpt": TiedGPT,
    "frozen_buffer": FrozenAndBuffer,
    "graph_break": GraphBreak,
    "reused_weight": ReusedWeight,
}

_INPUT_FEATURES = {"uneven_mlp": 7, "frozen_buffer": 6, "graph_break": 9, "reused_weight": 10, "lora_mlp": 256}


def global_batch(name: str, step: int, batch: int = 8) -> torch.Tensor:
    """The same global batch on every rank (each trains on its slice), fixed by step."""
    generator = torch.Generator().manual_seed(1000 + step)
    if name == "tied_gpt":
        return torch.randint(0, 256, (batch, 17), generator=generator)
    return torch.randn(batch, _INPUT_FEATURES[name], generator=generator)


def local_batch(name: str, step: int, rank: int, world_size: int, batch: int = 8) -> torch.Tensor:
    return global_batch(name, step, batch).chunk(world_size)[rank]

