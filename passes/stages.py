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

# Every rank's shard holds a multiple of this many elements. In an all-gather's output (and a
# reduce-scatter's input) rank r's chunk starts at element r * shard_numel, so each chunk then
# starts 16-byte aligned in every dtype, int8 codes included: NCCL's kernels and vectorised copies
# move 16-byte words and take slower paths on chunks that are not (FSDP1 aligns its flat
# parameters to 16 bytes likewise; not measured here, no GPU). Costs under 16 elements of padding
# per rank and parameter, against under 1 without it.
SHARD_ALIGNMENT = 16


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of each rank's shard of a parameter of `numel` elements sharded over `world_size`
    ranks: the ceiling of numel / N, rounded up to a multiple of SHARD_ALIGNMENT. The one
    definition of the padding; rank r holds elements [r * shard, (r + 1) * shard) of the flat
    parameter zero-padded to `padded_numel`."""
    return SHARD_ALIGNMENT * math.ceil(numel / (world_size * SHARD_ALIGNMENT))


def padded_numel(numel: int, world_size: int) -> int:
    """Elements of the flat parameter padded to `world_size` shards: what an all-gather returns."""
    return shard_numel(numel, world_size) * world_size


@dataclasses.dataclass(frozen=True)
class StagePolicy:
    stage: int
    # Each rank holds a 1/N slice (padded, see `shard_numel`) of every parameter, its gradient and
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

    def local_numel(self, numel: int, world_size: int) -> int:
        """Elements of a parameter of `numel` elements that one rank holds: its aligned shard, or
        the whole parameter (unpadded) where the stage keeps parameters whole."""
        return shard_numel(numel, world_size) if self.shards_parameters else numel


STAGES: dict[int, StagePolicy] = {
    0: StagePolicy(0, shards_parameters=False, gathers_at_forward_start=False, keeps_gathered_for_backward=False, reduces_at_backward_end=False),
    1: StagePolicy(1, shards_parameters=True, gathers_at_forward_start=True, keeps_gathered_for_backward=True, reduces_at_backward_end=True),
    2: StagePolicy(2, shards_parameters=True, gathers_at_forward_start=True, keeps_gathered_for_backward=True, reduces_at_backward_end=False),
    3: StagePolicy(3, shards_parameters=True, gathers_at_forward_start=False, keeps_gathered_for_backward=False, reduces_at_backward_end=False),
}


def stage_policy(stage: int) -> StagePolicy:
    return STAGES[stage]
