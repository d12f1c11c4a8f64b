"""`init_distributed()`: one call that starts torch.distributed under torchrun, Slurm, or alone."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

from zerocompile.passes.lowering import ALL_TO_ALL_REDUCE_SCATTER, NATIVE_REDUCE_SCATTER

T = TypeVar("T")


def launcher_environment() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's or srun's variables, if either launched us.

    Inside a Slurm allocation but outside `srun` (the body of an sbatch script, an salloc shell),
    SLURM_PROCID is 0 and SLURM_NTASKS the job's task count, yet no other task runs: taking them
    at their word would wait forever for ranks that never come, so that is an error instead.
    Only srun sets SLURM_STEP_ID.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        tasks = env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]
        return int(env["SLURM_PROCID"]), int(tasks), int(env.get("SLURM_LOCALID", 0))
    job_tasks = int(env.get("SLURM_NTASKS", "1"))
    if job_tasks > 1:
        raise RuntimeError(
            f"this process runs in a Slurm job of {job_tasks} tasks (SLURM_NTASKS={job_tasks}) but "
            "was not started by srun (no SLURM_STEP_ID), so no other rank will join it: start one "
            "process per task with `srun python SCRIPT ...` in the sbatch script, or one torchrun "
            "per node with `srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES ...`"
        )
    return None


def _first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: "node[07-09,12],gpu1" -> "node07", "r1-n[2-3]-ib" -> "r1-n2-ib"."""
    depth = 0
    for end, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            nodelist = nodelist[:end]
            break
    # Each bracket's first entry ("07-09,12" -> "07"), zero padding kept.
    return re.sub(r"\[([^\]]*)\]", lambda group: re.split("[,-]", group[1])[0], nodelist)


def _slurm_master_addr() -> str:
    return _first_host(os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST") or "127.0.0.1")


def _slurm_master_port() -> int:
    """29500 plus the job id modulo 1000: jobs sharing their first node rarely pick the same port."""
    return 29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000


def process_group_timeout(group: dist.ProcessGroup | None = None) -> timedelta:
    """How long collectives on `group` (default: the world) wait for a peer before failing.

    The timeout `init_process_group`/`new_group` gave the group's backend: gloo enforces it on
    every collective, functional ones inside compiled graphs included.
    """
    group = group if group is not None else dist.group.WORLD
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        if options is not None:
            return options._timeout
    return dist.distributed_c10d._get_process_group_store(group).timeout


def default_backend(device: torch.device | str | None = None) -> str:
    """The backend `init_distributed` starts when given none: torch's default for `device`'s type
    (gloo for the CPU, nccl for CUDA); for no device, or one torch has no default for (meta), nccl
    where CUDA is available, else gloo."""
    backends = dist.Backend.default_device_backend_map
    if device is not None and torch.device(device).type in backends:
        return backends[torch.device(device).type]
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    backend: str | None = None, timeout: timedelta | None = None, device: torch.device | str | None = None
) -> tuple[int, int]:
    """Initialise torch.distributed and return (rank, world_size).

    Reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun) or, under srun, SLURM_PROCID/
    SLURM_STEP_NUM_TASKS/SLURM_LOCALID with the first host of SLURM_STEP_NODELIST as MASTER_ADDR
    and MASTER_PORT defaulting to 29500 + SLURM_JOB_ID % 1000 (either may be set to override).
    Without a launcher, starts a one-rank group in this process, binding no port; inside a
    multi-task Slurm job but not under srun, raises (the other ranks would never come). Without a
    `backend`, uses torch's default for `device`'s type (gloo for "cpu", so a CPU run works on a
    machine with GPUs), or without a device nccl when CUDA is available, gloo otherwise. A backend
    that runs CUDA tensors (nccl, or "cpu:gloo,cuda:nccl") makes this rank's GPU current and binds the group to it (`device_id`):
    the local rank's GPU, counted among those this process sees. A no-op returning the current
    rank and size when already initialised.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend is None:
        backend = default_backend(device)
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    launched = launcher_environment()
    rank, world_size, local_rank = launched if launched is not None else (0, 1, 0)
    gpu = _cuda_device(backend, local_rank)
    if gpu is not None:
        torch.cuda.set_device(gpu)
        kwargs["device_id"] = gpu
    if launched is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=rank, world_size=world_size, **kwargs)
        return rank, world_size
    # Passed on, not written into os.environ: a library leaves its process's environment as it was.
    addr = os.environ.get("MASTER_ADDR") or _slurm_master_addr()
    port = int(os.environ.get("MASTER_PORT") or _slurm_master_port())
    restart_store = _torchrun_attempt_store(addr, port, world_size, timeout)
    if restart_store is not None:
        dist.init_process_group(backend, store=restart_store, rank=rank, world_size=world_size, **kwargs)
    else:
        host = f"[{addr}]" if ":" in addr else addr  # an IPv6 address, as a URL writes it
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size, **kwargs)
    return rank, world_size


def _cuda_device(backend: str, local_rank: int) -> torch.device | None:
    """The GPU this rank runs on if `backend` takes CUDA tensors other than through gloo, else None.

    The local rank modulo the GPUs this process sees: a launcher that shows each task only its own
    GPU (Slurm's --gpus-per-task=1, a per-task CUDA_VISIBLE_DEVICES) leaves local rank 3 one
    device, cuda:0, where `cuda:LOCAL_RANK` would be an invalid device ordinal.
    """
    if _backends_by_device_type(backend).get("cuda", "gloo") == "gloo":
        return None
    visible = torch.cuda.device_count()
    if visible == 0:
        raise RuntimeError(
            f"backend {backend!r} runs CUDA tensors but this process sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): give each rank a GPU "
            "(e.g. srun --gpus-per-task=1), or train on the CPU with zerocompile.init_distributed(backend='gloo')"
        )
    return torch.device("cuda", local_rank % visible)


def _torchrun_attempt_store(addr: str, port: int, world_size: int, timeout: timedelta | None) -> dist.Store | None:
    """Under torchrun's agent store, a view of it private to this restart attempt; else None.

    With the static rendezvous (--master-addr/--master-port) torchrun keeps one store for the whole
    job across --max-restarts. A restarted rank could read the killed attempt's gloo addresses
    from it before the new ones are written and connect to a dead process ("Connection refused").
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        addr,
        port,
        world_size,
        is_master=False,
        timeout=timeout or timedelta(minutes=30),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"zerocompile/attempt-{attempt}/", store)


