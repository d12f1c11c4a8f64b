"""--big: one real run of a large GPT at stage 3 (FSDP2 beside it if it fits), its losses and peaks."""

from __future__ import annotations

import argparse
import math
from typing import Any

from zerocompile.tools.gpt import SIZES

from .job import LEARNING_RATE, Job
from .measure import GB
from .parent import job_environment, malloc_text, run_job
from .prediction import model_facts


def big_run(args: argparse.Namespace, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """--big-ranks ranks training the --big-size GPT at stage 3 from meta init; FSDP2 beside if it
    fits. Predicted from `measured` (this report's runs, or --calibrate's) when they hold the mode."""
    size, ranks = args.big_size, args.big_ranks
    facts = model_facts(SIZES[size])
    malloc = malloc_text() if args.exact_rss else "default"
    result: dict[str, Any] = {"size": size, "phi": facts.phi, "ranks": ranks, "malloc": malloc, "runs": []}
    for mode in ("zero3", "fsdp2"):
        job = Job(mode, size, ranks, args.steps, args.tokens, args.compiler, args.seed, repeat_batch=True, lr=args.big_lr)
        wait = args.big_wait if mode == "zero3" else 0  # FSDP2 only if it fits right away
        min_free = args.big_min_free * GB if args.big_force and mode == "zero3" else None
        row = run_job(job, facts, wait, measured, job_environment(args), min_free)
        if row["status"] == "ok":
            losses = row["losses"]
            row["finite_and_falling"] = all(map(math.isfinite, losses)) and all(
                later < earlier for earlier, later in zip(losses, losses[1:])
            )
        result["runs"].append(row)
        print(_big_line(row), flush=True)
    return result


def _big_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"--big {row['mode']}: {row.get('reason', row['status'])}"
    return f"--big {row['mode']}: losses {', '.join(f'{x:.4f}' for x in row['losses'])}; peak {row['peak_rss_bytes'] / GB:.2f} GB/rank"


def _loss_verdict(losses: list[float]) -> str:
    if not all(map(math.isfinite, losses)):
        return " (**not finite**)"
    falling = all(later < earlier for earlier, later in zip(losses, losses[1:]))
    return " (finite and falling)" if falling else " (finite, **not falling**)"


def big_table(big: dict[str, Any]) -> str:
    lines = [
        f"--big: GPT {big['size']} (Φ = {big['phi']:,}; fp32 parameters alone {4 * big['phi'] / GB:.1f} GB, "
        f"with AdamW 16Φ = {16 * big['phi'] / GB:.1f} GB per replica), {big['ranks']} ranks on this machine, "
        f"malloc {big.get('malloc', 'default')}:",
        "",
    ]
    for row in big["runs"]:
        predicted = (
            f"predicted {row['predicted_total_bytes'] / GB:.1f} GB total ({row['predicted_peak_per_rank_bytes'] / GB:.2f} "
            f"GB/rank, from {row['predicted_from']})"
        )
        if row["status"] != "ok":
            lines.append(f"- {row['mode']}: {row.get('reason', row['status'])} ({predicted})")
            continue
        per_rank = sorted(row["per_rank"], key=lambda m: m["rank"])
        total = sum(m["peak_rss"] for m in per_rank)
        lines += [
            f"- {row['mode']} ({row['compiler']} compiler, 1 x {row['tokens']} tokens per rank, the same batch every "
            f"step, AdamW lr {row.get('lr', LEARNING_RATE):g}, {row['seconds']:.0f} s; {predicted}): loss per step "
            + ", ".join(f"{x:.4f}" for x in row["losses"])
            + _loss_verdict(row["losses"])
            + "; peak RSS per rank " + ", ".join(f"{m['peak_rss'] / GB:.2f}" for m in per_rank) + " GB; "
            f"max {row['peak_rss_bytes'] / GB:.2f} GB, total {total / GB:.2f} GB; min MemAvailable during the run "
            f"{row['min_mem_available'] / GB:.1f} GB",
        ]
    return "\n".join(lines) + "\n"
