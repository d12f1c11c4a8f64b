"""Check that zerocompile works on this machine: stages 0-3 against DDP, eager compiler and Inductor.

    zerocompile check                       # CPU (or the GPUs, where CUDA sees some)
    zerocompile check --device cpu --ranks 4
    zerocompile check --fake-ranks 8        # memory of one rank of 8, on the fake process group
    zerocompile check --offload-dir /nvme/zc   # stages 1-3 with the optimizer state on disk there
    zerocompile check --offload-cpu            # ... in host memory, updated on the CPU (for GPUs)

What a user runs on a new machine or cluster before trusting it with a job. It prints what the
install runs on (zerocompile, torch, CUDA, NCCL, gloo, the visible devices, the C++ compiler
Inductor will call), then trains a small GPT (tied embeddings; parameter sizes no world size
divides, so shards are padded) a few AdamW steps under DDP and under each ZeRO stage, with the
eager compiler and with Inductor: same seed, the same global batches, each rank its slice. One
table, a row per (stage, compiler), compares

  max |Δ grad|    the first step's gradients (gathered) against DDP's: AdamW divides each update by
                  the root of its second moment, so a gradient off by a constant factor (a reduction
                  missing its 1/N) leaves the parameters nearly where DDP's go; the gradients show it
  max |Δ param|   the parameters (gathered) after the last step against DDP's
  state bytes     zerocompile.model_state_bytes on each rank after a step, offloaded state included (AdamW, fp32: parameters,
                  gradients, two moments) against 16 B per padded shard element (16Φ at stage 0)
  sent bytes      bytes each rank wrote per step (/proc/self/io wchar) against ZeRO's
                  2Φ(N-1)/N·4 B (stages 0-2) or 3Φ(N-1)/N·4 B (stage 3), within 2 %; gloo only
                  (NCCL does not send through write calls: n/a)
  step time       median of the timed steps against DDP under torch.compile with the same compiler
                  (aot_eager for the eager rows): a ratio to read, not a verdict

and the command exits 1, naming each row and what was off, if any figure is out of bounds.

What runs where (`plan`, a function of the device and the number of visible GPUs):
  --device cpu           --ranks N (default 2) gloo ranks on 127.0.0.1
  --device cuda, 2+ GPUs NCCL, one rank per GPU
  --device cuda, 1 GPU   one NCCL rank (real kernels, trivial collectives); two gloo ranks sharing
                         the GPU at stage 0, eager compiler (real two-rank arithmetic; zerocompile
                         refuses stages 1-3 on gloo with accelerator tensors, and the shared GPU
                         makes the time meaningless); stage 3 as rank 0 of 8 on the fake group
  --fake-ranks N         only the fake group: rank 0 of N in a process of its own, stage 3 (values
                         are garbage there: shapes and memory only): model-state bytes against
                         16Φ/N, and the device's peak of allocated bytes on an accelerator
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from zerocompile import offload_files, torch_support
from zerocompile.distributed import default_backend
from zerocompile.passes.stages import shard_numel
from zerocompile.dtensor_parameters import flat_grad
from zerocompile.sharded_parameters import shard_info, shard_of_parameter
from zerocompile.tools.arguments import add_offload_arguments, positive_int
from zerocompile.tools import spawn
from zerocompile.tools.check_verdict import judge, render
from zerocompile.tools.gpt import GPT, GPTConfig
from zerocompile.tools.measuring import device_peak, finish_queued_work, reset_device_peak, written_bytes

# Two layers keep Inductor's compiles short (they cost the time here, not the steps); a width of
# 99 makes Φ = 266,112, enough that collectives' headers and a barrier stay far below 2 % of the
# bytes a step sends. Odd width and sequence length: no parameter's dim 0 is a multiple of the
# world size, so at every world size every shard is padded (passes.stages.shard_numel: under N rows
# per parameter); the padding is 0.5 %, 0.8 %, 3.2 % of Φ at N = 2, 4, 8 (check_verdict's
# FAKE_STATE_TOLERANCE).
CHECK_GPT = GPTConfig(vocab_size=251, block_size=33, n_layer=2, n_head=3, n_embd=99)
ROWS_PER_RANK = 2
STEPS = 6  # the first compiles and is not timed
LR = 1e-3
STAGES = (0, 1, 2, 3)
COMPILERS = ("eager", "inductor")
# The eager compiler runs the same ATen ops as DDP on the same values: on gloo CPU ranks the
# parameters came out bitwise equal (benchmarks/gpu_visit.py, 2 ranks, AdamW and SGD). 1e-6 leaves room
# for a reduction that sums in another order than DDP's all-reduce (NCCL's reduce-scatter over more
# than 2 ranks) and nothing for a real error. Inductor fuses and reorders fp32 arithmetic, and
# AdamW magnifies ulp-level gradient differences where gradients are tiny: tests/test_parity.py
# measures 5e-6 on a GPT after 5 steps at every stage, 0 included; 1e-4 is the bound to report.
TOLERANCE = {"eager": 1e-6, "inductor": 1e-4}
FAKE_RANKS = 8
FP32_BYTES = 4
# A run that is still going after this long is stuck (a rank waiting for a peer that died): the
# whole CPU check takes about 2 minutes on 2 cores.
RUN_TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True)
class Run:
    """One set of ranks the check starts, and what it can measure there."""

    backend: str  # "gloo", "nccl" (the accelerator's), or "fake"
    ranks: int  # the world size
    device: str  # device type the model lives on
    stages: tuple[int, ...]
    compilers: tuple[str, ...]
    sent: bool  # bytes sent are measurable (gloo writes them through sockets)
    timed: bool  # step times mean something (not ranks sharing one device, not a fake group)
    offload: str | None = None  # stages 1-3 keep their optimizer state there: "disk" (under offload_dir) or "cpu"
    offload_dir: str | None = None

    @property
    def processes(self) -> int:
        """Processes to start: a fake group's other ranks do not exist."""
        return 1 if self.backend == "fake" else self.ranks

    @property
    def name(self) -> str:
        return f"{self.backend} x{self.ranks} {self.device}"


