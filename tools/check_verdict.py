"""What `zerocompile check`'s rows say: each row judged against its bounds (gradients and parameters
against DDP's, model-state bytes, bytes sent against ZeRO's formulas), and the one table of them."""

from __future__ import annotations

from typing import Any

SENT_TOLERANCE = 0.02
# Under the fake group (one rank of N = 8): padding, under 8 rows per parameter, 3.2 % of Φ for
# check.py's CHECK_GPT (odd sizes on purpose; a model of 64-multiple widths pads nothing).
FAKE_STATE_TOLERANCE = 0.04


def row_name(row: dict[str, Any]) -> str:
    """"stage 2, inductor (gloo x2 cpu)"; a failure outside the rows is named by what ran ("DDP reference")."""
    what = f"stage {row['stage']}, {row['compiler']}" if isinstance(row["stage"], int) else row["compiler"]
    return f"{what} ({row['run']})"


def judge(row: dict[str, Any]) -> list[str]:
    """What is out of bounds in `row`, each naming the row and the figure; empty if nothing."""
    name = row_name(row)
    if "error" in row:
        return [f"{name}: FAILED: {row['error']}"]
    problems = []
    for kind in ("grad", "param"):
        error = row.get(f"{kind}_error")
        if error is not None and not error <= row["tolerance"]:  # NaN fails too
            problems.append(
                f"{name}: max |Δ {kind}| {error:.2e} against DDP at {row[f'{kind}_fqn']} exceeds {row['tolerance']:.0e}"
            )
    for rank, held in enumerate(row["state_bytes"]):
        if held != row["state_expected"]:
            problems.append(
                f"{name}: rank {rank} holds {held:,} B of model state, expected {row['state_expected']:,} B "
                "(16 B per padded shard element; 16Φ at stage 0)"
            )
    if row.get("state_16phi_over_n") is not None:
        ideal = row["state_16phi_over_n"]
        off = row["state_bytes"][0] / ideal - 1
        if abs(off) > FAKE_STATE_TOLERANCE:
            problems.append(f"{name}: {row['state_bytes'][0]:,} B of model state is {off:+.2%} off 16Φ/N = {ideal:,.0f} B")
    for rank, sent in enumerate(row.get("sent_bytes") or []):
        off = _sent_deviation(sent, row["sent_expected"])
        if off is not None and abs(off) > SENT_TOLERANCE:
            problems.append(
                f"{name}: rank {rank} sent {sent:,.0f} B per step, ZeRO's formula {row['sent_expected']:,.0f} B "
                f"({off:+.1%}, allowed ±{SENT_TOLERANCE:.0%})"
            )
    return problems


def _sent_deviation(sent: float, expected: float) -> float | None:
    """Relative deviation from the formula; None for one rank (the formula is 0: nothing to compare)."""
    return None if expected == 0 else sent / expected - 1


def render(rows: list[dict[str, Any]]) -> str:
    """The one table: a row per (ranks, stage, compiler)."""
    lines = [
        "| ranks | stage | compiler | max abs Δ grad | max abs Δ param | state B/rank (expected) | sent B/step (ZeRO formula) "
        "| step time (x DDP+compile) | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append("| " + " | ".join([row["run"], str(row["stage"]), row["compiler"], *_cells(row)]) + " |")
    return "\n".join(lines)


def _cells(row: dict[str, Any]) -> list[str]:
    verdict = "ok" if not judge(row) else "MISMATCH"
    if "error" in row:
        return ["", "", "", "", "", f"FAILED: {row['error'][:200]}"]
    grads = "n/a (fake group)" if row.get("grad_error") is None else f"{row['grad_error']:.2e}"
    params = "n/a (fake group)" if row.get("param_error") is None else f"{row['param_error']:.2e} (tol {row['tolerance']:.0e})"
    state = f"{max(row['state_bytes']):,} ({row['state_expected']:,})"
    if row.get("device_peak_bytes") is not None:
        state += f"; device peak {row['device_peak_bytes']:,}"
    if row.get("sent_bytes") is None:
        sent = "n/a" + (" (fake group)" if row["backend"] == "fake" else f" ({row['backend']})")
    else:
        sent = f"{max(row['sent_bytes']):,.0f} ({row['sent_expected']:,.0f})"
    if row.get("step_seconds") is None:
        time_cell = "n/a"
    else:
        time_cell = f"{row['step_seconds'] * 1e3:.1f} ms ({row['step_seconds'] / row['ddp_compile_seconds']:.2f}x)"
    return [grads, params, state, sent, time_cell, verdict]

