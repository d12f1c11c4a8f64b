"""Soak test: a long steady-state run that must neither recompile nor grow in memory.

Trains the bundled GPT with ZeRO (default stage 3) on CPU ranks it spawns (gloo on 127.0.0.1), or
as the rank torchrun/srun started, for --steps optimizer steps, and reports for every rank:

  recompiles   frames Dynamo converted after step 2 (torch._dynamo.utils.counters["frames"]
               ["total"], which counts every cache miss: a first compile or a recompile). Steps 1-2
               may compile (the first forward, then guards on gradients and optimizer state that
               the first step creates); a steady state compiles nothing after them.
  RSS          VmRSS at step --rss-from (default 100, when allocator pools and caches have warmed
               up) and at the last step, and the growth between them in percent: a leak of
               anything kept per step (graph records, dump records, cached collectives) shows
               here.
  steps/s      optimizer steps per second after step 2 (compiling excluded).

With --allocations one more step runs after the last under torch.profiler, and the table lists
rank 0's allocations of at least 64 KiB in it by the op that made them (`benchmarks/allocations.py`):
the per-step churn that fragments a CPU heap, for each mode.

With --compare-ddp the same run (model, seed, batches, steps) is then trained again with
DDP+compile (`torch.compile(DistributedDataParallel(model))`, default Inductor) in freshly spawned
ranks, and the table shows both modes per rank: under glibc's default allocator RSS also grows
from heap fragmentation, and DDP+compile is the reference for how much of that is torch's own.

Prints a table and writes JSON (--out). The exit status is 1 when any rank recompiled after
step 2 or grew more than --max-rss-growth percent, so the command can gate a CI job (the
comparison run is reported, not judged).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.utils
import torch._inductor.config
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import zerocompile as zc
from zerocompile import torch_support
from zerocompile.distributed import launcher_environment, leave_process_group
from zerocompile.tools.arguments import positive_int
from zerocompile.tools import spawn
from benchmarks.allocations import allocation_census, format_census
from zerocompile.tools.gpt import GPT, SIZES
from zerocompile.tools.measuring import reset_peak_rss, status_bytes
from zerocompile.tools.train import GlobalBatches, load_text

MB = 1e6
# Steps that may compile: the first traces the model, the second sees the gradients and the
# optimizer state the first created.
COMPILING_STEPS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m benchmarks.soak`."""
    parser.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps (default 1000)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3, help="ZeRO stage (default 3)")
    parser.add_argument(
        "--ranks", type=positive_int, default=2, help="CPU ranks to spawn (default 2; ignored under torchrun/srun)"
    )
    parser.add_argument("--model-size", choices=sorted(SIZES), default="tiny", help="GPT size (default tiny)")
    parser.add_argument(
        "--batch-size", type=positive_int, default=8, help="sequences per global batch, split over the ranks (default 8)"
    )
    parser.add_argument(
        "--compiler",
        choices=("inductor", "eager"),
        default="inductor",
        help="inductor generates code (what a real run uses); eager runs the rewritten graphs op by op",
    )
    parser.add_argument(
        "--rss-from",
        type=positive_int,
        default=100,
        help="step whose RSS is the baseline of the growth (default 100; must be before --steps)",
    )
    parser.add_argument(
        "--max-rss-growth",
        type=float,
        default=2.0,
        help="percent of RSS growth from --rss-from to the last step above which the soak fails (default 2)",
    )
    parser.add_argument(
        "--rss-every", type=positive_int, default=50, help="also record RSS every this many steps, for the JSON"
    )
    parser.add_argument(
        "--compare-ddp",
        action="store_true",
        help="then run DDP+compile the same way in fresh ranks and report both modes' RSS per rank "
        "(spawned ranks only)",
    )
    parser.add_argument(
        "--allocations",
        action="store_true",
        help="after the last step, profile one more and list its allocations of >= 64 KiB by op (rank 0, each mode)",
    )
    parser.add_argument("--out", type=Path, default=Path("soak.json"), help="JSON results (default ./soak.json)")


def run(args: argparse.Namespace) -> int:
    """`python -m benchmarks.soak`: 0 when every rank stayed within the limits, 1 otherwise."""
    if args.rss_from >= args.steps:
        raise SystemExit(f"python -m benchmarks.soak: --rss-from {args.rss_from} must be before the last step {args.steps}")
    results = soak(args)
    if results is None:  # a rank other than torchrun's rank 0: rank 0 reports
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(format_table(results), flush=True)
    print(f"results: {args.out}", flush=True)
    return 0 if results["passed"] else 1


