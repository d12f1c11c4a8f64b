"""benchmarks/link_chart.py on hand-written bench summaries: rows ordered by the probed rate, each
mode's paired ratio to the first mode, and refusals for runs that are not one job over links."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import link_chart

pytestmark = pytest.mark.fast


def _run(directory: Path, rate: str, probe: float, steps: dict[str, float], **settings: object) -> Path:
    """A bench.json as `zerocompile bench --link RATE --interleave ...` writes it, trimmed to what the chart reads."""
    modes = list(steps)
    ratio = {m: {o: {"p25": 0.9 * steps[m] / steps[o], "median": steps[m] / steps[o], "p75": 1.1 * steps[m] / steps[o]} for o in modes} for m in modes}
    summary = {
        "machine": {"node": "vm", "cpu_count": 2, "torch": "2.13.0"},
        "settings": {
            "model_size": "12m", "layers": None, "batch_size": 4, "block_size": 128, "ranks": 2, "optimizer": "fp32 AdamW", "nodes": None,
            "link": {"rate": rate, "nodes": 1, "probe_bits_per_second": probe},
            **settings,
        },
        "interleaved": {"modes": modes, "step_time_s": steps, "paired_ratio": ratio},
    }
    directory.mkdir()
    (directory / "bench.json").write_text(json.dumps(summary))
    return directory


def test_rows_follow_the_probed_rate_and_give_ratios_to_the_first_mode(tmp_path: Path) -> None:
    runs = [
        _run(tmp_path / "unlimited", "unlimited", 15e9, {"ddp-compile": 0.30, "zero3-int8": 0.33}),
        _run(tmp_path / "1gbit", "1gbit", 0.999e9, {"ddp-compile": 0.96, "zero3-int8": 0.57}),
    ]
    assert link_chart.main([*map(str, runs), "--out", str(tmp_path / "chart")]) == 0
    text = (tmp_path / "chart" / "link-chart.md").read_text()
    lines = text.splitlines()
    assert lines[0] == "| link (probe Gbit/s) | ddp-compile | zero3-int8 |"
    assert lines[2] == "| 1gbit (1.00) | 0.960 s, 1.00× | 0.570 s, 0.59× (0.53-0.65) |"
    assert lines[3] == "| unlimited (15.00) | 0.300 s, 1.00× | 0.330 s, 1.10× (0.99-1.21) |"
    assert (tmp_path / "chart" / "link-chart.png").stat().st_size > 0


def test_runs_of_other_jobs_or_without_a_link_are_refused(tmp_path: Path) -> None:
    one = _run(tmp_path / "a", "1gbit", 1e9, {"ddp-compile": 1.0})
    other = _run(tmp_path / "b", "10gbit", 1e10, {"ddp-compile": 0.5}, batch_size=8)
    with pytest.raises(SystemExit, match=r"differ in batch_size \(4 and 8\)"):
        link_chart.main([str(one), str(other), "--out", str(tmp_path / "chart")])
    unlinked = _run(tmp_path / "c", "1gbit", 1e9, {"ddp-compile": 1.0}, link=None)
    with pytest.raises(SystemExit, match=r"used no link; run `zerocompile bench --link RATE`"):
        link_chart.main([str(unlinked), "--out", str(tmp_path / "chart")])
    with pytest.raises(SystemExit, match="no bench.json there"):
        link_chart.main([str(tmp_path / "missing"), "--out", str(tmp_path / "chart")])
