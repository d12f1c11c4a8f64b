"""Read a zerocompile dump: every collective, its parameters and bytes, and where buffers are freed.

  zerocompile dump DIR                  report on a dump written with ZEROCOMPILE_DUMP=DIR
  zerocompile dump DIR --diff DIR2      compare two dumps (e.g. two stages)
  zerocompile dump DIR --png OUT.png    draw each rank's memory timeline of one step
  zerocompile dump DIR -- python train.py ...   run a command with dumping on, then report

Per graph (Dynamo fragment x forward/backward, per rank): each collective with the parameter FQNs
it serves, bytes in and predicted bytes sent, dtype, bucket, the compute it overlaps and the node
after which a gathered buffer is freed. Per rank: bytes gathered, reduced and sent per step, the
peak of gathered buffers and the model state the collectives imply.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

from zerocompile.dump import ENV_VAR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="the dump directory (ZEROCOMPILE_DUMP / dump_dir)")
    parser.add_argument("--diff", metavar="DIR2", help="compare with another dump")
    parser.add_argument("--png", metavar="OUT", help="write a memory timeline of the step (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    command = args.command
    if command:
        completed = subprocess.run(command, env={**os.environ, ENV_VAR: str(Path(args.directory).resolve())})
        if completed.returncode != 0:
            print(f"zerocompile dump: {' '.join(command)} exited with {completed.returncode}", file=sys.stderr)
            return completed.returncode
    ledgers = load(args.directory)
    if not ledgers:
        print(f"zerocompile dump: no ledgers under {args.directory}; was it written with {ENV_VAR}=DIR?", file=sys.stderr)
        return 1
    if args.diff:
        print(diff(ledgers, load(args.diff), args.directory, args.diff))
    else:
        print(report(ledgers))
    if args.png:
        draw_timeline(ledgers, args.png)
        print(f"memory timeline written to {args.png}")
    return 0


def load(directory: str) -> dict[str, dict[str, dict]]:
    """{rank folder: {graph name: ledger}}, graphs in compile order (forward before backward)."""
    order = {"inference": 0, "forward": 1, "backward": 2}
    ranks: dict[str, dict[str, dict]] = {}
    for folder in sorted(Path(directory).glob("rank*")):
        paths = sorted(folder.glob("*-ledger.json"), key=lambda p: _graph_sort_key(p.name, order))
        ranks[folder.name] = {path.name.removesuffix("-ledger.json"): json.loads(path.read_text()) for path in paths}
    return ranks


def _graph_sort_key(name: str, order: dict[str, int]) -> tuple:
    compile_id, kind, _ = name.rsplit("-", 2)
    return tuple(int(part) if part.isdigit() else part for part in compile_id.split("_")), order.get(kind, 3)


def _mb(n: float) -> str:
    """Bytes in the largest decimal unit that keeps them above 1."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def model_state(graphs: dict[str, dict]) -> dict[str, int]:
    """Parameter and gradient bytes per rank implied by the collectives (each parameter once);
    the optimizer column assumes Adam-like state: two tensors per gradient element."""
    params: dict[str, int] = {}
    grads: dict[str, int] = {}
    for ledger in graphs.values():
        for entry in ledger["entries"]:
            for param, held in zip(entry["params"], entry["param_bytes"]):
                if entry["op"] != "all_gather":
                    grads[param] = held
                params[param] = held
    return {"params": sum(params.values()), "grads": sum(grads.values()), "optimizer": 2 * sum(grads.values())}


def rank_summary(graphs: dict[str, dict]) -> dict[str, int]:
    return {
        "gathered": sum(g["gathered_bytes"] for g in graphs.values()),
        "reduced": sum(g["reduced_bytes"] for g in graphs.values()),
        "sent": sum(g["sent_bytes"] for g in graphs.values()),
        "peak_gathered": max((g["peak_gathered_bytes"] for g in graphs.values()), default=0),
        **model_state(graphs),
    }