def soak(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the soak; the results on the process that reports (see `summarise`), None on the others.

    Under torchrun or srun this process is one rank of theirs; otherwise it spawns --ranks
    processes and waits for them.
    """
    if launcher_environment() is not None:
        if args.compare_ddp:
            raise SystemExit("python -m benchmarks.soak: --compare-ddp spawns its own ranks; run it without torchrun/srun")
        results = _soak_this_rank(args, ZERO)
        leave_process_group()
        return results
    results = _spawn(args, ZERO)
    if args.compare_ddp:
        compared = _spawn(args, DDP_COMPILE)
        results["compare"] = {
            "mode": DDP_COMPILE,
            **{key: compared[key] for key in ("rss_growth_percent", "steps_per_second", "per_rank")},
        }
    return results


def _spawn(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Run `mode` in --ranks freshly spawned processes; the summarised results. They run on the C
    library's malloc, nothing preloaded: the soak bounds glibc's RSS growth (see the docstring)."""
    return spawn.spawn_ranks(_spawned_rank, args.ranks, (args, mode), preload=None)[0]


def _spawned_rank(rank: int, args: argparse.Namespace, mode: str) -> dict[str, Any] | None:
    # The ranks share this machine's cores; more threads than cores makes every rank slower.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.ranks))
    return _soak_this_rank(args, mode)


def _soak_this_rank(args: argparse.Namespace, mode: str) -> dict[str, Any] | None:
    """The soak loop of one rank, its process group started here; rank 0 gets the results."""
    # One compile worker per rank: the ranks already keep every core busy.
    torch._inductor.config.compile_threads = 1
    rank, world_size = zc.init_distributed()
    measured = _measure(args, rank, world_size, mode)
    per_rank: list[dict[str, Any]] = [{}] * world_size
    dist.all_gather_object(per_rank, measured)
    return summarise(args, world_size, per_rank) if rank == 0 else None


# The modes a soak trains: ours (--stage, --compiler), and DDP+compile for --compare-ddp.
ZERO, DDP_COMPILE = "zero", "ddp-compile"


def _measure(args: argparse.Namespace, rank: int, world_size: int, mode: str = ZERO) -> dict[str, Any]:
    """Train --steps steps of `mode` on this rank; its compile counts, RSS samples and timings."""
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the {world_size} ranks")
    config = SIZES[args.model_size]
    torch.manual_seed(0)
    model = GPT(config)
    if mode == DDP_COMPILE:
        wrapped = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
        compiled = torch.compile(wrapped)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        zc.shard(model, stage=args.stage)
        compiled = torch.compile(model, backend="zero", options={"compiler": args.compiler})
    batches = GlobalBatches(load_text(), args.batch_size, config.block_size, seed=0)
    rows = args.batch_size // world_size
    mine = slice(rank * rows, (rank + 1) * rows)

    frames = torch._dynamo.utils.counters["frames"]
    rss_samples: dict[int, int] = {}
    step_peaks: dict[int, int] = {}
    frames_after_compiling = graphs_after_compiling = 0
    start = steady_start = time.perf_counter()

    def train_step() -> float:
        inputs, targets = batches.next(mine)
        loss = compiled(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()  # waits for the step: RSS and time are taken after it

    with zc.record_graphs() as graphs:  # the graphs lowered: a recompile adds some
        for step in range(1, args.steps + 1):
            if step in (args.rss_from, args.steps):
                if not reset_peak_rss():
                    raise RuntimeError("/proc/self/clear_refs refused: the soak cannot take the peak of one step")
            loss_value = train_step()
            if step == COMPILING_STEPS:
                frames_after_compiling, graphs_after_compiling = frames["total"], len(graphs)
                steady_start = time.perf_counter()
            if step in (args.rss_from, args.steps):
                step_peaks[step] = status_bytes("VmHWM")
            if step in (args.rss_from, args.steps) or step % args.rss_every == 0:
                rss_samples[step] = status_bytes("VmRSS")
    end = time.perf_counter()
    steady_steps = args.steps - COMPILING_STEPS
    census = allocation_census(train_step) if args.allocations else None
    return {
        "rank": rank,
        "mode": mode,
        "frames_compiled": frames["total"],
        "recompiles_after_step_2": frames["total"] - frames_after_compiling,
        "zero_graphs_lowered": len(graphs),
        "zero_graphs_lowered_after_step_2": len(graphs) - graphs_after_compiling,
        "rss_bytes": {str(step): rss for step, rss in sorted(rss_samples.items())},
        "rss_from_bytes": rss_samples[args.rss_from],
        "rss_last_bytes": rss_samples[args.steps],
        "rss_growth_percent": 100.0 * (rss_samples[args.steps] / rss_samples[args.rss_from] - 1.0),
        "step_peak_from_bytes": step_peaks[args.rss_from],
        "step_peak_last_bytes": step_peaks[args.steps],
        "step_peak_growth_percent": 100.0 * (step_peaks[args.steps] / step_peaks[args.rss_from] - 1.0),
        "seconds": end - start,
        "steps_per_second": steady_steps / (end - steady_start) if steady_steps > 0 else None,
        "last_loss": loss_value,
        "allocations": census,
    }


def summarise(args: argparse.Namespace, world_size: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON of a soak: its settings, every rank's measurements, and the worst rank's numbers."""
    recompiles = max(r["recompiles_after_step_2"] for r in per_rank)
    growth = max(r["rss_growth_percent"] for r in per_rank)
    steady = [r["steps_per_second"] for r in per_rank if r["steps_per_second"] is not None]
    return {
        "settings": {
            "steps": args.steps,
            "stage": args.stage,
            "ranks": world_size,
            "model_size": args.model_size,
            "batch_size": args.batch_size,
            "compiler": args.compiler,
            "rss_from": args.rss_from,
            "max_rss_growth_percent": args.max_rss_growth,
            "torch": torch_support.RELEASE,
        },
        "recompiles_after_step_2": recompiles,
        "rss_from_bytes": max(r["rss_from_bytes"] for r in per_rank),
        "rss_last_bytes": max(r["rss_last_bytes"] for r in per_rank),
        "rss_growth_percent": growth,
        # The slowest rank sets the pace of a synchronous job.
        "steps_per_second": min(steady) if steady else None,
        "passed": recompiles == 0 and growth <= args.max_rss_growth,
        "per_rank": per_rank,
    }


def format_table(results: dict[str, Any]) -> str:
    """The per-rank table printed at the end of a soak, with the verdict."""
    settings = results["settings"]
    rss_from, last = settings["rss_from"], settings["steps"]
    lines = [
        f"python -m benchmarks.soak: stage {settings['stage']}, {settings['ranks']} ranks, GPT {settings['model_size']}, "
        f"{last} steps, compiler {settings['compiler']}",
        f"| rank | recompiles after step 2 | RSS step {rss_from} MB | RSS step {last} MB | growth % | steps/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["per_rank"]:
        speed = "-" if r["steps_per_second"] is None else f"{r['steps_per_second']:.1f}"
        lines.append(
            f"| {r['rank']} | {r['recompiles_after_step_2']} | {r['rss_from_bytes'] / MB:.1f} | "
            f"{r['rss_last_bytes'] / MB:.1f} | {r['rss_growth_percent']:+.2f} | {speed} |"
        )
    compare = results.get("compare")
    if compare is not None:
        ours_name, theirs_name = f"stage {settings['stage']}", compare["mode"]
        lines += [
            "",
            f"RSS per rank, {ours_name} and then {theirs_name} (same model, batches and steps, fresh ranks):",
            f"| rank | mode | RSS step {rss_from} MB | RSS step {last} MB | growth MB | growth % "
            f"| peak of step {rss_from} MB | peak of step {last} MB | peak growth % |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for ours, theirs in zip(results["per_rank"], compare["per_rank"]):
            for name, rank in ((ours_name, ours), (theirs_name, theirs)):
                lines.append(
                    f"| {rank['rank']} | {name} | {rank['rss_from_bytes'] / MB:.1f} | {rank['rss_last_bytes'] / MB:.1f} | "
                    f"{(rank['rss_last_bytes'] - rank['rss_from_bytes']) / MB:+.1f} | {rank['rss_growth_percent']:+.2f} | "
                    f"{rank['step_peak_from_bytes'] / MB:.1f} | {rank['step_peak_last_bytes'] / MB:.1f} | "
                    f"{rank['step_peak_growth_percent']:+.2f} |"
                )
        lines.append("")
    modes = [(f"stage {settings['stage']}", results["per_rank"])]
    if compare is not None:
        modes.append((compare["mode"], compare["per_rank"]))
    for name, per_rank in modes:
        census = per_rank[0].get("allocations")
        if census is not None:
            lines += [*format_census(census, f"One step of {name} after the last, rank 0"), ""]
    verdict = "PASSED" if results["passed"] else "FAILED"
    lines.append(
        f"{verdict}: {results['recompiles_after_step_2']} recompiles after step 2 (limit 0), RSS growth "
        f"{results['rss_growth_percent']:+.2f} % (limit {settings['max_rss_growth_percent']} %)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    from benchmarks import harness

    sys.exit(harness.main("benchmarks.soak"))
