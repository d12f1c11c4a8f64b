"""The records a plan is made of: precision settings, counted parameters, one stage's bytes, and
the error a bad input raises."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerocompile.passes.lowering import gathers_quantised, int8_row_bytes
from zerocompile.passes.stages import padded_numel, shard_numel

from .text import format_bytes

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# The paper's optimizer state per parameter when --optimizer-bytes is not given.
DEFAULT_OPTIMIZER_BYTES = {"bf16": 12, "fp16": 12, "fp32": 8}
# --params's default dtype: the paper's mixed precision (Figure 1).
PAPER_PARAM_DTYPE = "bf16"
PAPER = "Rajbhandari et al. 2020, ZeRO, §5 and Figure 1"


class PlanError(ValueError):
    """Bad input to `zerocompile plan`; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Precision:
    """The paper's precision (--params): bytes per element of parameters and gradients, and
    optimizer bytes per trainable parameter."""

    param_dtype: str
    element_bytes: int
    optimizer_bytes: float  # K in the paper


@dataclasses.dataclass(frozen=True)
class CountedParameter:
    """One distinct Parameter of the model, as zerocompile.shard() sees it."""

    fqn: str
    names: tuple[str, ...]  # every FQN it is reachable under (tied parameters have several)
    numel: int
    trainable: bool
    dtype: torch.dtype  # its shard's, gradient's and (by default) optimizer state's, at any setting
    shape: tuple[int, ...]

    @property
    def element_bytes(self) -> int:
        return self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ZeroPrecision:
    """zerocompile's precision settings (--model), as ZeroConfig names them; None is its default.

    They change what is gathered, computed and reduced in, never what a rank holds: shards,
    gradients and optimizer state stay in each parameter's own dtype.
    """

    param_dtype: str | None  # gathered and computed in; None: each parameter's own dtype
    reduce_dtype: str | None  # gradients reduced in; None: the dtype they are computed in
    optimizer_bytes: float | None  # K per trainable parameter; None: Adam's two moments in the shard's dtype

    def compute_bytes(self, param: CountedParameter) -> int:
        return ELEMENT_BYTES[self.param_dtype] if self.param_dtype else param.element_bytes

    def reduce_bytes(self, param: CountedParameter) -> int:
        return ELEMENT_BYTES[self.reduce_dtype] if self.reduce_dtype else self.compute_bytes(param)

    def state_bytes(self, param: CountedParameter) -> float:
        """Optimizer bytes per element of a trainable parameter."""
        return 2 * param.element_bytes if self.optimizer_bytes is None else self.optimizer_bytes

    # int8 collectives (ZeroConfig.gather_quant / reduce_quant): elements per fp32 scale; 0: exact.
    gather_quant_block: int = 0
    reduce_quant_block: int = 0

    def gathered_wire_bytes(self, param: CountedParameter, ranks: int) -> int:
        """Bytes of all N ranks' parts of one all-gather of `param` (stages 1-3)."""
        shard, block = shard_numel(param.shape, ranks), self.gather_quant_block
        if block and param.dtype.is_floating_point and gathers_quantised(shard, self.compute_bytes(param), block):
            return ranks * int8_row_bytes(shard, block)
        return self.compute_bytes(param) * padded_numel(param.shape, ranks)

    def reduced_wire_bytes(self, param: CountedParameter, ranks: int) -> int:
        """Bytes of all N rows of one reduce-scatter of `param`'s gradient (stages 1-3; quantised
        at stage 0 too, as the first half of its all-reduce, in the same shards)."""
        if self.reduce_quant_block:
            return ranks * int8_row_bytes(shard_numel(param.shape, ranks), self.reduce_quant_block)
        return self.reduce_bytes(param) * padded_numel(param.shape, ranks)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage's bytes per rank. Bounds are marked because a counted model is not a traced graph."""

    stage: int
    params: float
    grads: float
    optimizer: float
    sent_per_step: float
    formula: str = ""  # the paper's model-state formula (--params)
    gathered_in_step: float | None = None  # full parameters alive inside a step (--model)
    full_grads_in_step: float | None = None  # full gradients alive inside a step (--model)
    gathered_is_lower_bound: bool = False
    full_grads_is_lower_bound: bool = False
    sent_is_upper_bound: bool = False
    memory_budget: int | None = None  # stage 3 with ZeroConfig.memory_budget (--memory-budget)
    optimizer_sent: float = 0.0  # of sent_per_step, what the optimizer's step sends (Muon's exchange, --muon)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def label(self) -> str:
        return str(self.stage) if self.memory_budget is None else f"3, budget {format_bytes(self.memory_budget)}"

    def as_json(self) -> dict[str, Any]:
        """Exact bytes for --json; the bound flags travel with the numbers they qualify."""
        record: dict[str, Any] = {
            "stage": self.stage,
            "model_state_bytes": {
                "params": self.params,
                "grads": self.grads,
                "optimizer": self.optimizer,
                "total": self.total,
            },
            "sent_bytes_per_step": self.sent_per_step,
            "sent_is_upper_bound": self.sent_is_upper_bound,
            "optimizer_sent_bytes_per_step": self.optimizer_sent,
        }
        if self.formula:
            record["formula"] = self.formula
        if self.memory_budget is not None:
            record["memory_budget"] = self.memory_budget
        if self.gathered_in_step is not None:
            record["gathered_in_step_bytes"] = self.gathered_in_step
            record["gathered_is_lower_bound"] = self.gathered_is_lower_bound
            record["full_grads_in_step_bytes"] = self.full_grads_in_step
            record["full_grads_is_lower_bound"] = self.full_grads_is_lower_bound
        return record
