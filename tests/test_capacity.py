"""`python -m benchmarks.capacity`: one real configuration in spawned ranks (tiny GPT, eager compiler), the
skip that protects the machine, the fit, and the tables, checked for structure and consistency.

Nothing here asserts a time or an RSS value: they depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from benchmarks import capacity
from benchmarks.capacity import command, parent
from benchmarks.capacity.big import big_table
from benchmarks.capacity.job import MODES
from benchmarks.capacity.load_check import load_check_table
from benchmarks.capacity.parent import malloc_text
from benchmarks.capacity.prediction import calibrated_peak, fits_per_mode, linear_fit, model_facts, predicted_peak
from benchmarks.capacity.table import capacity_table
from zerocompile.tools.gpt import SIZES


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("capacity") / "capacity.json"
    report = command.capacity(_args("--sizes", "tiny", "--ranks", "2", "--modes", "zero3", "--json", str(out)))
    return report, out


def test_capacity_runs_as_a_module_of_benchmarks_not_a_subcommand() -> None:
    """Lab equipment: run from the repository root, not shipped in the wheel's `zerocompile` command."""
    from zerocompile.tools import cli

    assert "capacity" not in cli.SUBCOMMANDS
    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    args = parser.parse_args(["--sizes", "tiny", "--ranks", "2,4", "--modes", "ddp,zero3"])
    assert (args.sizes, args.ranks, args.modes, args.compiler) == (["tiny"], [2, 4], ["ddp", "zero3"], "eager")


def test_one_configuration_runs_in_its_ranks_and_reports_every_phase(tiny_run: tuple[dict, Path]) -> None:
    report, out = tiny_run
    assert json.loads(out.read_text()) == report
    assert report["date"] and report["machine"]["cores"] >= 1 and report["machine"]["ram_bytes"] > 0
    (row,) = report["runs"]
    assert row["status"] == "ok", row.get("reason")
    assert (row["mode"], row["size"], row["ranks"]) == ("zero3", "tiny", 2)
    assert sorted(m["rank"] for m in row["per_rank"]) == [0, 1]
    assert len(row["losses"]) == 3 and all(math.isfinite(loss) for loss in row["losses"])
    for measured in row["per_rank"]:
        phases = [mark["phase"] for mark in measured["marks"]]
        assert phases == ["started", "built", "sharded/initialised", "step 1 (compiles)", "step 2", "step 3"]
        # VmHWM never falls, bounds every RSS seen, and the rank's peak is the last one read.
        hwms = [mark["hwm"] for mark in measured["marks"]]
        assert hwms == sorted(hwms) and all(mark["rss"] <= mark["hwm"] for mark in measured["marks"])
        assert measured["peak_rss"] >= hwms[-1]
        assert measured["peak_phase"] in phases
    assert row["peak_rss_bytes"] == max(m["peak_rss"] for m in row["per_rank"])
    assert row["bytes_per_param"] == pytest.approx(row["peak_rss_bytes"] / row["phi"])
    table = capacity_table(report)
    assert report["machine"]["node"] in table and "| zero3 | 2 |" in table and "- (1 point)" in table


def test_a_configuration_that_cannot_fit_is_skipped_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object) -> None:
        raise AssertionError("a configuration predicted not to fit was spawned")

    monkeypatch.setattr(parent, "mem_available", lambda: 10**6)
    monkeypatch.setattr(parent, "spawn_ranks", refuse)
    report = command.capacity(_args("--sizes", "tiny,small", "--ranks", "2", "--modes", "ddp,fsdp2"))
    assert [row["status"] for row in report["runs"]] == ["skipped"] * 4
    assert all(row["reason"].startswith("skipped: needs ~") for row in report["runs"])
    assert all(fit["a_bytes"] is None and fit["points"] == 0 for fit in report["fits"])
    assert capacity_table(report).count("skipped: needs ~") == 4
    assert capacity.run(_args("--sizes", "tiny", "--ranks", "2", "--modes", "ddp")) == 0  # a skip is no failure


def test_predictions_follow_what_each_mode_holds() -> None:
    facts = model_facts(SIZES["400m"])
    assert facts.phi == 20 * (12 * 1280**2 + 13 * 1280) + (256 + 128) * 1280 + 2 * 1280  # blocks, wte, wpe, ln_f
    need = {mode: predicted_peak(mode, facts, 4) for mode in MODES}
    assert need["zero3"] < need["zero2"] < need["zero1"] < need["ddp"]
    # The sharded modes hold 16Φ/N: more ranks, less per rank; DDP holds everything on each.
    assert predicted_peak("zero3", facts, 8) < need["zero3"]
    assert predicted_peak("ddp", facts, 8) == need["ddp"]


