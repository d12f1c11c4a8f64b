"""The plan as text and JSON: the paper's table (--params, across nodes) and zerocompile's
(--model), each with what its numbers assume."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import torch

from zerocompile.passes.stages import padded_numel

from .model import CountedModel, muon_exchange
from .paper import NodeLayoutPlan
from .records import DTYPE_NAMES, PAPER, CountedParameter, Precision, StagePlan, ZeroPrecision
from .text import bounded, format_bytes, table


def _precision_line(precision: Precision) -> str:
    k = precision.optimizer_bytes
    return (
        f"{precision.param_dtype} parameters and gradients ({precision.element_bytes} B each), "
        f"optimizer state K = {k:g} B per trainable parameter; 1 GB = 10^9 bytes"
    )


def paper_report(phi: int, ranks: int, precision: Precision, plans: list[StagePlan]) -> str:
    """The --params table, with each stage's formula so the numbers can be checked by hand."""
    header = ["stage", "formula", "params", "grads", "optimizer", "model state", "sent/step"]
    rows = [
        [str(s.stage), s.formula, *map(format_bytes, (s.params, s.grads, s.optimizer, s.total, s.sent_per_step))]
        for s in plans
    ]
    return "\n".join(
        [
            f"The ZeRO paper's model state and traffic per rank: Φ = {phi:,} parameters, N = {ranks} ranks "
            f"({PAPER})",
            _precision_line(precision),
            "",
            table(header, rows),
            "",
            (
                "sent/step: gradients all-reduced at stages 0-2, 2Φ(N-1)/N elements; stage 3 gathers the "
                "parameters in the forward and the backward and reduce-scatters the gradients, 3Φ(N-1)/N"
            ),
            (
                "This is the paper's accounting, not zerocompile's. In the paper ZeRO-1 keeps whole parameters "
                "and gradients, ZeRO-2 whole parameters, and mixed precision keeps 2-byte parameters and "
                "gradients beside fp32 master weights in the optimizer state (K = 12). zerocompile shards all "
                "three between steps at every stage >= 1, has the whole ones only inside a step, and with "
                "param_dtype=torch.bfloat16 keeps fp32 shards, fp32 gradients and fp32 Adam state (4 + 4 + 8 "
                "bytes per parameter), only gathering, computing and reducing in bf16. `zerocompile plan "
                "--model` shows what it holds and sends."
            ),
        ]
    )


def node_layout_report(plans: list[NodeLayoutPlan], ranks: int, per_node: int) -> str:
    header = ["stage 3", "setting", "formula", "model state", "sent/step", "to other nodes", "formula"]
    rows = [
        [plan.layout, plan.setting, plan.formula_state, format_bytes(plan.model_state), format_bytes(plan.sent_per_step),
         format_bytes(plan.inter_node_per_step), plan.formula_inter]
        for plan in plans
    ]  # fmt: skip
    return "\n".join(
        [
            f"Across nodes: N = {ranks} ranks, M = {per_node} per node ({ranks // per_node} nodes)",
            "",
            table(header, rows),
            "",
            "to other nodes: a rank's share of the bytes its node sends to other nodes per step, for ring "
            "collectives (NCCL's; a ring over all N ranks leaves each node once, so 1/M of a rank's bytes; "
            "zerocompile's ledger counts the same). hpZ also holds a 1/M slice of each parameter from its forward "
            "use to its backward, pΦ/M at most.",
        ]
    )


