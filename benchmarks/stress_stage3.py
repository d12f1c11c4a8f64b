"""Launch ZeRO training again and again and count the launches that die (aborts, signals).

`--launches` launches of `--steps` steps each on `--ranks` gloo ranks (a GPT of tools/gpt.py,
AdamW, random tokens) at `--stage`, with the Inductor or the eager compiler, and reports the
crashes per 1,000 rank-steps beside the count. What can be switched, one at a time, to find a
crash's cause by elimination:

  --allocator      the ranks' malloc: tcmalloc, jemalloc, system (glibc), or glibc-check (glibc
                   with MALLOC_CHECK_=3 and its debugging library preloaded: a corrupted heap is
                   reported at the free that finds it)
  --no-buffer-reuse  Inductor's allow_buffer_reuse=False (a buffer reused while a collective
                   still reads or writes it would show as a difference here)
  --threads N      torch's intra-op threads in each rank
  --prefetch 0     no all-gather issued ahead of its use
  --launcher       spawn: ranks that leave through os._exit once every rank is done (the tests'
                   way; no interpreter shutdown); torchrun: `torchrun` run by `subprocess.run(...,
                   capture_output=True)` as a user's job script, each rank ending its script
                   normally, which is where issue 56's exit abort happened
  --dump-graphs DIR  every graph before and after each pass (ZeroConfig.dump_dir), per launch

Ranks started by `spawn` print every thread's Python stack on a fatal signal (faulthandler).

    python -m benchmarks.stress_stage3 --launches 200 --steps 30
    python -m benchmarks.stress_stage3 --launches 1 --steps 2000 --ranks 2 --compiler eager --timeout 7200
    python -m benchmarks.stress_stage3 --launches 100 --steps 5 --launcher torchrun --model-size tiny

Run from the repository root (the ranks import this module). Prints one line per launch and a
summary line; --out writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zerocompile.tools import spawn
from zerocompile.tools.gpt import SIZES

PROGRESS_EVERY = 100  # steps between rank 0's progress lines
EXIT_ABORT = "terminate called without an active exception"
GLIBC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"  # glibc >= 2.34 keeps MALLOC_CHECK_ there


def _train(rank: int, settings: dict[str, Any]) -> dict:
    import dataclasses

    import torch
    import torch._inductor.config

    import zerocompile as zc
    from zerocompile.tools.gpt import GPT

    zc.init_distributed()
    if settings["threads"] is not None:
        torch.set_num_threads(settings["threads"])
    config = SIZES[settings["model_size"]]
    if settings["layers"] is not None:
        config = dataclasses.replace(config, n_layer=settings["layers"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    zc.shard(model, stage=settings["stage"], init=GPT._init_weights, prefetch=settings["prefetch"])
    options = {"compiler": settings["compiler"]} | ({"dump_dir": settings["dump_graphs"]} if settings["dump_graphs"] else {})
    compiled = torch.compile(model, backend="zero", options=options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.Generator().manual_seed(rank)
    with torch._inductor.config.patch(allow_buffer_reuse=not settings["no_buffer_reuse"]):
        for step in range(1, settings["steps"] + 1):
            x = torch.randint(config.vocab_size, (settings["batch_size"], config.block_size + 1), generator=tokens)
            loss = compiled(x[:, :-1], x[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % PROGRESS_EVERY == 0:  # a long launch says how far it got
                print(f"  step {step}/{settings['steps']}, loss {float(loss.detach()):.4f}", flush=True)
    return {"loss": float(loss.detach())}


def _environment(allocator: str) -> tuple[dict[str, str], str | None]:
    """Variables for the ranks and the library they preload for `--allocator`."""
    if allocator == "glibc-check":
        if not Path(GLIBC_DEBUG).is_file():
            raise SystemExit(f"--allocator glibc-check: {GLIBC_DEBUG} is not installed (glibc >= 2.34 ships it)")
        return {"MALLOC_CHECK_": "3"}, GLIBC_DEBUG
    return {}, spawn.find_allocator(allocator)


def _launch_spawned(settings: dict[str, Any], variables: dict[str, str], preload: str | None, timeout: float) -> dict:
    try:
        results = spawn.spawn_ranks(_train, settings["ranks"], (settings,), env=variables, preload=preload, timeout=timeout)
        return {"ok": True, "loss": results[0]["loss"]}
    except (spawn.RanksFailed, TimeoutError) as failure:
        return {"ok": False, "error": str(failure)[-4000:]}


def _launch_torchrun(settings: dict[str, Any], variables: dict[str, str], preload: str | None, timeout: float) -> dict:
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={settings['ranks']}",
        "--master-addr=127.0.0.1", f"--master-port={spawn.free_loopback_port()}",
        "-m", "benchmarks.stress_stage3", "--rank-settings", json.dumps(settings),
    ]  # fmt: skip
    environment = spawn.child_environment({**variables, "GLOO_SOCKET_IFNAME": "lo"}, preload)
    try:
        finished = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"still running after {timeout:.0f} s"}
    output = finished.stdout + finished.stderr
    if finished.returncode == 0:
        return {"ok": True, "loss": float(output.split("final loss ")[-1].split()[0])}
    return {"ok": False, "exit_abort": EXIT_ABORT in output, "error": output[-4000:]}


def _rank_main(settings: dict[str, Any]) -> None:
    """A rank torchrun started: train, say the loss, and end the script as a user's would."""
    import os

    result = _train(int(os.environ["RANK"]), settings)
    if os.environ["RANK"] == "0":
        print(f"final loss {result['loss']:.6f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--stage", type=int, choices=(2, 3), default=3)
    parser.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    parser.add_argument("--model-size", choices=sorted(SIZES), default="small")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: the size's)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each rank")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--no-buffer-reuse", action="store_true", help="Inductor's allow_buffer_reuse=False")
    parser.add_argument("--dump-graphs", default=None, help="directory for every graph before/after each pass")
    parser.add_argument("--launcher", choices=("spawn", "torchrun"), default="spawn")
    parser.add_argument(
        "--timeout", type=float, default=1800.0,
        help="seconds per launch before it counts as hung (a 2000-step launch beside other work on 2 cores needs ~7200)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--allocator", choices=(*spawn.ALLOCATOR_CHOICES, "glibc-check"), default="auto",
        help="the ranks' malloc (see above); auto: tcmalloc, else jemalloc, where installed",
    )  # fmt: skip
    parser.add_argument("--rank-settings", help=argparse.SUPPRESS)  # what a rank torchrun started runs
    args = parser.parse_args()
    if args.rank_settings is not None:
        _rank_main(json.loads(args.rank_settings))
        return
    settings = {
        key: getattr(args, key)
        for key in ("steps", "ranks", "stage", "compiler", "model_size", "layers", "batch_size", "threads", "prefetch", "no_buffer_reuse", "dump_graphs")
    }  # fmt: skip
    variables, preload = _environment(args.allocator)
    described = f"{args.allocator} malloc" + (f" ({preload})" if preload else "")
    print(f"ranks use {described}", flush=True)
    launch = _launch_torchrun if args.launcher == "torchrun" else _launch_spawned
    outcomes = []
    for number in range(1, args.launches + 1):
        started = time.monotonic()
        outcome = launch(settings, variables, preload, args.timeout)
        outcome["seconds"] = round(time.monotonic() - started, 1)
        outcomes.append(outcome)
        detail = f"loss {outcome['loss']:.4f}" if outcome["ok"] else "\n" + outcome["error"]
        print(f"launch {number}/{args.launches}: {'ok' if outcome['ok'] else 'FAILED'} in {outcome['seconds']} s, {detail}", flush=True)
    failed = sum(not outcome["ok"] for outcome in outcomes)
    rank_steps = args.launches * args.ranks * args.steps
    print(
        f"{args.launches - failed} of {args.launches} launches of {args.steps} steps ran through, {failed} failed: "
        f"{1000 * failed / rank_steps:.2f} crashes per 1,000 rank-steps ({rank_steps} rank-steps; stage {args.stage}, "
        f"{args.ranks} ranks, {args.model_size}, {args.compiler}, {described}, launched by {args.launcher})"
    )
    if args.out is not None:
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out), "preload": preload}, "launches": outcomes}, indent=1))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    # The ranks import `_train` by its module's name, which `python -m` hides as __main__.
    from benchmarks.stress_stage3 import main as main_of_the_module

    main_of_the_module()
