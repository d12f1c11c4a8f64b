"""Hybrid sharding (FSDP2's HSDP, DeepSpeed's MiCS): shard inside groups of K ranks, replicate across.

`ZeroConfig(shard_size=K)` cuts the N ranks of the sharding group into N/K *shard groups* of K
consecutive ranks (a node's ranks, in torchrun's and Slurm's numbering) and K *replica groups*,
each holding the ranks with the same position in their shard group. Parameters, gradients and
optimizer state are sharded over the shard group, so all-gathers stay inside it (inside a node);
a gradient is reduce-scattered inside the shard group and its shard then all-reduced across the
replica group, the only collective that crosses nodes (stage 0: all-reduced inside, then across).
`shard_size="node"` takes K from the launcher (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks per
node); a 2-D `DeviceMesh` with dimensions ("replicate", "shard") gives both groups directly.

`shard_size=None` (the default) or K = N is plain sharding over the whole group: no replica group.
"""

from __future__ import annotations

import dataclasses
import os
import re
import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

MESH_DIMENSIONS = ("replicate", "shard")


@dataclasses.dataclass(frozen=True)
class HybridGroups:
    """Where one model's parameters are sharded and across which ranks its shards are replicated."""

    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None  # None: a single replica (plain sharding)

    @property
    def replicas(self) -> int:
        return 1 if self.replicate is None else dist.get_world_size(self.replicate)


# Process groups are made once per set of ranks: torch names a group made with local
# synchronisation after its ranks, so a second one over the same ranks would collide. Two models
# with the same layout share the groups, as two models on one world group share it. Kept per world
# (default group), weakly: after `destroy_process_group()` and a new `init_process_group()` the new
# world makes its own groups, and the destroyed world's go once nothing else holds them.
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)


def check_shard_size(shard_size: object, setting: str = "shard_size") -> None:
    """The error for a `shard_size` (or `setting`) that is none of None, an int >= 1, "node" or a 2-D mesh."""
    if shard_size is None or shard_size == "node" or isinstance(shard_size, DeviceMesh):
        if isinstance(shard_size, DeviceMesh) and shard_size.mesh_dim_names != MESH_DIMENSIONS:
            raise ValueError(
                f"shard_size=DeviceMesh needs 2 dimensions named {MESH_DIMENSIONS}, as FSDP2's HSDP "
                f"takes it (init_device_mesh(device, (replicas, shard_size), mesh_dim_names={MESH_DIMENSIONS})), "
                f"got dimensions {shard_size.mesh_dim_names}"
            )
        return
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(
            f"{setting} must be None (shard over the whole group), a number of ranks >= 1, 'node' "
            f"(the ranks of one node) or a 2-D DeviceMesh {MESH_DIMENSIONS}, got {shard_size!r}"
        )


def hybrid_groups(
    group: dist.ProcessGroup, shard_size: int | str | DeviceMesh | None, setting: str = "shard_size"
) -> HybridGroups:
    """The shard and replica groups of this rank for sharding over `group` in groups of `shard_size`
    (hpZ's secondary groups are the shard groups of `secondary_shard_size`, named in errors)."""
    ranks = dist.get_process_group_ranks(group)
    if isinstance(shard_size, DeviceMesh):
        return _from_mesh(shard_size, ranks)
    size = ranks_per_node() if shard_size == "node" else shard_size
    if size is None or size == len(ranks):
        return HybridGroups(group, None)
    if len(ranks) % size:
        raise ValueError(
            f"{setting}={size} does not divide the {len(ranks)} ranks of the group: each group "
            f"holds {setting} ranks, so use a divisor of {len(ranks)} (e.g. the ranks per node)"
        )
    position = ranks.index(dist.get_rank())
    block = position // size
    shard_ranks = ranks[block * size : (block + 1) * size]
    replica_ranks = ranks[position % size :: size]
    return HybridGroups(_group_of(shard_ranks), _group_of(replica_ranks) if len(replica_ranks) > 1 else None)


def _group_of(ranks: list[int]) -> dist.ProcessGroup:
    made = _GROUPS.setdefault(dist.group.WORLD, {})
    key = tuple(ranks)
    if key not in made:
        # Only the members synchronise: each rank makes just its own shard and replica groups.
        made[key] = dist.new_group(ranks, use_local_synchronization=True)
    return made[key]


def _from_mesh(mesh: DeviceMesh, ranks: list[int]) -> HybridGroups:
    if sorted(mesh.mesh.flatten().tolist()) != sorted(ranks):
        raise ValueError(
            f"the DeviceMesh holds ranks {mesh.mesh.tolist()} but the sharding group has ranks {ranks}: "
            "build the mesh over the same ranks (init_device_mesh over the world, or pass group= the "
            "mesh's ranks)"
        )
    replicate = mesh.get_group("replicate")
    return HybridGroups(mesh.get_group("shard"), replicate if dist.get_world_size(replicate) > 1 else None)


def ranks_per_node() -> int:
    """How many ranks the launcher started on this node: torchrun's LOCAL_WORLD_SIZE, else Slurm's
    tasks per node (the same on every node: a shard group must not straddle two)."""
    env = os.environ
    if "LOCAL_WORLD_SIZE" in env:
        return int(env["LOCAL_WORLD_SIZE"])
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node is not None:
        counts = {int(count) for count in re.findall(r"(\d+)(?:\(x\d+\))?", per_node)}
        if len(counts) != 1:
            raise ValueError(
                f"shard_size='node': Slurm runs different numbers of tasks per node ({per_node}), so "
                "a node is no shard group: run the same number of tasks on every node "
                "(srun --ntasks-per-node=K) or give shard_size=K"
            )
        return counts.pop()
    raise ValueError(
        "shard_size='node' takes the ranks per node from the launcher (torchrun's LOCAL_WORLD_SIZE or "
        "Slurm's SLURM_STEP_TASKS_PER_NODE), and neither is set: start with torchrun or srun, or give "
        "shard_size=K (a number of ranks)"
    )
