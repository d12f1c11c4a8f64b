"""Pretrained weights into shards without init: `zc.from_pretrained` against reading the files alone,
and against the old route (meta build, `shard(init=model._init_weights)`, then `load_weights`).

A Llama of Φ = 110M (hidden 768, 12 layers, 12 heads, vocab 32000, intermediate 2048, tied
embeddings, fp32) written by `save_pretrained` into several files; 2 gloo ranks, stage 3. Each
round starts fresh ranks for each route. In the new route's ranks, `--repeats` times: the time to
read each rank's bytes of the files alone (`weights.file_readers`, the reads `from_pretrained`
makes), then `zc.from_pretrained(dir, stage=3)` timed (its peak measured the first time), both
kept alive so each repeat writes into memory fresh from the system; then one training step
(eager compiler, AdamW). `from_pretrained` over the reads before it is what loading costs beyond
reading; the step is reported beside it (compile dominates it). In the old route's ranks:
the build, the init of every tensor and `load_weights`, timed and measured the same way. Peak: the
rise of VmHWM (reset by `clear_refs`) over VmRSS before, against this rank's shards + the largest
module's full parameters + 64 MB. Before the clock starts, each rank has imported what the route
imports (a tiny Llama built on meta and sharded).

    python -m benchmarks.load_without_init --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from zerocompile.tools import spawn

MB = 2**20
SLACK = 64 * MB
LLAMA = dict(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=12, max_position_embeddings=512, tie_word_embeddings=True,
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="fresh ranks per route and round")
    parser.add_argument("--repeats", type=int, default=3, help="reads and from_pretrained calls per new-route rank")
    parser.add_argument("--max-shard-size", default="150MB", help="save_pretrained's, so the model spans several files")
    spawn.add_allocator_argument(parser)


def run(args: argparse.Namespace) -> int:
    preload = spawn.find_allocator(args.allocator)
    print(spawn.allocator_line(preload), flush=True)
    with tempfile.TemporaryDirectory() as directory:
        files = _save_pretrained(directory, args.max_shard_size)
        print(f"Φ = {files['phi'] / 1e6:.1f}M in {files['files']} files", flush=True)
        rounds = []
        for _ in range(args.rounds):
            new = spawn.spawn_ranks(_new_route, 2, (directory, args.repeats), preload=preload, timeout=1800)
            old = spawn.spawn_ranks(_old_route, 2, (directory,), preload=preload, timeout=1800)
            rounds.append({"new": new, "old": old})
            for rank, (new_rank, old_rank) in enumerate(zip(new, old)):
                print(_round_line(len(rounds), rank, new_rank, old_rank), flush=True)
    print(_summary(rounds), flush=True)
    print(json.dumps(rounds))
    return 0 if all(r["rise"] <= _bound(r) for one in rounds for r in one["new"]) else 1


def _save_pretrained(directory: str, max_shard_size: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    phi = sum(p.numel() for p in model.parameters())
    return {"phi": phi, "files": len(list(Path(directory).glob("*.safetensors")))}


def _warm_up() -> None:
    """Import what the routes import, so that their clocks do not count it: a tiny Llama built on
    meta and sharded."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import zerocompile as zc

    tiny = LlamaConfig(**{**LLAMA, "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "num_key_value_heads": 2})  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny)
    zc.shard(model, stage=3, init=model._init_weights)


class _Clock:
    """Time and peak RSS from `start()`: the peak as the rise of VmHWM over VmRSS at the start."""

    def start(self) -> None:
        from zerocompile.tools.measuring import reset_peak_rss, status_bytes

        self.rss_before = status_bytes("VmRSS")
        if not reset_peak_rss():
            raise RuntimeError("the kernel refused to reset VmHWM (/proc/self/clear_refs): peaks cannot be measured")
        self.started = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def rise(self) -> int:
        from zerocompile.tools.measuring import status_bytes

        return status_bytes("VmHWM") - self.rss_before


def _new_route(rank: int, path: str, repeats: int) -> dict:
    import zerocompile as zc

    zc.init_distributed()
    _warm_up()
    clock, reads, loads, alive = _Clock(), [], [], []
    for repeat in range(repeats):
        read_s, kept = _read_alone(path, rank)
        clock.start()
        model = zc.from_pretrained(path, stage=3)
        loads.append(clock.seconds())
        reads.append(read_s)
        if repeat == 0:  # later repeats start above the earlier ones' memory
            rise = clock.rise()
        # Kept: each repeat reads and loads into memory fresh from the system, as the first does.
        alive.append((kept, model))
    clock.start()
    _one_step(model)
    return {"load_s": loads, "read_s": reads, "step_s": clock.seconds(), "rise": rise, **_sizes(model)}


def _old_route(rank: int, path: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import zerocompile as zc

    zc.init_distributed()
    _warm_up()
    clock = _Clock()
    clock.start()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    zc.shard(model, stage=3, init=model._init_weights)
    init_s = clock.seconds()
    zc.load_weights(model, path)
    return {"init_s": init_s, "load_s": clock.seconds(), "rise": clock.rise(), **_sizes(model)}


def _one_step(model) -> None:
    import torch

    model.train()
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, LLAMA["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(0))
    compiled(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _read_alone(path: str, rank: int) -> tuple[float, list]:
    """Seconds to read this rank's part of every tensor the files hold, with the reads
    `from_pretrained` makes (stage 3's shard sizes), and the tensors read: kept alive, so that
    `from_pretrained`, measured next, also reads into memory fresh from the system, not into
    pages these reads freed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerocompile.passes.stages import stage_policy
    from zerocompile.weights import file_readers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    readers = file_readers(model, path)  # the header and shape checks, untimed: reads only below
    policy, world_size = stage_policy(3), torch.distributed.get_world_size()
    started = time.perf_counter()
    kept = [
        read(policy.local_numel(tuple(tensor.shape), world_size) if isinstance(tensor, torch.nn.Parameter) else None, rank, torch.device("cpu"))
        for tensor, read in readers.items()
    ]
    return time.perf_counter() - started, kept


def _sizes(model) -> dict:
    """This rank's shards, and the largest module's full parameters (what the walk holds at once)."""
    import zerocompile as zc

    distinct = {id(p): p for p in model.parameters()}.values()
    largest = max(
        sum(zc.full_shape(p).numel() * p.element_size() for p in module.parameters(recurse=False))
        for module in model.modules()
    )
    return {"shards": sum(p.numel() * p.element_size() for p in distinct), "largest": largest}


def _bound(report: dict) -> int:
    return report["shards"] + report["largest"] + SLACK


def _round_line(number: int, rank: int, n: dict, o: dict) -> str:
    """One rank's round: the new route's load and read times and peak, beside the old route's."""
    ratios = ", ".join(f"{load / read:.2f}" for load, read in zip(n["load_s"], n["read_s"]))
    return (
        f"round {number} rank {rank}: from_pretrained {_listed(n['load_s'])} s, reading alone {_listed(n['read_s'])} s "
        f"(ratios {ratios}), then the first step {n['step_s']:.1f} s; peak rise {n['rise'] / MB:.0f} MB against "
        f"{_bound(n) / MB:.0f} MB (shards {n['shards'] / MB:.0f} + largest module {n['largest'] / MB:.0f} + 64) | "
        f"old route {o['load_s']:.2f} s (init {o['init_s']:.2f} s), peak rise {o['rise'] / MB:.0f} MB"
    )


def _listed(seconds: list[float]) -> str:
    return "/".join(f"{s:.2f}" for s in seconds)


def _summary(rounds: list[dict]) -> str:
    """The medians over every round and rank, with the quartiles of the load-to-read ratio."""
    new = [r for one in rounds for r in one["new"]]
    old = [r for one in rounds for r in one["old"]]
    loads = [load for r in new for load in r["load_s"]]
    ratios = [load / read for r in new for load, read in zip(r["load_s"], r["read_s"])]
    return (
        f"medians over {len(rounds)} round(s) x 2 ranks: from_pretrained {statistics.median(loads):.2f} s, reading alone "
        f"{statistics.median(read for r in new for read in r['read_s']):.2f} s, ratio {statistics.median(ratios):.2f} "
        f"(quartiles {_quartiles(ratios)}; target <= 1.2); from_pretrained + first step "
        f"{statistics.median(r['load_s'][-1] + r['step_s'] for r in new):.1f} s; old route "
        f"{statistics.median(r['load_s'] for r in old):.2f} s (init {statistics.median(r['init_s'] for r in old):.2f} s); "
        f"peak rise {statistics.median(r['rise'] for r in new) / MB:.0f} MB against {_bound(new[0]) / MB:.0f} MB "
        f"(old route {statistics.median(r['rise'] for r in old) / MB:.0f} MB)"
    )


def _quartiles(values: list[float]) -> str:
    if len(values) < 2:
        return "-"
    low, _median, high = statistics.quantiles(values, n=4)
    return f"{low:.2f}-{high:.2f}"


if __name__ == "__main__":
    import sys

    from benchmarks import harness

    sys.exit(harness.main("benchmarks.load_without_init"))
