"""One visit to a lent GPU, as one command: `zerocompile check`, the fake-group benchmark, a trace, a summary.

    python -m benchmarks.gpu_visit --device cuda --out "$OUT"

Device time is scarce (minutes per session), so everything a visit should learn runs in one call,
in order of what matters most, each step in a process of its own with its own time limit: a step
that fails or hangs is reported with its output and the next one runs. What each step does:

  profile  each of --profile-modes (plain compile, stage 3 and FSDP2 compiled per block, bf16) on the
           fake group of 8 and on one real rank (--profile-group): forward / backward / optimizer
           seconds, ops dispatched per step, then torch.profiler's kernels and device time per
           family; the summary judges stage 3 against its targets (step <= 1.15x plain compile's
           and <= 0.85x FSDP2's, kernels <= 1.3x plain compile's plus the collectives, device busy
           >= 70 %); on a GPU, compile-bf16 and zero3-bf16 again with Inductor's CUDA-graph trees
  check    `zerocompile check --device <dev> --json ...`: a small GPT under DDP and under stages 0-3,
           eager compiler and Inductor, gradients, parameters, model-state bytes, bytes sent and
           step time against DDP's (see tools/check.py for what runs on one GPU, on
           several, and on the CPU); then stages 1 and 3 with the optimizer state on disk
           (check-offload: `--offload-dir`, the state staged on the device for each bucket's step;
           check-offload-cpu: `--offload-cpu`, the update on the CPU between pinned copies)
  trace    a stage-3 compile of a small GPT on the fake group under TORCH_TRACE (for tlparse), and
           the code Inductor generated for its forward and backward
  bench    `zerocompile bench --fake-ranks 8`, bf16: stage 3 against plain torch.compile and
           FSDP2+compile on torch's "fake" process group (real kernels, real all-gather and
           reduce-scatter shapes, communication free) on a 400M GPT, then (--large) on a 1.3B one;
           bench-offload-cpu: one real rank, zero3 beside zero3-offload-cpu (offload="cpu")

What comes back ($OUT): summary.md (every figure, every failure with its output), visit.log,
forward.py / backward.py (Inductor's code), trace.log.gz, results.tar.gz (the JSON and tables).
`--device cpu` runs the same visit on gloo CPU ranks with C++ kernels, so it can be tried anywhere;
`--quick` shrinks every step to a smoke run; `--budget S` fits the whole visit into S seconds (a
device lease's call has a hard limit). The profiles' Chrome traces are in results.tar.gz.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from zerocompile.tools import check, check_verdict

# ----------------------------------------------------------------------------------------- trace


def run_trace(args: argparse.Namespace) -> int:
    """Stage 3 of a small GPT on a fake 8-rank group: compile, one step; Inductor's code saved."""
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zerocompile as zc
    from zerocompile.tools.gpt import SIZES, GPT

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = zc.shard(GPT(SIZES["small"]).to(device), stage=3, param_dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="zero")
    tokens = torch.randint(256, (2, 129), device=device)

    def step() -> None:
        compiled(tokens[:, :-1], tokens[:, 1:]).backward()

    _, codes = run_and_get_code(step)
    out = Path(args.out)
    for kind, code in zip(("forward", "backward"), codes):
        (out / f"{kind}.py").write_text(code)
    print(f"trace: {len(codes)} generated modules, {sum(len(c) for c in codes):,} characters", flush=True)
    return 0 if len(codes) >= 2 else 1


# --------------------------------------------------------------------------------------- profile

# Kernel families by name, first match wins: where a step's device time goes.
KERNEL_FAMILIES = (
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "sm80_", "cublas", "matmul", "mm_")),
    ("triton (Inductor)", ("triton_",)),
    ("copy / fill", ("memcpy", "memset", "copy", "fill", "cat")),
    ("collective", ("nccl",)),
)


def kernel_family(name: str) -> str:
    lowered = name.lower()
    return next((family for family, marks in KERNEL_FAMILIES if any(mark in lowered for mark in marks)), "other")