def _backends_by_device_type(backend: str) -> dict[str, str]:
    """{device type: backend} for a backend as `init_process_group` takes it or
    `get_backend_config` reports it: "nccl" -> {"cuda": "nccl"}, "gloo" -> {"cpu": "gloo",
    "cuda": "gloo"}, "cpu:gloo,cuda:nccl" -> as written."""
    return BackendConfig(Backend(backend)).get_device_backend_map()


def backend_for(group: dist.ProcessGroup, device: torch.device) -> str:
    """The backend that runs `group`'s collectives on tensors of `device` ("gloo", "nccl", ...):
    a group may have one per device type ("cpu:gloo,cuda:nccl")."""
    config = dist.get_backend_config(group)
    per_device = _backends_by_device_type(config)
    if device.type not in per_device:
        raise ValueError(
            f"the process group has no backend for {device.type} tensors (its backends: {config}): "
            f"move the model to one of {sorted(per_device)} before zerocompile.shard()"
        )
    return per_device[device.type]


def reduce_scatter_flavour(group: dist.ProcessGroup, device: torch.device) -> str:
    """How gradients reduce-scatter on `group` for tensors of `device`: `flavour_of_backend`."""
    return flavour_of_backend(backend_for(group, device))


def flavour_of_backend(backend: str) -> str:
    """How a backend ("gloo", "nccl", ...) reduce-scatters, which also decides how buckets are
    gathered (`zerocompile.passes.lowering.gathers_coalesced`): gloo's own reduce-scatter sends
    twice the textbook bytes."""
    return ALL_TO_ALL_REDUCE_SCATTER if backend == "gloo" else NATIVE_REDUCE_SCATTER


def runs_on_gloo(group: dist.ProcessGroup) -> bool:
    """Whether gloo runs `group`'s collectives on the tensors made for them (`group_device`):
    "gloo", "cpu:gloo", or "cpu:gloo,cuda:nccl" on a machine without an accelerator."""
    return backend_for(group, group_device(group)) == "gloo"


def group_device(group: dist.ProcessGroup) -> torch.device:
    """Where `group`'s collectives take the tensors made for them: this process's current
    accelerator (the GPU `init_distributed` made current) if the group runs its tensors on a
    backend other than gloo (nccl; also in "cpu:gloo,cuda:nccl"), else the CPU (gloo, "cpu:gloo")."""
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        backends = _backends_by_device_type(dist.get_backend_config(group))
        if backends.get(accelerator.type, "gloo") != "gloo":
            return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def leave_process_group() -> None:
    """End the group of a rank a launcher started (its process goes on). The barrier first: a rank
    tearing gloo down while another is still in a collective sometimes kills that one (SIGABRT)."""
    dist.barrier()
    dist.destroy_process_group()


def agreed(check: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """Run `check` here and agree with the other ranks of `group` (default: the world) on whether
    all passed: a rank that failed raises its error, the others an error naming it, so no rank is
    left waiting in a collective for one that gave up. One all-gather of the outcomes."""
    try:
        result, error = check(), None
    except Exception as caught:  # re-raised below; first every rank must hear of it
        result, error = None, caught
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages = [message]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        messages = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, message, group=group)
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    if failed:
        raise RuntimeError(f"rank {failed[0][0]} failed, so this rank stops too: {failed[0][1]}")
    return result
