"""What zerocompile holds and sends per stage for a model (--model): its parameters counted as
zerocompile.shard() counts them, Muon's matrices, the memory budget's stage-3 row."""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from torch import nn

from zerocompile.optim import muon_exchange_bytes
from zerocompile.passes.stages import padded_numel

from .records import CountedParameter, PlanError, StagePlan, ZeroPrecision


@dataclasses.dataclass(frozen=True)
class CountedModel:
    """A model reduced to what the plan needs: its distinct parameters and its buffers' bytes."""

    spec: str  # MODULE:FACTORY it was built from
    parameters: list[CountedParameter]
    buffer_bytes: int  # replicated on every rank, in the buffers' own dtypes

    @property
    def trainable(self) -> list[CountedParameter]:
        return [param for param in self.parameters if param.trainable]

    @property
    def frozen(self) -> list[CountedParameter]:
        return [param for param in self.parameters if not param.trainable]

    @property
    def tied(self) -> list[tuple[str, ...]]:
        return [param.names for param in self.parameters if len(param.names) > 1]

    @property
    def largest(self) -> CountedParameter:
        return max(self.parameters, key=lambda param: param.numel)


def count_model(model: nn.Module, spec: str) -> CountedModel:
    """Each distinct Parameter object once, with all its FQNs, in shard()'s order."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    if not names:
        raise PlanError(f"--model {spec} built a {type(model).__name__} without parameters: nothing to shard")
    parameters = [
        CountedParameter(fqns[0], tuple(fqns), p.numel(), p.requires_grad, p.dtype, tuple(p.shape))
        for p, fqns in names.items()
    ]
    return CountedModel(spec, parameters, sum(b.numel() * b.element_size() for b in model.buffers()))


def model_plan(
    counted: CountedModel,
    ranks: int,
    precision: ZeroPrecision,
    muon: Sequence[CountedParameter] = (),
    flat_gathers: bool = False,
) -> list[StagePlan]:
    """What zerocompile does with the model's parameters on N ranks, stage by stage.

    Held (between steps, as zc.model_state_bytes reports after optimizer.step()): stage 0 keeps
    everything whole; stages 1-3 keep one padded shard of each parameter, of each trainable
    parameter's gradient and of its optimizer state; all in each parameter's own dtype, whatever
    param_dtype and reduce_dtype are. Inside a step, in param_dtype: stages 1-2 gather every
    parameter at the start of the forward (padded buffers) and stage 1 keeps every full gradient
    until the end of the backward; stages 2-3 reduce each gradient as it is produced and stage 3
    gathers one layer at a time, so there only the largest one is certain.
    Sent per step: stage 0 all-reduces trainable gradients (2(N-1)/N of each, in reduce_dtype);
    stages 1-3 all-gather each padded parameter (in param_dtype) and reduce-scatter each padded
    trainable gradient (in reduce_dtype), (N-1)/N of each; stage 3 gathers again in the backward.
    Quantised, each rank's part is an int8 row instead (`int8_row_bytes`), counted per parameter
    (a bucket's collective quantises its shards as one row, padded once: up to four blocks fewer
    per parameter than counted here), and stage 0's all-reduce is a quantised
    reduce-scatter plus an all-gather of the quantised means, (N-1)/N of the rows each.
    `muon`'s matrices hold Muon's one momentum instead, and at stages 1-3 each step adds Muon's
    exchange, the busiest rank's (`muon_exchange`). `flat_gathers` (every backend but gloo): a
    bucket is gathered into one buffer and its parameters copied out of it, so for a moment the
    buffer lives beside the copies and the gathered bytes are a lower bound at every stage.
    """
    n = ranks
    spread = (n - 1) / n
    parameters, trainable = counted.parameters, counted.trainable
    padded = {param.fqn: padded_numel(param.shape, n) for param in parameters}
    compute, reduce = precision.compute_bytes, precision.reduce_bytes
    muon_names = {param.fqn for param in muon}
    exchange = max(muon_exchange(muon, n), default=0)

    def state(param: CountedParameter) -> float:
        return param.element_bytes if param.fqn in muon_names else precision.state_bytes(param)

    plans = [
        StagePlan(
            0,
            params=sum(param.element_bytes * param.numel for param in parameters),
            grads=sum(param.element_bytes * param.numel for param in trainable),
            optimizer=sum(state(param) * param.numel for param in trainable),
            sent_per_step=2 * spread * sum(
                precision.reduced_wire_bytes(param, n) if precision.reduce_quant_block else reduce(param) * param.numel
                for param in trainable
            ),
            gathered_in_step=0,
            full_grads_in_step=0,  # the held gradients are the full ones
            sent_is_upper_bound=bool(precision.reduce_quant_block),  # a bucket pads its int8 row once
        )
    ]
    gathered = [compute(param) * padded[param.fqn] for param in parameters]
    full_grads = [compute(param) * param.numel for param in trainable]
    quantised = bool(precision.gather_quant_block or precision.reduce_quant_block)
    for stage in (1, 2, 3):
        gathers = 2 if stage == 3 else 1
        plans.append(
            StagePlan(
                stage,
                params=sum(param.element_bytes * (padded[param.fqn] // n) for param in parameters),
                grads=sum(param.element_bytes * (padded[param.fqn] // n) for param in trainable),
                optimizer=sum(state(param) * (padded[param.fqn] // n) for param in trainable),
                sent_per_step=spread
                * (
                    gathers * sum(precision.gathered_wire_bytes(param, n) for param in parameters)
                    + sum(precision.reduced_wire_bytes(param, n) for param in trainable)
                )
                + exchange,
                optimizer_sent=exchange,
                gathered_in_step=max(gathered) if stage == 3 else sum(gathered),
                full_grads_in_step=sum(full_grads) if stage == 1 else max(full_grads, default=0),
                # int8: dequantisation writes whole code planes before cutting them to the shard
                gathered_is_lower_bound=stage == 3 or flat_gathers or bool(precision.gather_quant_block),
                full_grads_is_lower_bound=stage > 1,
                sent_is_upper_bound=stage == 3 or quantised,
            )
        )
    return plans


def muon_matrices(counted: CountedModel, pattern: str) -> list[CountedParameter]:
    """Muon's parameters: the trainable 2-D ones whose FQN (any of a tied one's) matches `pattern`,
    as nanoGPT-style code picks the hidden matrices by name and `ndim == 2`."""
    try:
        regex = re.compile(pattern)
    except re.error as error:
        raise PlanError(f"--muon {pattern!r} is not a regular expression: {error}") from None
    chosen = [
        param
        for param in counted.trainable
        if len(param.shape) == 2 and any(regex.search(name) for name in param.names)
    ]
    if not chosen:
        matrices = ", ".join([param.fqn for param in counted.trainable if len(param.shape) == 2][:6])
        raise PlanError(
            f"--muon {pattern!r} matches no trainable 2-D parameter of {counted.spec}; its matrices begin: "
            f"{matrices or 'none (nothing for Muon)'}"
        )
    return chosen


def muon_exchange(muon: Sequence[CountedParameter], ranks: int) -> list[int]:
    """Each rank's bytes sent by one `zc.optim.Muon` step at stages 1-3 (updates to each matrix's
    owner in bfloat16 and back; owners balanced on Newton-Schulz's cost, as the optimizer does)."""
    return muon_exchange_bytes([param.shape for param in muon], ranks) if muon else []