def plan(
    device: str,
    visible_gpus: int,
    ranks: int | None = None,
    fake_ranks: int | None = None,
    stages: tuple[int, ...] = STAGES,
    compilers: tuple[str, ...] = COMPILERS,
    offload_dir: str | None = None,
    offload_cpu: bool = False,
) -> list[Run]:
    """The runs for `device` with `visible_gpus` accelerators visible (see the module docstring),
    their stages 1-3 with the optimizer state on disk under `offload_dir` if given, or in host
    memory with the update on the CPU with `offload_cpu`.

    Pure, so a test can check every case with made-up device counts.
    """
    offload = "disk" if offload_dir is not None else "cpu" if offload_cpu else None
    return [
        dataclasses.replace(run, offload=offload, offload_dir=offload_dir)
        for run in _runs(device, visible_gpus, ranks, fake_ranks, stages, compilers)
    ]


def _runs(
    device: str, visible_gpus: int, ranks: int | None, fake_ranks: int | None, stages: tuple[int, ...], compilers: tuple[str, ...]
) -> list[Run]:
    fake_stages = tuple(stage for stage in stages if stage == 3)
    if fake_ranks is not None:
        return [Run("fake", fake_ranks, device, fake_stages, compilers, sent=False, timed=False)]
    if device == "cpu":
        return [Run("gloo", ranks or 2, "cpu", stages, compilers, sent=True, timed=True)]
    if visible_gpus == 0:
        raise ValueError(
            f"--device {device}: no {device} device is visible to this process (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): check the driver and the job's GPU "
            "allocation, or run --device cpu"
        )
    backend = default_backend(device)
    if visible_gpus > 1:
        world = ranks or visible_gpus
        if world > visible_gpus:
            raise ValueError(f"--ranks {world}: only {visible_gpus} {device} devices are visible (one rank per device)")
        return [Run(backend, world, device, stages, compilers, sent=False, timed=True)]
    shared_stages = tuple(stage for stage in stages if stage == 0)
    shared_compilers = tuple(compiler for compiler in compilers if compiler == "eager")
    runs = [
        Run(backend, 1, device, stages, compilers, sent=False, timed=True),
        Run("gloo", 2, device, shared_stages, shared_compilers, sent=True, timed=False),
        Run("fake", FAKE_RANKS, device, fake_stages, compilers, sent=False, timed=False),
    ]
    return [run for run in runs if run.stages and run.compilers]


