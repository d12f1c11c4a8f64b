"""`zerocompile plan`'s run: the flags checked against each other, the plan computed and printed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from zerocompile.distributed import flavour_of_backend
from zerocompile.passes.lowering import gathers_coalesced

from .factory import build_on_meta, load_factory
from .model import budget_plan, count_model, model_plan, muon_matrices
from .offload import Masters, masters, offload_plan, offload_report
from .paper import node_layout_plan, paper_plan, precision_from
from .records import PAPER_PARAM_DTYPE, PlanError, StagePlan, ZeroPrecision
from .report import model_json, model_report, node_layout_report, paper_report


def run(args: argparse.Namespace) -> int:
    """`zerocompile plan`: prints the plan; exit code 2 with a message naming the fix on bad input."""
    try:
        print(plan(args))
    except PlanError as error:
        print(f"zerocompile plan: error: {error}", file=sys.stderr)
        return 2
    return 0


def plan(args: argparse.Namespace) -> str:
    """The text `zerocompile plan` prints for these arguments (a table, or JSON with --json)."""
    if args.disk_bandwidth is not None and args.offload != "disk":
        raise PlanError("--disk-bandwidth sizes the disk traffic of --offload disk: give --offload disk too")
    if args.params is not None:
        if args.memory_budget is not None:
            raise PlanError(
                "--memory-budget is zerocompile's setting, and which parameters it keeps depends on their sizes, "
                "which the paper's accounting (--params) does not have: plan a model with --model to see it"
            )
        if args.reduce_dtype is not None:
            raise PlanError(
                "--reduce-dtype is zerocompile's setting, and the paper's accounting (--params) has one dtype "
                "for parameters and gradients: plan a model with --model to see it"
            )
        if args.muon is not None:
            raise PlanError(
                "--muon picks matrices by name and shape, which the paper's accounting (--params) does not have: "
                "plan a model with --model to see it"
            )
        for flag, value in (("--gather-quant", args.gather_quant), ("--reduce-quant", args.reduce_quant)):
            if value is not None:
                raise PlanError(
                    f"{flag} is zerocompile's setting, and the paper's accounting (--params) sends parameters and "
                    "gradients in their dtype: plan a model with --model to see it"
                )
        precision = precision_from(args.param_dtype or PAPER_PARAM_DTYPE, args.optimizer_bytes)
        plans = paper_plan(args.params, args.ranks, precision)
        layouts = []
        if args.ranks_per_node is not None:
            if args.ranks % args.ranks_per_node:
                raise PlanError(
                    f"--ranks-per-node {args.ranks_per_node} does not divide --ranks {args.ranks}: "
                    "every node holds the same number of ranks"
                )
            layouts = node_layout_plan(args.params, args.ranks, args.ranks_per_node, precision)
        if args.json:
            record = {"params": args.params, "ranks": args.ranks, **dataclasses.asdict(precision)}
            if layouts:
                record["ranks_per_node"] = args.ranks_per_node
                record["node_layouts"] = [layout.as_json() for layout in layouts]
            return json.dumps({**record, "stages": [p.as_json() for p in plans], **_offload_json(args, plans)}, indent=2)
        report = paper_report(args.params, args.ranks, precision, plans)
        if layouts:
            report += "\n\n" + node_layout_report(layouts, args.ranks, args.ranks_per_node)
        return report + _offload_text(args, plans)
    if args.ranks_per_node is not None:
        raise PlanError(
            "--ranks-per-node plans stage 3 across nodes with the paper's accounting: give --params "
            "(the model's parameter count) instead of --model"
        )
    counted = count_model(build_on_meta(load_factory(args.model), args.model), args.model)
    precision = ZeroPrecision(
        args.param_dtype, args.reduce_dtype, args.optimizer_bytes,
        gather_quant_block=args.quant_block if args.gather_quant else 0,
        reduce_quant_block=args.quant_block if args.reduce_quant else 0,
    )
    muon = muon_matrices(counted, args.muon) if args.muon is not None else []
    plans = model_plan(counted, args.ranks, precision, muon, flat_gathers=not gathers_coalesced(flavour_of_backend(args.backend)))
    if args.memory_budget is not None:
        plans.append(budget_plan(counted, args.ranks, precision, plans[2], plans[3], args.memory_budget))
    moved = masters(counted, args.ranks, args.param_dtype)
    if args.json:
        return json.dumps({**model_json(counted, args.ranks, precision, plans, muon), **_offload_json(args, plans, moved)}, indent=2)
    return model_report(counted, args.ranks, precision, plans, muon) + _offload_text(args, plans, moved)


def _offload_json(args: argparse.Namespace, plans: list[StagePlan], moved: Masters = Masters(0, 0)) -> dict[str, Any]:
    if args.offload is None:
        return {}
    offloaded = offload_plan(plans, args.offload, args.disk_bandwidth, moved)
    return {"offload": [p.as_json() for p in offloaded], "disk_bandwidth_mb_per_s": args.disk_bandwidth}


def _offload_text(args: argparse.Namespace, plans: list[StagePlan], moved: Masters = Masters(0, 0)) -> str:
    if args.offload is None:
        return ""
    offloaded = offload_plan(plans, args.offload, args.disk_bandwidth, moved)
    return "\n\n" + offload_report(offloaded, args.offload, args.disk_bandwidth, moved.stored)
