"""`init_distributed()`: one call that starts torch.distributed under torchrun, Slurm, or alone."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def _launcher_environment() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's or Slurm's variables, if either launched us."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None


def _slurm_master_addr() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    # "node[01-04],gpu7" -> "node01": the first host of the first group.
    first = nodelist.split(",")[0]
    if "[" in first:
        prefix, ranges = first.split("[", 1)
        first = prefix + ranges.rstrip("]").split(",")[0].split("-")[0]
    return first


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a rendezvous of ranks this process spawns."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def loopback_rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun would set for `rank` of a single-node job on 127.0.0.1:`port`."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def init_distributed(backend: str | None = None, timeout: timedelta | None = None) -> tuple[int, int]:
    """Initialise torch.distributed and return (rank, world_size).

    Reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun) or SLURM_PROCID/SLURM_NTASKS/
    SLURM_JOB_NODELIST (srun; MASTER_PORT defaults to 29500). Without either, starts a one-rank
    group in this process, binding no port. Uses nccl when CUDA is available, gloo otherwise.
    A no-op returning the current rank and size when already initialised.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {"timeout": timeout} if timeout is not None else {}
    launched = _launcher_environment()
    if launched is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return 0, 1
    rank, world_size, local_rank = launched
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = _slurm_master_addr()
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
    return rank, world_size
