"""Step time against link rate: one chart and one table from bench runs over links of several rates.

Each argument is a `zerocompile bench --link RATE ... --interleave MODES` run (its --out directory
or its bench.json), all of one network shape (one link, or --nodes) and one model and batch. The
chart plots each interleaved mode's median step against the rate the run's probe measured, an
unlimited link at its probe's rate (shaped rates are what the probe moved; loopback has no rate
of its own); the table gives, per rate, each mode's step and its ratio to the first mode of the
runs (the median over rounds of the paired ratio, quartiles in brackets).

    python -m benchmarks.link_chart link1-1gbit link1-2.5gbit link1-10gbit link1-unlimited --out chart
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Settings that must agree for runs to share a chart: the same job over links of other rates.
_SAME_JOB = ("model_size", "layers", "batch_size", "ranks", "optimizer", "nodes")


def load_run(path: Path) -> dict[str, Any]:
    """A bench run's summary (its directory or its bench.json); refused unless it ran over a link
    and interleaved its modes (the ratios come from steps taken side by side)."""
    summary_path = path / "bench.json" if path.is_dir() else path
    if not summary_path.exists():
        raise SystemExit(f"{path}: no bench.json there; give a `zerocompile bench --out` directory or its bench.json")
    summary = json.loads(summary_path.read_text())
    link = summary["settings"].get("link")
    if link is None:
        raise SystemExit(f"{summary_path}: this run used no link; run `zerocompile bench --link RATE` (or --link unlimited)")
    if not summary.get("interleaved"):
        raise SystemExit(f"{summary_path}: no interleaved modes; run the bench with --interleave MODES")
    return summary


def rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """(modes in every run, first run's order; one row per run from the slowest link up) or a
    SystemExit naming the setting on which two runs differ."""
    first = runs[0]["settings"]
    for run in runs[1:]:
        for key in _SAME_JOB:
            if run["settings"].get(key) != first.get(key):
                raise SystemExit(
                    f"the runs differ in {key} ({first.get(key)!r} and {run['settings'].get(key)!r}): a chart "
                    "compares one job over links of several rates"
                )
    modes = [mode for mode in runs[0]["interleaved"]["modes"] if all(mode in run["interleaved"]["modes"] for run in runs)]
    if not modes:
        raise SystemExit("the runs interleaved no mode in common")
    reference = modes[0]
    table = []
    for run in runs:
        link, interleaved = run["settings"]["link"], run["interleaved"]
        table.append({
            "rate": link["rate"],
            "probe_gbit": link["probe_bits_per_second"] / 1e9,
            "steps": {mode: interleaved["step_time_s"][mode] for mode in modes},
            "ratios": {mode: interleaved["paired_ratio"][mode][reference] for mode in modes},
        })
    table.sort(key=lambda row: row["probe_gbit"])
    return modes, table


def markdown(modes: list[str], table: list[dict[str, Any]]) -> str:
    """Per rate: each mode's step (s) and its paired ratio to the first mode."""
    reference = modes[0]
    lines = [
        f"| link (probe Gbit/s) | {' | '.join(modes)} |",
        "|---|" + "---|" * len(modes),
    ]
    for row in table:
        cells = []
        for mode in modes:
            ratio = row["ratios"][mode]
            quartiles = "" if mode == reference else f" ({ratio['p25']:.2f}-{ratio['p75']:.2f})"
            cells.append(f"{row['steps'][mode]:.3f} s, {ratio['median']:.2f}×{quartiles}")
        lines.append(f"| {row['rate']} ({row['probe_gbit']:.2f}) | {' | '.join(cells)} |")
    return "\n".join(lines) + f"\n\nEach cell: median step, and × {reference} (median over rounds, quartiles).\n"


def plot(modes: list[str], table: list[dict[str, Any]], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("the chart is drawn with matplotlib: pip install matplotlib") from error
    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    rates = [row["probe_gbit"] for row in table]
    for mode in modes:
        axis.plot(rates, [row["steps"][mode] for row in table], marker="o", label=mode)
    axis.set_xscale("log")
    axis.set_xticks(rates, [f"{row['rate']}\n{row['probe_gbit']:.1f}" for row in table])
    axis.minorticks_off()
    axis.set_xlabel("link (asked, and Gbit/s a probe moved)")
    axis.set_ylabel("median step (s)")
    axis.set_ylim(bottom=0)
    axis.legend(fontsize="small")
    axis.set_title(title, fontsize="medium")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _title(run: dict[str, Any]) -> str:
    settings, machine = run["settings"], run["machine"]
    nodes = settings.get("nodes") or 1
    shape = f"{nodes} nodes x {settings['ranks'] // nodes} ranks" if nodes > 1 else f"{settings['ranks']} ranks, one link"
    return f"GPT {settings['model_size']}, {shape}, global batch {settings['batch_size']} x {settings['block_size']}, {machine['node']} ({machine['cpu_count']} CPUs)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="bench --out directories (or their bench.json), one per link rate")
    parser.add_argument("--out", type=Path, required=True, help="directory for link-chart.png and link-chart.md")
    args = parser.parse_args(argv)
    runs = [load_run(path) for path in args.runs]
    modes, table = rows(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(modes, table)
    (args.out / "link-chart.md").write_text(text)
    plot(modes, table, _title(runs[0]), args.out / "link-chart.png")
    print(f"{text}\nwrote {args.out}/link-chart.png, link-chart.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