def budget_plan(
    counted: CountedModel, ranks: int, precision: ZeroPrecision, stage2: StagePlan, stage3: StagePlan, budget: int
) -> StagePlan:
    """Stage 3 with `memory_budget=budget`: held as stage 3, sending less by what the budget keeps.

    The joint pass keeps, first fit, parameters the backward reads within `budget` bytes of full
    tensors in the compute dtype, and the backward does not gather those again. A budget holding
    every parameter leaves nothing to gather again: stage 2's traffic (exact under stage 2's
    condition, every parameter used). A smaller one either keeps every parameter the backward
    reads, or left one out that did not fit, so the kept ones add up to more than the budget minus
    the largest parameter: stage 3's traffic less at least (N-1)/N of their gathered bytes, an
    upper bound (which parameters the backward reads is the traced graph's).
    """
    n = ranks
    full = {param.fqn: precision.compute_bytes(param) * param.numel for param in counted.parameters}
    if budget >= sum(full.values()):
        return dataclasses.replace(stage3, sent_per_step=stage2.sent_per_step, sent_is_upper_bound=False, memory_budget=budget)
    # The fewest bytes a gather sends per byte of full tensor (padding and int8 scales vary by parameter).
    per_byte = min(precision.gathered_wire_bytes(param, n) / full[param.fqn] for param in counted.parameters if param.numel)
    saved = (n - 1) / n * per_byte * max(0, budget - max(full.values()))
    sent = max(stage2.sent_per_step, stage3.sent_per_step - saved)
    return dataclasses.replace(stage3, sent_per_step=sent, sent_is_upper_bound=True, memory_budget=budget)
