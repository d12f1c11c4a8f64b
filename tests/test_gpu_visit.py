"""The GPU visit (zerocompile/tools/gpu_visit.py) keeps working between visits: device time is
minutes per session, so a visit that breaks on the device is a visit lost. Here its first step,
`zerocompile check`, runs on two gloo CPU ranks through the visit's own step runner, and the
summary must carry the check's table; a stage that trained differently from DDP must show as a
mismatch naming the row, not as ok."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zerocompile.tools import gpu_visit


def _visit(tmp_path: Path) -> gpu_visit.Visit:
    return gpu_visit.Visit(argparse.Namespace(out=str(tmp_path), device="cpu"))


def test_check_step_matches_ddp_and_lands_in_the_summary(tmp_path: Path) -> None:
    visit = _visit(tmp_path)
    # The visit's command, narrowed to the eager compiler at stages 0 and 3 to stay cheap
    # (tests/test_check.py runs Inductor).
    command = ["zerocompile.tools.cli", "check", "--device", "cpu", "--stages", "0,3", "--compilers", "eager",
               "--json", str(visit.work / "check.json")]
    record = visit.step("check", command, timeout=600)
    assert record["returncode"] == 0, record["output"][-3000:]
    report = json.loads((visit.work / "check.json").read_text())
    visit.finish()
    assert [(row["stage"], row["compiler"]) for row in report["rows"]] == [(0, "eager"), (3, "eager")]
    # Two gloo ranks, eager compiler: the same ops as DDP's on the same values.
    assert all(row["ok"] and row["param_error"] == 0.0 and row["grad_error"] == 0.0 for row in report["rows"])
    summary = (tmp_path / "summary.md").read_text()
    assert "## check: exit 0" in summary
    assert summary.count("| gloo x2 cpu | ") == 2 and "MISMATCH" not in summary
    assert "- c++ compiler (Inductor): " in summary
    assert (tmp_path / "results.tar.gz").stat().st_size > 0


def test_a_parameter_off_ddp_is_a_mismatch_in_the_summary(tmp_path: Path) -> None:
    visit = _visit(tmp_path)
    row = {
        "run": "gloo x2 cpu", "backend": "gloo", "ranks": 2, "device": "cpu", "stage": 3, "compiler": "eager",
        "param_error": 2e-3, "param_fqn": "blocks.0.fc.weight", "grad_error": 0.0, "grad_fqn": "wte.weight",
        "tolerance": 1e-6, "state_bytes": [100, 100], "state_expected": 100, "sent_bytes": None,
        "sent_expected": None, "step_seconds": None, "ddp_compile_seconds": None, "device_peak_bytes": None,
    }
    problems = gpu_visit.check.judge(row)
    report = {"rows": [{**row, "problems": problems, "ok": False}], "problems": problems, "ok": False}
    (visit.work / "check.json").write_text(json.dumps(report))
    lines = visit.details({"name": "check", "returncode": 1, "output": ""})
    assert any("| gloo x2 cpu | 3 | eager | 0.00e+00 | 2.00e-03" in line and "MISMATCH" in line for line in lines), lines
    assert any("stage 3, eager (gloo x2 cpu): max |Δ param| 2.00e-03 against DDP at blocks.0.fc.weight" in line for line in lines), lines
