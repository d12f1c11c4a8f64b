"""Read a zerocompile dump: every collective, its parameters and bytes, and where buffers are freed.

  zerocompile dump DIR                  report on a dump written with ZEROCOMPILE_DUMP=DIR
  zerocompile dump DIR --diff DIR2      compare two dumps (e.g. two stages)
  zerocompile dump DIR --png OUT.png    draw each rank's memory timeline of one step
  zerocompile dump DIR -- python train.py ...   run a command with dumping on, then report
  zerocompile dump DIR --verbose        every parameter name of each collective, not a summary

Per graph (Dynamo fragment x forward/backward, per rank): each collective with the parameter FQNs
it serves, bytes in and predicted bytes sent, dtype, bucket, the compute it overlaps and the node
after which a gathered buffer is freed; and the gathered parameters kept from the forward for the
backward (stages 1-2: all the backward reads; stage 3: those its memory_budget keeps). Then the
optimizer's step where it sends (zc.optim.Muon's exchange with each matrix's owner, Adafactor's
sums). Per rank: bytes gathered, reduced and sent per step (the optimizer's included), the peak
of gathered buffers (kept ones included), the bytes kept and the model state the collectives imply.

A collective's parameters are summarised on one line (see `collapse_fqns`): names differing only
in a numeric index share braces, blocks.{0,1}.attn.qkv.weight, with runs written a..b,
blocks.{0..11}; a numbered block whose every parameter is there is `*`, blocks.{0,1}.* (24 params).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Collection, Sequence
from pathlib import Path

from zerocompile.dump import ENV_VAR
from zerocompile.passes.ledger import LedgerEntry

# A collective's parameters go on the line under it: indented, the line fits a 120-column terminal.
PARAMS_INDENT = " " * 10
PARAMS_LINE_CHARS = 100
_INDEX = re.compile(r"0|[1-9][0-9]*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="the dump directory (ZEROCOMPILE_DUMP / dump_dir)")
    parser.add_argument("--diff", metavar="DIR2", help="compare with another dump")
    parser.add_argument("--png", metavar="OUT", help="write a memory timeline of the step (needs matplotlib)")
    parser.add_argument(
        "--verbose", action="store_true", help="list every parameter of each collective instead of a one-line summary"
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        metavar="M",
        help="also give each rank's bytes sent to other nodes, nodes being blocks of M consecutive ranks",
    )


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
        print(diff(ledgers, load(args.diff), args.directory, args.diff, args.verbose))
    else:
        print(report(ledgers, args.verbose, args.ranks_per_node, load_offloads(args.directory)))
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


def load_offloads(directory: str) -> dict[str, dict[str, dict]]:
    """{rank folder: {optimizer: what its offloaded store holds and moves per step}}."""
    return {
        folder.name: {path.name.removesuffix("-offload.json"): json.loads(path.read_text()) for path in sorted(folder.glob("*-offload.json"))}
        for folder in sorted(Path(directory).glob("rank*"))
    }


def _graph_sort_key(name: str, order: dict[str, int]) -> tuple:
    """Compiles in order, each forward before its backward; then what is not a compile (an optimizer's step)."""
    compile_id, kind, _ = name.rsplit("-", 2)
    parts = compile_id.split("_")
    if not all(part.isdigit() for part in parts):
        return (1, compile_id, kind)
    return (0, tuple(map(int, parts)), order.get(kind, 3))


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
        "across_replicas": sum(g.get("replica_sent_bytes", 0) for g in graphs.values()),
        "peak_gathered": max((g["peak_gathered_bytes"] for g in graphs.values()), default=0),
        # A forward's kept parameters are its backward's: count them once, from the forwards.
        "kept": sum(g.get("kept_bytes", 0) for g in graphs.values() if g["kind"] == "forward"),
        **model_state(graphs),
    }


