"""Host work per step, per bucket or per parameter: kernel-like ops dispatched by one training step.

One process, rank 0 of a fake process group of `--ranks` (the layout a GPU backend takes, nothing
sent), a deep narrow GPT in bf16, fused AdamW, one step under torch.profiler after two warm-up
steps, counted by `zerocompile.tools.dispatched` (what `zerocompile bench` reports as ops/step):
bench's compile-bf16, zero3-bf16 and fsdp2-compile-bf16 modes. A GPU step of small kernels is
bound by these calls.

    python -m benchmarks.host_ops --layers 24 --width 128
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import zerocompile as zc
from zerocompile.passes import analysis
from zerocompile.tools.bench.modes import MODES as BENCH_MODES
from zerocompile.tools.dispatched import dispatched_per_step, kernel_profiling
from zerocompile.tools.gpt import GPT, GPTConfig

MODES = ("compile-bf16", "zero3-bf16", "fsdp2-compile-bf16")


def measure(mode: str, config: GPTConfig, batch: int) -> dict:
    """`mode` as `zerocompile bench` builds it, stepped with fused AdamW instead of bench's."""
    torch.manual_seed(0)
    model = GPT(config)
    forward = BENCH_MODES[mode].build(model, "adamw").runner
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tokens = torch.randint(config.vocab_size, (batch, config.block_size + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        forward(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()

    with kernel_profiling(), zc.record_graphs() as graphs:
        step()
        step()
    counted = dispatched_per_step(step, torch.device("cpu"))
    counted["collectives"] = sum(len(analysis.collectives(graph.graph)) for graph in graphs)
    torch._dynamo.reset()
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="sequences on this rank")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.ranks)
    config = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=128)
    results = collections.OrderedDict((mode, measure(mode, config, args.batch)) for mode in args.modes.split(","))
    plain = results.get("compile-bf16", {}).get("ops")
    for mode, counted in results.items():
        ratio = f"{counted['ops'] / plain:.2f}x compile-bf16" if plain else ""
        print(f"{mode:20s} {counted['ops']:6d} ops/step  {ratio}  collectives {counted['collectives']}  top {counted['top'][:5]}")
    print(json.dumps({mode: {k: v for k, v in r.items() if k != "top"} for mode, r in results.items()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
