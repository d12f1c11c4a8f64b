"""Plan each ZeRO stage's memory and traffic per rank for N ranks, without the ranks.

Answers "how much will N ranks need" before anything is launched, in two ways:

  zerocompile plan --params 7.5e9 --ranks 64 --optimizer-bytes 12
      The ZeRO paper's accounting (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
      Training Trillion Parameter Models", §5 and Figure 1) for Φ parameters: model state per rank
      and bytes sent per step, stages 0-3. Reproduces Figure 1: 120.0, 31.4, 16.6, 1.9 GB. It is the
      paper's, not zerocompile's: see the precision paragraph below.

  zerocompile plan --model zerocompile.tools.gpt:GPT --ranks 1024 [--param-dtype bf16]
      What zerocompile does. Imports FACTORY from MODULE (a callable taking no arguments that
      returns an nn.Module), calls it under `torch.device("meta")` so no parameter is allocated,
      counts parameters as zerocompile.shard() does (tied ones once; frozen ones held and gathered,
      but without gradient or optimizer state), pads each to N shards of a multiple of 16
      elements as shard() does, and prints per stage what a rank holds between steps (what
      zc.model_state_bytes reports), the full-size tensors alive inside a step, and the bytes it
      sends per step.

Precision. --params follows the paper: --param-dtype (default bf16) is the dtype of parameters and
gradients, --optimizer-bytes K the optimizer state per parameter, by default 12 with bf16/fp16
(mixed-precision Adam: fp32 master weights, momentum, variance) and 8 with fp32 (Adam's momentum
and variance). --model follows zerocompile, whose mixed precision is different: the shards, their
gradients and the optimizer state keep the model's own dtype whatever the settings (param_dtype
keeps fp32 master shards; reduced gradients land in the shards' dtype), so a model built in fp32
holds 4 + 4 + 8 bytes per parameter with Adam at any --param-dtype (K by default: Adam's two
moments in each shard's dtype). --param-dtype (ZeroConfig.param_dtype; default: none, the model
computes in its own dtype) is what parameters are gathered and computed in: it sizes the
gathered buffers, the gradients awaiting reduction and the bytes sent. --reduce-dtype
(ZeroConfig.reduce_dtype; default: the dtype gradients are computed in) is what gradients are
reduced in: it sizes only the bytes the reductions send.

Sizes are decimal: 1 GB = 10^9 bytes, the unit that reproduces the paper's Figure 1 (in GiB its
120 GB would be 111.8). --json prints exact byte counts instead of the table.

Stated limits of --model: the model is counted, not traced. Whether a stage-3 backward gathers a
parameter again, and which gathered buffers and gradients are alive together, are properties of
the traced graph; without it the plan gives bounds and marks them (≥, ≤): stage-3 traffic is at
most ZeRO's 3Φ (a parameter the backward does not need, such as an embedding's weight, is not
gathered again), the stage-3 gathered-buffer peak is at least the largest single parameter, and
the stage-2/3 peak of unreduced gradients at least the largest trainable one. Stages 1-2 are exact
if the forward uses every parameter. Tracing forward and backward on FakeTensorMode with a fake
process group of N ranks through the "zero" backend would read the exact figures off the lowered
graphs, but it needs example inputs that a no-argument factory does not give, and for a
1B-parameter GPT at N = 1024 it took 7.5 s (stage 0) to 11.6 s (stage 3) per stage after a 3 s
import, about 45 s for the four stages against the 60 s budget; counting takes about 5 s.
tests/test_plan.py holds the counted figures and their bounds against traced graphs of small models.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import re
import sys
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from zerocompile.config import ZeroConfig
from zerocompile.optim import muon_exchange_bytes
from zerocompile.distributed import flavour_of_backend
from zerocompile.passes.lowering import gathers_coalesced, gathers_quantised, int8_row_bytes
from zerocompile.passes.stages import padded_numel, shard_numel

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# The paper's optimizer state per parameter when --optimizer-bytes is not given.
DEFAULT_OPTIMIZER_BYTES = {"bf16": 12, "fp16": 12, "fp32": 8}
# --params's default dtype: the paper's mixed precision (Figure 1).
PAPER_PARAM_DTYPE = "bf16"
DECIMAL_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")
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
    shape: tuple[int, ...] = ()

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
        shard, block = shard_numel(param.numel, ranks), self.gather_quant_block
        if block and param.dtype.is_floating_point and gathers_quantised(shard, self.compute_bytes(param), block):
            return ranks * int8_row_bytes(shard, block)
        return self.compute_bytes(param) * padded_numel(param.numel, ranks)

    def reduced_wire_bytes(self, param: CountedParameter, ranks: int) -> int:
        """Bytes of all N rows of one reduce-scatter of `param`'s gradient (stages 1-3; quantised
        at stage 0 too, as the first half of its all-reduce, in the same shards)."""
        if self.reduce_quant_block:
            return ranks * int8_row_bytes(shard_numel(param.numel, ranks), self.reduce_quant_block)
        return self.reduce_bytes(param) * padded_numel(param.numel, ranks)


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


# ------------------------------------------------------------------------------------ arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `zerocompile plan`: one of --params / --model, the ranks, the precision."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--params", type=_parameter_count, metavar="Φ", help="parameter count, e.g. 7.5e9: the ZeRO paper's formulas"
    )
    source.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="a no-argument callable returning an nn.Module, e.g. zerocompile.tools.gpt:GPT; built on "
        "the meta device (MODULE is imported with the current directory on the path)",
    )
    parser.add_argument("--ranks", type=_rank_count, required=True, metavar="N", help="data-parallel ranks")
    parser.add_argument(
        "--param-dtype",
        choices=sorted(ELEMENT_BYTES),
        help="with --params, the dtype of parameters and gradients (default bf16, as in the paper); with "
        "--model, zerocompile's param_dtype: what parameters are gathered and computed in, while shards, "
        "gradients and optimizer state keep the model's dtype (default: the model's own dtype)",
    )
    parser.add_argument(
        "--reduce-dtype",
        choices=sorted(ELEMENT_BYTES),
        help="with --model, zerocompile's reduce_dtype: what gradients are reduced in (default: the dtype "
        "they are computed in)",
    )
    parser.add_argument(
        "--optimizer-bytes",
        type=_optimizer_bytes,
        metavar="K",
        help="optimizer state bytes per trainable parameter (--params: default 12 with bf16/fp16, the paper's "
        "mixed-precision Adam, 8 with fp32; --model: default Adam's two moments in each shard's dtype, 8 for fp32)",
    )
    parser.add_argument(
        "--gather-quant", choices=["int8"], help="with --model, zerocompile's gather_quant: parameters gathered as int8 blocks"
    )
    parser.add_argument(
        "--reduce-quant", choices=["int8"], help="with --model, zerocompile's reduce_quant: gradients reduced as int8 blocks"
    )
    parser.add_argument(
        "--quant-block",
        type=_block_size,
        default=ZeroConfig.quant_block,
        metavar="B",
        help=f"elements per int8 scale (default {ZeroConfig.quant_block}, ZeroConfig's)",
    )
    parser.add_argument(
        "--memory-budget",
        type=_budget_bytes,
        metavar="BYTES",
        help="with --model, zerocompile's memory_budget: one more stage-3 row, keeping up to BYTES of gathered "
        "parameters from the forward for the backward instead of gathering them again",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=_whole_number_at_least_one("ranks", "--ranks-per-node"),
        metavar="M",
        help="with --params, also plan stage 3 across nodes of M ranks: plain, hybrid sharding (shard_size=M) "
        "and hpZ (secondary_shard_size=M), with the bytes each rank sends to other nodes",
    )
    parser.add_argument(
        "--muon",
        metavar="REGEX",
        help="with --model, the parameters zc.optim.Muon steps: the trainable 2-D ones whose FQN matches REGEX "
        "(re.search), e.g. '^blocks\\.' for the hidden matrices; they hold one momentum instead of K and, at "
        "stages 1-3, each step sends their updates to an owner rank and back. The others: --optimizer-bytes "
        "(AdamW by default)",
    )
    parser.add_argument(
        "--backend",
        default="nccl",
        help="with --model, the process group's backend (default nccl): on gloo a bucket's parameters are "
        "gathered each into its own buffer; on every other backend into one buffer they are copied out of, "
        "which lives beside the copies for a moment, so stages 1-2's gathered bytes are then a lower bound too",
    )
    parser.add_argument(
        "--offload",
        choices=["disk", "cpu"],
        help="zerocompile's offload: stages 1-3 keep the optimizer state on disk (adds what a step moves through "
        "the disk: its state read and written back) or in host memory, updated on the CPU (adds what a step "
        "copies between the device and the host: parameter shards and gradients there, parameters back)",
    )
    parser.add_argument(
        "--disk-bandwidth",
        type=_megabytes_per_second,
        metavar="MB/s",
        help="with --offload disk, the disk's bandwidth (zerocompile check --offload-dir DIR measures it): the "
        "time a step's disk traffic takes at least",
    )
    parser.add_argument("--json", action="store_true", help="print exact byte counts as JSON instead of a table")


def _megabytes_per_second(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MB/s such as 1500, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a bandwidth is more than 0 MB/s, got {text}")
    return value


def _parameter_count(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a parameter count such as 7.5e9, got {text!r}") from None
    if not value.is_integer() or value <= 0:
        raise argparse.ArgumentTypeError(f"the parameter count must be a positive whole number, got {text}")
    return int(value)


def _whole_number_at_least_one(unit: str, name: str) -> Callable[[str], int]:
    """An argparse type: a whole number of `unit` (ranks, elements per scale), 1 or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number of {unit}, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
        return value

    return parse