def graph_lines(name: str, ledger: dict) -> list[str]:
    lines = [f"  {name}  (N={ledger['world_size']}, {ledger['node_count']} nodes)"]
    lines.append(f"    {'pos':>4} {'op':<14} {'bkt':>3} {'params':<28} {'in':>12} {'sent':>12} {'dtype':<9} freed after / overlaps")
    for e in ledger["entries"]:
        where = f"freed after {e['freed_after']} (pos {e['freed_position']})" if e["freed_after"] else ""
        overlaps = f"overlaps {', '.join(e['overlaps'])}" if e["overlaps"] else "overlaps nothing"
        if e.get("detail"):
            overlaps += f" ({e['detail']})"
        lines.append(
            f"    {e['position']:>4} {e['op']:<14} {e['bucket']:>3} {','.join(e['params']):<28} "
            f"{_mb(e['input_bytes']):>12} {_mb(e['sent_bytes']):>12} {e['dtype']:<9} {where or overlaps}"
        )
    lines.append(
        f"    gathered {_mb(ledger['gathered_bytes'])}, reduced {_mb(ledger['reduced_bytes'])}, "
        f"sent {_mb(ledger['sent_bytes'])}; peak gathered {_mb(ledger['peak_gathered_bytes'])}, "
        f"peak unreduced gradients {_mb(ledger['peak_unreduced_grad_bytes'])}"
    )
    return lines


def report(ranks: dict[str, dict[str, dict]]) -> str:
    lines = []
    for rank, graphs in ranks.items():
        lines.append(f"{rank}")
        for name, ledger in graphs.items():
            lines.extend(graph_lines(name, ledger))
        s = rank_summary(graphs)
        lines.append(
            f"  per step: gathered {_mb(s['gathered'])}, reduced {_mb(s['reduced'])}, sent {_mb(s['sent'])}; "
            f"peak gathered {_mb(s['peak_gathered'])}"
        )
        lines.append(
            f"  model state implied: params {_mb(s['params'])}, grads {_mb(s['grads'])}, "
            f"optimizer {_mb(s['optimizer'])} (Adam-like)"
        )
    return "\n".join(lines)


def diff(first: dict, second: dict, first_name: str, second_name: str) -> str:
    """Per-rank totals side by side, then a unified diff of the collective listings."""
    lines = []
    for rank in sorted(set(first) | set(second)):
        a, b = rank_summary(first.get(rank, {})), rank_summary(second.get(rank, {}))
        lines.append(f"{rank}: {'':<14} {first_name:>16} {second_name:>16}")
        lines.extend(f"  {key:<14} {_mb(a[key]):>16} {_mb(b[key]):>16}" for key in a)
        listing = [[line for name, ledger in ranks.get(rank, {}).items() for line in graph_lines(name, ledger)]
                   for ranks in (first, second)]
        lines.extend(difflib.unified_diff(*listing, first_name, second_name, lineterm="", n=1))
    return "\n".join(lines)


def draw_timeline(ranks: dict[str, dict[str, dict]], out: str) -> None:
    """Bytes of gathered parameters and of gradients awaiting reduction, node by node, per rank."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("zerocompile dump --png needs matplotlib: pip install matplotlib") from error
    figure, axes = plt.subplots(len(ranks), 1, figsize=(10, 3 * len(ranks)), squeeze=False)
    for axis, (rank, graphs) in zip(axes[:, 0], ranks.items()):
        offset, boundaries = 0, []
        gathered, unreduced = [], []
        for name, ledger in graphs.items():
            for key, intervals in (("gathered_intervals", gathered), ("unreduced_grad_intervals", unreduced)):
                intervals.extend((offset + start, offset + end, size) for start, end, size in ledger[key])
            boundaries.append((offset, name))
            offset += ledger["node_count"]
        xs = range(offset)
        for intervals, label in ((gathered, "gathered parameters"), (unreduced, "gradients awaiting reduction")):
            axis.step(xs, [sum(n for s, e, n in intervals if s <= x <= e) / 1e6 for x in xs], where="post", label=label)
        for start, name in boundaries:
            axis.axvline(start, color="grey", linewidth=0.5)
            axis.text(start, axis.get_ylim()[1] * 0.95, f" {name}", fontsize=7, va="top")
        axis.set_title(f"{rank}: full-size tensors alive during one step")
        axis.set_xlabel("graph node (forward, then backward)")
        axis.set_ylabel("MB")
        axis.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