def visible_devices(device: str) -> int:
    """How many devices of type `device` this process sees (0 for the CPU, or no such accelerator)."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if device == "cpu" or accelerator is None or accelerator.type != device:
        return 0
    return torch.accelerator.device_count()


# ---------------------------------------------------------------------------------- environment


def environment(device: str) -> dict[str, str]:
    """What the check ran on: everything that decides the generated code and the collectives."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    facts = {
        "zerocompile": f"{_distribution_version('zerocompile')} ({Path(zc.__file__).parent})",
        "torch": torch_support.RELEASE,
        "python": f"{platform.python_version()} ({sys.executable})",
        "host": platform.node(),
        "cuda": f"{torch.version.cuda} (available: {torch.cuda.is_available()})" if torch.version.cuda else "none (CPU build)",
        "nccl": _nccl_version(),
        "gloo": "available" if dist.is_gloo_available() else "MISSING: CPU ranks cannot start",
        "devices": _device_list(accelerator),
        "c++ compiler (Inductor)": inductor_cpp_compiler(),
        "triton": _distribution_version('triton'),
        "device checked": device,
    }
    return facts


def offload_directory_fact(directory: Path) -> str:
    """Where --offload-dir is and what it moves: the disk a step's optimizer state streams through."""
    bandwidth = offload_files.measure_disk_bandwidth(directory)
    return (
        f"{offload_files.describe_directory(directory)}: write {bandwidth['write'] / 1e6:,.0f} MB/s (fsync'd), "
        f"read {bandwidth['read'] / 1e6:,.0f} MB/s (uncached), on 256 MiB"
    )


def _nccl_version() -> str:
    if not dist.is_nccl_available():
        return "not built in"
    return ".".join(str(part) for part in torch.cuda.nccl.version())


def _device_list(accelerator: torch.device | None) -> str:
    cpus = f"cpu ({len(os.sched_getaffinity(0))} cores usable)"
    if accelerator is None:
        return cpus
    module = torch.get_device_module(accelerator.type)
    names = [module.get_device_name(index) for index in range(torch.accelerator.device_count())]
    return f"{cpus}; {len(names)} x {accelerator.type}: {', '.join(names)}"


def inductor_cpp_compiler() -> str:
    """The C++ compiler Inductor calls for CPU kernels (its own search: torch._inductor.config.cpp.cxx,
    i.e. $CXX or g++), with its version line; or why there is none and how to get one."""
    from torch._inductor import cpp_builder

    try:
        compiler = cpp_builder.get_cpp_compiler()
    except Exception as error:  # InvalidCxxCompiler, whatever the release calls it
        return (
            f"NONE ({type(error).__name__}): Inductor cannot build CPU kernels; install g++ or set CXX "
            "to a C++17 compiler"
        )
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()
    return f"{compiler} ({shutil.which(compiler) or 'not on PATH'}): {version[0] if version else 'version unknown'}"


