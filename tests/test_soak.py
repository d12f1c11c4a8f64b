"""`python -m benchmarks.soak` end to end on a short run: the JSON it writes and no recompile after step 2.

The 1000-step acceptance run (RSS growth under 2 %) is too long for the suite; this checks that
the command measures what it reports, on the eager compiler to keep Inductor's compile time out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

STEPS, RSS_FROM, RANKS = 30, 10, 2


def test_short_soak_writes_its_json_and_never_recompiles_after_step_2(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "benchmarks.soak", "--steps", str(STEPS), "--rss-from"]
    # RSS growth over 20 steps says little (allocator pools still filling): the limit is opened
    # here so the exit status reflects recompiles only.
    command += [str(RSS_FROM), "--rss-every", "10", "--compiler", "eager", "--max-rss-growth", "100", "--out", str(out)]
    command += ["--allocations"]
    root = Path(__file__).resolve().parent.parent  # benchmarks/ is not packaged: run from the repository root
    result = subprocess.run(command, cwd=root, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| rank | recompiles after step 2 |" in result.stdout and "PASSED" in result.stdout, result.stdout

    results = json.loads(out.read_text())
    assert results["settings"]["steps"] == STEPS and results["settings"]["stage"] == 3
    assert results["recompiles_after_step_2"] == 0 and results["passed"] is True
    # The run reports its slowest rank (steps/s over the steps after step 2, compiling excluded).
    assert results["steps_per_second"] == min(r["steps_per_second"] for r in results["per_rank"])
    assert [r["rank"] for r in results["per_rank"]] == list(range(RANKS))
    for rank in results["per_rank"]:
        # The model was compiled (one frame, a forward and a backward lowered) and nothing after step 2.
        assert rank["frames_compiled"] >= 1 and rank["recompiles_after_step_2"] == 0, rank
        assert rank["zero_graphs_lowered"] >= 2 and rank["zero_graphs_lowered_after_step_2"] == 0, rank
        assert list(rank["rss_bytes"]) == ["10", "20", "30"], rank
        assert rank["rss_from_bytes"] == rank["rss_bytes"]["10"] > 0
        assert rank["rss_last_bytes"] == rank["rss_bytes"]["30"] > 0
        growth = 100 * (rank["rss_last_bytes"] / rank["rss_from_bytes"] - 1)
        assert abs(rank["rss_growth_percent"] - growth) < 1e-9
    assert results["rss_growth_percent"] == max(r["rss_growth_percent"] for r in results["per_rank"])

    # --allocations: the profiled step after the last. Stage 3 gathers parameters and
    # reduce-scatters gradients at every step, so both collectives' allocations are listed.
    census = results["per_rank"][0]["allocations"]
    assert [row["bytes"] for row in census] == sorted((row["bytes"] for row in census), reverse=True)
    assert all(row["bytes"] >= row["allocations"] * 64 * 1024 for row in census), census
    ops = " ".join(row["op"] for row in census)
    assert "all_gather_into_tensor_coalesced" in ops and "all_to_all_single" in ops, ops
    assert "One step of stage 3 after the last, rank 0:" in result.stdout and "| MB | allocations |" in result.stdout


def test_census_counts_each_large_allocation_under_its_op() -> None:
    """Two 4 MiB tensors kept and one small one: the census lists the two, under the op and the
    function that made them, and nothing for the small one."""
    from benchmarks.allocations import allocation_census

    kept = []

    def step() -> None:
        with torch.profiler.record_function("make_buffers"):
            kept.extend([torch.empty(2**20), torch.empty(2**20), torch.empty(8)])

    (row,) = allocation_census(step)
    assert row == {"op": "aten::empty <- make_buffers", "allocations": 2, "bytes": 2 * 4 * 2**20}


def test_compare_ddp_table_lists_both_modes_per_rank() -> None:
    """--compare-ddp's table: one row per rank and mode, from the JSON's RSS samples (no run here:
    the comparison trains DDP+compile with Inductor, too long for the suite)."""
    from benchmarks import soak

    def rank(index: int, mode: str, first: int, last: int) -> dict:
        peak_first, peak_last = first + 50_000_000, last + 60_000_000  # a step's peak is above what stays after it
        return {
            "rank": index, "mode": mode, "recompiles_after_step_2": 0, "steps_per_second": 1.0,
            "rss_from_bytes": first, "rss_last_bytes": last, "rss_growth_percent": 100.0 * (last / first - 1),
            "step_peak_from_bytes": peak_first, "step_peak_last_bytes": peak_last,
            "step_peak_growth_percent": 100.0 * (peak_last / peak_first - 1),
        }  # fmt: skip

    ours = [rank(0, "zero", 600_000_000, 630_000_000), rank(1, "zero", 610_000_000, 620_000_000)]
    theirs = [rank(0, "ddp-compile", 700_000_000, 707_000_000), rank(1, "ddp-compile", 700_000_000, 700_000_000)]
    results = {
        "settings": {"stage": 3, "ranks": 2, "model_size": "12m", "steps": 300, "compiler": "inductor",
                     "rss_from": 20, "max_rss_growth_percent": 2.0},
        "per_rank": ours, "recompiles_after_step_2": 0, "rss_growth_percent": 5.0, "passed": False,
        "compare": {"mode": "ddp-compile", "per_rank": theirs, "rss_growth_percent": 1.0, "steps_per_second": 1.0},
    }  # fmt: skip
    table = soak.format_table(results)
    assert (
        "| rank | mode | RSS step 20 MB | RSS step 300 MB | growth MB | growth % "
        "| peak of step 20 MB | peak of step 300 MB | peak growth % |"
    ) in table
    assert "| 0 | stage 3 | 600.0 | 630.0 | +30.0 | +5.00 | 650.0 | 690.0 | +6.15 |" in table
    assert "| 0 | ddp-compile | 700.0 | 707.0 | +7.0 | +1.00 | 750.0 | 767.0 | +2.27 |" in table
    assert "| 1 | stage 3 | 610.0 | 620.0 | +10.0 | +1.64 | 660.0 | 680.0 | +3.03 |" in table
    assert "| 1 | ddp-compile | 700.0 | 700.0 | +0.0 | +0.00 | 750.0 | 760.0 | +1.33 |" in table
