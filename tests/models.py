"""The models the parity tests train: each exercises one thing sharding can get wrong."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from zerocompile.tools.gpt import GPT, SIZES


class UnevenMLP(nn.Module):
    """(a) No parameter size divisible by 2 or 4: every shard is padded. With `loss=False` it
    returns its outputs instead of a loss (inference tests compare those)."""

    def __init__(self, loss: bool = True) -> None:
        super().__init__()
        self.loss = loss
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 11)
        self.fc3 = nn.Linear(11, 3)

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


class GraphBreak(nn.Module):
    """(d) A graph break between layers: two Dynamo graphs, each sharded on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(9, 14)
        self.second = nn.Linear(14, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.sigmoid(self.first(x))
        torch._dynamo.graph_break()
        return self.second(hidden).square().mean()


class ReusedWeight(nn.Module):
    """(e) One parameter used twice in a forward: gathered once, gradients summed, reduced once."""

    def __init__(self) -> None:
        super().__init__()
        self.square = nn.Linear(10, 10)
        self.out = nn.Linear(10, 1)

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


MODELS = {
    "uneven_mlp": UnevenMLP,
    "tied_gpt": TiedGPT,
    "frozen_buffer": FrozenAndBuffer,
    "graph_break": GraphBreak,
    "reused_weight": ReusedWeight,
}

_INPUT_FEATURES = {"uneven_mlp": 7, "frozen_buffer": 6, "graph_break": 9, "reused_weight": 10}


def global_batch(name: str, step: int, batch: int = 8) -> torch.Tensor:
    """The same global batch on every rank (each trains on its slice), fixed by step."""
    generator = torch.Generator().manual_seed(1000 + step)
    if name == "tied_gpt":
        return torch.randint(0, 256, (batch, 17), generator=generator)
    return torch.randn(batch, _INPUT_FEATURES[name], generator=generator)


def local_batch(name: str, step: int, rank: int, world_size: int, batch: int = 8) -> torch.Tensor:
    return global_batch(name, step, batch).chunk(world_size)[rank]
