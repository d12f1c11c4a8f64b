"""`python -m benchmarks.capacity`'s flags and run: the table, --load-check and --big as asked."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

from zerocompile.tools.arguments import names_from, positive_int
from zerocompile.tools.gpt import SIZES

from .big import big_run, big_table
from .job import LEARNING_RATE, MODES, Job
from .load_check import load_check, load_check_table
from .measure import GB, GiB, machine, mem_available
from .parent import job_environment, malloc_text, run_job
from .prediction import BASELINE_BYTES, BUDGET_BYTES, RESERVE_BYTES, SAFETY, fits_per_mode, model_facts
from .table import capacity_table

DEFAULT_SIZES = ("50m", "200m", "400m")
DEFAULT_RANKS = (2, 4)


def _rank_list(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m benchmarks.capacity`."""
    parser.add_argument("--sizes", type=names_from(sorted(SIZES)), default=list(DEFAULT_SIZES),
                        help=f"GPT sizes, comma-separated (default {','.join(DEFAULT_SIZES)})")
    parser.add_argument("--ranks", type=_rank_list, default=list(DEFAULT_RANKS),
                        help=f"rank counts N, comma-separated (default {','.join(map(str, DEFAULT_RANKS))})")
    parser.add_argument("--modes", type=names_from(MODES), default=list(MODES), help=f"comma-separated (default {','.join(MODES)})")
    parser.add_argument("--no-table", action="store_true", help="skip the capacity table (only --load-check / --big)")
    parser.add_argument("--steps", type=positive_int, default=3, help="training steps per job (default 3)")
    parser.add_argument("--tokens", type=positive_int, default=64, help="tokens of the one sequence per rank (default 64)")
    parser.add_argument("--compiler", choices=("eager", "inductor"), default="eager",
                        help="zero modes' compiler; ddp compiles with aot_eager or inductor to match (default eager)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds to wait for MemAvailable before skipping a configuration (default 0)")
    parser.add_argument("--load-check", action="store_true", help="also measure the load_weights/save_weights memory bounds")
    parser.add_argument("--load-size", choices=sorted(SIZES), default="200m", help="GPT of the load check (default 200m)")
    parser.add_argument("--load-ranks", type=positive_int, default=2, help="ranks of the load check (default 2)")
    parser.add_argument("--big", action="store_true", help="also the one big run (stage 3; FSDP2 if it fits)")
    parser.add_argument("--big-size", choices=sorted(SIZES), default="1b", help="GPT of --big (default 1b)")
    parser.add_argument("--big-ranks", type=positive_int, default=8, help="ranks of --big (default 8)")
    parser.add_argument("--big-lr", type=float, default=5e-6,
                        help="AdamW learning rate of --big (default 5e-6). Adam's first steps move every parameter by "
                        "about lr whatever its gradient, so the loss moves by about lr times the gradient's L1 norm, "
                        "which grows with Φ: the table's 3e-4 overshot by the third step from 200m up (400m: 5.6 -> "
                        "8.5), and on the 1b GPT 5e-5 overshot at once (5.56 -> 8.95 -> 5.75 on one batch)")
    parser.add_argument("--big-force", action="store_true",
                        help="run --big's stage 3 when MemAvailable >= --big-min-free even if its prediction does not "
                        "fit (the watchdog still kills the ranks if MemAvailable runs low; FSDP2 stays gated)")
    parser.add_argument("--big-min-free", type=float, default=20.0, help="GB free that --big-force waits for (default 20)")
    parser.add_argument("--big-wait", type=float, default=1800.0,
                        help="seconds --big waits for enough MemAvailable before giving up (default 1800)")
    parser.add_argument("--exact-rss", action="store_true",
                        help="capacity and --big ranks unmap freed tensors at once (MALLOC_MMAP_THRESHOLD_=65536): "
                        "RSS follows live tensors instead of including glibc's retained heap")
    parser.add_argument("--calibrate", type=Path, default=None,
                        help="a previous capacity JSON whose runs predict --big's need (default: this run's)")
    parser.add_argument("--json", type=Path, default=None, help="write the whole report as JSON here")


def capacity(args: argparse.Namespace) -> dict[str, Any]:
    """Run what the flags ask for; the report (also printed, and written to --json)."""
    report: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {**machine(), "mem_available_at_start": mem_available()},
        "settings": {
            "steps": args.steps,
            "tokens": args.tokens,
            "batch": "1 sequence per rank",
            "optimizer": f"torch.optim.AdamW(lr={LEARNING_RATE}), fp32",
            "compiler": args.compiler,
            "ddp_backend": "aot_eager" if args.compiler == "eager" else "inductor",
            "malloc": malloc_text() if args.exact_rss else "default",
            "budget_bytes": BUDGET_BYTES,
            "prediction": {"baseline_bytes": BASELINE_BYTES, "safety": SAFETY, "reserve_bytes": RESERVE_BYTES},
        },
        "runs": [],
        "fits": [],
    }
    m = report["machine"]
    print(f"python -m benchmarks.capacity on {m['node']} ({m['cores']} cores, {m['ram_bytes'] / GiB:.1f} GiB RAM, "
          f"MemAvailable {m['mem_available_at_start'] / GB:.1f} GB), {report['date']}", flush=True)
    if not args.no_table:
        for size in args.sizes:
            facts = model_facts(SIZES[size])
            for ranks in args.ranks:
                for mode in args.modes:
                    job = Job(mode, size, ranks, args.steps, args.tokens, args.compiler, args.seed)
                    row = run_job(job, facts, args.wait, report["runs"], job_environment(args))
                    report["runs"].append(row)
                    print(_progress(row), flush=True)
        report["fits"] = fits_per_mode(report["runs"])
        print("\n" + capacity_table(report), flush=True)
    if args.load_check:
        report["load_check"] = load_check(args.load_size, args.load_ranks, args.seed, args.wait)
        print("\n" + load_check_table(report["load_check"]), flush=True)
    if args.big:
        calibration = report["runs"] or (json.loads(args.calibrate.read_text())["runs"] if args.calibrate else [])
        report["big"] = big_run(args, calibration)
        print("\n" + big_table(report["big"]), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", flush=True)
    return report


def _progress(row: dict[str, Any]) -> str:
    head = f"{row['mode']:<6} N={row['ranks']} {row['size']:<5}"
    if row["status"] == "ok":
        return (f"{head} peak {row['peak_rss_bytes'] / GB:.2f} GB/rank ({row['bytes_per_param']:.1f} B/param, predicted "
                f"{row['predicted_peak_per_rank_bytes'] / GB:.2f}) at {row['peak_phase']}; losses "
                f"{', '.join(f'{x:.3f}' for x in row['losses'])}; {row['seconds']} s")
    return f"{head} {row['status']}: {row.get('reason', '')[:300]}"


def run(args: argparse.Namespace) -> int:
    """`python -m benchmarks.capacity`: 1 if a configuration failed or was aborted, else 0 (skips are not failures)."""
    report = capacity(args)
    statuses = [row["status"] for row in report["runs"]]
    statuses += [row["status"] for row in report.get("big", {}).get("runs", [])]
    if "load_check" in report:
        statuses.append(report["load_check"]["status"])
    return 1 if any(status in ("failed", "aborted") for status in statuses) else 0
