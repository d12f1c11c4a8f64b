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

The fix declines the split whenever it would change a loop's number of iterations: before
torch's `try_loop_split` runs, every division it could split on (an iteration variable divided by
an integer above 8, the conditions torch checks) is checked against that variable's range, and a
range that is not a whole number of divisors keeps the nodes as they are. A split that keeps every
iteration is left to torch, so correct code is generated exactly as before. Checking first rather
than undoing afterwards needs nothing but the loop bodies' sizes and indexing, which every torch
from 2.11 to 2.15 has (2.13's `snapshot_loop_state` does not exist in 2.11). Measured per version
by tests/test_upstream_fixes.py: 2.11.0 and 2.13.0 have the bug. It applies to every C++ kernel
Inductor generates in the process while installed, since the backward's kernels are generated after
our backend has returned (which only ever turns wrong code into right code); the backend installs
it while a sharded model lives, and the last one collected puts torch's method back
(`zerocompile.process_hooks`). On CUDA, Triton kernels do not go through this function.
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
        if any(_split_would_drop_iterations(node) for node in nodes):
            return nodes
        return original(self, nodes)

    setattr(try_loop_split, _MARK, True)
    CppScheduling.try_loop_split = try_loop_split


def remove_loop_split_fix() -> None:
    """Put torch's own `try_loop_split` back (idempotent)."""
    from torch._inductor.codegen.cpp import CppScheduling

    installed = CppScheduling.try_loop_split
    if getattr(installed, _MARK, False):
        CppScheduling.try_loop_split = installed.__wrapped__


def _split_would_drop_iterations(node: Any) -> bool:
    """Whether `node` divides an iteration variable by an integer above 8 (what torch may split
    on) whose range is not a whole number of that divisor (or not known to be)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    sizes_body = getattr(node.node, "get_default_sizes_body", None)
    if sizes_body is None:  # not a computed buffer: torch does not split it either
        return False
    (sizes, _reduction_sizes), body, _vars = sizes_body()
    ranges = dict(zip(body.iter_vars, sizes))
    for expr in body.indexing_exprs.values():
        if not isinstance(expr, sympy.Expr):
            continue
        for division in expr.find(FloorDiv):
            variable, divisor = division.args
            if variable in ranges and divisor.is_Integer and divisor > 8:
                if not (ranges[variable] % divisor == 0):
                    return True
    return False
