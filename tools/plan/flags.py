"""The flags of `zerocompile plan` and the argparse types that check their values."""

from __future__ import annotations

import argparse
from typing import Callable, TypeVar

from zerocompile.config import ZeroConfig

from .records import ELEMENT_BYTES

Number = TypeVar("Number", int, float)


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


def _number(text: str, parse: Callable[[str], Number], expected: str) -> Number:
    """`parse(text)`, or the argparse error saying what was `expected` instead."""
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def _megabytes_per_second(text: str) -> float:
    value = _number(text, float, "MB/s such as 1500")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a bandwidth is more than 0 MB/s, got {text}")
    return value


def _parameter_count(text: str) -> int:
    value = _number(text, float, "a parameter count such as 7.5e9")
    if not value.is_integer() or value <= 0:
        raise argparse.ArgumentTypeError(f"the parameter count must be a positive whole number, got {text}")
    return int(value)


def _whole_number_at_least_one(unit: str, name: str) -> Callable[[str], int]:
    """An argparse type: a whole number of `unit` (ranks, elements per scale), 1 or more."""

    def parse(text: str) -> int:
        value = _number(text, int, f"a whole number of {unit}")
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
        return value

    return parse


_rank_count = _whole_number_at_least_one("ranks", "the number of ranks")
_block_size = _whole_number_at_least_one("elements per scale", "--quant-block")


def _budget_bytes(text: str) -> int:
    value = _number(text, float, "a number of bytes such as 2e9")
    if not value.is_integer() or value < 0:
        raise argparse.ArgumentTypeError(f"--memory-budget must be a whole number of bytes >= 0, got {text}")
    return int(value)


def _optimizer_bytes(text: str) -> float:
    value = _number(text, float, "bytes per parameter such as 12")
    if value < 0:
        raise argparse.ArgumentTypeError(f"optimizer bytes per parameter cannot be negative, got {value:g}")
    return int(value) if value.is_integer() else value  # whole byte counts stay exact integers in --json