def collapse_fqns(fqns: Sequence[str], all_fqns: Collection[str], max_chars: int = PARAMS_LINE_CHARS) -> str:
    """A one-line summary of parameter names: their count, then the names with indices folded.

    Names that differ only in a numeric component are written once, the indices in braces in
    ascending order: blocks.0.fc.weight and blocks.1.fc.weight are blocks.{0,1}.fc.weight. Three or
    more consecutive indices are a run a..b, both ends included: blocks.{0..11} is twelve blocks,
    {0..3,6} five. A numbered block holding several parameters, all of those `all_fqns` has under
    it, is written `*` with the count it stands for: blocks.{0,1}.* (24 params). Groups appear in
    the order of their first name; a name given twice counts once. Groups that would take the line
    past `max_chars` are left off as "... +K more" (K parameters); the first group is shown even if
    it alone is longer.
    """
    names = list(dict.fromkeys(fqns))
    tree: dict[str, dict] = {}
    for name in names:
        node = tree
        for part in name.split("."):
            node = node.setdefault(part, {})
    groups = [
        (f"{pattern} ({count} params)" if pattern.endswith("*") else pattern, count)
        for pattern, count in _patterns(tree, "", set(names), set(all_fqns)).items()
    ]
    if not groups:
        return _counted(0)
    line, shown = f"{_counted(len(names))}: {groups[0][0]}", groups[0][1]
    for group, count in groups[1:]:
        left_off = len(names) - shown - count
        longer = f"{line}, {group}"
        if len(longer) + (len(f", ... +{left_off} more") if left_off else 0) > max_chars:
            break
        line, shown = longer, shown + count
    return line + (f", ... +{len(names) - shown} more" if shown < len(names) else "")


def _patterns(tree: dict[str, dict], path: str, chosen: set[str], known: set[str]) -> dict[str, int]:
    """The name patterns under `path` (written relative to it), each with how many names it stands for."""
    if not tree:
        return {"": 1}
    # (the part, or None for any index; the pattern below it) -> (part, names) of each member
    groups: dict[tuple[str | None, str], list[tuple[str, int]]] = {}
    for part, subtree in tree.items():
        below = _patterns(subtree, f"{path}{part}.", chosen, known)
        is_index = _INDEX.fullmatch(part) is not None
        names_below = sum(below.values())
        if is_index and names_below > 1 and {name for name in known if name.startswith(f"{path}{part}.")} <= chosen:
            below = {"*": names_below}
        for pattern, count in below.items():
            groups.setdefault((None if is_index else part, pattern), []).append((part, count))
    patterns = {}
    for (name, pattern), members in groups.items():
        head = name if name is not None else _index_set(sorted(int(part) for part, _ in members))
        patterns[_joined(head, pattern)] = sum(count for _, count in members)
    return patterns


def _counted(params: int) -> str:
    return f"{params} param{'' if params == 1 else 's'}"


def _joined(head: str, suffix: str) -> str:
    return f"{head}.{suffix}" if suffix else head


def _index_set(indices: list[int]) -> str:
    """Sorted indices as one index, or braces with runs of three or more as a..b: {0..3,6}."""
    if len(indices) == 1:
        return str(indices[0])
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    parts = [f"{run[0]}..{run[-1]}" if len(run) >= 3 else ",".join(map(str, run)) for run in runs]
    return "{" + ",".join(parts) + "}"


def rank_parameters(graphs: dict[str, dict]) -> list[str]:
    """Every parameter a rank's collectives serve, in first-seen order: what `*` is measured against."""
    served = (param for ledger in graphs.values() for entry in ledger["entries"] for param in entry["params"])
    return list(dict.fromkeys(served))


def graph_lines(name: str, ledger: dict, all_fqns: Collection[str], verbose: bool = False) -> list[str]:
    """One line per collective, then its parameters on the next: summarised, or all with `verbose`."""
    where = "the optimizer's step" if ledger["kind"] == "optimizer" else f"{ledger['node_count']} nodes"
    lines = [f"  {name}  (N={ledger['world_size']}, {where})"]
    lines.append(
        f"    {'pos':>4} {'op':<14} {'bkt':>3} {'group':>5} {'in':>10} {'sent':>10} {'dtype':<9} freed after / overlaps"
    )
    for e in ledger["entries"]:
        where = f"freed after {e['freed_after']} (pos {e['freed_position']})" if e["freed_after"] else ""
        overlaps = f"overlaps {', '.join(e['overlaps'])}" if e["overlaps"] else "overlaps nothing"
        if e.get("detail"):
            overlaps += f" ({e['detail']})"
        lines.append(
            f"    {e['position']:>4} {e['op']:<14} {e['bucket']:>3} {_group(e):>5} "
            f"{_mb(e['input_bytes']):>10} {_mb(e['sent_bytes']):>10} {e['dtype']:<9} {where or overlaps}"
        )
        if verbose:
            listing = f"{_counted(len(e['params']))}: {', '.join(e['params'])}"
            lines.extend(
                textwrap.wrap(
                    listing, len(PARAMS_INDENT) + PARAMS_LINE_CHARS, initial_indent=PARAMS_INDENT,
                    subsequent_indent=PARAMS_INDENT + "  ", break_long_words=False, break_on_hyphens=False,
                )
            )
        else:
            lines.append(PARAMS_INDENT + collapse_fqns(e["params"], all_fqns))
    lines.append(
        f"    gathered {_mb(ledger['gathered_bytes'])}, reduced {_mb(ledger['reduced_bytes'])}, "
        f"sent {_mb(ledger['sent_bytes'])}; peak gathered {_mb(ledger['peak_gathered_bytes'])}, "
        f"peak unreduced gradients {_mb(ledger['peak_unreduced_grad_bytes'])}"
    )
    if ledger.get("kept_params"):
        verb = "saves" if ledger["kind"] == "forward" else "receives"
        lines.append(
            f"    {verb} gathered for the backward ({_mb(ledger['kept_bytes'])}): "
            + collapse_fqns(ledger["kept_params"], all_fqns)
        )
    return lines


