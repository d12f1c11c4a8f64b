"""One visit to a lent GPU, as one command: `zerocompile check`, the fake-group benchmark, a trace, a summary.

    python -m zerocompile.tools.gpu_visit --device cuda --out "$OUT"

Device time is scarce (minutes per session), so everything a visit should learn runs in one call,
in order of what matters most, each step in a process of its own with its own time limit: a step
that fails or hangs is reported with its output and the next one runs. What each step does:

  check    `zerocompile check --device <dev> --json ...`: a small GPT under DDP and under stages 0-3,
           eager compiler and Inductor, gradients, parameters, model-state bytes, bytes sent and
           step time against DDP's (see zerocompile/tools/check.py for what runs on one GPU, on
           several, and on the CPU)
  bench    `zerocompile bench --fake-ranks 8`, bf16: stage 3 against plain torch.compile and
           FSDP2+compile on torch's "fake" process group (real kernels, real all-gather and
           reduce-scatter shapes, communication free) on a 400M GPT, then on a 1.3B one
  trace    a stage-3 compile of a small GPT on the fake group under TORCH_TRACE (for tlparse), and
           the code Inductor generated for its forward and backward

What comes back ($OUT): summary.md (every figure, every failure with its output), visit.log,
forward.py / backward.py (Inductor's code), trace.log.gz, results.tar.gz (the JSON and tables).
`--device cpu` runs the same visit on gloo CPU ranks with C++ kernels, so it can be tried anywhere;
`--quick` shrinks every step to a smoke run.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
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

from zerocompile.tools import check

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


# ----------------------------------------------------------------------------------------- visit


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

    def step(self, name: str, command: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run `command` (a Python module's arguments) in a process of its own, output to the log."""
        print(f"== {name}: {' '.join(command)} (limit {timeout:.0f} s)", flush=True)
        begin = time.perf_counter()
        record: dict[str, Any] = {"name": name, "command": " ".join(command)}
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

    def write_summary(self) -> None:
        lines = [
            f"# GPU visit, {self.started:%Y-%m-%d %H:%M} UTC",
            "",
            f"Command: `python -m zerocompile.tools.gpu_visit {' '.join(sys.argv[1:])}`",
            "",
            *(f"- {key}: {value}" for key, value in self.facts.items()),
            "",
        ]
        for record in self.steps:
            lines += [f"## {record['name']}: exit {record['returncode']}, {record['seconds']} s", ""]
            lines += self.details(record)
        (self.out / "summary.md").write_text("\n".join(lines) + "\n")

    def details(self, record: dict[str, Any]) -> list[str]:
        name = record["name"]
        lines: list[str] = []
        if name == "check" and (self.work / "check.json").exists():
            lines += check_details(json.loads((self.work / "check.json").read_text()))
        if name.startswith("bench") and (self.work / name / "bench.md").exists():
            lines += [(self.work / name / "bench.md").read_text(), ""]
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
    lines = [check.render(report["rows"]), ""]
    lines += [f"- {problem}" for problem in report["problems"]]
    for row in report["rows"]:
        if row.get("traceback"):
            lines += [f"{check.row_name(row)}:", "```", row["traceback"].strip(), "```", ""]
    return [*lines, ""]


def environment(device: str) -> dict[str, str]:
    """What ran: the check's facts (versions of everything that decides the generated code and the
    collectives, devices, C++ compiler), with the date and the CPUs."""
    return {"date": f"{datetime.date.today()}", **check.environment(device), "cpus": str(os.cpu_count())}


def run_visit(args: argparse.Namespace) -> int:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    visit = Visit(args)
    me = "zerocompile.tools.gpu_visit"
    gpu = args.device != "cpu"
    quick = args.quick
    check_narrowing = ["--stages", "0,3", "--compilers", "eager"] if quick else []
    bench_steps = ["--steps", "2", "--warmup", "1"] if quick else ["--steps", "6", "--warmup", "2"]
    bench_modes = "compile-bf16,fsdp2-compile-bf16,zero3-bf16"
    sizes = [("tiny", "8")] if quick else [("400m", "64"), *([("1.3b", "64")] if args.large else [])]
    work = visit.work
    try:
        # Most important first: does it compute the right thing on this device at all.
        visit.step(
            "check",
            ["zerocompile.tools.cli", "check", "--device", args.device, *check_narrowing,
             "--json", str(work / "check.json")],
            timeout=240 if gpu else 900,
        )
        size, batch = sizes[0]
        visit.step(
            f"bench-{size}",
            ["zerocompile.tools.cli", "bench", "--fake-ranks", "8", "--device", args.device, "--model-size", size,
             "--modes", bench_modes, "--batch-size", batch, *bench_steps, "--out", str(work / f"bench-{size}")],
            timeout=180 if gpu else 900,
        )
        (work / "trace").mkdir()
        visit.step(
            "trace",
            [me, "trace", "--device", args.device, "--out", str(visit.out)],
            timeout=40 if gpu else 300,
            env={"TORCH_TRACE": str(work / "trace")},
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
    parser = argparse.ArgumentParser(prog="python -m zerocompile.tools.gpu_visit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="gpu-visit")
    parser.add_argument("--quick", action="store_true", help="every step as a smoke run")
    parser.add_argument("--large", action="store_true", help="also the 1.3B GPT (about 3 more minutes on an H200)")
    steps = parser.add_subparsers(dest="step")
    trace = steps.add_parser("trace", help="the traced stage-3 compile (a step of the visit)")
    trace.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    trace.add_argument("--out", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"trace": run_trace}.get(args.step, run_visit)(args)


if __name__ == "__main__":
    sys.exit(main())
