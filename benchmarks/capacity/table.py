"""The capacity table: peak RSS per mode, N and size, the fitted lines, and where each peak was reached."""

from __future__ import annotations

from typing import Any

from .measure import GB, GiB


def _params(phi: float) -> str:
    return f"{phi / 1e9:.2f}B" if phi >= 1e9 else f"{phi / 1e6:.0f}M"


def _cell(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        return f"{row['peak_rss_bytes'] / GB:.2f} GB ({row['bytes_per_param']:.1f} B/param)"
    if row["status"] == "skipped":
        return f"skipped: needs ~{row['predicted_total_bytes'] / GB:.0f} GB"
    return f"{row['status']}"


def capacity_table(report: dict[str, Any]) -> str:
    rows, fitted = report["runs"], report["fits"]
    settings, machine_ = report["settings"], report["machine"]
    sizes = list(dict.fromkeys(row["size"] for row in rows))
    phis = {row["size"]: row["phi"] for row in rows}
    lines = [
        f"`python -m benchmarks.capacity` on {machine_['node']} ({machine_['cores']} cores, {machine_['ram_bytes'] / GiB:.1f} GiB RAM, "
        f"torch {machine_['torch']}), {report['date']}: peak RSS (VmHWM) per rank over the whole job (start-up, "
        f"build, shard/init, compile, {settings['steps']} steps of fp32 AdamW on 1 x {settings['tokens']} tokens "
        f"per rank), the largest rank; compiler {settings['compiler']} (ddp: {settings['ddp_backend']}; fsdp2 "
        f"eager); malloc: {settings['malloc']}. Largest GPT in 8 GiB per rank: Φ = (8 GiB − a) / b from the least-squares "
        "line peak = a + b·Φ through the measured sizes (an extrapolation).",
        "",
        "| mode | N | " + " | ".join(f"{size} (Φ = {_params(phis[size])})" for size in sizes)
        + " | fit a + b·Φ | largest GPT in 8 GiB/rank |",
        "|---|---|" + "---|" * len(sizes) + "---|---|",
    ]
    by_key = {(row["mode"], row["ranks"], row["size"]): row for row in rows}
    notes = []
    for entry in fitted:
        mode, ranks = entry["mode"], entry["ranks"]
        cells = []
        for size in sizes:
            row = by_key.get((mode, ranks, size))
            cells.append("" if row is None else _cell(row))
            if row is not None and row["status"] in ("failed", "aborted"):
                notes.append(f"- {mode} N={ranks} {size} {row['status']}: {row.get('reason', '')[:400]}")
        if entry["a_bytes"] is None:
            fit_text, largest = f"- ({entry['points']} point{'s' * (entry['points'] != 1)})", "-"
        else:
            fit_text = f"{entry['a_bytes'] / GB:.2f} GB + {entry['b_bytes_per_param']:.2f} B·Φ ({entry['points']} pts)"
            largest = "-" if entry["largest_phi_in_budget"] is None else _params(entry["largest_phi_in_budget"])
        lines.append(f"| {mode} | {ranks} | " + " | ".join(cells) + f" | {fit_text} | {largest} |")
    lines += ["", "Where each peak was reached, and the prediction that gated the run:", "",
              "| mode | N | size | predicted GB/rank | peak GB/rank | peak reached in | min MemAvailable GB | run s |",
              "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        peak = f"{row['peak_rss_bytes'] / GB:.2f}" if row.get("peak_rss_bytes") else "-"
        lowest = f"{row['min_mem_available'] / GB:.1f}" if row.get("min_mem_available") else "-"
        lines.append(
            f"| {row['mode']} | {row['ranks']} | {row['size']} | {row['predicted_peak_per_rank_bytes'] / GB:.2f} | {peak} "
            f"| {row.get('peak_phase') or row['status']} | {lowest} | {row.get('seconds', '-')} |"
        )
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