def _group(entry: dict) -> str:
    """The ranks a collective runs on: their count, and `/K` for every K-th rank (a hybrid replica group)."""
    size, stride = entry.get("group_size", 0), entry.get("group_stride", 1)
    return "?" if not size else f"{size}" + (f"/{stride}" if stride > 1 else "")


def sent_across_nodes(graphs: dict[str, dict], ranks_per_node: int) -> int:
    """A rank's bytes per step to ranks on other nodes, as the ledger counts them."""
    fields = {field.name for field in dataclasses.fields(LedgerEntry)}
    entries = [LedgerEntry(**{k: v for k, v in e.items() if k in fields}) for g in graphs.values() for e in g["entries"]]
    return sum(entry.sent_across_nodes(ranks_per_node) for entry in entries)


def report(
    ranks: dict[str, dict[str, dict]],
    verbose: bool = False,
    ranks_per_node: int | None = None,
    offloads: dict[str, dict[str, dict]] | None = None,
) -> str:
    lines = []
    for rank, graphs in ranks.items():
        lines.append(f"{rank}")
        parameters = rank_parameters(graphs)
        for name, ledger in graphs.items():
            lines.extend(graph_lines(name, ledger, parameters, verbose))
        s = rank_summary(graphs)
        lines.append(
            f"  per step: gathered {_mb(s['gathered'])}, reduced {_mb(s['reduced'])}, sent {_mb(s['sent'])}; "
            f"peak gathered {_mb(s['peak_gathered'])}, kept for the backward {_mb(s['kept'])}"
        )
        if s["across_replicas"]:
            lines.append(f"  of the bytes sent, {_mb(s['across_replicas'])} across replicas (hybrid sharding)")
        if ranks_per_node:
            lines.append(f"  sent to other nodes ({ranks_per_node} ranks per node): {_mb(sent_across_nodes(graphs, ranks_per_node))}")
        lines.append(
            f"  model state implied: params {_mb(s['params'])}, grads {_mb(s['grads'])}, "
            f"optimizer {_mb(s['optimizer'])} (Adam-like)"
        )
        for name, store in (offloads or {}).get(rank, {}).items():
            lines.append(
                f"  {name}: optimizer state {store['where']}, {_mb(store['state_bytes'])}"
                + (f" and master weights {_mb(store['master_bytes'])}" if store.get("master_bytes") else "")
                + f"; per step "
                f"{_mb(store['moved_bytes_per_step'])} moved ({store['moves']}), in {store['buckets']} buckets"
            )
    return "\n".join(lines)


def diff(first: dict, second: dict, first_name: str, second_name: str, verbose: bool = False) -> str:
    """Per-rank totals side by side, then a unified diff of the collective listings."""
    lines = []
    for rank in sorted(set(first) | set(second)):
        a, b = rank_summary(first.get(rank, {})), rank_summary(second.get(rank, {}))
        lines.append(f"{rank}: {'':<14} {first_name:>16} {second_name:>16}")
        lines.extend(f"  {key:<14} {_mb(a[key]):>16} {_mb(b[key]):>16}" for key in a)
        listing = []
        for graphs in (first.get(rank, {}), second.get(rank, {})):
            parameters = rank_parameters(graphs)
            listing.append(
                [line for name, ledger in graphs.items() for line in graph_lines(name, ledger, parameters, verbose)]
            )
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
