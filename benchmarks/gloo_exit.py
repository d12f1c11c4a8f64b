"""A process that ends right after a gloo collective, launched again and again: how many abort.

The torch-only reduction of issue 56's exit abort ("terminate called without an active
exception", SIGABRT after every rank finished). Each rank runs a few functional all-gathers on
gloo and ends the script right after the last one's wait, in one of two ways:

  freed-first  Python frees the collective's input while gloo still holds it, as a compiled
               graph does at the tensor's last use: torch keeps its Python object alive, and the
               gloo worker that drops the last reference must take the GIL, which during
               interpreter shutdown ends the thread inside a noexcept destructor (abort).
  held         the same, with zerocompile's `await_gloo_release` after each wait
               (`passes/gloo_release.py`): Python frees the tensors only after gloo.

    python -m benchmarks.gloo_exit --launches 20
    python -m benchmarks.gloo_exit --cost --model-size 12m --steps 20

Each launch is `torchrun --nproc-per-node 2` of this module with output captured, as a user's
job script would run it. Prints one line per mode: launches, aborted launches.

--cost measures what holding costs a compiled stage-3 step instead: 2 spawned gloo ranks train
the bundled GPT under Inductor, and torch.profiler sums the time spent in await_gloo_release
over --steps steps (after 3 warm-up steps) beside those steps' wall time, in the same run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

MODES = ("freed-first", "held")
ABORT = "terminate called without an active exception"


def _rank(mode: str) -> None:
    import torch
    import torch.distributed as dist

    import zerocompile.passes.gloo_release  # noqa: F401  (registers zerocompile::await_gloo_release)

    dist.init_process_group("gloo")
    funcol = torch.ops._c10d_functional
    group, world_size = dist.group.WORLD.group_name, dist.get_world_size()
    for _ in range(3):
        sent = torch.randn(1 << 20)
        received = funcol.wait_tensor(funcol.all_gather_into_tensor(sent, world_size, group))
        if mode == "held":
            torch.ops.zerocompile.await_gloo_release([torch.empty(0, dtype=torch.uint8), sent, received])
        del sent, received
    # The script ends here, right after the last collective, as a training script may.


def _cost(rank: int, size: str, steps: int) -> dict:
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    import zerocompile as zc
    from zerocompile.tools.gpt import GPT, SIZES

    zc.init_distributed()
    config = SIZES[size]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    zc.shard(model, stage=3, init=GPT._init_weights)
    compiled = torch.compile(model, backend="zero")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.Generator().manual_seed(rank)

    def step() -> None:
        x = torch.randint(config.vocab_size, (4, config.block_size + 1), generator=tokens)
        compiled(x[:, :-1], x[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - started
    held = [event for event in profiled.key_averages() if event.key == "zerocompile::await_gloo_release"]
    return {"wall_s": wall, "held_s": sum(event.cpu_time_total for event in held) / 1e6, "calls": sum(event.count for event in held)}


def _launch(mode: str, port: int) -> tuple[int, bool]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(port), "-m", "benchmarks.gloo_exit", "--rank-mode", mode,
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return finished.returncode, ABORT in finished.stdout + finished.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20, help="launches per mode")
    parser.add_argument("--cost", action="store_true", help="measure what holding costs a stage-3 step")
    parser.add_argument("--model-size", default="12m", help="with --cost: the GPT size")
    parser.add_argument("--steps", type=int, default=20, help="with --cost: steps timed")
    parser.add_argument("--rank-mode", choices=MODES, help=argparse.SUPPRESS)  # what a launched rank runs
    args = parser.parse_args()
    if args.rank_mode is not None:
        _rank(args.rank_mode)
        return
    from zerocompile.tools.spawn import free_loopback_port, spawn_ranks

    if args.cost:
        for rank, result in enumerate(spawn_ranks(_cost, 2, (args.model_size, args.steps))):
            share = result["held_s"] / result["wall_s"]
            print(
                f"rank {rank}: {result['calls'] / args.steps:.0f} holds per step, {1000 * result['held_s'] / args.steps:.2f} ms "
                f"of {1000 * result['wall_s'] / args.steps:.1f} ms per step held ({100 * share:.2f} %)"
            )
        return

    for mode in MODES:
        outcomes = [_launch(mode, free_loopback_port()) for _ in range(args.launches)]
        failed = sum(code != 0 for code, _ in outcomes)
        aborted = sum(aborted for _, aborted in outcomes)
        print(f"{mode:12s} {args.launches} launches of 2 ranks: {failed} failed, {aborted} with '{ABORT}'", flush=True)


if __name__ == "__main__":
    # The ranks import `_cost` by its module's name, which `python -m` hides as __main__.
    from benchmarks.gloo_exit import main as main_of_the_module

    main_of_the_module()