_rank_count = _whole_number_at_least_one("ranks", "the number of ranks")
_block_size = _whole_number_at_least_one("elements per scale", "--quant-block")


def _budget_bytes(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes such as 2e9, got {text!r}") from None
    if not value.is_integer() or value < 0:
        raise argparse.ArgumentTypeError(f"--memory-budget must be a whole number of bytes >= 0, got {text}")
    return int(value)


def _optimizer_bytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes per parameter such as 12, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"optimizer bytes per parameter cannot be negative, got {value:g}")
    return int(value) if value.is_integer() else value  # whole byte counts stay exact integers in --json


def precision_from(param_dtype: str, optimizer_bytes: float | None) -> Precision:
    """The paper's precision the flags ask for, with the paper's optimizer default of that dtype."""
    k = DEFAULT_OPTIMIZER_BYTES[param_dtype] if optimizer_bytes is None else optimizer_bytes
    return Precision(param_dtype, ELEMENT_BYTES[param_dtype], k)


# ---------------------------------------------------------------------------------- the paper


def paper_plan(phi: int, ranks: int, precision: Precision) -> list[StagePlan]:
    """ZeRO's model state per rank and traffic per step for Φ parameters on N ranks.

    Parameters and gradients take p bytes each, the optimizer K: stage 0 holds (p+p+K)Φ; stage 1
    partitions the optimizer state, stage 2 also the gradients, stage 3 also the parameters.
    Gradients are all-reduced (2Φ(N-1)/N elements sent) at stages 0-2; stage 3 all-gathers the
    parameters in the forward and again in the backward and reduce-scatters the gradients (3Φ).
    """
    p, k, n = precision.element_bytes, precision.optimizer_bytes, ranks
    spread = (n - 1) / n
    return [
        StagePlan(0, p * phi, p * phi, k * phi, 2 * phi * spread * p, f"({p}+{p}+K)Φ"),
        StagePlan(1, p * phi, p * phi, k * phi / n, 2 * phi * spread * p, f"{2 * p}Φ + KΦ/N"),
        StagePlan(2, p * phi, p * phi / n, k * phi / n, 2 * phi * spread * p, f"{p}Φ + ({p}+K)Φ/N"),
        StagePlan(3, p * phi / n, p * phi / n, k * phi / n, 3 * phi * spread * p, f"({p}+{p}+K)Φ/N"),
    ]


