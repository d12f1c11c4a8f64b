"""The GPU visit (zerocompile/tools/gpu_visit.py) keeps working between visits: device time is
minutes per session, so a visit that breaks on the device is a visit lost. Here its parity step
runs on two gloo CPU ranks through the visit's own step runner, and the summary must carry the
table; a stage that trained differently from DDP must show as a mismatch, not as ok."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zerocompile.tools import gpu_visit


def _visit(tmp_path: Path) -> gpu_visit.Visit:
    return gpu_visit.Visit(argparse.Namespace(out=str(tmp_path), device="cpu"))


def _parity_command(visit: gpu_visit.Visit, name: str) -> list[str]:
    return [
        "zerocompile.tools.gpu_visit", "parity", "--device", "cpu", "--backend", "gloo", "--ranks", "2",
        "--compilers", "eager", "--stages", "0,3", "--json", str(visit.work / f"{name}.json"),
    ]


def test_parity_step_matches_ddp_and_lands_in_the_summary(tmp_path: Path) -> None:
    visit = _visit(tmp_path)
    record = visit.step("parity-2-gloo-ranks", _parity_command(visit, "parity-2-gloo-ranks"), timeout=600)
    rows = json.loads((visit.work / "parity-2-gloo-ranks.json").read_text())["rows"]
    visit.finish()
    assert record["returncode"] == 0, record["output"][-3000:]
    assert [(row["optimizer"], row["stage"]) for row in rows] == [("sgd", 0), ("sgd", 3), ("adamw", 0), ("adamw", 3)]
    # Two gloo ranks, eager compiler: the same ops as DDP's on the same values.
    assert all(row["ok"] and row["param_error"] == 0.0 for row in rows), rows
    summary = (tmp_path / "summary.md").read_text()
    assert "## parity-2-gloo-ranks: exit 0" in summary
    assert summary.count("| eager | ") == 4 and "MISMATCH" not in summary
    assert (tmp_path / "results.tar.gz").stat().st_size > 0


def test_a_parameter_off_ddp_is_a_mismatch_in_the_summary(tmp_path: Path) -> None:
    visit = _visit(tmp_path)
    row = {"optimizer": "sgd", "compiler": "eager", "stage": 3, "param_error": 2e-3, "loss_error": 0.0, "ok": False}
    (visit.work / "parity-x.json").write_text(json.dumps({"rows": [row]}))
    lines = visit.details({"name": "parity-x", "returncode": 1, "output": ""})
    assert any("| sgd | eager | 3 | 2.00e-03 |" in line and "MISMATCH" in line for line in lines), lines
