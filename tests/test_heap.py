"""Heap trimming: glibc's free heap pages handed back every `TRIM_EVERY` steps of an optimizer that
holds a CPU model's shards; nothing for other optimizers, with `trim_heap=False`, or where another
allocator is preloaded.

What trimming buys is measured, not tested (RSS depends on the machine): `python -m benchmarks.soak
--compare-ddp` reports each step's RSS for stage 3 and DDP+compile.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import zerocompile as zc
from training import train
from zerocompile import heap, sharding
from zerocompile.tools import spawn


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, count: int) -> None:
    train(lambda x: model(x).square().mean(), optimizer, (torch.ones(4, 4) for _ in range(count)))


def test_trims_every_tenth_step_of_the_sharded_models_optimizer(single_rank, monkeypatch) -> None:
    if heap.glibc_malloc_trim() is None:  # e.g. the suite run under LD_PRELOAD of tcmalloc
        pytest.skip("this process does not allocate with glibc's malloc: nothing to trim")
    # Counted against what this worker's earlier tests left, not assumed empty.
    trimmers_before = len(sharding.WHILE_SHARDED.trimmers)
    model = zc.shard(nn.Linear(4, 4), stage=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, optimizer, 2 * heap.TRIM_EVERY - 1)
    trimmer = sharding.WHILE_SHARDED.trimmers[optimizer]
    assert trimmer.trims == 1
    _steps(model, optimizer, 1)
    assert trimmer.trims == 2
    plain = nn.Linear(4, 4)
    foreign = torch.optim.SGD(plain.parameters(), lr=0.1)
    _steps(plain, foreign, heap.TRIM_EVERY)
    assert foreign not in sharding.WHILE_SHARDED.trimmers
    del model, optimizer, trimmer
    gc.collect()
    # Its trimmer leaves with the optimizer (that the hooks leave with the last model is
    # test_process_hooks.py's, in a fresh interpreter where no other test's model lives).
    assert len(sharding.WHILE_SHARDED.trimmers) == trimmers_before


def test_trim_heap_false_leaves_the_heap_alone(single_rank) -> None:
    model = zc.shard(nn.Linear(4, 4), stage=3, trim_heap=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, optimizer, heap.TRIM_EVERY)
    assert optimizer not in sharding.WHILE_SHARDED.trimmers


# Skipped where neither is installed: the check needs a second malloc to preload, and CI installs
# tcmalloc (.ci/run) so it runs there.
@pytest.mark.skipif(spawn.find_allocator("auto") is None, reason="no tcmalloc/jemalloc installed to preload")
def test_nothing_to_trim_under_a_preloaded_allocator() -> None:
    library = spawn.find_allocator("auto")
    probe = "from zerocompile import heap; print(heap.glibc_malloc_trim() is None)"
    environment = {**os.environ, "LD_PRELOAD": library}
    preloaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=environment, timeout=120)
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})  # fmt: skip
    assert (preloaded.stdout.strip(), plain.stdout.strip()) == ("True", "False"), preloaded.stderr + plain.stderr


def test_trim_heap_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="trim_heap must be True or False"):
        zc.ZeroConfig(trim_heap="yes")
