"""One visit to a lent GPU, as one command: parity, the fake-group benchmark, a trace, a summary.

    python -m zerocompile.tools.gpu_visit --device cuda --out "$OUT"

Device time is scarce (minutes per session), so everything a visit should learn runs in one call,
in order of what matters most, each step in a process of its own with its own time limit: a step
that fails or hangs is reported with its output and the next one runs. What each step does:

  parity   a tiny GPT (tied embeddings) trained 4 steps with SGD and with AdamW under DDP and under
           zerocompile stages 0-3, eager compiler and Inductor, same seed and global batch; max
           |Δ param| against DDP. On one NCCL rank on the device (real Triton kernels and NCCL
           calls, trivial collectives), then on two gloo ranks sharing the device (gloo stages the
           device's tensors through host memory: real two-rank arithmetic, eager compiler only;
           stage 0 alone on an accelerator, where shard() refuses gloo at stages 1-3: its coalesced
           all-gather of device tensors crashes, pytorch/pytorch#152645)
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
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

PARITY_STEPS = 4
# The parity model: tied embeddings, and sizes that no world size divides, so shards are padded.
PARITY_GPT = dict(vocab_size=250, block_size=32, n_layer=2, n_head=2, n_embd=36)
# One NCCL rank runs the same kernels as DDP where the compiler is eager, so only rounding of the
# collectives' own copies could differ: 1e-6. Inductor fuses and reorders fp32 arithmetic, and
# AdamW divides by the root of the second moment, magnifying ulp-level gradient differences where
# gradients are tiny (the CPU suite measures 5e-6 on a GPT; tests/test_parity.py): 1e-4 here,
# a bound to report against, not a claim.
TOLERANCE = {"eager": 1e-6, "inductor": 1e-4}


# ---------------------------------------------------------------------------------------- parity


def _parity_rank(
    rank: int, ranks: int, backend: str, device: str, port: int, compilers: list[str], stages: list[int], out: str
) -> None:
    import torch.distributed as dist
    from torch import nn

    import zerocompile as zc
    from zerocompile.distributed import exit_spawned_rank, loopback_rank_environment
    from zerocompile.tools.gpt import GPT, GPTConfig

    os.environ.update(loopback_rank_environment(rank, ranks, port))
    zc.init_distributed(backend=backend)
    where = torch.device(device)
    config = GPTConfig(**PARITY_GPT)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(config.vocab_size, (PARITY_STEPS, 2 * ranks, config.block_size + 1), generator=generator)
    rows = slice(2 * rank, 2 * rank + 2)

    def train(model: nn.Module, runner: Any, optimizer_name: str) -> list[float]:
        optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.5)
            if optimizer_name == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=1e-3)
        )
        losses = []
        for step in range(PARITY_STEPS):
            batch = tokens[step, rows].to(where)
            loss = runner(batch[:, :-1], batch[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return GPT(config).to(where)

    rows_out = []
    for optimizer_name in ("sgd", "adamw"):
        reference = fresh()
        ddp = nn.parallel.DistributedDataParallel(reference, device_ids=[where] if where.type != "cpu" and backend == "nccl" else None)
        reference_losses = train(reference, ddp, optimizer_name)
        expected = {fqn: p.detach() for fqn, p in reference.named_parameters()}
        for compiler in compilers:
            for stage in stages:
                row: dict[str, Any] = {"optimizer": optimizer_name, "compiler": compiler, "stage": stage}
                started = time.perf_counter()
                try:
                    torch._dynamo.reset()
                    model = zc.shard(fresh(), stage=stage)
                    compiled = torch.compile(model, backend="zero", options={"compiler": compiler})
                    losses = train(model, compiled, optimizer_name)
                    with torch.no_grad():
                        error = max(
                            (_full(p) - expected[fqn]).abs().max().item() for fqn, p in model.named_parameters()
                        )
                    row.update(
                        param_error=error,
                        loss_error=max(abs(a - b) for a, b in zip(losses, reference_losses)),
                        ok=error <= TOLERANCE[compiler],
                    )
                except Exception as failure:  # one failing case must not hide the others
                    row.update(ok=False, error=f"{type(failure).__name__}: {failure}", traceback=traceback.format_exc())
                row["seconds"] = round(time.perf_counter() - started, 1)
                rows_out.append(row)
                if rank == 0:
                    print(f"parity {backend} x{ranks} {_row_text(row)}", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"backend": backend, "ranks": ranks, "device": device, "rows": rows_out}))
    exit_spawned_rank()


def _full(param: torch.Tensor) -> torch.Tensor:
    from zerocompile.sharding import shard_info

    info = shard_info(param)
    return param.detach() if info is None or info.stage == 0 else info.gather(param.detach())


def _row_text(row: dict[str, Any]) -> str:
    head = f"{row['optimizer']:5} {row['compiler']:8} stage {row['stage']}"
    if "error" in row:
        return f"{head}: FAILED {row['error'][:300]}"
    return f"{head}: max|Δ param| {row['param_error']:.2e}, max|Δ loss| {row['loss_error']:.2e} {'ok' if row['ok'] else 'MISMATCH'}"


def run_parity(args: argparse.Namespace) -> int:
    from zerocompile.distributed import free_loopback_port

    torch.multiprocessing.spawn(
        _parity_rank,
        args=(
            args.ranks, args.backend, args.device, free_loopback_port(), args.compilers.split(","),
            [int(stage) for stage in args.stages.split(",")], args.json,
        ),
        nprocs=args.ranks,
    )
    rows = json.loads(Path(args.json).read_text())["rows"]
    return 0 if all(row["ok"] for row in rows) else 1


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
            *(f"- {key}: {value}" for key, value in environment(self.args.device).items()),
            "",
        ]
        for record in self.steps:
            lines += [f"## {record['name']}: exit {record['returncode']}, {record['seconds']} s", ""]
            lines += self.details(record)
        (self.out / "summary.md").write_text("\n".join(lines) + "\n")

    def details(self, record: dict[str, Any]) -> list[str]:
        name = record["name"]
        lines: list[str] = []
        if name.startswith("parity") and (self.work / f"{name}.json").exists():
            report = json.loads((self.work / f"{name}.json").read_text())
            lines += ["| optimizer | compiler | stage | max abs Δ param | max abs Δ loss | verdict |", "|---|---|---|---|---|---|"]
            for row in report["rows"]:
                if "error" in row:
                    lines.append(f"| {row['optimizer']} | {row['compiler']} | {row['stage']} | | | FAILED: {row['error'][:200]} |")
                else:
                    verdict = "ok" if row["ok"] else f"MISMATCH (> {TOLERANCE[row['compiler']]:.0e})"
                    lines.append(
                        f"| {row['optimizer']} | {row['compiler']} | {row['stage']} | {row['param_error']:.2e} "
                        f"| {row['loss_error']:.2e} | {verdict} |"
                    )
            lines.append("")
            for row in report["rows"]:
                if "traceback" in row:
                    lines += [f"{row['optimizer']} {row['compiler']} stage {row['stage']}:", "```", row["traceback"].strip(), "```", ""]
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


def environment(device: str) -> dict[str, str]:
    """What ran: versions of everything that decides the generated code and the collectives."""
    import zerocompile

    facts = {
        "date": f"{datetime.date.today()}",
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "zerocompile": zerocompile.__version__,
        "device": device,
    }
    if torch.cuda.is_available():
        facts["gpu"] = f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
        facts["cuda"] = str(torch.version.cuda)
        facts["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = "not installed"
    facts["cpus"] = str(os.cpu_count())
    return facts


def run_visit(args: argparse.Namespace) -> int:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    visit = Visit(args)
    me = "zerocompile.tools.gpu_visit"
    gpu = args.device != "cpu"
    quick = args.quick
    bench_steps = ["--steps", "2", "--warmup", "1"] if quick else ["--steps", "6", "--warmup", "2"]
    bench_modes = "compile-bf16,fsdp2-compile-bf16,zero3-bf16"
    sizes = [("tiny", "8")] if quick else [("400m", "64"), *([("1.3b", "64")] if args.large else [])]
    work = visit.work
    try:
        # Most important first: does it compute the right thing on this device at all.
        visit.step(
            "parity-1-rank",
            [me, "parity", "--device", args.device, "--backend", "nccl" if gpu else "gloo", "--ranks", "1",
             "--compilers", "eager,inductor", "--json", str(work / "parity-1-rank.json")],
            timeout=80 if gpu else 900,
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
        visit.step(
            "parity-2-gloo-ranks",
            [me, "parity", "--device", args.device, "--backend", "gloo", "--ranks", "2", "--compilers", "eager",
             *([] if not gpu else ["--stages", "0"]), "--json", str(work / "parity-2-gloo-ranks.json")],
            timeout=35 if gpu else 600,
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
    parity = steps.add_parser("parity", help="one parity run (a step of the visit)")
    parity.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parity.add_argument("--backend", default="nccl")
    parity.add_argument("--ranks", type=int, default=1)
    parity.add_argument("--compilers", default="eager,inductor")
    parity.add_argument("--stages", default="0,1,2,3")
    parity.add_argument("--json", required=True)
    trace = steps.add_parser("trace", help="the traced stage-3 compile (a step of the visit)")
    trace.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    trace.add_argument("--out", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"parity": run_parity, "trace": run_trace}.get(args.step, run_visit)(args)


if __name__ == "__main__":
    sys.exit(main())
