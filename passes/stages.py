"""What each ZeRO stage does: the one table every pass and every runtime module asks.

| stage | held between steps | forward gathers                | kept for the backward | gradient reduction                  |
|-------|--------------------|--------------------------------|-----------------------|-------------------------------------|
| 0     | whole parameters   | none (the parameter is whole)  | -                     | all-reduce where produced           |
| 1     | 1/N shards         | all at the start of the forward | gathered parameters   | reduce-scatter at the backward's end |
| 2     | 1/N shards         | all at the start of the forward | gathered parameters   | reduce-scatter where produced       |
| 3     | 1/N shards         | each just before its use       | shards (re-gathered)  | reduce-scatter where produced       |

Optimizer state follows the parameter: whole at stage 0, this rank's slice at stages 1-3. At
stage 1 full gradients live until the end of the backward (the paper's full gradient buffer); at
stages 2-3 each is reduced to its shard where it is produced. With prefetch, stage 1-2 gathers are
issued `prefetch` buckets ahead of their first use rather than all at once (`lower_markers`).

A `local` marker (inside `no_sync`: its input already is a full local copy) is whole at any
stage: neither gathered nor reduced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

def shard_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements of each rank's shard of a parameter of `shape` sharded over `world_size` ranks:
    ceil(rows / N) rows of dim 0, the one definition of the layout. Rank r holds rows
    [r * ceil(rows / N), (r + 1) * ceil(rows / N)) flattened, zero-padded at the end (the last
    ranks may hold fewer valid rows, or none), which is `torch.chunk`'s split and DTensor's
    `Shard(0)`: each rank's valid rows are a `Shard(0)` local tensor over the shard's own storage.
    Laid end to end the N shards are the flat parameter followed by its padding, so an all-gather
    of shards is the parameter's rows as they are (narrowed, viewed; no copy), and rank r's
    elements start at r * shard_numel of the flat parameter. A 0-d parameter is one row.

    The padding is under N rows per parameter (FSDP2 pads dim 0 alike); a chunk starts 16-byte
    aligned wherever rows * row width is a multiple of 16 elements, as transformer widths are."""
    rows = shape[0] if len(shape) else 1
    return math.ceil(rows / world_size) * math.prod(shape[1:])


def padded_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements of the flat parameter padded to `world_size` shards: what an all-gather returns."""
    return shard_numel(shape, world_size) * world_size


# Chunks of a flat buffer cut inside one collective (hpZ's secondary slices, a replica group's or
# stage 0's quantised all-reduce) hold a multiple of this many elements: each chunk then starts
# 16-byte aligned in every dtype, int8 codes included, as NCCL's kernels and vectorised copies
# want (FSDP1 aligns its flat parameters to 16 bytes likewise). Not a parameter's layout: no
# user sees these chunks.
CHUNK_ALIGNMENT = 16


def chunk_numel(numel: int, parts: int) -> int:
    """Elements of each of `parts` aligned chunks a flat buffer of `numel` elements is cut into
    for one collective (zero-padded at the end): ceil(numel / parts) rounded up to CHUNK_ALIGNMENT."""
    return CHUNK_ALIGNMENT * math.ceil(numel / (parts * CHUNK_ALIGNMENT))


@dataclasses.dataclass(frozen=True)
class StagePolicy:
    stage: int
    # Each rank holds 1/N of the rows (padded, see `shard_numel`) of every parameter, its gradient and
    # its optimizer state.
    shards_parameters: bool
    # The forward's gathers of graph inputs move to the top of the forward graph.
    gathers_at_forward_start: bool
    # The partitioner saves gathered parameters for the backward. If a sharding stage does not,
    # the backward re-gathers (`recompute_gathers` tags them) and full parameters die after their
    # last forward use. (Stage 0 gathers nothing: its markers are identities, left alone.)
    keeps_gathered_for_backward: bool
    # Reductions whose only reader is the graph output move to the end of the backward.
    reduces_at_backward_end: bool

    @property
    def reduction(self) -> str:
        """The collective that averages gradients: the shard's slice of it, or the whole."""
        return "reduce_scatter" if self.shards_parameters else "all_reduce"

    def local_numel(self, shape: Sequence[int], world_size: int) -> int:
        """Elements of a parameter of `shape` that one rank holds: its shard of rows (padded), or
        the whole parameter where the stage keeps parameters whole."""
        return shard_numel(shape, world_size) if self.shards_parameters else math.prod(shape)


STAGES: dict[int, StagePolicy] = {
    0: StagePolicy(0, shards_parameters=False, gathers_at_forward_start=False, keeps_gathered_for_backward=False, reduces_at_backward_end=False),
    1: StagePolicy(1, shards_parameters=True, gathers_at_forward_start=True, keeps_gathered_for_backward=True, reduces_at_backward_end=True),
    2: StagePolicy(2, shards_parameters=True, gathers_at_forward_start=True, keeps_gathered_for_backward=True, reduces_at_backward_end=False),
    3: StagePolicy(3, shards_parameters=True, gathers_at_forward_start=False, keeps_gathered_for_backward=False, reduces_at_backward_end=False),
}


def stage_policy(stage: int) -> StagePolicy:
    return STAGES[stage]
