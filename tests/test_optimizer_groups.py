"""Optimizer groups by shape after `shard()`: nanoGPT's configure_optimizers (weight decay only on
parameters of two or more dimensions) trains like DDP written with `p.dim()` (the parameters are
DTensors of the full shape) or with `zc.full_shape`. (When parameters were flat 1-D shards, the
`p.dim()` variant decayed nothing and was 3.5e-2 off: tests/test_torch_habits.py checks the
groups themselves.)
"""

from __future__ import annotations

import torch
from torch import nn

import zerocompile as zc
from models import UnevenMLP, local_batch
from ranks import run_on_ranks
from training import train

STEPS = 3
# A decay this strong shrinks the 2-D weights by 10 % a step (AdamW's decoupled decay:
# p -= lr * weight_decay * p), so decaying the wrong parameters shows far above rounding.
LR, WEIGHT_DECAY = 1e-2, 10.0
TOLERANCE = 1e-5  # fp32 rounding of a few AdamW steps (test_parity's eager bound)


def _nanogpt_optimizer(model: nn.Module, dims) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if dims(p) >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if dims(p) < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR)


def _train(forward, optimizer: torch.optim.Optimizer, rank: int, world_size: int) -> None:
    train(forward, optimizer, (local_batch("uneven_mlp", step, rank, world_size) for step in range(STEPS)))


def decay_groups(rank: int, world_size: int) -> dict[str, float]:
    torch.manual_seed(0)
    reference = UnevenMLP()
    _train(nn.parallel.DistributedDataParallel(reference), _nanogpt_optimizer(reference, nn.Parameter.dim), rank, world_size)
    errors = {}
    for name, dims in (("full_shape", lambda p: len(zc.full_shape(p))), ("dim", nn.Parameter.dim)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = zc.shard(UnevenMLP(), stage=3)
        optimizer = _nanogpt_optimizer(model, dims)  # built after shard(): the habit that bites
        _train(torch.compile(model, backend="zero", options={"compiler": "eager"}), optimizer, rank, world_size)
        full = dict(reference.named_parameters())
        with zc.gathered(model):
            errors[name] = max((p.detach() - full[fqn].detach()).abs().max().item() for fqn, p in model.named_parameters())
    return errors


def test_groups_built_after_shard_by_dim_or_full_shape_train_like_ddp() -> None:
    errors = run_on_ranks(2, decay_groups)[0]
    assert errors["full_shape"] <= TOLERANCE, errors
    assert errors["dim"] <= TOLERANCE, errors  # p.dim() after shard() is the full parameter's


def test_full_shape_is_the_shape_before_shard(single_rank) -> None:
    model = nn.Linear(3, 5)
    zc.shard(model, stage=3)
    assert zc.full_shape(model._parameters["weight"]) == torch.Size([5, 3])
    assert zc.full_shape(nn.Parameter(torch.zeros(2, 7))) == torch.Size([2, 7])  # not sharded: its own
