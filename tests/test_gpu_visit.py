"""The GPU visit (benchmarks/gpu_visit.py) keeps working between visits: device time is
minutes per session, so a visit that breaks on the device is a visit lost. Here its first step,
`zerocompile check`, runs on two gloo CPU ranks through the visit's own step runner, and the
summary must carry the check's table; a stage that trained differently from DDP must show as a
mismatch naming the row, not as ok."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import gpu_visit
from zerocompile.tools import check_verdict


@pytest.fixture
def visit(tmp_path: Path) -> Iterator[gpu_visit.Visit]:
    """A visit writing to tmp_path; its scratch directory (outside tmp_path) goes when the test ends."""
    visit = gpu_visit.Visit(argparse.Namespace(out=str(tmp_path), device="cpu"))
    yield visit
    shutil.rmtree(visit.work, ignore_errors=True)


def test_check_step_matches_ddp_and_lands_in_the_summary(visit: gpu_visit.Visit, tmp_path: Path) -> None:
    # The visit's command, narrowed to the eager compiler at stage 0 to stay cheap (tests/test_check.py
    # runs stage 3 with both compilers).
    command = ["zerocompile.tools.cli", "check", "--device", "cpu", "--stages", "0", "--compilers", "eager",
               "--json", str(visit.work / "check.json")]
    record = visit.step("check", command, timeout=600)
    assert record["returncode"] == 0, record["output"][-3000:]
    report = json.loads((visit.work / "check.json").read_text())
    visit.finish()
    assert [(row["stage"], row["compiler"]) for row in report["rows"]] == [(0, "eager")]
    # Two gloo ranks, eager compiler: the same ops as DDP's on the same values.
    assert all(row["ok"] and row["param_error"] == 0.0 and row["grad_error"] == 0.0 for row in report["rows"])
    summary = (tmp_path / "summary.md").read_text()
    assert "## check: exit 0" in summary
    assert summary.count("| gloo x2 cpu | ") == 1 and "MISMATCH" not in summary
    assert "- c++ compiler (Inductor): " in summary
    assert (tmp_path / "results.tar.gz").stat().st_size > 0


def test_a_parameter_off_ddp_is_a_mismatch_in_the_summary(visit: gpu_visit.Visit) -> None:
    row = {
        "run": "gloo x2 cpu", "backend": "gloo", "ranks": 2, "device": "cpu", "stage": 3, "compiler": "eager",
        "param_error": 2e-3, "param_fqn": "blocks.0.fc.weight", "grad_error": 0.0, "grad_fqn": "wte.weight",
        "tolerance": 1e-6, "state_bytes": [100, 100], "state_expected": 100, "sent_bytes": None,
        "sent_expected": None, "step_seconds": None, "ddp_compile_seconds": None, "device_peak_bytes": None,
    }
    problems = check_verdict.judge(row)
    report = {"rows": [{**row, "problems": problems, "ok": False}], "problems": problems, "ok": False}
    (visit.work / "check.json").write_text(json.dumps(report))
    lines = visit.details({"name": "check", "returncode": 1, "output": ""})
    assert any("| gloo x2 cpu | 3 | eager | 0.00e+00 | 2.00e-03" in line and "MISMATCH" in line for line in lines), lines
    assert any("stage 3, eager (gloo x2 cpu): max |Δ param| 2.00e-03 against DDP at blocks.0.fc.weight" in line for line in lines), lines


def test_profile_step_times_phases_and_writes_its_table(tmp_path: Path) -> None:
    # The visit's profile step, as a smoke run on the CPU (the eager compiler keeps it cheap): on a
    # GPU its kernel families are what explain a mode's step; here only the host side is profiled.
    command = [sys.executable, "-m", "benchmarks.gpu_visit", "profile", "--device", "cpu", "--mode", "zero3-eager",
               "--model-size", "tiny", "--batch-size", "8", "--warmup", "1", "--steps", "2", "--out", str(tmp_path)]
    root = Path(__file__).resolve().parent.parent  # benchmarks/ is not packaged: run from the repository root
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "profile-zero3-eager.json").read_text())
    assert (report["group"], report["ranks"], report["batch_size"]) == ("fake", 8, 8)
    assert report["step_s"] == pytest.approx(report["forward_s"] + report["backward_s"] + report["optimizer_s"], abs=2e-4)
    assert report["kernels_per_step"] == 0 and report["families"] == {}  # no device kernels on the CPU
    table = (tmp_path / "profile-zero3-eager.txt").read_text()
    # The fake group's flat layout: each bucket packed, gathered, cut out.
    assert "zerocompile::pack" in table or "_c10d_functional::all_gather_into_tensor" in table, table
    assert (tmp_path / "chrome-trace-profile-zero3-eager.json").stat().st_size > 0


@pytest.mark.fast
def test_kernel_families_and_the_side_by_side_table() -> None:
    assert gpu_visit.kernel_family("nvjet_sm90_tst_128x256_64x4_4x2_h_bz_coopA_NTN") == "matmul"
    assert gpu_visit.kernel_family("triton_poi_fused__to_copy_8") == "triton (Inductor)"
    assert gpu_visit.kernel_family("Memcpy DtoD (Device -> Device)") == "copy / fill"
    assert gpu_visit.kernel_family("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "collective"
    assert gpu_visit.kernel_family("void at::native::vectorized_elementwise_kernel<8>") == "other"
    reports = [
        {"mode": mode, "group": "fake", "ranks": 8, "step_s": step, "forward_s": 0.0, "backward_s": 0.0,
         "optimizer_s": 0.0, "kernels_per_step": 3.0, "device_ms_per_step": 1.5, "families": families}
        for mode, step, families in [
            ("compile-bf16", 0.03, {"matmul": {"kernels": 2.0, "device_ms": 1.0}}),
            ("zero3-bf16", 0.09, {"copy / fill": {"kernels": 3.0, "device_ms": 0.5}}),
        ]
    ]
    lines = gpu_visit.profile_details(reports)
    assert lines[0] == "| per step | compile-bf16 (fake x8) | zero3-bf16 (fake x8) |"
    assert "| step_s | 0.03 | 0.09 |" in lines
    # A family one mode never launched shows as zero kernels there, not as a missing cell.
    assert "| matmul: ms (kernels) | 1.0 (2) | 0 (0) |" in lines
    assert "| copy / fill: ms (kernels) | 0 (0) | 0.5 (3) |" in lines


@pytest.mark.fast
def test_targets_say_met_or_missed_per_group() -> None:
    def report(mode: str, group: str, step: float, kernels: float, busy: float | None, collectives: int = 0) -> dict:
        families = {"collective": {"kernels": collectives, "device_ms": 0.0}} if collectives else {}
        return {"mode": mode, "group": group, "step_s": step, "kernels_per_step": kernels, "device_busy": busy,
                "families": families}

    reports = [
        report("compile-bf16", "fake", 0.100, 1000, 0.9),
        report("fsdp2-compile-bf16", "fake", 0.200, 3000, 0.5),
        report("zero3-bf16", "fake", 0.110, 1300, 0.8, collectives=10),  # 1.10x, 0.55x, 1.3 / 1.01
        report("compile-bf16", "nccl", 0.040, 1000, 0.9),
        report("zero3-bf16", "nccl", 0.100, 2000, 0.3),
        report("fsdp2-compile-bf16", "nccl", 0.100, 3000, 0.5),  # 2.5x, 1.0x, 2.0, busy 0.3: all missed
    ]
    lines = gpu_visit.target_lines(reports)
    fake = [line for line in lines if line.startswith("- fake group")]
    real = [line for line in lines if line.startswith("- one real rank")]
    assert len(fake) == len(real) == 4
    assert all(line.endswith(": met") for line in fake), fake
    assert all(line.endswith(": MISSED") for line in real), real
    assert "step vs compile-bf16: 2.50 (<= 1.15)" in real[0]
    assert gpu_visit.target_lines(reports[:2]) == [
        "- fake group: not all of compile-bf16, zero3-bf16, fsdp2-compile-bf16 were profiled",
        "- one real rank: not all of compile-bf16, zero3-bf16, fsdp2-compile-bf16 were profiled",
    ]


@pytest.mark.fast
def test_deepspeed_targets_read_the_side_by_side_benches(tmp_path: Path) -> None:
    def bench(name: str, times: dict[str, float]) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps({"interleaved": {"step_time_s": times}}))

    assert gpu_visit.deepspeed_target_lines(tmp_path) == []  # neither ran
    bench("bench-deepspeed", {"compile-bf16": 0.05, "zero3-bf16": 0.09, "deepspeed3-bf16": 0.10})
    bench("bench-deepcompile", {"zero3-bf16": 0.09, "deepspeed3-deepcompile-bf16": 0.06})
    assert gpu_visit.deepspeed_target_lines(tmp_path) == [
        "- one real rank, step vs deepspeed3-bf16: 0.90 (<= 0.8): MISSED",
        "- one real rank, step vs deepspeed3-deepcompile-bf16: 1.50",
    ]
    bench_json = tmp_path / "bench-deepspeed" / "bench.json"
    bench_json.write_text(json.dumps({"interleaved": {"step_time_s": {"zero3-bf16": 0.07, "deepspeed3-bf16": 0.10}}}))
    assert gpu_visit.deepspeed_target_lines(tmp_path)[0] == "- one real rank, step vs deepspeed3-bf16: 0.70 (<= 0.8): met"


@pytest.mark.fast
def test_without_deepspeed_its_steps_are_skipped_saying_how_to_carry_it(
    visit: gpu_visit.Visit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_visit.importlib.util, "find_spec", lambda name: None)
    ran = []
    monkeypatch.setattr(visit, "step", lambda name, *args, **kwargs: ran.append(name))
    gpu_visit.deepspeed_bench(visit, "cuda", "400m", "8", [], gpu=True)
    assert ran == []
    assert [record["name"] for record in visit.steps] == ["bench-deepspeed", "bench-deepcompile"]
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("skipped (DeepSpeed is not importable here") == 2
    assert "bash benchmarks/peer_wheels.sh" in summary


@pytest.mark.fast
@pytest.mark.parametrize("gpu", [False, True])
def test_deepspeed_steps_run_one_real_rank_side_by_side(visit: gpu_visit.Visit, gpu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_visit.importlib.util, "find_spec", lambda name: object())
    ran = {}
    monkeypatch.setattr(visit, "step", lambda name, command, **kwargs: ran.setdefault(name, command))
    gpu_visit.deepspeed_bench(visit, "cuda" if gpu else "cpu", "400m", "8", ["--steps", "6"], gpu=gpu)
    assert list(ran) == (["bench-deepspeed", "bench-deepcompile"] if gpu else ["bench-deepspeed"])  # DeepCompile: CUDA only
    command = ran["bench-deepspeed"]
    assert command[command.index("--ranks") + 1] == "1" and "--fake-ranks" not in command
    assert command[command.index("--interleave") + 1] == "compile-bf16,zero3-bf16,deepspeed3-bf16"
