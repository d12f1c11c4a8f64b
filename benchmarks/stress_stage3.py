"""Launch stage-3 training again and again and count the launches that die (aborts, signals).

Issue 39 saw a stage-3 rank die mid-backward with glibc's "malloc(): unaligned tcache chunk
detected" in about 1 of 6 short launches while a process-wide CPU allocator of ours was installed.
This counts how often any rank of a launch fails: `--launches` launches of `--steps` steps each,
on 2 gloo ranks (a GPT of tools/gpt.py, AdamW, random tokens), with the Inductor or the eager
compiler and the ranks' malloc of `--allocator`.

    python -m benchmarks.stress_stage3 --launches 20 --steps 20 --compiler inductor
    python -m benchmarks.stress_stage3 --launches 1 --steps 2000 --compiler eager

Run from the repository root (the ranks import this module). Prints one line per launch and a summary line; --out writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from zerocompile.tools import spawn
from zerocompile.tools.gpt import SIZES

PROGRESS_EVERY = 100  # steps between rank 0's progress lines


def _train(rank: int, size: str, layers: int | None, steps: int, compiler: str, batch: int) -> dict:
    import dataclasses

    import torch

    import zerocompile as zc
    from zerocompile.tools.gpt import GPT

    zc.init_distributed()
    config = SIZES[size] if layers is None else dataclasses.replace(SIZES[size], n_layer=layers)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    zc.shard(model, stage=3, init=GPT._init_weights)
    compiled = torch.compile(model, backend="zero", options={"compiler": compiler})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        x = torch.randint(config.vocab_size, (batch, config.block_size + 1), generator=tokens)
        loss = compiled(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and step % PROGRESS_EVERY == 0:  # a long launch says how far it got
            print(f"  step {step}/{steps}, loss {float(loss.detach()):.4f}", flush=True)
    return {"loss": float(loss.detach())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    parser.add_argument("--model-size", choices=sorted(SIZES), default="50m")
    parser.add_argument("--layers", type=int, default=4, help="blocks (default 4: 50m's width, ~25M parameters)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch before it counts as hung")
    parser.add_argument("--out", type=Path, default=None)
    spawn.add_allocator_argument(parser)
    args = parser.parse_args()
    preload = spawn.find_allocator(args.allocator)
    print(spawn.allocator_line(preload), flush=True)
    outcomes = []
    for launch in range(args.launches):
        started = time.monotonic()
        try:
            results = spawn.spawn_ranks(
                _train, 2, (args.model_size, args.layers, args.steps, args.compiler, args.batch_size),
                preload=preload, timeout=args.timeout,
            )  # fmt: skip
            outcome = {"ok": True, "loss": results[0]["loss"]}
        except (spawn.RanksFailed, TimeoutError) as failure:
            outcome = {"ok": False, "error": str(failure)[-4000:]}
        outcome["seconds"] = round(time.monotonic() - started, 1)
        outcomes.append(outcome)
        detail = f"loss {outcome['loss']:.4f}" if outcome["ok"] else "\n" + outcome["error"]
        print(f"launch {launch + 1}/{args.launches}: {'ok' if outcome['ok'] else 'FAILED'} in {outcome['seconds']} s, {detail}", flush=True)
    failed = sum(not outcome["ok"] for outcome in outcomes)
    print(
        f"{args.launches - failed} of {args.launches} launches of {args.steps} steps ran through, {failed} failed "
        f"(stage 3, 2 ranks, {args.model_size} with {args.layers} layers, {args.compiler}, {spawn.allocator_line(preload)})"
    )
    if args.out is not None:
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out), "preload": preload}, "launches": outcomes}, indent=1))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    # The ranks import `_train` by its module's name, which `python -m` hides as __main__.
    from benchmarks.stress_stage3 import main as main_of_the_module

    main_of_the_module()
