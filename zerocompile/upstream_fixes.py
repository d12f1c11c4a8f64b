"""Workarounds for torch 2.13 bugs that make our graphs compute wrong values.

**Inductor's C++ loop split drops iterations.** `CppScheduling.try_loop_split` rewrites a loop
whose indexing divides the loop variable by a constant d > 8 into `range // d` outer by `d` inner
iterations; when the range is not a multiple of d, the `range % d` iterations left over are never
run and their outputs stay uninitialised memory. In plain torch:
`torch.compile(lambda a, s: (a * s).view(256)[:80] + 1)` with `a` [2, 2, 64] and `s` [2, 2, 1]
computes 64 of its 80 outputs. int8 dequantisation is exactly this pattern (one scale per block of
64 elements, a shard that is not whole blocks): the uneven MLP trained with `gather_quant="int8"`
at stage 3 on 2 ranks under Inductor had a first loss of 0.082 against the eager compiler's 0.026.
No upstream issue was found (the issues corpus, searched 2026-11-26); the code is in
torch/_inductor/codegen/cpp.py, `loop_split` inside `try_loop_split`, in 2.13.0.

The fix keeps the loop as it was whenever the split would change its number of iterations; a split
that keeps them all is left alone, so correct code is generated exactly as before. It applies to
every C++ kernel Inductor generates in the process once installed, since the backward's kernels are
generated after our backend has returned (which only ever turns wrong code into right code). On
CUDA, Triton kernels do not go through this function.
"""

from __future__ import annotations

import functools
from typing import Any

_MARK = "_zerocompile_keeps_every_iteration"


def keep_every_iteration_of_split_loops() -> None:
    """Install the loop-split fix (idempotent)."""
    from torch._inductor.codegen.cpp import CppScheduling

    original = CppScheduling.try_loop_split
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def try_loop_split(self: CppScheduling, nodes: list[Any]) -> list[Any]:
        before = [(node, node.snapshot_loop_state(), _iterations(node)) for node in nodes]
        split = original(self, nodes)
        if all(_iterations(node) == iterations for node, _state, iterations in before):
            return split
        for node, state, _iterations_before in reversed(before):
            node.restore_loop_state(state)
        return nodes

    setattr(try_loop_split, _MARK, True)
    CppScheduling.try_loop_split = try_loop_split


def _iterations(node: Any) -> Any:
    from torch._inductor.utils import sympy_product

    return sympy_product(node.get_ranges()[0])
