"""The ZeRO paper's accounting (--params): model state and traffic per rank for Φ parameters,
on one node and across nodes."""

from __future__ import annotations

import dataclasses
from typing import Any

from .records import DEFAULT_OPTIMIZER_BYTES, ELEMENT_BYTES, Precision, StagePlan


def precision_from(param_dtype: str, optimizer_bytes: float | None) -> Precision:
    """The paper's precision the flags ask for, with the paper's optimizer default of that dtype."""
    k = DEFAULT_OPTIMIZER_BYTES[param_dtype] if optimizer_bytes is None else optimizer_bytes
    return Precision(param_dtype, ELEMENT_BYTES[param_dtype], k)


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