def _distribution_version(name: str) -> str:
    """The installed distribution's version, as pip has it (the package itself is not imported)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# ------------------------------------------------------------------------------------ on a rank


class RowFailed(RuntimeError):
    """A row (or the DDP reference) raised: carries which, so the error names it."""

    def __init__(self, row: str) -> None:
        super().__init__(row)
        self.row = row


def measure(run: Run, on_row: Callable[[dict[str, Any]], None] = lambda row: None) -> list[dict[str, Any]]:
    """Every row of `run`, on this rank of an initialised process group of `run.ranks` ranks (a
    fake group: rank 0 of `run.ranks`). Every rank returns the same rows; `on_row` sees each as
    soon as it is measured, so rows measured before a failure are not lost with it."""
    device = _rank_device(run)
    batches = _global_batches(run)
    reference = None
    if run.backend != "fake":
        with _row("DDP reference"):
            reference = _train(_ddp(device), device, batches, count_sent=False)
    rows = []
    for compiler in run.compilers:
        baseline = None
        if run.timed:
            with _row(f"DDP + torch.compile ({compiler})"):
                baseline = _ddp_compiled_seconds(device, batches, compiler)
        for stage in run.stages:
            with _row(f"stage {stage}, {compiler}"):
                row = _measure_row(run, device, batches, stage, compiler, reference, baseline)
            on_row(row)
            rows.append(row)
    return rows


@dataclasses.dataclass
class Trace:
    """What training recorded on this rank."""

    first_grads: dict[str, torch.Tensor]  # full gradients of the first step, by FQN
    params: dict[str, torch.Tensor]  # full parameters after the last step
    seconds: list[float]  # the timed steps
    sent: list[int] | None  # bytes written in each timed step
    state_bytes: int  # model-state bytes held after the last step (its gradients still there)
    offloaded_bytes: int  # of those, optimizer state offloaded (on disk or in host memory)


def _rank_device(run: Run) -> torch.device:
    """Where this rank's model lives: the CPU, or the accelerator this rank's group made current."""
    if run.device == "cpu":
        return torch.device("cpu")
    return torch.device(run.device, torch.accelerator.current_device_index())


def _global_batches(run: Run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the same global batches on every rank and in every row (drawn on the CPU)."""
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        CHECK_GPT.vocab_size, (STEPS, ROWS_PER_RANK * run.ranks, CHECK_GPT.block_size + 1), generator=generator
    )
    mine = tokens[:, rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
    return [(step[:, :-1].contiguous(), step[:, 1:].contiguous()) for step in mine]


@dataclasses.dataclass
class _Model:
    """A model to train: what runs a step, and the module whose parameters are compared."""

    runner: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    module: nn.Module
    optimizer: torch.optim.Optimizer


def _fresh_gpt(device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(CHECK_GPT).to(device)


def _ddp(device: torch.device, compiler: str | None = None) -> _Model:
    """DDP over a fresh GPT; under torch.compile with `compiler`'s plain-torch counterpart if given."""
    module = _fresh_gpt(device)
    nccl_device = device.type != "cpu" and dist.get_backend() != "gloo"
    ddp = nn.parallel.DistributedDataParallel(module, device_ids=[device] if nccl_device else None)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    if compiler is None:
        return _Model(ddp, module, optimizer)
    return _Model(torch.compile(ddp, backend="aot_eager" if compiler == "eager" else "inductor"), module, optimizer)


def _ddp_compiled_seconds(device: torch.device, batches: list, compiler: str) -> float:
    """Median step time of DDP under torch.compile (the slowest rank's): what the rows are timed against."""
    torch._dynamo.reset()
    return max(_per_rank(statistics.median(_train(_ddp(device, compiler), device, batches, False).seconds)))


def _zero(device: torch.device, stage: int, compiler: str, run: Run) -> _Model:
    torch._dynamo.reset()
    module = _fresh_gpt(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    offload = {"offload": run.offload, "offload_dir": run.offload_dir} if run.offload is not None and stage > 0 else {}
    zc.shard(module, stage=stage, optimizer=optimizer, **offload)
    return _Model(torch.compile(module, backend="zero", options={"compiler": compiler}), module, optimizer)


def _train(model: _Model, device: torch.device, batches: list, count_sent: bool) -> Trace:
    """AdamW steps over `batches`; each step starts after a barrier, its gradients cleared first so
    the last step's are there to be counted."""
    optimizer = model.optimizer
    seconds, sent, first_grads = [], [], {}
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        finish_queued_work(device)
        dist.barrier()
        written = written_bytes() if count_sent else 0
        start = time.perf_counter()
        model.runner(inputs.to(device), targets.to(device)).backward()
        if step == 0:  # the untimed step
            first_grads = _full(model.module, flat_grad)
        optimizer.step()
        finish_queued_work(device)
        seconds.append(time.perf_counter() - start)
        sent.append(written_bytes() - written if count_sent else 0)
    held = zc.model_state_bytes(model.module, optimizer)
    params = _full(model.module, shard_of_parameter)
    return Trace(first_grads, params, seconds[1:], sent[1:] if count_sent else None, sum(held.values()), held.get("optimizer_on_disk", held.get("optimizer_on_host", 0)))


def _full(module: nn.Module, value: Callable[[nn.Parameter], torch.Tensor]) -> dict[str, torch.Tensor]:
    """`value(param)` for each parameter (tied ones once, by their first FQN), gathered to full
    shape where it is a flat shard (a DTensor parameter's, or its gradient's), on the CPU."""
    full = {}
    with torch.no_grad():
        for fqn, param in module.named_parameters():
            info = shard_info(param)
            tensor = value(param).detach()
            full[fqn] = (tensor.clone() if info is None else info.gather(tensor)).cpu()
    return full


def _measure_row(
    run: Run, device: torch.device, batches: list, stage: int, compiler: str, reference: Trace | None, baseline: float | None
) -> dict[str, Any]:
    """One (stage, compiler): train, then every figure of the table (see the module docstring)."""
    if run.backend == "fake":
        return _measure_fake_row(run, device, batches, stage, compiler)
    trace = _train(_zero(device, stage, compiler, run), device, batches, run.sent)
    param_error, param_fqn = _largest_difference(trace.params, reference.params)
    grad_error, grad_fqn = _largest_difference(trace.first_grads, reference.first_grads)
    seconds = max(_per_rank(statistics.median(trace.seconds))) if run.timed else None
    return {
        **_row_head(run, stage, compiler),
        "param_error": param_error,
        "param_fqn": param_fqn,
        "grad_error": grad_error,
        "grad_fqn": grad_fqn,
        "tolerance": TOLERANCE[compiler],
        "state_bytes": _per_rank(trace.state_bytes),
        "state_offloaded_bytes": _per_rank(trace.offloaded_bytes),
        "state_expected": expected_state_bytes(stage, run.ranks),
        "sent_bytes": _per_rank(statistics.median(trace.sent)) if run.sent else None,
        "sent_expected": zero_sent_bytes(stage, run.ranks) if run.sent else None,
        "step_seconds": seconds,
        "ddp_compile_seconds": baseline,
        "device_peak_bytes": None,
    }


def _measure_fake_row(run: Run, device: torch.device, batches: list, stage: int, compiler: str) -> dict[str, Any]:
    """Rank 0 of a fake group: two steps (the first compiles), the device's peak over the second."""
    model = _zero(device, stage, compiler, run)
    optimizer = model.optimizer
    peaks = []
    for inputs, targets in batches[:2]:
        optimizer.zero_grad(set_to_none=True)
        reset_device_peak(device)
        model.runner(inputs.to(device), targets.to(device)).backward()
        optimizer.step()
        peaks.append(device_peak(device))
    return {
        **_row_head(run, stage, compiler),
        # What a fake group cannot give: its collectives return garbage and send nothing.
        **dict.fromkeys(("param_error", "param_fqn", "grad_error", "grad_fqn", "tolerance"), None),
        **dict.fromkeys(("sent_bytes", "sent_expected", "step_seconds", "ddp_compile_seconds"), None),
        "state_bytes": [sum(zc.model_state_bytes(model.module, optimizer).values())],
        "state_expected": expected_state_bytes(stage, run.ranks),
        "state_16phi_over_n": 16 * full_numel() / run.ranks,
        "device_peak_bytes": peaks[-1],
    }


def _row_head(run: Run, stage: int, compiler: str) -> dict[str, Any]:
    return {"run": run.name, "backend": run.backend, "ranks": run.ranks, "device": run.device, "stage": stage, "compiler": compiler}


def _largest_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |got - expected| over all parameters, and the FQN where it is."""
    return max(((got[fqn] - expected[fqn]).abs().max().item(), fqn) for fqn in expected)


def _per_rank(value: Any) -> list[Any]:
    """`value` from every rank, in rank order (this rank's alone on a fake group, whose peers do not exist)."""
    if dist.get_backend() == "fake":
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


@contextlib.contextmanager
def _row(name: str) -> Iterator[None]:
    """Turns an exception inside it into RowFailed naming `name`, the original chained."""
    try:
        yield
    except RowFailed:
        raise
    except Exception as error:
        raise RowFailed(name) from error


# -------------------------------------------------------------------------------------- formulas


def _parameter_shapes() -> list[torch.Size]:
    """The shape of each distinct parameter of the unsharded CHECK_GPT (tied ones once)."""
    with torch.device("meta"):
        model = GPT(CHECK_GPT)
    return [param.shape for param in {id(param): param for param in model.parameters()}.values()]


def full_numel() -> int:
    """Φ of CHECK_GPT."""
    return sum(shape.numel() for shape in _parameter_shapes())


def expected_state_bytes(stage: int, ranks: int) -> int:
    """fp32 AdamW's model state per rank: 16 B (parameter, gradient, two moments) per element held:
    all Φ at stage 0, each parameter's padded shard (passes.stages.shard_numel) at stages 1-3."""
    shapes = _parameter_shapes()
    held = sum(shape.numel() for shape in shapes) if stage == 0 else sum(shard_numel(shape, ranks) for shape in shapes)
    return 16 * held


def zero_sent_bytes(stage: int, ranks: int) -> float:
    """ZeRO's bytes sent per rank and step in fp32: 2Φ(N-1)/N at stages 0-2 (all-reduce, or
    reduce-scatter plus all-gather), 3Φ(N-1)/N at stage 3 (the backward gathers again)."""
    volumes = 3 if stage == 3 else 2
    return volumes * full_numel() * (ranks - 1) / ranks * FP32_BYTES


# ---------------------------------------------------------------------------------- the verdict


def conclude(facts: dict[str, str], runs: list[Run], rows: list[dict[str, Any]], json_path: Path | None) -> int:
    """Print the table, every problem (to stderr), write the JSON; the exit code: 1 on any problem."""
    problems = [problem for row in rows for problem in judge(row)]
    missing = [run.name for run in runs if not any(row["run"] == run.name for row in rows)]
    problems += [f"{name}: no row measured" for name in missing]
    print(render(rows), flush=True)
    if json_path is not None:
        report = {
            "environment": facts,
            "runs": [dataclasses.asdict(run) for run in runs],
            "rows": [{**row, "problems": judge(row), "ok": not judge(row)} for row in rows],
            "problems": problems,
            "ok": not problems,
        }
        json_path.write_text(json.dumps(report, indent=1))
    for problem in problems:
        print(f"zerocompile check: {problem}", file=sys.stderr)
    print("check passed" if not problems else f"check FAILED: {len(problems)} problem(s)", flush=True)
    return 1 if problems else 0


# ------------------------------------------------------------------------------- starting ranks


def _spawned_rank(rank: int, run: Run, work: str) -> None:
    """One rank of `run`: its group, a share of the cores, then `measure`; rank 0 writes the rows."""
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // run.processes))
    if run.processes > 1:
        torch._inductor.config.compile_threads = 1  # the ranks already keep every core busy
    if run.backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=run.ranks)
    else:
        zc.init_distributed(backend=run.backend, device=run.device)
    rows_file = Path(work) / "rows.jsonl"

    def keep(row: dict[str, Any]) -> None:
        if rank == 0:
            with rows_file.open("a") as rows:
                rows.write(json.dumps(row) + "\n")

    try:
        measure(run, keep)
    except RowFailed as failure:
        cause = failure.__cause__
        record = {"row": failure.row, "error": f"{type(cause).__name__}: {cause}", "traceback": traceback.format_exc()}
        (Path(work) / f"error-rank{rank}.json").write_text(json.dumps(record))
        raise


def execute(run: Run, preload: str | None = None) -> list[dict[str, Any]]:
    """Start `run`'s ranks and wait for them: its rows, and a failed row for whatever stopped it.
    The rows are written as they are measured, so a failure keeps those before it."""
    print(f"== {run.name}: stages {', '.join(map(str, run.stages))}; {', '.join(run.compilers)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="zerocompile-check-") as work:
        # One Inductor cache for the ranks of this check, fresh: kernels compiled on an earlier day or
        # by another torch would not exercise this machine's compiler. Shared, so of two ranks
        # compiling the same kernel one compiles and the other loads it (the compile is the cost here).
        cache = os.path.join(work, "inductor")
        environment = {"TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        failure = None
        try:
            spawn.spawn_ranks(
                _spawned_rank, run.processes, (run, work), env=environment, preload=preload, timeout=RUN_TIMEOUT_S
            )
        except spawn.RanksFailed as error:
            failure = str(error).strip().splitlines()[-1]
        except TimeoutError:
            failure = f"no result after {RUN_TIMEOUT_S:.0f} s (a rank stuck waiting for its peers?)"
        rows_file = Path(work) / "rows.jsonl"
        rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
        if failure is not None:
            rows.append(_failed_row(run, Path(work), failure))
    return rows


def _failed_row(run: Run, work: Path, failure: str) -> dict[str, Any]:
    """The row a rank was measuring when the run stopped, with the rank's own error (any rank's)."""
    records = [json.loads(path.read_text()) for path in sorted(work.glob("error-rank*.json"))]
    row, error = (records[0]["row"], records[0]["error"]) if records else ("the ranks' start", failure)
    stage, compiler = _row_key(row)
    return {**_row_head(run, stage, compiler), "error": error, "traceback": records[0]["traceback"] if records else ""}


def _row_key(row: str) -> tuple[Any, str]:
    """(stage, compiler) from a row name like "stage 2, inductor"; ("-", name) for the others."""
    if row.startswith("stage "):
        stage, compiler = row[len("stage ") :].split(", ")
        return int(stage), compiler
    return "-", row


# ------------------------------------------------------------------------------------ the command


def _stage_list(text: str) -> tuple[int, ...]:
    stages = tuple(int(part) for part in text.split(","))
    if not set(stages) <= set(STAGES):
        raise argparse.ArgumentTypeError(f"stages are 0-3, got {text!r}")
    return stages


def _compiler_list(text: str) -> tuple[str, ...]:
    compilers = tuple(text.split(","))
    if not set(compilers) <= set(COMPILERS):
        raise argparse.ArgumentTypeError(f"compilers are {', '.join(COMPILERS)}, got {text!r}")
    return compilers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `zerocompile check`."""
    parser.add_argument(
        "--device", default=None, help="cpu, or an accelerator type such as cuda (default: the accelerator torch finds, else cpu)"
    )
    parser.add_argument("--ranks", type=positive_int, default=None, help="ranks (default: 2 on the CPU, one per GPU)")
    parser.add_argument(
        "--fake-ranks", type=positive_int, default=None, help="only stage 3 as rank 0 of N on the fake process group (memory)"
    )
    parser.add_argument("--stages", type=_stage_list, default=STAGES, help="comma-separated (default 0,1,2,3)")
    parser.add_argument("--compilers", type=_compiler_list, default=COMPILERS, help="comma-separated (default eager,inductor)")
    parser.add_argument("--json", type=Path, default=None, help="also write the environment and every row here")
    add_offload_arguments(
        parser,
        disk_help="train stages 1-3 with their optimizer state on disk there (offload='disk'), and measure its bandwidth",
        cpu_help="train stages 1-3 with their optimizer state in host memory and the update on the CPU (offload='cpu', "
        "for parameters on an accelerator)",
    )
    spawn.add_allocator_argument(parser)


def run(args: argparse.Namespace) -> int:
    """`zerocompile check`: 0 if every row is within bounds, 1 otherwise, 2 if it cannot run here."""
    preload = spawn.find_allocator(args.allocator)
    print(spawn.allocator_line(preload), flush=True)
    device = args.device or (torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")).type
    try:
        offload_dir = str(args.offload_dir) if args.offload_dir is not None else None
        runs = plan(
            device, visible_devices(device), args.ranks, args.fake_ranks, args.stages, args.compilers, offload_dir, args.offload_cpu
        )
    except ValueError as impossible:
        print(f"zerocompile check: {impossible}", file=sys.stderr)
        return 2
    facts = {**environment(device), "ranks' malloc": preload or "C library"}
    if args.offload_dir is not None:
        facts["offload dir"] = offload_directory_fact(args.offload_dir)
    for key, value in facts.items():
        print(f"{key:24} {value}")
    started = time.perf_counter()
    rows = [row for one in runs for row in execute(one, preload)]
    print(f"measured in {time.perf_counter() - started:.0f} s", flush=True)
    return conclude(facts, runs, rows, args.json)
