"""Workarounds for torch bugs (zerocompile/upstream_fixes.py): each still needed, each working.

The unfixed case runs in a process of its own, since the fix, once installed, holds for the whole
process. When torch fixes the bug, the first test fails: then the workaround can go.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from zerocompile.upstream_fixes import keep_every_iteration_of_split_loops, remove_loop_split_fix

pytestmark = pytest.mark.core


def dequantised(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One scale broadcast over each block of 64, then a cut that is not whole blocks: int8
    dequantisation of a shard of 80 elements has this shape."""
    return (codes * scales).view(256)[:80] + 1


def _compiled_error() -> float:
    torch._dynamo.reset()
    codes, scales = torch.randn(2, 2, 64), torch.randn(2, 2, 1)
    with torch._inductor.config.patch(fx_graph_cache=False):
        return (torch.compile(dequantised)(codes, scales) - dequantised(codes, scales)).abs().max().item()


def test_inductor_still_drops_the_iterations_a_loop_split_leaves_over() -> None:
    script = "\n".join(
        ["import torch", inspect.getsource(dequantised), inspect.getsource(_compiled_error), "print(_compiled_error())"]
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    error = float(result.stdout.split()[-1])
    assert not error <= 1e-6, f"torch {torch.__version__} computes the cut exactly: the loop-split fix can go"


def test_with_the_fix_every_element_is_computed() -> None:
    from torch._inductor.codegen.cpp import CppScheduling

    torch_split = CppScheduling.try_loop_split
    keep_every_iteration_of_split_loops()
    keep_every_iteration_of_split_loops()
    try:
        assert not hasattr(CppScheduling.try_loop_split.__wrapped__, "__wrapped__"), "installed twice"
        assert _compiled_error() <= 1e-6
    finally:
        remove_loop_split_fix()
        remove_loop_split_fix()
    assert CppScheduling.try_loop_split is torch_split
