"""A small GPT (nanoGPT-shaped): token + position embeddings, pre-LayerNorm blocks with causal
self-attention, and an output head tied to the token embedding. Used by the main job, the
benchmarks and the tests."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    # Recompute each block in the backward (torch.utils.checkpoint, non-reentrant) instead of
    # saving its activations.
    activation_checkpointing: bool = False


SIZES = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32),
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "12m": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=128),
    # Benchmark and capacity sizes (Φ = 50.1M, 201.9M, 394.0M, 926.1M, 1209.4M): build them on the
    # meta device and let zerocompile.shard(..., init=GPT._init_weights) materialise the shards.
    "50m": GPTConfig(n_layer=8, n_head=8, n_embd=720, block_size=128),
    "200m": GPTConfig(n_layer=16, n_head=16, n_embd=1024, block_size=128),
    "400m": GPTConfig(n_layer=20, n_head=20, n_embd=1280, block_size=128),
    "1b": GPTConfig(n_layer=24, n_head=14, n_embd=1792, block_size=128),
    # GPT-3 XL's shape (1.3B parameters with its 50k-token vocabulary, 1.21B with bytes): the size
    # `zerocompile bench --fake-ranks 8` compares stage 3 with FSDP2 at on one GPU.
    "1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=128),
    # Φ = 2.01B: 32 GB of fp32 AdamW training state, more than this 24 GiB machine holds
    # (benchmarks.offload_capacity trains it with the optimizer state on disk).
    "2b": GPTConfig(n_layer=40, n_head=16, n_embd=2048, block_size=128),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, time, channels))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.out = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embedding
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """Every parameter's initial value (what `zerocompile.shard(..., init=GPT._init_weights)`
        runs on a model built on the meta device, where nothing else gives them one)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when `targets` is given."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.config.activation_checkpointing else block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