def _zero_precision_lines(
    counted: CountedModel, precision: ZeroPrecision, muon: Sequence[CountedParameter] = ()
) -> list[str]:
    """What the precision settings mean for this model: what is held (not theirs to change) and what moves."""
    own = _dtype_names(param.dtype for param in counted.parameters)
    others = " outside Muon" if muon else ""
    if precision.optimizer_bytes is not None:
        optimizer = f"K = {precision.optimizer_bytes:g} B per trainable parameter{others} (--optimizer-bytes)"
    else:
        muon_names = {param.fqn for param in muon}
        per_element = sorted({precision.state_bytes(param) for param in counted.trainable if param.fqn not in muon_names})
        k = "/".join(f"{each:g}" for each in per_element) or "0"
        optimizer = f"K = {k} B per trainable parameter{others} (Adam's two moments in {own})"
    compute = precision.param_dtype or own
    reduce = precision.reduce_dtype or compute
    if precision.gather_quant_block:
        gathered = f"gathered as int8 blocks of {precision.gather_quant_block} + fp32 scales and computed in {compute}"
    else:
        gathered = f"gathered and computed in {compute}"
    if precision.reduce_quant_block:
        reduced = f"reduced as int8 blocks of {precision.reduce_quant_block} + fp32 scales, summed in fp32"
    else:
        reduced = f"reduced in {reduce} (reduce_dtype={_setting(precision.reduce_dtype)})"
    return [
        f"held whatever param_dtype and reduce_dtype are: shards and their gradients in the model's own {own}, "
        f"optimizer state {optimizer}; 1 GB = 10^9 bytes",
        f"moved: parameters {gathered} "
        f"(param_dtype={_setting(precision.param_dtype)}), gradients {reduced}, landing in {own}",
    ]


