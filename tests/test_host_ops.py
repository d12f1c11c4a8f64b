"""Per-bucket, not per-parameter: stage 3's host work per step against plain torch.compile's.

A GPU step of small kernels is bound by the host's calls, so every per-parameter op (a wait, a
cast, a copy) costs time plain torch.compile does not spend. Measured as `zerocompile bench`
reports it (`tools/dispatched.py`), by `benchmarks/host_ops.py` on a smaller GPT: one process as
rank 0 of a fake group of 8, which takes the layout a GPU's backend takes, a deep narrow GPT in
bf16, fused AdamW, one profiled step after warm-up. Stage 3's count may exceed plain compile's
only by a constant per collective: a bucket's pack (a cat and a cast), the collective, its wait
and the copy out of the gathered rows, with one to spare: `PER_COLLECTIVE` ops. (A gradient whose
shard is not a whole number of 16-element blocks is padded on its own, a fill and a copy: this
GPT's shards need no padding at 8 ranks, as a model of real widths.)
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.host_ops import measure
from zerocompile.tools.dispatched import count_kernel_like
from zerocompile.tools.gpt import GPTConfig

pytestmark = pytest.mark.fast

CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=128, block_size=32)
PER_COLLECTIVE = 6


def test_stage3_dispatches_plain_compiles_ops_plus_a_constant_per_collective(fake_eight_ranks):
    plain = measure("compile-bf16", CONFIG, batch=2)
    zero3 = measure("zero3-bf16", CONFIG, batch=2)
    collectives = zero3["collectives"]
    allowed = plain["ops"] + PER_COLLECTIVE * collectives
    assert 0 < collectives <= 6  # this GPT is a few buckets: forward gathers, backward re-gathers, reductions
    assert zero3["ops"] <= allowed, (
        f"stage 3 dispatches {zero3['ops']} ops a step, plain compile {plain['ops']} + {PER_COLLECTIVE} x "
        f"{collectives} collectives = {allowed}; most frequent: {zero3['top']}"
    )


def test_a_collective_counts_once_and_views_not_at_all():
    """The counting rule on a hand-made profile: a fake group's copies inside a collective and the
    views and allocations beneath an op are not host work of their own."""
    with torch.profiler.profile() as profile:
        x = torch.randn(8, 8)
        x.t().contiguous()  # a view, then one copy
        torch.mm(x, x)
        x.to(torch.bfloat16)  # aten::to -> _to_copy -> copy_: one
    counts = count_kernel_like(profile.events())
    assert counts["aten::copy_"] == 2 and counts["aten::mm"] == 1 and counts["aten::randn"] == 0
    assert "aten::t" not in counts and "aten::empty_strided" not in counts and "aten::to" not in counts
    assert counts["aten::normal_"] == 1  # randn's kernel