def run_profile(args: argparse.Namespace) -> int:
    """One bench mode on a fake group, timed by phase and then under torch.profiler: where its
    step's time goes, kernel by kernel. Writes profile-<mode>.json and .txt to --out."""
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch._dynamo.utils import counters

    from zerocompile.distributed import default_backend
    from zerocompile.tools import dispatched
    from zerocompile.tools.bench.modes import MODES
    from zerocompile.tools.bench.settings import Settings
    from zerocompile.tools.bench.steps import RandomBatches, one_step, training_step
    from zerocompile.tools.gpt import SIZES, GPT
    from zerocompile.tools.spawn import free_loopback_port

    device = torch.device(args.device)
    if args.cudagraphs:
        # This process only (a step of its own): Inductor's CUDA-graph trees for every graph it
        # compiles, stage 3's included (what mode="reduce-overhead" turns on for plain compile).
        torch._inductor.config.triton.cudagraphs = True
    if args.real_group:
        # One real rank: the device's own backend, whose collectives at N = 1 are a copy at most.
        # The fake backend instead copies every gathered input into each of its N chunks, one
        # copy per parameter and rank: kernels of its own that a real group does not launch.
        dist.init_process_group(default_backend(device), init_method=f"tcp://127.0.0.1:{free_loopback_port()}",
                                rank=0, world_size=1)
    else:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.ranks)
    torch.manual_seed(0)
    config = SIZES[args.model_size]
    prepared = MODES[args.mode].build(GPT(config).to(device), "adamw")
    ranks = 1 if args.real_group else args.ranks
    # bench's own step and batches: phases timed to the end of the device's queued work.
    settings = Settings(
        ranks=ranks, model_size=args.model_size, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
        seed=0, modes=(args.mode,), interleave=(), cache_root="", device=device, fake=not args.real_group,
    )  # fmt: skip
    batches = RandomBatches(config, settings, 0, device)

    def step() -> tuple[float, float, float]:
        return one_step(prepared, batches).phases

    with dispatched.kernel_profiling():
        for _ in range(args.warmup):
            step()
    phases = [step() for _ in range(args.steps)]
    host = dispatched.dispatched_per_step(lambda: training_step(prepared, batches), device)
    on_device = device.type != "cpu"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
    with profile(activities=activities) as profiler:
        for _ in range(args.steps):
            step()
    kernels = [event for event in profiler.events() if event.device_type != DeviceType.CPU] if on_device else []
    families: dict[str, list[float]] = {}
    for kernel in kernels:
        count_and_time = families.setdefault(kernel_family(kernel.name), [0, 0.0])
        count_and_time[0] += 1
        count_and_time[1] += kernel.device_time_total
    per_step = {family: {"kernels": count / args.steps, "device_ms": round(us / args.steps / 1000, 3)}
                for family, (count, us) in sorted(families.items(), key=lambda item: -item[1][1])}
    median = sorted(phases, key=sum)[len(phases) // 2]
    report = {
        "mode": args.mode, "model_size": args.model_size, "group": dist.get_backend(),
        "ranks": dist.get_world_size(), "batch_size": args.batch_size,
        "step_s": round(sum(median), 4), "forward_s": round(median[0], 4), "backward_s": round(median[1], 4),
        "optimizer_s": round(median[2], 4), "kernels_per_step": len(kernels) / args.steps,
        "device_ms_per_step": round(sum(k.device_time_total for k in kernels) / args.steps / 1000, 3),
        "ops_per_step": host["ops"], "cudagraphs": args.cudagraphs,
        # Why Inductor ran a graph without its CUDA graph, if it did (its own counter).
        "cudagraph_skips": dict(counters["inductor"]) if args.cudagraphs else {},
        "families": per_step,
    }
    report["device_busy"] = round(report["device_ms_per_step"] / 1000 / report["step_s"], 3) if on_device else None
    out = Path(args.out)
    name = profile_name(args.mode, args.real_group, args.cudagraphs)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=70)
    (out / f"{name}.txt").write_text(table)
    profiler.export_chrome_trace(str(out / f"chrome-trace-{name}.json"))
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()
    return 0


def profile_name(mode: str, real_group: bool, cudagraphs: bool = False) -> str:
    """The step's and its files' name: a real one-rank group's profile beside the fake group's."""
    return f"profile-{mode}" + ("-one-real-rank" if real_group else "") + ("-cudagraphs" if cudagraphs else "")