def _muon_lines(muon: Sequence[CountedParameter], ranks: int) -> list[str]:
    """What --muon adds: its matrices, their state, and the exchange each step at stages 1-3."""
    if not muon:
        return []
    exchange = muon_exchange(muon, ranks)
    numel = sum(param.numel for param in muon)
    return [
        f"Muon (zc.optim.Muon) steps {len(muon)} matrices, {numel:,} elements: their state is one momentum in the "
        "parameter's dtype. At stages 1-3 each step sends each matrix's update slices (bfloat16) to one owner "
        "rank, which runs Newton-Schulz on the whole matrix, and the results back: "
        f"{format_bytes(max(exchange, default=0))} from the busiest rank (least {format_bytes(min(exchange, default=0))}), "
        "in sent/step; owners balanced on Newton-Schulz's cost, max(m, n)·min(m, n)². Stage 0 computes every "
        "matrix on every rank and sends nothing more."
    ]


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    names = dict.fromkeys(DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")) for dtype in dtypes)
    return "/".join(names)


def _setting(dtype_name: str | None) -> str:
    """How ZeroConfig spells a --param-dtype / --reduce-dtype choice."""
    return next((str(dtype) for dtype, name in DTYPE_NAMES.items() if name == dtype_name), "None")


def model_report(
    counted: CountedModel,
    ranks: int,
    precision: ZeroPrecision,
    plans: list[StagePlan],
    muon: Sequence[CountedParameter] = (),
) -> str:
    """The --model table and what each column assumes: which numbers are exact and which are bounds."""
    trainable_numel = sum(param.numel for param in counted.trainable)
    largest, largest_grad = counted.largest, max(counted.trainable, key=lambda param: param.numel, default=None)
    header = ["stage", "params", "grads", "optimizer", "held", "+gathered in step", "+full grads in step", "sent/step"]
    rows = [
        [
            s.label,
            *map(format_bytes, (s.params, s.grads, s.optimizer, s.total)),
            bounded(s.gathered_in_step, lower=s.gathered_is_lower_bound) if s.stage else "-",
            bounded(s.full_grads_in_step, lower=s.full_grads_is_lower_bound) if s.stage else "(held)",
            bounded(s.sent_per_step, upper=s.sent_is_upper_bound),
        ]
        for s in plans
    ]
    lines = [
        f"{counted.spec} built on the meta device, N = {ranks} ranks",
        (
            f"Φ = {sum(p.numel for p in counted.parameters):,} parameters in {len(counted.parameters)} tensors: "
            f"{trainable_numel:,} trainable, {sum(p.numel for p in counted.frozen):,} frozen (frozen: held and "
            "gathered like the others, no gradient, no optimizer state, no reduction)"
        ),
    ]
    if counted.tied:
        lines.append("tied, counted once: " + "; ".join(" = ".join(names) for names in counted.tied))
    lines += [
        *_zero_precision_lines(counted, precision, muon),
        *_muon_lines(muon, ranks),
        f"buffers: {format_bytes(counted.buffer_bytes)}, replicated on every rank (not model state)",
        "",
        table(header, rows),
        "",
        (
            "per rank. params, grads, optimizer, held: between steps, what zc.model_state_bytes reports after "
            "optimizer.step(); stages 1-3 hold shards of a multiple of 16 elements, as zc.shard() pads them."
        ),
        (
            "+gathered in step: whole parameters alive inside a step. Stages 1-2 gather every parameter at the "
            "start of the forward. At stage 3 the largest single gathered parameter, "
            f"'{largest.fqn}' ({largest.numel:,} elements), is a lower bound of the gathered-buffer peak: "
            "which gathered buffers are alive together depends on the traced graph, which plan does not trace."
        ),
        (
            "+full grads in step: stage 1 keeps every full gradient until the end of the backward; stages 2-3 "
            "reduce each as it is produced, so at least the largest"
            + (f", '{largest_grad.fqn}'." if largest_grad else " (no parameter is trainable).")
        ),
        (
            "sent/step: stage 0 all-reduces trainable gradients, 2(N-1)/N of each; stages 1-3 all-gather every "
            "padded parameter and reduce-scatter every padded trainable gradient, (N-1)/N of each. Stage 3 "
            "gathers again in the backward: at most, since a parameter the backward does not need (e.g. an "
            "embedding's weight) is not gathered again."
        ),
    ]
    for s in plans:
        if s.memory_budget is not None:
            lines.append(
                f"3, budget {format_bytes(s.memory_budget)} (memory_budget={s.memory_budget}): held as stage 3; the "
                "backward does not gather again the parameters it reads that the budget keeps (full, in the compute "
                "dtype, first fit). A budget holding every parameter sends stage 2's bytes; a smaller one at most "
                "stage 3's less (N-1)/N of the budget minus the largest parameter. Kept parameters stay gathered "
                "from the forward into the backward, on top of stage 3's window; per compiled graph (graph breaks)."
            )
    if precision.param_dtype and any(DTYPE_NAMES.get(p.dtype) != precision.param_dtype for p in counted.parameters):
        lines.append(
            f"With param_dtype={_setting(precision.param_dtype)}, stage 0 also casts each parameter to "
            f"{precision.param_dtype} where it is used and computes {precision.param_dtype} gradients before "
            "their all-reduce: copies alive inside a step, not in the table."
        )
    return "\n".join(lines)


def model_json(
    counted: CountedModel,
    ranks: int,
    precision: ZeroPrecision,
    plans: list[StagePlan],
    muon: Sequence[CountedParameter] = (),
) -> dict[str, Any]:
    """The --model plan as exact bytes, with the counts (tied, frozen, largest) it rests on."""
    largest = counted.largest
    return {
        "model": counted.spec,
        "ranks": ranks,
        **dataclasses.asdict(precision),
        "params": sum(param.numel for param in counted.parameters),
        "trainable_params": sum(param.numel for param in counted.trainable),
        "frozen_params": sum(param.numel for param in counted.frozen),
        "tied": [list(names) for names in counted.tied],
        "largest_param": {
            "fqn": largest.fqn,
            "numel": largest.numel,
            "padded_numel": padded_numel(largest.shape, ranks),
        },
        "buffer_bytes": counted.buffer_bytes,
        "muon": {
            "params": [param.fqn for param in muon],
            "numel": sum(param.numel for param in muon),
            "exchange_bytes_per_rank": muon_exchange(muon, ranks),
        },
        "stages": [plan.as_json() for plan in plans],
    }
