"""`zerocompile bench`'s run: the flags resolved, each mode in ranks of its own (spawned, or
started inside a simulated network), then the interleaved modes, and the summary written to
bench.json, bench.md and bench.png."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import zerocompile as zc
from zerocompile import torch_support
from zerocompile.distributed import default_backend
from zerocompile.tools import link_budget, netsim, spawn
from zerocompile.tools.bench.report import described, markdown_table, plot, progress_line
from zerocompile.tools.bench.deepspeed_modes import DEEPSPEED_MODES, rank_environment
from zerocompile.tools.bench.method import method
from zerocompile.tools.bench.modes import MODES, optimizer_description
from zerocompile.tools.bench.rank import interleaved_rank, spawned_rank
from zerocompile.tools.bench.settings import (
    DEFAULT_RANKS,
    DEFAULTS,
    EXACT_RSS_ENVIRONMENT,
    QUICK,
    Settings,
    check_link,
    gpt_config,
    interleaved_modes,
    preloaded_allocator,
)
from zerocompile.tools.gpt import GPT, GPTConfig

FP32_BYTES = 4


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn the ranks, run every mode, write bench.json/.md/.png to --out; returns the JSON."""
    size, steps, warmup = QUICK if args.quick else DEFAULTS
    model_size = args.model_size or size
    fake = args.fake_ranks is not None
    ranks = args.fake_ranks if fake else (args.ranks or DEFAULT_RANKS) * args.nodes
    if args.batch_size % ranks:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {ranks} ranks")
    backend = "fake" if fake else default_backend(args.device)
    if not args.modes and not interleaved_modes(args):
        raise SystemExit("--modes none leaves nothing to run: give --interleave with two or more modes")
    check_link(args, backend)
    preload = preloaded_allocator(args)
    config = gpt_config(model_size, args.layers)
    phi = _count_parameters(config)
    print(spawn.allocator_line(preload), flush=True)
    machine = {"node": platform.node(), "cpu_count": os.cpu_count(), "torch": torch_support.RELEASE}
    print(
        f"zerocompile bench on {machine['node']} ({machine['cpu_count']} CPUs, torch {machine['torch']}): "
        f"{ranks} {backend} ranks, GPT {described(model_size, args.layers)} (Φ = {phi:,}), global batch {args.batch_size} x "
        f"{config.block_size} tokens, {optimizer_description(args.optimizer)}, {args.warmup or warmup} warm-up + "
        f"{args.steps or steps} timed steps per mode",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="zerocompile-bench-") as tmp, _network(args) as network:
        link = _link_line(args, network)
        offload_dir = args.offload_dir or Path(tmp, "offload")
        offload_dir.mkdir(exist_ok=True)
        settings = Settings(
            ranks=ranks,
            model_size=model_size,
            layers=args.layers,
            steps=args.steps or steps,
            warmup=args.warmup or warmup,
            batch_size=args.batch_size,
            seed=args.seed,
            modes=tuple(args.modes),
            interleave=interleaved_modes(args),
            cache_root=str(args.inductor_cache.resolve()) if args.inductor_cache else tmp,
            device=args.device,
            optimizer=args.optimizer,
            fake=fake,
            nodes=args.nodes,
            link=args.link is not None,
            offload_dir=str(offload_dir),
        )
        measured = {}
        environment = {
            **(EXACT_RSS_ENVIRONMENT if args.exact_rss else {}),
            **rank_environment([*settings.modes, *settings.interleave], settings.device),
        }

        def launch(fn: Callable[..., Any], fn_args: tuple) -> Any:
            """Rank 0's result of `fn(rank, *fn_args)` on every rank."""
            if network is None:
                return spawn.spawn_ranks(fn, settings.processes, fn_args, env=environment, preload=preload)[0]
            return network.run_ranks(fn, ranks // args.nodes, fn_args, env=spawn.child_environment(environment, preload))[0]

        for name in settings.modes:
            measured[name] = launch(spawned_rank, (name, settings))
            print(progress_line(measured[name]), flush=True)
        interleaved = _run_interleaved(settings, launch) if settings.interleave else None
    if link is not None:
        add_floors(measured, interleaved, link["probe_bits_per_second"], unlimited_steps(args.floor_from))
    summary = {
        "machine": machine,
        "settings": {
            **{
                k: v
                for k, v in dataclasses.asdict(settings).items()
                if k not in ("modes", "interleave", "cache_root", "device", "offload_dir")
            },
            "device": None if args.device is None else str(args.device),  # None: the process group's
            "backend": backend,
            "phi": phi,
            "block_size": settings.config.block_size,
            "optimizer": optimizer_description(args.optimizer),
            "quick": args.quick,
            "malloc": " ".join(f"{k}={v}" for k, v in EXACT_RSS_ENVIRONMENT.items()) if args.exact_rss else preload or "default",
            "link": link,
        },
        "method": method(
            args.inductor_cache,
            fake,
            link is not None,
            any(MODES[name].offload_of for name in (*settings.modes, *settings.interleave)),
            any(name in DEEPSPEED_MODES for name in (*settings.modes, *settings.interleave)),
        ),
        "theory": _theory(phi, ranks),
        "modes": [measured[name] for name in args.modes],
        "interleaved": interleaved,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = markdown_table(summary)
    (args.out / "bench.md").write_text(table)
    plot(summary, args.out / "bench.png")
    print(f"\n{table}\nwrote {args.out}/bench.json, bench.md, bench.png", flush=True)
    return summary


def _network(args: argparse.Namespace) -> contextlib.AbstractContextManager[netsim.SimulatedNetwork | None]:
    """The simulated network --link asks for (removed afterwards, also on failure), or none."""
    return netsim.SimulatedNetwork(args.nodes, args.link) if args.link else contextlib.nullcontext()


def unlimited_steps(path: Path | None) -> dict[str, float]:
    """Each mode's step on an unlimited link, from a bench.json (--floor-from): interleaved
    modes' medians where it has them (their ratios are the ones to quote), else the modes' own."""
    if path is None:
        return {}
    unlimited = json.loads(Path(path).read_text())
    steps = {mode["mode"]: mode["step_time_s"] for mode in unlimited["modes"] if mode["status"] == "ok"}
    return {**steps, **((unlimited.get("interleaved") or {}).get("step_time_s") or {})}


def add_floors(
    measured: dict[str, dict[str, Any]], interleaved: dict[str, Any] | None, bits_per_second: float,
    unlimited: dict[str, float],
) -> None:  # fmt: skip
    """Each mode's floor (tools/link_budget.py) and its step over it, beside its link figures."""

    def floor(figures: dict[str, Any], name: str, step: float) -> dict[str, Any]:
        seconds = link_budget.floor_seconds(unlimited.get(name), figures["link_bytes_per_step"] or [], bits_per_second)
        return {"floor_s": seconds, "unlimited_step_s": unlimited.get(name), "step_over_floor": step / seconds if seconds else None}

    for name, mode in measured.items():
        if mode["status"] == "ok":
            mode.update(floor(mode, name, mode["step_time_s"]))
    for name, figures in (interleaved or {}).get("link", {}).items():
        figures.update(floor(figures, name, interleaved["step_time_s"][name]))


def _link_line(args: argparse.Namespace, network: netsim.SimulatedNetwork | None) -> dict[str, Any] | None:
    """Print and return what the link is: the rate asked for and the rate a probe measured."""
    if network is None:
        return None
    measured = network.probe()
    shape = "one link between all ranks" if args.nodes == 1 else f"{args.nodes} nodes of {args.ranks or DEFAULT_RANKS} ranks"
    print(f"link             {args.link} asked, {measured / 1e9:.3f} Gbit/s measured by a probe; {shape}", flush=True)
    return {"rate": args.link, "nodes": args.nodes, "probe_bits_per_second": measured}


def _count_parameters(config: GPTConfig) -> int:
    """Φ of the model, tied parameters once, without allocating it."""
    with torch.device("meta"):
        return zc.full_numel(GPT(config))


def _theory(phi: int, ranks: int) -> dict[str, float]:
    """ZeRO's fp32 figures per rank (bytes) for comparison with the measured ones."""
    share = (ranks - 1) / ranks
    return {
        "sent_2phi": 2 * phi * share * FP32_BYTES,
        "sent_3phi": 3 * phi * share * FP32_BYTES,
        "state_16phi": 16 * phi,
        "state_16phi_over_n": 16 * phi / ranks,
    }


def _run_interleaved(settings: Settings, launch: Callable[[Callable[..., Any], tuple], Any]) -> dict[str, Any]:
    print(f"interleaved      {', '.join(settings.interleave)}: {settings.steps} rounds", flush=True)
    interleaved = launch(interleaved_rank, (settings,))
    first = settings.interleave[0]
    print(
        "interleaved      "
        + " | ".join(
            f"{name} {seconds:.3f} s ({interleaved['paired_ratio'][name][first]['median']:.2f}x {first})"
            for name, seconds in interleaved["step_time_s"].items()
        ),
        flush=True,
    )
    return interleaved