@dataclasses.dataclass(frozen=True)
class NodeLayoutPlan:
    """Stage 3 across nodes of M ranks: a rank's model state and the bytes it sends per step,
    all of them and those to ranks on other nodes."""

    layout: str
    setting: str
    model_state: float
    sent_per_step: float
    inter_node_per_step: float
    formula_state: str
    formula_inter: str

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def node_layout_plan(phi: int, ranks: int, per_node: int, precision: Precision) -> list[NodeLayoutPlan]:
    """Plain stage 3, hybrid sharding and hpZ on N ranks in nodes of M, p bytes per element.

    Bytes are counted as the ledger counts them for NCCL's ring collectives: an all-gather or
    reduce-scatter over G ranks sends (G-1)/G of the full tensor, an all-reduce twice that, each
    rank to one neighbour, so a ring over all N ranks crosses between nodes on N/M of its N edges:
    1/M of what a rank sends leaves its node (a node sends one rank's worth). A hybrid shard group
    (or hpZ's secondary group) is one node; a replica group has one rank per node, so all of its
    ring crosses. Plain: forward gather, backward gather, reduce-scatter over N. Hybrid: those three
    inside the node over M, then the reduced shard (pΦ/M) all-reduced over N/M replicas. hpZ:
    forward gather and reduce-scatter over N, the backward's gather inside the node. (On gloo
    zerocompile reduce-scatters by all-to-all, which sends each peer its part directly: pΦ(N-M)/N
    of a reduce-scatter leaves the node; the ledger counts that.)
    """
    p, k, n, per = precision.element_bytes, precision.optimizer_bytes, ranks, per_node
    state = (2 * p + k) * phi
    one_over_n = p * phi * (n - 1) / n  # one gather or reduce-scatter over all N ranks
    one_over_k = p * phi * (per - 1) / per  # one inside a node
    replicas = n // per
    across_replicas = 2 * (replicas - 1) / replicas * p * phi / per  # the ring all-reduce of a 1/K shard
    remote_share = 1 / per if n > per else 0.0  # of a ring over all N ranks
    return [
        NodeLayoutPlan(
            "plain", "stage=3", state / n, 3 * one_over_n, 3 * one_over_n * remote_share,
            f"(2·{p}+K)Φ/N", f"3·{p}Φ(N-1)/(N·M)",
        ),
        NodeLayoutPlan(
            "hybrid", f"stage=3, shard_size={per}", state / per, 3 * one_over_k + across_replicas, across_replicas,
            f"(2·{p}+K)Φ/M", f"2·{p}Φ(N-M)/(N·M)",
        ),
        NodeLayoutPlan(
            "hpZ", f"stage=3, secondary_shard_size={per}", state / n, 2 * one_over_n + one_over_k,
            2 * one_over_n * remote_share, f"(2·{p}+K)Φ/N", f"2·{p}Φ(N-1)/(N·M)",
        ),
    ]


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
            _table(header, rows),
            "",
            "to other nodes: a rank's share of the bytes its node sends to other nodes per step, for ring "
            "collectives (NCCL's; a ring over all N ranks leaves each node once, so 1/M of a rank's bytes; "
            "zerocompile's ledger counts the same). hpZ also holds a 1/M slice of each parameter from its forward "
            "use to its backward, pΦ/M at most.",
        ]
    )