def profile_details(reports: list[dict[str, Any]]) -> list[str]:
    """The profiled modes side by side: phases, then device time and kernels per family."""
    if not reports:
        return []
    names = [
        f"{report['mode']} ({report['group']} x{report['ranks']}{', CUDA graphs' if report.get('cudagraphs') else ''})"
        for report in reports
    ]
    lines = ["| per step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    keys = ("step_s", "forward_s", "backward_s", "optimizer_s", "ops_per_step", "kernels_per_step",
            "device_ms_per_step", "device_busy")
    for key in keys:
        lines.append(f"| {key} | " + " | ".join(str(report.get(key)) for report in reports) + " |")
    families = sorted({family for report in reports for family in report["families"]})
    for family in families:
        cells = [report["families"].get(family, {"kernels": 0, "device_ms": 0}) for report in reports]
        lines.append(f"| {family}: ms (kernels) | "
                     + " | ".join(f"{cell['device_ms']} ({cell['kernels']:g})" for cell in cells) + " |")
    return [*lines, ""]


# Stage 3 on a GPU against plain torch.compile and FSDP2 (per-block compile), bf16, per group:
# (what, the bound, how the figure is worked out from the profiles).
TARGETS = (
    ("step vs compile-bf16", 1.15, lambda z, c, f: z["step_s"] / c["step_s"]),
    ("step vs fsdp2-compile-bf16", 0.85, lambda z, c, f: z["step_s"] / f["step_s"]),
    # Kernels beyond plain compile's collectives included: stage 3's own collectives may add.
    (
        "kernels vs compile-bf16's + stage 3's collectives",
        1.3,
        lambda z, c, f: z["kernels_per_step"] / (c["kernels_per_step"] + z["families"].get("collective", {}).get("kernels", 0)),
    ),
)
MIN_DEVICE_BUSY = 0.70


def target_lines(reports: list[dict[str, Any]]) -> list[str]:
    """Each group's stage-3 profile against the targets: met or missed, with the figure."""
    lines = []
    for real in (False, True):
        by_mode = {r["mode"]: r for r in reports if (r["group"] != "fake") == real and not r.get("cudagraphs")}
        zero3, plain, fsdp2 = (by_mode.get(m) for m in ("zero3-bf16", "compile-bf16", "fsdp2-compile-bf16"))
        where = "one real rank" if real else "fake group"
        if zero3 is None or plain is None or fsdp2 is None:
            lines.append(f"- {where}: not all of compile-bf16, zero3-bf16, fsdp2-compile-bf16 were profiled")
            continue
        for name, bound, figure in TARGETS:
            value = figure(zero3, plain, fsdp2)
            lines.append(f"- {where}, {name}: {value:.2f} (<= {bound}): {'met' if value <= bound else 'MISSED'}")
        busy = zero3.get("device_busy")
        if busy is not None:
            lines.append(f"- {where}, device busy: {busy:.2f} (>= {MIN_DEVICE_BUSY}): {'met' if busy >= MIN_DEVICE_BUSY else 'MISSED'}")
    return lines


# ------------------------------------------------------------------------------------- deepspeed

# The modes each DeepSpeed step interleaves on one real rank, and the bound on stage 3's step
# against DeepSpeed ZeRO-3's there (issue 68).
DEEPSPEED_STEPS = {
    "bench-deepspeed": "compile-bf16,zero3-bf16,deepspeed3-bf16",
    "bench-deepcompile": "zero3-bf16,deepspeed3-deepcompile-bf16",
}
DEEPSPEED_BOUND = 0.80
PEER_WHEELS = ("DeepSpeed is not importable here: on the GPU machine, run `bash benchmarks/peer_wheels.sh` "
               "here first, carry .whl and install it as that script says")


def deepspeed_bench(visit: "Visit", device: str, size: str, batch: str, bench_steps: list[str], gpu: bool) -> None:
    """The DeepSpeed steps: skipped with the way to install it where it is missing (the GPU image
    has no DeepSpeed), DeepCompile on CUDA only."""
    for name, modes in DEEPSPEED_STEPS.items():
        if name == "bench-deepcompile" and not gpu:
            continue
        if importlib.util.find_spec("deepspeed") is None:
            visit.skip(name, PEER_WHEELS)
            continue
        visit.step(
            name,
            ["zerocompile.tools.cli", "bench", "--ranks", "1", "--device", device, "--model-size", size,
             "--modes", "none", "--interleave", modes, "--batch-size", batch, *bench_steps,
             "--out", str(visit.work / name)],
            timeout=240 if gpu else 900,
        )


