"""The tests' training loop (optimizer steps on a loss, batch by batch), and what they read of a
run: the bytes a process has written (gloo writes its messages to sockets, so they measure what a
step sends), and the full parameters training left."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import zerocompile as zc


def written_bytes() -> int:
    """Bytes this process has written so far (/proc/self/io's wchar), its sockets' included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def train(
    forward: Callable[[Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    *,
    scaler: torch.amp.GradScaler | None = None,
    sent: list[int] | None = None,
    after_backward: Callable[[], object] | None = None,
    after_step: Callable[[], object] | None = None,
) -> list[float]:
    """One step of `optimizer` per batch on the loss `forward(batch)`; the losses.

    `scaler` scales the loss and takes the step (then updates its scale). `sent` gets each step's
    bytes written by its forward and backward, counted from a barrier that starts the ranks' step
    together. `after_backward` runs before the step (to clip, or read the gradients);
    `after_step` before the gradients are zeroed (to measure what a step holds).
    """
    losses = []
    for batch in batches:
        if sent is not None:
            dist.barrier()
            before = written_bytes()
        loss = forward(batch)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if sent is not None:
            sent.append(written_bytes() - before)
        if after_backward is not None:
            after_backward()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        if after_step is not None:
            after_step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter of `model` whole, sharded or not (stage 0 keeps them whole)."""
    full = {}
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            # Sharded ones are DTensors of the full shape (stage 0 holds plain whole tensors).
            full[fqn] = param.detach().full_tensor() if isinstance(param, DTensor) else param.detach().clone()
    return full


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each trainable parameter's gradient whole, sharded or not (a collective: every rank calls it)."""
    with torch.no_grad():
        return {
            fqn: param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad.clone()
            for fqn, param in model.named_parameters()
            if param.grad is not None
        }
