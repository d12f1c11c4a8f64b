"""Whole-matrix work on sharded parameters: each matrix assembled on one owner rank, computed there
once, and handed back in slices.

At stages 1-3 a rank holds a flat run of each parameter's row-major elements (its shard, padded at
the end). Work that needs a parameter as a matrix (Muon's Newton-Schulz) cannot run on that run.
`compute_on_owners` sends each matrix's slices to one owner rank in one all-to-all, the owner lays
them out in rank order, drops the padding and views the matrix, computes, and a second all-to-all
returns each rank its slice of the result: every rank sends and receives about 2·(N-1)/N² of the
matrices' bytes, and each matrix is computed once in the group instead of once per rank.

Owners are chosen by longest-processing-time on each matrix's cost, the same on every rank (it is
a function of the shapes only), so the ranks' shares of the work are balanced.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist


def assign_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """The owner rank of each item: the costliest first, each to the rank with the least work so
    far (the lowest rank on ties). Deterministic, so every rank computes the same assignment."""
    loads = [0.0] * ranks
    owners = [0] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(ranks), key=lambda rank: (loads[rank], rank))
        owners[item] = owner
        loads[owner] += costs[item]
    return owners


def bytes_sent_each_way(
    numels: Sequence[int], owners: Sequence[int], rank: int, ranks: int, itemsize: int
) -> tuple[int, int]:
    """The bytes `rank` sends to other ranks in the two all-to-alls of one `compute_on_owners` of
    slices of `numels` elements and `itemsize` bytes: to the owners, its slice of each matrix
    another rank owns; back, the other ranks' slices of each matrix it owns."""
    others = sum(numel for numel, owner in zip(numels, owners) if owner != rank)
    owned = sum(numel for numel, owner in zip(numels, owners) if owner == rank)
    return others * itemsize, (ranks - 1) * owned * itemsize


def compute_on_owners(
    slices: Sequence[torch.Tensor],
    shapes: Sequence[tuple[int, ...]],
    owners: Sequence[int],
    group: dist.ProcessGroup,
    compute: Callable[[int, torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """This rank's slice of `compute(i, matrix_i)` for every matrix i.

    `slices[i]` is this rank's flat slice of matrix i: element `rank * slices[i].numel()` onwards
    of its row-major elements padded to `ranks * slices[i].numel()`, as `shard()` lays a
    parameter out. All slices share one dtype, in which they travel; `compute` runs on the owner
    `owners[i]` with the matrix viewed in `shapes[i]` and returns a tensor of its numel, which
    travels back in that dtype (its padding zeros). Blocking: two all-to-alls on `group`."""
    ranks, rank = group.size(), group.rank()
    numels = [piece.numel() for piece in slices]
    # Sent grouped by owner, each owner's matrices in index order: that is also the order in
    # which every owner lays out what it receives and what it returns.
    order = sorted(range(len(slices)), key=lambda i: (owners[i], i))
    per_owner = [0] * ranks
    for i in order:
        per_owner[owners[i]] += numels[i]
    dtype = slices[0].dtype
    sent = torch.cat([slices[i].reshape(-1) for i in order])
    received = sent.new_empty(ranks * per_owner[rank])
    dist.all_to_all_single(received, sent, [per_owner[rank]] * ranks, per_owner, group=group)
    rows = received.view(ranks, per_owner[rank])  # row r: rank r's slices of the matrices owned here
    results, start = [], 0
    for i in (i for i in order if owners[i] == rank):
        matrix = rows[:, start : start + numels[i]].reshape(-1)[: math.prod(shapes[i])].view(shapes[i])
        result = compute(i, matrix).reshape(-1).to(dtype)
        results.append(torch.nn.functional.pad(result, [0, ranks * numels[i] - result.numel()]).view(ranks, numels[i]))
        start += numels[i]
    returned = torch.cat(results, dim=1) if results else rows.new_empty(ranks, 0)
    back = sent.new_empty(sent.numel())
    dist.all_to_all_single(back, returned.reshape(-1), per_owner, [per_owner[rank]] * ranks, group=group)
    mine = dict(zip(order, back.split([numels[i] for i in order])))
    return [mine[i] for i in range(len(slices))]
