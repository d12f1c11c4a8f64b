"""The heap trimmer: every `TRIM_EVERY` optimizer steps while a model sharded on a CPU group lives.

What it buys is measured, not tested (RSS depends on the machine): `zerocompile soak
--compare-ddp` reports each step's peak for stage 3 and DDP+compile; README "Limits" has the run.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import zerocompile as zc
from zerocompile import heap


@pytest.fixture
def counted_trimmer(monkeypatch: pytest.MonkeyPatch):
    """The process's trimmer replaced by one that counts instead of trimming."""
    trimmer = heap.HeapTrimmer(trim=lambda: None)
    monkeypatch.setattr(heap, "_trimmer", trimmer)
    yield trimmer
    trimmer.close()


def _steps(model: nn.Module, count: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(count):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_trims_every_tenth_step_while_the_sharded_model_lives(single_rank, counted_trimmer) -> None:
    model = zc.shard(nn.Linear(4, 4), stage=3)
    _steps(model, 2 * heap.TRIM_EVERY - 1)
    assert counted_trimmer.trims == 1
    _steps(model, 1)
    assert counted_trimmer.trims == 2
    del model
    gc.collect()
    _steps(nn.Linear(4, 4), heap.TRIM_EVERY)  # a plain model's optimizer: nothing to trim for
    assert counted_trimmer.trims == 2


def test_trim_heap_false_leaves_the_heap_alone(single_rank, counted_trimmer) -> None:
    model = zc.shard(nn.Linear(4, 4), stage=3, trim_heap=False)
    _steps(model, heap.TRIM_EVERY)
    assert counted_trimmer.trims == 0


def test_trim_heap_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="trim_heap must be True or False"):
        zc.ZeroConfig(trim_heap="yes")