# ---------------------------------------------------------------------------------- the model


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by MODULE:FACTORY (FACTORY may be dotted, e.g. Class.create)."""
    module_name, sep, attribute_path = spec.partition(":")
    if not sep or not module_name or not attribute_path or ":" in attribute_path:
        raise PlanError(f"--model takes MODULE:FACTORY, e.g. zerocompile.tools.gpt:GPT; got {spec!r}")
    # As `python -m` would: a user's mymodels.py in the working directory is importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name or module_name.startswith(f"{error.name}."):
            raise PlanError(
                f"cannot import module {module_name!r} of --model {spec}: no module named {error.name!r}. "
                f"Run from the directory holding it, add that directory to PYTHONPATH, or install its package"
            ) from None
        raise PlanError(
            f"importing module {module_name!r} of --model {spec} failed: it imports {error.name!r}, which is "
            "not installed; install it"
        ) from None
    target: Any = module
    for name in attribute_path.split("."):
        if not hasattr(target, name):
            callables = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise PlanError(
                f"module {module_name!r} has no {attribute_path!r} (from --model {spec}); its callables: "
                f"{', '.join(callables) or 'none'}"
            )
        target = getattr(target, name)
    if not callable(target):
        raise PlanError(f"--model {spec} names a {type(target).__name__}, not a callable returning an nn.Module")
    _check_takes_no_arguments(target, spec)
    return target


def _check_takes_no_arguments(factory: Callable[..., Any], spec: str) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature: calling will tell
        return
    required = [
        name
        for name, parameter in signature.parameters.items()
        if parameter.default is inspect.Parameter.empty
        and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if required:
        raise PlanError(
            f"--model {spec} needs arguments ({', '.join(required)}), but plan calls it with none: "
            f"wrap it in a function, e.g. def make_model(): return {spec.partition(':')[2]}(...)"
        )


def build_on_meta(factory: Callable[[], Any], spec: str) -> nn.Module:
    """Call the factory with the meta device as default: shapes and dtypes, no storage."""
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise PlanError(f"--model {spec} returned a {type(model).__name__}, not a torch.nn.Module")
    allocated = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if not tensor.is_meta]
    if allocated:
        print(
            f"zerocompile plan: note: {spec} put {allocated[:3]} on a real device despite the meta default "
            "(an explicit device= argument); they were allocated, the counts are unaffected",
            file=sys.stderr,
        )
    return model


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
    padded = {param.fqn: padded_numel(param.numel, n) for param in parameters}
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


# ------------------------------------------------------------------------------------- output


def format_bytes(count: float) -> str:
    """Decimal units with one decimal, e.g. 31406250000 -> '31.4 GB' (1 GB = 10^9 bytes)."""
    value = float(count)
    for unit in DECIMAL_UNITS[:-1]:
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} {DECIMAL_UNITS[-1]}"


def _bounded(count: float, lower: bool = False, upper: bool = False) -> str:
    return ("≥ " if lower else "≤ " if upper else "") + format_bytes(count)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *rows]]
    return "\n".join(lines)


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
            _table(header, rows),
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
            _bounded(s.gathered_in_step, lower=s.gathered_is_lower_bound) if s.stage else "-",
            _bounded(s.full_grads_in_step, lower=s.full_grads_is_lower_bound) if s.stage else "(held)",
            _bounded(s.sent_per_step, upper=s.sent_is_upper_bound),
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
        _table(header, rows),
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
            "padded_numel": padded_numel(largest.numel, ranks),
        },
        "buffer_bytes": counted.buffer_bytes,
        "muon": {
            "params": [param.fqn for param in muon],
            "numel": sum(param.numel for param in muon),
            "exchange_bytes_per_rank": muon_exchange(muon, ranks),
        },
        "stages": [plan.as_json() for plan in plans],
    }


# ------------------------------------------------------------------------------------ command


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """One stage's optimizer state offloaded (offload="disk" or "cpu"), per rank."""

    stage: int
    offload: str  # "disk" or "cpu"
    offloaded: float  # the optimizer state's bytes, out of the device's memory
    held: float  # what stays in the device's memory between steps: params and grads
    # disk: through the disk each step, the state read and written back; cpu: copied between the
    # device and the host, the parameter shards and gradients to the host and the parameters back
    moved_per_step: float
    floor_seconds: float | None  # moved_per_step at the disk's bandwidth, where given

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def offload_plan(plans: list[StagePlan], offload: str, megabytes_per_second: float | None) -> list[OffloadPlan]:
    """Stages 1-3 of `plans` with their optimizer state offloaded (stage 0 cannot offload it)."""
    return [
        OffloadPlan(
            s.stage, offload, s.optimizer, s.params + s.grads,
            2 * s.optimizer if offload == "disk" else 2 * s.params + s.grads,
            2 * s.optimizer / (megabytes_per_second * 1e6) if megabytes_per_second else None,
        )
        for s in plans
        if s.stage > 0 and s.memory_budget is None
    ]  # fmt: skip