def deepspeed_target_lines(work: Path) -> list[str]:
    """Stage 3's step against DeepSpeed's ZeRO-3 (and DeepCompile's) where they ran side by side."""
    lines = []
    for name, modes in DEEPSPEED_STEPS.items():
        path = work / name / "bench.json"
        if not path.exists():
            continue
        times = json.loads(path.read_text())["interleaved"]["step_time_s"]
        peer = modes.split(",")[-1]
        ratio = times["zero3-bf16"] / times[peer]
        verdict = f" (<= {DEEPSPEED_BOUND}): {'met' if ratio <= DEEPSPEED_BOUND else 'MISSED'}" if peer == "deepspeed3-bf16" else ""
        lines.append(f"- one real rank, step vs {peer}: {ratio:.2f}{verdict}")
    return lines


# ----------------------------------------------------------------------------------------- visit


MIN_STEP_SECONDS = 20  # less is not worth starting a step: compiling alone takes longer


class Visit:
    """Runs the steps, keeps their outcomes, and rewrites summary.md after each one."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.work = Path(tempfile.mkdtemp(prefix="zerocompile-visit-"))
        self.log = (self.out / "visit.log").open("a")
        self.steps: list[dict[str, Any]] = []
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.facts = environment(args.device)  # once: it runs the C++ compiler to read its version
        self.deadline = time.perf_counter() + getattr(args, "budget", float("inf"))

    def step(self, name: str, command: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run `command` (a Python module's arguments) in a process of its own, output to the log."""
        begin = time.perf_counter()
        record: dict[str, Any] = {"name": name, "command": " ".join(command)}
        # The lease ends the whole call at its limit: a step cut short by the visit's own budget
        # still leaves the summary and the results archive written.
        timeout = min(timeout, self.deadline - begin)
        if timeout < MIN_STEP_SECONDS:
            print(f"== {name}: skipped, {self.deadline - begin:.0f} s of the visit's budget left", flush=True)
            record.update(returncode="skipped (budget)", output="", seconds=0.0)
            self.steps.append(record)
            self.write_summary()
            return record
        print(f"== {name}: {' '.join(command)} (limit {timeout:.0f} s)", flush=True)
        try:
            result = subprocess.run(
                [sys.executable, "-m", *command],
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
            record.update(returncode=result.returncode, output=result.stdout)
        except subprocess.TimeoutExpired as expired:
            output = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
            record.update(returncode="timeout", output=output)
        record["seconds"] = round(time.perf_counter() - begin, 1)
        self.log.write(f"\n===== {name} ({record['seconds']} s, exit {record['returncode']})\n{record['output']}")
        self.log.flush()
        print(f"   exit {record['returncode']} after {record['seconds']} s", flush=True)
        self.steps.append(record)
        self.write_summary()
        return record

    def skip(self, name: str, why: str) -> None:
        """A step that cannot run here, reported with what would let it."""
        print(f"== {name}: skipped, {why}", flush=True)
        self.steps.append({"name": name, "command": "", "returncode": f"skipped ({why})", "output": "", "seconds": 0.0})
        self.write_summary()

    def write_summary(self) -> None:
        lines = [
            f"# GPU visit, {self.started:%Y-%m-%d %H:%M} UTC",
            "",
            f"Command: `python -m benchmarks.gpu_visit {' '.join(sys.argv[1:])}`",
            "",
            *(f"- {key}: {value}" for key, value in self.facts.items()),
            "",
        ]
        profiled = sorted((self.work / "profile").glob("profile-*.json")) if (self.work / "profile").exists() else []
        reports = [json.loads(path.read_text()) for path in profiled]
        targets = [*(target_lines(reports) if reports else []), *deepspeed_target_lines(self.work)]
        if targets:
            lines += ["## Stage 3 against its targets", "", *targets, ""]
        if reports:
            lines += ["## Profiled modes side by side", ""]
            lines += profile_details(reports)
        for record in self.steps:
            lines += [f"## {record['name']}: exit {record['returncode']}, {record['seconds']} s", ""]
            lines += self.details(record)
        (self.out / "summary.md").write_text("\n".join(lines) + "\n")

    def details(self, record: dict[str, Any]) -> list[str]:
        name = record["name"]
        lines: list[str] = []
        if name.startswith("check") and (self.work / f"{name}.json").exists():
            lines += check_details(json.loads((self.work / f"{name}.json").read_text()))
        if name.startswith("bench") and (self.work / name / "bench.md").exists():
            lines += [(self.work / name / "bench.md").read_text(), ""]
        if name.startswith("profile-") and (self.work / "profile" / f"{name}.txt").exists():
            report = json.loads((self.work / "profile" / f"{name}.json").read_text())
            table = (self.work / "profile" / f"{name}.txt").read_text()
            lines += [*profile_details([report]), "```", table.strip(), "```", ""]
        if record["returncode"] != 0:
            lines += ["Output (last 6000 characters):", "```", record["output"][-6000:].strip(), "```", ""]
        return lines

    def finish(self) -> None:
        with tarfile.open(self.out / "results.tar.gz", "w:gz") as archive:
            archive.add(self.work, arcname="results")
        traces = sorted((self.work / "trace").glob("*.log")) if (self.work / "trace").exists() else []
        if traces:
            with gzip.open(self.out / "trace.log.gz", "wb") as packed:
                for trace in traces:
                    packed.write(trace.read_bytes())
        self.write_summary()
        self.log.close()
        shutil.rmtree(self.work, ignore_errors=True)


def check_details(report: dict[str, Any]) -> list[str]:
    """The check's table, what was off in it, and the traceback of a row that failed."""
    lines = [check_verdict.render(report["rows"]), ""]
    lines += [f"- {problem}" for problem in report["problems"]]
    for row in report["rows"]:
        if row.get("traceback"):
            lines += [f"{check_verdict.row_name(row)}:", "```", row["traceback"].strip(), "```", ""]
    return [*lines, ""]


def environment(device: str) -> dict[str, str]:
    """What ran: the check's facts (versions of everything that decides the generated code and the
    collectives, devices, C++ compiler), with the date and the CPUs."""
    return {"date": f"{datetime.date.today()}", **check.environment(device), "cpus": str(os.cpu_count())}


def run_visit(args: argparse.Namespace) -> int:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    visit = Visit(args)
    me = "benchmarks.gpu_visit"
    gpu = args.device != "cpu"
    quick = args.quick
    check_narrowing = ["--stages", "0,3", "--compilers", "eager"] if quick else []
    bench_steps = ["--steps", "2", "--warmup", "1"] if quick else ["--steps", "6", "--warmup", "2"]
    bench_modes = "compile-bf16,fsdp2-compile-bf16,zero3-bf16"
    sizes = [("tiny", "8")] if quick else [("400m", "64"), *([("1.3b", "64")] if args.large else [])]
    work = visit.work
    try:
        # Most important first: stage 3 against its targets (its correctness on a GPU was shown
        # on earlier visits, and `check` follows).
        size, batch = sizes[0]
        (work / "profile").mkdir()

        def profile(mode: str, real_group: bool, cudagraphs: bool = False) -> None:
            visit.step(
                profile_name(mode, real_group, cudagraphs),
                [me, "profile", "--device", args.device, "--mode", mode, "--model-size", size,
                 "--batch-size", str(int(batch) // 8) if real_group else batch,
                 *(["--real-group"] if real_group else []), *(["--cudagraphs"] if cudagraphs else []),
                 *(["--warmup", "1", "--steps", "1"] if quick else []), "--out", str(work / "profile")],
                timeout=150 if gpu else 600,
            )

        for real_group in {"fake": [False], "real": [True], "both": [False, True]}[args.profile_group]:
            for mode in args.profile_modes.split(","):
                profile(mode, real_group)
        if gpu:  # do Inductor's CUDA-graph trees take stage 3's graphs (one real rank, as a user runs it)?
            for mode in ("compile-bf16", "zero3-bf16"):
                profile(mode, True, cudagraphs=True)
        # Stage 3 beside DeepSpeed's ZeRO-3 (and DeepCompile, its compiler route, CUDA only) on
        # one real rank, round by round: what users would run instead of us on this device.
        deepspeed_bench(visit, args.device, size, str(int(batch) // 8), bench_steps, gpu)
        visit.step(
            "check",
            ["zerocompile.tools.cli", "check", "--device", args.device, *check_narrowing,
             "--json", str(work / "check.json")],
            timeout=240 if gpu else 900,
        )
        # Stages 1 and 3 with their optimizer state offloaded, against DDP like every check row: on disk
        # (the state copied to the device for each bucket's step and back) and in pinned host memory
        # (the shards and gradients copied to the host, updated on the CPU, copied back, events
        # ordering the copies). Neither path's device side runs on the CPU.
        (work / "offload").mkdir()
        for name, flags in (("check-offload", ["--offload-dir", str(work / "offload")]), ("check-offload-cpu", ["--offload-cpu"])):
            visit.step(
                name,
                ["zerocompile.tools.cli", "check", "--device", args.device, "--stages", "1,3", "--compilers", "eager",
                 *flags, "--json", str(work / f"{name}.json")],
                timeout=120 if gpu else 600,
            )
        (work / "trace").mkdir()
        visit.step(
            "trace",
            [me, "trace", "--device", args.device, "--out", str(visit.out)],
            timeout=40 if gpu else 300,
            env={"TORCH_TRACE": str(work / "trace")},
        )
        visit.step(
            f"bench-{size}",
            ["zerocompile.tools.cli", "bench", "--fake-ranks", "8", "--device", args.device, "--model-size", size,
             "--modes", bench_modes, "--batch-size", batch, *bench_steps, "--out", str(work / f"bench-{size}")],
            timeout=180 if gpu else 900,
        )
        # offload="cpu"'s speed: one real rank, its optimizer step with the state in pinned host
        # memory and the update on the CPU beside zero3's on the device, interleaved round by round.
        visit.step(
            "bench-offload-cpu",
            ["zerocompile.tools.cli", "bench", "--ranks", "1", "--device", args.device, "--model-size", sizes[0][0],
             "--modes", "none", "--interleave", "zero3,zero3-offload-cpu", "--batch-size", "8", *bench_steps,
             "--out", str(work / "bench-offload-cpu")],
            timeout=180 if gpu else 900,
        )
        for size, batch in sizes[1:]:
            visit.step(
                f"bench-{size}",
                ["zerocompile.tools.cli", "bench", "--fake-ranks", "8", "--device", args.device, "--model-size", size,
                 "--modes", bench_modes, "--batch-size", batch, *bench_steps, "--out", str(work / f"bench-{size}")],
                timeout=150,
            )
    finally:
        visit.finish()
    failed = [record["name"] for record in visit.steps if record["returncode"] != 0]
    print(f"visit done: {len(visit.steps)} steps, failed: {', '.join(failed) or 'none'}; summary in {visit.out}/summary.md")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_visit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="gpu-visit")
    parser.add_argument("--quick", action="store_true", help="every step as a smoke run")
    parser.add_argument("--large", action="store_true", help="also the 1.3B GPT (about 3 more minutes on an H200)")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds for the whole visit: steps are cut to fit, later ones skipped")
    parser.add_argument("--profile-modes", default="compile-bf16,zero3-bf16,fsdp2-compile-bf16",
                        help="bench modes to profile kernel by kernel (comma-separated)")
    parser.add_argument("--profile-group", choices=("fake", "real", "both"), default="both",
                        help="profile on the fake group of 8 (as the bench), on one real rank with one rank's "
                        "batch (collectives at N = 1: what the passes cost without the fake group's copies), or both")
    steps = parser.add_subparsers(dest="step")
    trace = steps.add_parser("trace", help="the traced stage-3 compile (a step of the visit)")
    trace.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    trace.add_argument("--out", required=True)
    profiled = steps.add_parser("profile", help="one bench mode timed by phase and profiled (a step of the visit)")
    profiled.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    profiled.add_argument("--mode", required=True)
    profiled.add_argument("--model-size", default="400m")
    profiled.add_argument("--batch-size", type=int, default=64, help="global: each of the ranks runs 1/ranks of it")
    profiled.add_argument("--ranks", type=int, default=8, help="size of the fake group")
    profiled.add_argument("--real-group", action="store_true",
                          help="instead, a real group of one rank (nccl on CUDA, gloo on the CPU): the whole "
                          "--batch-size on it, collectives at N = 1")
    profiled.add_argument("--warmup", type=int, default=2)
    profiled.add_argument("--steps", type=int, default=3)
    profiled.add_argument("--rows", type=int, default=25, help="rows of the kernel table")
    profiled.add_argument("--cudagraphs", action="store_true",
                          help="compile with Inductor's CUDA-graph trees (triton.cudagraphs) in this process")
    profiled.add_argument("--out", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"trace": run_trace, "profile": run_profile}.get(args.step, run_visit)(args)


if __name__ == "__main__":
    sys.exit(main())