def test_measured_runs_calibrate_the_prediction_of_larger_ones() -> None:
    """With one size measured: start-up RSS plus, per parameter, the state at the new N and what
    that size needed beyond its own state, and a few modules in full. With a line through two
    sizes: its intercept plus the state at the new N and the slope beyond the state, per parameter."""
    facts = model_facts(SIZES["1b"])
    start, modules = 300e6, 4 * facts.largest_module_bytes

    def run(ranks: int, phi: int, beyond_state: float, fixed: float = 0.0) -> dict:
        peak = start + fixed + (16 / ranks + beyond_state) * phi
        return {"mode": "zero3", "ranks": ranks, "phi": phi, "status": "ok", "peak_rss_bytes": peak,
                "per_rank": [{"marks": [{"phase": "started", "rss": start}]}]}

    one_size = [run(2, 400_000_000, 2.0), run(4, 400_000_000, 3.0)]
    assert calibrated_peak("zero3", facts, 8, one_size) == pytest.approx(start + 5.0 * facts.phi + modules)
    two_sizes = [run(2, 50_000_000, 1.5, fixed=2e8), run(2, 400_000_000, 1.5, fixed=2e8), run(4, 400_000_000, 9.0)]
    expected = start + 2e8 + (16 / 8 + 1.5) * facts.phi
    assert calibrated_peak("zero3", facts, 8, two_sizes) == pytest.approx(expected)
    assert calibrated_peak("fsdp2", facts, 8, two_sizes) is None
    # Lines at N = 2 and 4 whose rests (1.5 and 1.0 B/param) are 0.5 + 2/N: at N = 8, 0.75.
    two_n = two_sizes[:2] + [run(4, 50_000_000, 1.0, fixed=1e8), run(4, 400_000_000, 1.0, fixed=1e8)]
    expected = start + 2e8 + (16 / 8 + 0.75) * facts.phi
    assert calibrated_peak("zero3", facts, 8, two_n) == pytest.approx(expected)


def test_fit_and_largest_model_in_the_budget() -> None:
    a, b = linear_fit([(1e8, 1e9 + 8e8), (2e8, 1e9 + 16e8), (4e8, 1e9 + 32e8)])
    assert (a, b) == (pytest.approx(1e9), pytest.approx(8.0))
    assert linear_fit([(1e8, 5e8)]) is None
    rows = [
        {"mode": "zero3", "ranks": 2, "phi": phi, "status": "ok", "peak_rss_bytes": 5e8 + 8 * phi}
        for phi in (5e7, 2e8)
    ]
    rows.append({"mode": "zero3", "ranks": 2, "phi": 4e8, "status": "skipped"})
    (fit,) = fits_per_mode(rows)
    assert fit["points"] == 2 and fit["b_bytes_per_param"] == pytest.approx(8.0)
    assert fit["largest_phi_in_budget"] == pytest.approx((8 * 2**30 - 5e8) / 8)


def test_load_check_table_marks_a_broken_bound() -> None:
    per_rank = {"rise": 3e8, "rise_by_shard": 1e8, "rise_by_load": 3e8, "rise_anon": 1.2e8, "rise_file": 1.8e8,
                "save_rise": 1e7}
    check = {
        "status": "ok", "size": "200m", "phi": 201_934_848, "ranks": 2, "malloc": malloc_text(),
        "largest_module_bytes": 16_793_600, "largest_tensor_bytes": 16_777_216, "file_bytes": 807_757_504,
        "bounds": {"meta": 2e8, "plain": 8e8, "save": 8e7},
        "meta": [per_rank, per_rank], "plain": [{**per_rank, "rise": 9e8}] * 2,
        "meta_rise": 3e8, "plain_rise": 9e8, "save_rise": 1e7, "meta_rise_anon": 1.2e8, "meta_rise_file": 1.8e8,
        "met": {"meta": False, "plain": True, "save": True},
    }
    table = load_check_table(check)
    assert "MALLOC_MMAP_THRESHOLD_=65536" in table
    assert table.count("| yes |") == 2 and table.count("**NO**") == 1
    assert "| 120 ; 180 / 120 ; 180 |" in table  # anonymous and file-backed rises, apart, per rank
    assert "Anonymous memory alone, meta route: 120 MB" in table and ": yes;" in table


def test_big_table_says_whether_the_loss_fell() -> None:
    row = {"mode": "zero3", "status": "ok", "compiler": "eager", "tokens": 64, "lr": 5e-6, "seconds": 400.0,
           "predicted_total_bytes": 24e9, "predicted_peak_per_rank_bytes": 3e9, "predicted_from": "measured runs",
           "losses": [5.5, 5.2, 4.9], "peak_rss_bytes": 2.7e9, "min_mem_available": 3e9,
           "per_rank": [{"rank": r, "peak_rss": 2.7e9} for r in range(8)]}
    big = {"size": "1b", "phi": 926_094_848, "ranks": 8, "malloc": "default", "runs": [row]}
    assert "(finite and falling)" in big_table(big) and "total 21.60 GB" in big_table(big)
    row["losses"] = [5.56, 8.95, 5.75]
    assert "(finite, **not falling**)" in big_table(big)
    row["losses"] = [5.56, float("nan"), 5.75]
    assert "(**not finite**)" in big_table(big)
