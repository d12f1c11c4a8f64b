"""What one spawned rank of `zerocompile bench` does: start its process group and a fresh Inductor
cache, build a mode (or the interleaved modes side by side), train it and measure it, and hand
every rank's figures to rank 0 to summarise."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import resource
import statistics
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._inductor.config
import torch.distributed as dist
from torch._dynamo.utils import compilation_time_metrics as compile_timers
from torch._inductor.runtime.cache_dir_utils import cache_dir, temporary_cache_dir
from torch.testing._internal.distributed.fake_pg import FakeStore

import zerocompile as zc
from zerocompile import offload_files
from zerocompile.tools import dispatched, link_budget
from zerocompile.tools import gpt as gpt_module
from zerocompile.tools.bench.modes import MODES, Mode
from zerocompile.tools.bench.settings import Settings
from zerocompile.tools.bench.steps import RandomBatches, Step, one_step, training_step
from zerocompile.tools.bench.summaries import summarise, summarise_interleaved
from zerocompile.tools.gpt import GPT
from zerocompile.tools.measuring import device_peak, reset_device_peak
from zerocompile.tools.measuring import reset_peak_rss, status_bytes
from zerocompile.tools.train import chosen_device


def spawned_rank(rank: int, name: str, settings: Settings) -> dict[str, Any] | None:
    """Run mode `name` on this rank; every rank's summarised figures on rank 0."""
    with rank_session(rank, settings, name):
        measured = _run_mode(MODES[name], settings, rank)
    return _gathered(measured, lambda per_rank: summarise(name, per_rank, settings.nodes))


def interleaved_rank(rank: int, settings: Settings) -> dict[str, Any] | None:
    """Time the --interleave modes side by side on this rank (see `zerocompile bench --help`)."""
    with rank_session(rank, settings, "interleaved"):
        device = chosen_device(settings.device)
        prepared = {}
        for name in settings.interleave:
            torch.manual_seed(settings.seed)
            prepared[name] = MODES[name].prepare(gpt_class_of_its_own(name)(settings.config).to(device), settings)
        batches = {name: RandomBatches(settings.config, settings, rank, device) for name in settings.interleave}
        interface = link_budget.link_interface() if settings.link else None
        steps: dict[str, list[Step]] = {name: [] for name in settings.interleave}
        graphs: dict[str, list[Any]] = {name: [] for name in settings.interleave}
        losses: dict[str, list[float]] = {name: [] for name in settings.interleave}
        for round_ in range(settings.warmup + settings.steps):
            for name in settings.interleave:
                with zc.record_graphs() as compiled:
                    step = one_step(prepared[name], batches[name], interface)
                graphs[name] += compiled
                losses[name].append(step.loss.item())
                if round_ >= settings.warmup:
                    steps[name].append(step)
        measured = {
            "step_times": {name: [step.seconds for step in taken] for name, taken in steps.items()},
            "phases": {name: [step.phases for step in taken] for name, taken in steps.items()},
            "waiting": {name: [step.waiting for step in taken] for name, taken in steps.items()},
            "link_sent": {name: [step.link_sent for step in taken] for name, taken in steps.items()},
            "predicted": {
                name: _predicted_bytes(graphs[name], prepared[name].optimizers, settings) for name in settings.interleave
            },
            "losses": losses,
            "load": os.getloadavg()[0],
            "disk": {
                name: _disk_figures(prepared[name].state_bytes(), settings.offload_dir) for name in settings.interleave
            },
        }
    return _gathered(measured, lambda per_rank: summarise_interleaved(per_rank, settings.nodes))


def gpt_class_of_its_own(name: str) -> type[GPT]:
    """The GPT class executed anew from its source, for mode `name` alone.

    Dynamo keeps state per code object: the cache entries and recompile count of each frame, and
    whether it gave up on a frame. FSDP2+compile gives up on `GPT.forward` (a graph break inside
    its loop over blocks), and every mode sharing that code object afterwards ran its forward
    eagerly, block by block: zero3 looked 1.7x slower interleaved than alone. Modes that share a
    process must not share code objects.
    """
    module_name = f"{gpt_module.__name__}_{re.sub(r'[^0-9a-zA-Z]', '_', name)}"
    spec = importlib.util.spec_from_file_location(module_name, gpt_module.__file__)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses resolve the config's annotations through it
    spec.loader.exec_module(module)
    return module.GPT


@contextlib.contextmanager
def rank_session(rank: int, settings: Settings, cache_name: str) -> Iterator[None]:
    """This rank's process group, threads and a fresh Inductor cache of its own for the run."""
    # The ranks share the machine's cores, and each compiles with one worker: more threads than
    # cores slows every rank down. A process alone (--fake-ranks) keeps Inductor's own workers:
    # serial Triton compiles took 50 s of a 1.3B GPT's compile on an H200.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.processes))
    if settings.processes > 1:
        torch._inductor.config.compile_threads = 1
    # Inductor's modules take tens of MB once imported: import them in every mode, so the eager
    # modes do not look leaner than the compiled ones by that much.
    importlib.import_module("torch._inductor.compile_fx")
    _start_process_group(settings)
    # Per rank too: ranks sharing a cache split the C++ compiles between them (the first to reach a
    # kernel compiles it, its peer loads it), so a rank's compile CPU depended on that race.
    with temporary_cache_dir(os.path.join(settings.cache_root, cache_name, f"rank{rank}")):
        yield


