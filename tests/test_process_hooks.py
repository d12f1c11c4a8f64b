"""zerocompile's process-wide hooks live exactly as long as a sharded model, and run nothing for
optimizers that hold no sharded parameter."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import torch
from torch import nn

import zerocompile as zc
from zerocompile import accumulation, sharding

# A fresh interpreter: torch's global hook dicts before zerocompile is imported are the baseline.
_LIFETIME = textwrap.dedent(
    """
    import gc, os, sys
    import torch
    from torch import nn
    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as torch_optimizer

    def global_hooks():
        return {
            f"{where.__name__}.{name}": list(table)
            for where in (torch_module, torch_optimizer)
            for name, table in vars(where).items()
            if name.startswith("_global_") and isinstance(table, dict)
        }

    before = global_hooks()
    from torch._inductor.codegen.cpp import CppScheduling
    torch_split = CppScheduling.try_loop_split
    import zerocompile as zc
    assert global_hooks() == before, "importing zerocompile installed a hook"
    zc.init_distributed()
    torch.manual_seed(0)
    model = zc.shard(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), stage=3)
    compiled = torch.compile(model, backend="zero", options={"compiler": COMPILER})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        compiled(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert global_hooks() != before, "no hook while a sharded model lives: this test proves nothing"
    patched = CppScheduling.try_loop_split is not torch_split
    assert patched == (COMPILER == "inductor"), "the loop-split fix goes with Inductor compiles only"
    del model, compiled, optimizer
    gc.collect()
    assert global_hooks() == before, f"left behind: {global_hooks()} (before: {before})"
    assert CppScheduling.try_loop_split is torch_split, "Inductor's loop split is still patched"

    package = os.path.dirname(zc.__file__)
    ours = []
    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            ours.append(frame.f_code.co_name)
    plain = nn.Linear(8, 2)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.randn(4, 8)).sum().backward()
    sys.setprofile(profile)
    sgd.step()
    sys.setprofile(None)
    assert not ours, f"zerocompile code ran in an unrelated optimizer's step: {ours}"
    print("ok")
    """
)


def _run_lifetime(compiler: str) -> None:
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("RANK", "WORLD_SIZE", "SLURM"))}
    done = subprocess.run(
        [sys.executable, "-c", f"COMPILER = {compiler!r}\n" + _LIFETIME],
        capture_output=True, text=True, timeout=300, env=environment,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_hooks_leave_with_the_last_sharded_model_eager_compiler() -> None:
    _run_lifetime("eager")


def test_hooks_leave_with_the_last_sharded_model_inductor() -> None:
    _run_lifetime("inductor")


def _calls_of_ours(step) -> list[str]:
    """Names of zerocompile functions called during `step()`."""
    package = os.path.dirname(zc.__file__)
    calls: list[str] = []

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def test_an_optimizer_without_sharded_parameters_runs_no_check(single_rank) -> None:
    torch.manual_seed(0)
    model = zc.shard(nn.Linear(8, 8), stage=3)
    ours = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = nn.Linear(8, 8)
    foreign = torch.optim.SGD(plain.parameters(), lr=0.1)
    checks = {sharding._check_optimizer_state.__name__, accumulation.check_nothing_pending.__name__}
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()
        plain(torch.randn(2, 8)).sum().backward()
        assert checks <= set(_calls_of_ours(ours.step)), "the sharded model's optimizer went unchecked"
        # While a sharded model lives, torch calls the one global pre-hook for every optimizer;
        # for this one it is a weak-dictionary lookup (the first step also sorts it).
        assert not checks & set(_calls_of_ours(foreign.step))
    assert foreign not in sharding.WHILE_SHARDED.trimmers
    del model, ours
    gc.collect()
    assert _calls_of_ours(foreign.step) == []