def offload_report(plans: list[OffloadPlan], offload: str, megabytes_per_second: float | None) -> str:
    if offload == "cpu":
        header = ["stage", "in host memory", "held on the device", "copied device <-> host per step"]
        rows = [[str(p.stage), format_bytes(p.offloaded), format_bytes(p.held), format_bytes(p.moved_per_step)] for p in plans]
        intro = (
            "offload='cpu': each rank keeps its optimizer state in host memory and updates on the CPU: per step its "
            "parameter shards and gradients are copied to the host and the parameters back. Gradients and parameters "
            "stay on the device (held)."
        )
        return "\n".join([intro, "", _table(header, rows)])
    header = ["stage", "on disk", "held in memory", "through the disk per step", "at least"]
    rows = [
        [str(p.stage), format_bytes(p.offloaded), format_bytes(p.held), format_bytes(p.moved_per_step),
         f"{p.floor_seconds:.2f} s" if p.floor_seconds is not None else "-"]
        for p in plans
    ]  # fmt: skip
    speed = (
        f"at {megabytes_per_second:,.0f} MB/s" if megabytes_per_second else "(give --disk-bandwidth, which `zerocompile check --offload-dir DIR` measures)"
    )
    return "\n".join(
        [
            "offload='disk': each rank keeps its optimizer state in a file and streams it through each step, read "
            f"and written back once; the step takes at least that traffic's time {speed}, more where the optimizer "
            "itself is slower. Gradients and parameters stay in memory (held).",
            "",
            _table(header, rows),
        ]
    )


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
    if args.json:
        return json.dumps({**model_json(counted, args.ranks, precision, plans, muon), **_offload_json(args, plans)}, indent=2)
    return model_report(counted, args.ranks, precision, plans, muon) + _offload_text(args, plans)


def _offload_json(args: argparse.Namespace, plans: list[StagePlan]) -> dict[str, Any]:
    if args.offload is None:
        return {}
    offloaded = offload_plan(plans, args.offload, args.disk_bandwidth)
    return {"offload": [p.as_json() for p in offloaded], "disk_bandwidth_mb_per_s": args.disk_bandwidth}


def _offload_text(args: argparse.Namespace, plans: list[StagePlan]) -> str:
    if args.offload is None:
        return ""
    return "\n\n" + offload_report(offload_plan(plans, args.offload, args.disk_bandwidth), args.offload, args.disk_bandwidth)