def _start_process_group(settings: Settings) -> None:
    """This rank of the spawned ranks (the spawner gave it torchrun's variables); under
    --fake-ranks, rank 0 of a fake group of `settings.ranks` (no peers, no port), whose collectives
    take tensors on every device."""
    if settings.fake:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=settings.ranks)
        return
    zc.init_distributed(device=settings.device)


def _gathered(measured: dict[str, Any], summarised: Callable[[list[dict]], dict]) -> dict[str, Any] | None:
    """`summarised` of every rank's `measured` on rank 0 (None on the others). A fake group's other
    ranks do not exist (and its all-gathers return garbage): rank 0's alone."""
    if _communicates():
        per_rank: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(per_rank, measured)
    else:
        per_rank = [measured]
    return summarised(per_rank) if dist.get_rank() == 0 else None


def _run_mode(mode: Mode, settings: Settings, rank: int) -> dict[str, Any]:
    try:
        return _measure_mode(mode, settings, rank)
    except Exception as error:  # a mode that fails must not take the others with it
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}


def _measure_mode(mode: Mode, settings: Settings, rank: int) -> dict[str, Any]:
    device = chosen_device(settings.device)
    torch.manual_seed(settings.seed)
    prepared = mode.prepare(GPT(settings.config).to(device), settings)
    batches = RandomBatches(settings.config, settings, rank, device)
    interface = link_budget.link_interface() if settings.link else None
    compile_timers.clear()  # a mode has processes of its own: what is timed from here on is its compile
    reset_device_peak(device)
    # Inductor's C++ kernels record themselves for the profiled step's count (`dispatched`).
    with zc.record_graphs() as graphs, dispatched.kernel_profiling():
        warmup = [one_step(prepared, batches, interface) for _ in range(settings.warmup)]
    compiled = {name: [len(spans), sum(spans)] for name, spans in compile_timers.items()}
    warmup_device_peak = device_peak(device)
    reset_device_peak(device)
    rss_source = "VmHWM" if reset_peak_rss() else "ru_maxrss"
    rss_before = status_bytes("VmRSS")
    load = os.getloadavg()[0]
    timed = [one_step(prepared, batches, interface) for _ in range(settings.steps)]
    steps_device_peak = device_peak(device)
    host_work = dispatched.dispatched_per_step(lambda: training_step(prepared, batches), device)
    held = prepared.state_bytes()  # the last step's gradients are still there
    if rss_source == "VmHWM":
        peak = status_bytes("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    disk = _disk_figures(held, settings.offload_dir)  # after the peak: its buffers are no step's
    return {
        "step_times": [step.seconds for step in timed],
        "phases": [step.phases for step in timed],
        "first_step": warmup[0].seconds,
        "compile_cpu": warmup[0].cpu_seconds - statistics.median(step.cpu_seconds for step in timed),
        "compile_timers": compiled,
        "inductor_cache": cache_dir(),
        "sent": [step.sent for step in timed] if _communicates() else None,
        "waiting": [step.waiting for step in timed],
        "link_sent": [step.link_sent for step in timed],
        "predicted": _predicted_bytes(graphs, prepared.optimizers, settings),
        "losses": [step.loss.item() for step in warmup + timed],
        "dispatched": host_work,
        "held": held,
        "peak_rss": peak,
        "device_peak_run": None if steps_device_peak is None else max(warmup_device_peak, steps_device_peak),
        "device_peak_steps": steps_device_peak,
        "rss_before": rss_before,
        "rss_source": rss_source,
        "load": load,
        "device": str(device),
        "world_size": dist.get_world_size(),
        "disk": disk,
    }


def _disk_figures(held: dict[str, int], directory: str) -> dict[str, Any] | None:
    """For a mode whose optimizer state is on disk (its model_state_bytes, `held`, count it): this
    rank's state bytes there, the bandwidth of `directory` measured on a file of that size, the
    bytes a step moves through the disk (the state read once and written once) and the seconds
    they take at that bandwidth, the optimizer step's floor. None for a mode with it in memory."""
    if "optimizer_on_disk" not in held:
        return None
    state = held["optimizer_on_disk"]
    # Every rank at once, as they stream their state in a step: the ranks of one machine share its
    # disk, and one rank measuring alone would get all of it, a floor up to N times too low.
    dist.barrier()
    bandwidth = offload_files.measure_disk_bandwidth(directory, state)
    return {
        "directory": offload_files.describe_directory(directory),
        "state_bytes": state,
        "bandwidth_bytes_per_s": bandwidth,
        "moved_bytes_per_step": 2 * state,
        "floor_s": state / bandwidth["read"] + state / bandwidth["write"],
    }


def _predicted_bytes(
    graphs: list[Any], optimizers: list[torch.optim.Optimizer], settings: Settings
) -> dict[str, int] | None:
    """What zerocompile's ledgers say this rank sends per step, in all and to other nodes: the
    graphs compiled in the warm-up (each runs once a step) and the optimizers' steps. None for
    modes that are not zerocompile's (no ledger)."""
    ledgers = [graph.ledger for graph in graphs]
    ledgers += [zc.optim.step_ledger(o) for o in optimizers if isinstance(o, (zc.optim.Muon, zc.optim.Adafactor))]
    if not graphs:
        return None
    per_node = settings.ranks // settings.nodes
    return {
        "sent": sum(ledger.sent_bytes for ledger in ledgers),
        "across_nodes": sum(ledger.sent_across_nodes(per_node) for ledger in ledgers),
    }


def _communicates() -> bool:
    """Whether the world group's collectives send anything (not on the fake backend)."""
    return dist.get_backend() != "fake"

