"""One training step of a bench mode on a rank, timed phase by phase with what it sent, and the
batches every mode and rank trains on."""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from zerocompile.tools import link_budget
from zerocompile.tools.bench.modes import Prepared
from zerocompile.tools.bench.settings import Settings
from zerocompile.tools.gpt import GPTConfig
from zerocompile.tools.measuring import finish_queued_work, written_bytes


class Step(NamedTuple):
    """One timed training step on this rank."""

    seconds: float  # forward + backward + optimizer step
    cpu_seconds: float  # CPU time of this rank and of the child processes it waited for (compilers)
    phases: tuple[float, float, float]  # seconds in the forward, the backward, the optimizer step
    sent: int  # bytes written (wchar)
    loss: torch.Tensor
    waiting: float  # seconds the rank was blocked, not computing (link_budget.blocked_seconds)
    link_sent: int | None  # bytes the simulated link's interface transmitted (None without --link)


def one_step(prepared: Prepared, batches: RandomBatches, interface: str | None = None) -> Step:
    """One training step; every rank starts it after a barrier. With `interface`, the bytes it
    transmitted during the step are counted too.

    Gradients are cleared at the start, not the end, so the last step's are there to be counted.
    """
    prepared.zero_grad()
    inputs, targets = batches.next()
    finish_queued_work(inputs.device)
    dist.barrier()
    link_before = None if interface is None else link_budget.transmitted_bytes(interface)
    written = written_bytes()
    cpu_start = _cpu_seconds()
    clock_start = link_budget.thread_clock()
    start = time.perf_counter()
    loss = prepared.runner(inputs, targets)
    finish_queued_work(inputs.device)
    forward_done = time.perf_counter()
    prepared.backward(loss)
    finish_queued_work(inputs.device)
    backward_done = time.perf_counter()
    prepared.step()
    finish_queued_work(inputs.device)
    end = time.perf_counter()
    waiting = link_budget.blocked_seconds(end - start, clock_start, link_budget.thread_clock())
    phases = (forward_done - start, backward_done - forward_done, end - backward_done)
    link_sent = None
    if interface is not None:
        # The node's other ranks may still be sending when this one is done: read the counter once
        # every rank is (the barrier adds a few hundred bytes).
        dist.barrier()
        link_sent = link_budget.transmitted_bytes(interface) - link_before
    return Step(end - start, _cpu_seconds() - cpu_start, phases, written_bytes() - written, loss.detach(), waiting, link_sent)


def training_step(prepared: Prepared, batches: RandomBatches) -> None:
    """A step as `one_step` runs it, without its clocks and barriers (what `dispatched` counts)."""
    prepared.zero_grad()
    prepared.backward(prepared.runner(*batches.next()))
    prepared.step()


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class RandomBatches:
    """The same global batches of random tokens on every rank and in every mode; this rank's rows,
    on `device` (drawn on the CPU: the same tokens whatever the device)."""

    def __init__(self, config: GPTConfig, settings: Settings, rank: int, device: torch.device) -> None:
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.shape = (settings.batch_size, config.block_size + 1)
        self.vocab_size = config.vocab_size
        per_rank = settings.batch_size // settings.ranks
        self.rows = slice(rank * per_rank, (rank + 1) * per_rank)
        self.device = device

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(self.vocab_size, self.shape, generator=self.generator)[self.rows]
        return tokens[:, :-1].contiguous().to(self.device), tokens[:, 1:].contiguous().to(self.device)

