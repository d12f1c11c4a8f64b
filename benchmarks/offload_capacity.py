"""Capacity with the optimizer state on disk: a GPT whose training state exceeds the machine's RAM.

--ranks gloo ranks on 127.0.0.1 (one process each) build the --size GPT on the meta device, shard it
at stage 3 with fp32 AdamW state on disk under --offload-dir (`offload="disk"`: only this rank's
shards are ever allocated, the optimizer state lives in a file and streams through memory in
64 MiB buckets), compile it with the eager compiler and train --steps steps on one sequence of
--tokens tokens per rank, the same batch every step (so the loss must fall).

Per rank it reports the peak resident set over the job's whole life (VmHWM: interpreter, torch,
building, sharding, compiling, training) and, apart, the peaks of anonymous memory and of file
pages mapped into the process (RssAnon, RssFile: the state file's pages count there while a bucket
is mapped); the bytes held in parameters and gradients (`zc.model_state_bytes`) and the bound

    peak <= parameters shard + gradients shard + 2 buckets + 1 GiB

with a bucket the offload's step bucket (`offload.STEP_BUCKET_BYTES`). Per step: its seconds, the
optimizer phase's seconds, and the bytes the rank read from and wrote to the disk during it
(/proc/self/io read_bytes and write_bytes; a step must move the state once each way), beside the
directory's disk bandwidth measured in the same run. The whole training state (16 B per
parameter) is set against the machine's RAM (MemTotal).

    python -m benchmarks.offload_capacity --size 2b --ranks 2 --offload-dir /work/offload \\
        --json docs/results/2026-11-29-offload-capacity-2b-tcmalloc.json

The ranks preload tcmalloc where it is installed, as `zerocompile train`'s do (--allocator system:
glibc's malloc, with --exact-rss its mmap threshold lowered so RSS follows live tensors).

A configuration that would not fit (RSS bound x ranks over MemAvailable) is refused before any rank
starts; while ranks run, the parent kills them if MemAvailable runs low (benchmarks.capacity's
watchdog).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zerocompile as zc
from benchmarks.capacity.measure import GB, GiB, Marks, Sampler, machine, mem_available
from benchmarks.capacity.parent import EXACT_RSS_ENVIRONMENT, spawn_ranks
from zerocompile import offload, offload_files
from zerocompile.tools import spawn
from zerocompile.tools.gpt import GPT, SIZES
from zerocompile.tools.measuring import io_counters
from zerocompile.tools.train import GlobalBatches, load_text

PARAM_DTYPES = {None: None, "bf16": torch.bfloat16}
SLACK_BYTES = GiB  # the bound's "+ 1 GiB": interpreter, torch, activations, gathered parameters


def _rank(rank: int, settings: dict[str, Any]) -> dict[str, Any]:
    marks = Marks()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings["ranks"]))
    with contextlib.suppress(OSError):  # the OOM killer takes these ranks before anyone else's work
        Path("/proc/self/oom_score_adj").write_text("1000")
    zc.init_distributed()
    marks("started")
    with Sampler() as sampler:
        torch.manual_seed(settings["seed"])
        with torch.device("meta"):
            model = GPT(SIZES[settings["size"]])
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"])
        zc.shard(model, stage=3, optimizer=optimizer, init=GPT._init_weights, offload="disk",
                 offload_dir=settings["offload_dir"], param_dtype=PARAM_DTYPES[settings["param_dtype"]])
        marks("sharded/initialised")
        runner = torch.compile(model, backend="zero", options={"compiler": "eager"})
        batches = GlobalBatches(load_text(), settings["ranks"], settings["tokens"], seed=settings["seed"])
        inputs, targets = batches.next(slice(rank, rank + 1))
        steps = []
        for step in range(1, settings["steps"] + 1):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = runner(inputs, targets)
            loss.backward()
            before, stepping = io_counters(), time.perf_counter()
            optimizer.step()
            after, ended = io_counters(), time.perf_counter()
            steps.append({
                "loss": loss.item(),
                "seconds": ended - started,
                "optimizer_seconds": ended - stepping,
                "disk_read_bytes": after["read_bytes"] - before["read_bytes"],
                "disk_write_bytes": after["write_bytes"] - before["write_bytes"],
            })
            marks(f"step {step}" + (" (compiles)" if step == 1 else ""))
        held = zc.model_state_bytes(model, optimizer)
    dist.barrier()
    bandwidth = offload_files.measure_disk_bandwidth(settings["offload_dir"], held["optimizer_on_disk"]) if rank == 0 else None
    measured = {
        "rank": rank,
        "peak_rss": marks.marks[-1]["hwm"],
        "peak_phase": marks.peak_phase(),
        "peak_rss_anon": sampler.peaks["RssAnon"],
        "peak_rss_file": sampler.peaks["RssFile"],
        "held": held,
        "steps": steps,
        "marks": marks.marks,
        "bandwidth": bandwidth,
    }
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, measured)
    return per_rank if rank == 0 else None


def bound(held: dict[str, int]) -> int:
    """The issue's RSS bound: parameters shard + gradients shard + 2 step buckets + 1 GiB."""
    return held["params"] + held["grads"] + 2 * offload.STEP_BUCKET_BYTES + SLACK_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m benchmarks.offload_capacity`."""
    parser.add_argument("--size", choices=sorted(SIZES), default="2b", help="GPT size (default 2b)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--offload-dir", type=Path, required=True, help="where the optimizer state's files go")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the one sequence per rank (default 64)")
    parser.add_argument("--lr", type=float, default=5e-6,
                        help="AdamW learning rate (default 5e-6: benchmarks.capacity's --big-lr, small enough for "
                        "Adam's first steps on a model this size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param-dtype", choices=sorted(name for name in PARAM_DTYPES if name), default=None,
                        help="compute in it; the fp32 master weights then go to the disk too, and the shards and "
                        "gradients in memory are in it (offload_masters)")
    spawn.add_allocator_argument(parser)
    parser.add_argument("--exact-rss", action="store_true",
                        help="with --allocator system: glibc unmaps freed tensors at once (MALLOC_MMAP_THRESHOLD_=65536), "
                        "so RSS follows live tensors instead of including its retained heap")
    parser.add_argument("--json", type=Path, default=None, help="write the report as JSON here")


def run(args: argparse.Namespace) -> int:
    """`python -m benchmarks.offload_capacity`: 0 when the job trained within the bound, else 1."""
    with torch.device("meta"):
        phi = sum(p.numel() for p in GPT(SIZES[args.size]).parameters())
    # Parameters and gradients shards (fp32, or param_dtype with the masters on disk) + the bound's rest, per rank.
    element = PARAM_DTYPES[args.param_dtype].itemsize if args.param_dtype else 4
    needed = args.ranks * (2 * element * phi / args.ranks + 2 * offload.STEP_BUCKET_BYTES + SLACK_BYTES)
    report: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {**machine(), "mem_available_at_start": mem_available()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "phi": phi,
        "training_state_bytes": 16 * phi,
        "offload_dir": offload_files.describe_directory(args.offload_dir),
    }
    head = (f"GPT {args.size} (Φ = {phi:,}; fp32 AdamW training state 16Φ = {16 * phi / GB:.1f} GB, RAM "
            f"{report['machine']['ram_bytes'] / GB:.1f} GB), stage 3, {args.ranks} ranks, state{' and fp32 master weights' if args.param_dtype else ''} on disk in {args.offload_dir}")
    print(head, flush=True)
    preload = spawn.find_allocator(args.allocator)
    if args.exact_rss and preload is not None:
        print(f"--exact-rss lowers glibc's mmap threshold, and the ranks would preload {preload}: give --allocator "
              "system too", flush=True)
        return 2
    if needed > mem_available():
        print(f"refused: needs ~{needed / GB:.1f} GB by the bound, MemAvailable {mem_available() / GB:.1f} GB", flush=True)
        return 1
    settings = {"size": args.size, "ranks": args.ranks, "offload_dir": str(args.offload_dir), "steps": args.steps,
                "tokens": args.tokens, "lr": args.lr, "seed": args.seed, "param_dtype": args.param_dtype}
    environment = dict(EXACT_RSS_ENVIRONMENT) if args.exact_rss else {}
    report["malloc"] = " ".join([preload or "C library", *(f"{k}={v}" for k, v in environment.items())])
    print(f"ranks' malloc: {report['malloc']}", flush=True)
    outcome = spawn_ranks(_rank, args.ranks, (settings,), spawn.child_environment(environment, preload))
    report.update(status=outcome["status"], seconds=round(outcome["seconds"], 1),
                  min_mem_available=outcome["min_mem_available"])
    if outcome["status"] != "ok":
        report["error"] = outcome["error"]
        print(f"{outcome['status']}: {outcome['error']}", flush=True)
    else:
        per_rank = outcome["results"][0]
        report["per_rank"] = per_rank
        report["bandwidth"] = per_rank[0]["bandwidth"]
        for measured in per_rank:
            measured["bound"] = bound(measured["held"])
            measured["within_bound"] = measured["peak_rss"] <= measured["bound"]
        report["losses"] = [sum(m["steps"][i]["loss"] for m in per_rank) / args.ranks for i in range(args.steps)]
        report["within_bound"] = all(m["within_bound"] for m in per_rank)
        print(summary(report), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report.get("within_bound") else 1


def summary(report: dict[str, Any]) -> str:
    """The report as markdown: one row per rank, then the steps of rank 0 against the disk's floor."""
    bandwidth = report["bandwidth"]
    lines = [
        f"Losses per step (mean over ranks): {', '.join(f'{x:.4f}' for x in report['losses'])}; "
        f"{report['seconds']:.0f} s in all; min MemAvailable {report['min_mem_available'] / GB:.1f} GB.",
        "",
        "| rank | peak RSS | at | peak RssAnon | peak RssFile | params + grads held | state on disk | bound | within |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in report["per_rank"]:
        held = m["held"]
        lines.append(
            f"| {m['rank']} | {m['peak_rss'] / GiB:.2f} GiB | {m['peak_phase']} | {m['peak_rss_anon'] / GiB:.2f} GiB | "
            f"{m['peak_rss_file'] / GiB:.2f} GiB | {(held['params'] + held['grads']) / GiB:.2f} GiB | "
            f"{held['optimizer_on_disk'] / GiB:.2f} GiB | {m['bound'] / GiB:.2f} GiB | {'yes' if m['within_bound'] else 'NO'} |"
        )
    state = report["per_rank"][0]["held"]["optimizer_on_disk"]
    floor = state / bandwidth["read"] + state / bandwidth["write"]
    lines += [
        "",
        f"Disk (measured after training, one rank alone): write {bandwidth['write'] / 2**20:,.0f} MiB/s, read "
        f"{bandwidth['read'] / 2**20:,.0f} MiB/s; one rank's state {state / GiB:.2f} GiB, read and written once a step: "
        f"floor {floor:.1f} s per rank alone.",
        "",
        "| step | step s | optimizer s | disk read | disk written |",
        "|---|---|---|---|---|",
    ]
    for i, step in enumerate(report["per_rank"][0]["steps"], 1):
        lines.append(f"| {i} | {step['seconds']:.1f} | {step['optimizer_seconds']:.1f} | "
                     f"{step['disk_read_bytes'] / GiB:.2f} GiB | {step['disk_write_bytes'] / GiB:.2f} GiB |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    from benchmarks import harness

    sys.exit(harness.main("benchmarks.offload_capacity"))
