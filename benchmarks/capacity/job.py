"""One configuration's job as its ranks run it: the mode's model built, trained, and measured."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from zerocompile.tools.gpt import GPT, SIZES, GPTConfig
from zerocompile.tools.train import GlobalBatches, load_text

from .measure import Marks, process_memory

LEARNING_RATE = 3e-4
MODES = ("ddp", "fsdp2", "zero1", "zero2", "zero3")


@dataclasses.dataclass(frozen=True)
class Job:
    mode: str
    size: str
    ranks: int
    steps: int
    tokens: int
    compiler: str
    seed: int = 0
    repeat_batch: bool = False  # train on the first batch every step (--big: the loss must fall)
    lr: float = LEARNING_RATE

    @property
    def config(self) -> GPTConfig:
        return SIZES[self.size]

    @property
    def sequence(self) -> int:
        """Tokens per sequence: --tokens, at most the model's block size."""
        return min(self.tokens, self.config.block_size)


def _build(job: Job, marks: Marks) -> tuple[Callable[..., torch.Tensor], torch.optim.Optimizer]:
    """The mode's model, made ready to train; marks "built" and "sharded/initialised"."""
    torch.manual_seed(job.seed)
    if job.mode == "ddp":
        model = GPT(job.config)  # whole on the CPU; the constructor initialises it
        marks("built")
        wrapped = nn.parallel.DistributedDataParallel(model)
        marks("wrapped")
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=job.lr)
        backend = "aot_eager" if job.compiler == "eager" else "inductor"
        return torch.compile(wrapped, backend=backend), optimizer
    with torch.device("meta"):
        model = GPT(job.config)
    marks("built")
    if job.mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (job.ranks,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.apply(GPT._init_weights)
        marks("sharded/initialised")
        return model, torch.optim.AdamW(model.parameters(), lr=job.lr)
    stage = int(job.mode.removeprefix("zero"))
    zc.shard(model, stage=stage, init=GPT._init_weights)
    marks("sharded/initialised")
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    return torch.compile(model, backend="zero", options={"compiler": job.compiler}), optimizer


def _train(job: Job, marks: Marks) -> dict[str, Any]:
    runner, optimizer = _build(job, marks)
    rank = dist.get_rank()
    # Windows of the bundled prose (bytes as tokens), so the loss can fall; each rank its own row.
    batches = GlobalBatches(load_text(), job.ranks, job.sequence, seed=job.seed)
    losses = []
    inputs, targets = batches.next(slice(rank, rank + 1))
    for step in range(1, job.steps + 1):
        if step > 1 and not job.repeat_batch:
            inputs, targets = batches.next(slice(rank, rank + 1))
        optimizer.zero_grad(set_to_none=True)
        loss = runner(inputs, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        marks(f"step {step}" + (" (compiles)" if step == 1 else ""))
    return {"losses": losses}


def rank_setup(ranks: int) -> None:
    """This rank's threads, compile workers and OOM score set for a job of `ranks` ranks; its group joined."""
    # The ranks share the machine's cores: more threads than cores slows every rank down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    # Inductor compiles in this process (no worker pool whose memory the rank's RSS would miss).
    torch._inductor.config.compile_threads = 1
    # Should the machine run out of memory after all, the kernel's OOM killer takes our ranks first,
    # not the processes of the machine's other users.
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")
    zc.init_distributed()


def gather_on_rank_zero(measured: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's measurements on rank 0 (None on the others)."""
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, measured)
    return per_rank if dist.get_rank() == 0 else None


def capacity_rank(rank: int, job: Job) -> list[dict[str, Any]] | None:
    """One rank of `job`: trained with its RSS marked after each phase; every rank's marks on rank 0."""
    marks = Marks()
    rank_setup(job.ranks)
    marks("started")
    try:
        measured = _train(job, marks)
    except Exception as error:  # reported; the other configurations still run
        measured = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    measured.update(
        rank=rank,
        peak_rss=process_memory()["VmHWM"],
        marks=marks.marks,
        peak_phase=marks.peak_phase() if marks.marks else None,
    )
    return gather_on_rank_zero(measured)
