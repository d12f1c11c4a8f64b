"""Host time of a sharded model's optimizer step and of its compilation, for two checkouts side by side.

One process, rank 0 of a fake process group of 2 (nothing sent), a deep narrow GPT at stage 3,
one thread. Compile time: the first forward and backward of `torch.compile(model, backend="zero")`
with the eager compiler (Dynamo, AOTAutograd and zerocompile's passes; Inductor's code generation
would get the same graphs from both checkouts, so it is left out). Step time: the median of
`optimizer.step()` over `--steps` training steps (zero_grad(set_to_none), forward, backward, step),
for fused and foreach AdamW, and of the whole training step. A GPU step of small kernels is bound
by this host time.

Run it from each checkout in turn, repeated, so both see the same machine:

    for i in 1 2 3; do for tree in ../before .; do (cd $tree && python -m benchmarks.step_host); done; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import zerocompile as zc
from zerocompile.tools.gpt import GPT, GPTConfig


def measure(config: GPTConfig, kind: str, steps: int, batch: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = zc.shard(GPT(config), stage=3)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **{kind: True})
    tokens = torch.randint(config.vocab_size, (batch, config.block_size + 1), generator=torch.Generator().manual_seed(0))
    step_times, iteration_times = [], []
    start = time.perf_counter()
    for step in range(steps + 3):
        begin_iteration = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        compiled(tokens[:, :-1], tokens[:, 1:]).backward()
        if step == 0:
            compile_s = time.perf_counter() - start
        begin = time.perf_counter()
        optimizer.step()
        if step >= 3:
            step_times.append(time.perf_counter() - begin)
            iteration_times.append(time.perf_counter() - begin_iteration)
    return {
        "compile_s": compile_s,
        "step_ms": statistics.median(step_times) * 1e3,
        "iteration_ms": statistics.median(iteration_times) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    config = GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(zc.__file__).parent)
    result = {"commit": commit.stdout.strip(), "torch": torch.__version__}
    for kind in ("fused", "foreach"):
        result[kind] = measure(config, kind, args.steps, args.batch)
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
