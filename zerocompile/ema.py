"""`EMA(model, decay)`: an exponential moving average of a sharded model's parameters.

The average is kept in each parameter's own layout on this rank, so at stages 1-3 it holds 1/N of
the model, like the optimizer state; the update is elementwise, so averaging shards equals
averaging the full parameters. `zerocompile.save(..., ema=ema)` checkpoints it, `ema.full_state_dict()`
exports it with the model's names (buffers taken from the model), and `zerocompile convert --ema`
writes it offline.
"""

from __future__ import annotations

import torch
from torch import nn

from zerocompile.checkpoint import gathered_state_dict, parameter_names, unwrap_model
from zerocompile.offload import full_precision


class EMA:
    """shadow = decay * shadow + (1 - decay) * parameter, for every parameter, at each `update()`.

    Call `update()` after each `optimizer.step()`. Starts from the parameters' current values.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1] (typically 0.999), got {decay}")
        self.model = unwrap_model(model)
        self.decay = float(decay)
        with torch.no_grad():
            self.shadow: dict[nn.Parameter, torch.Tensor] = {
                param: full_precision(param).detach().clone() for param in parameter_names(self.model)
            }

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the parameters' current values (their shards)."""
        for param, shadow in self.shadow.items():
            shadow.mul_(self.decay).add_(full_precision(param).detach(), alpha=1.0 - self.decay)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for the average."""
        return sum(shadow.numel() * shadow.element_size() for shadow in self.shadow.values())

    def full_state_dict(self, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
        """The unsharded model's state dict with the averaged parameters (as
        `zerocompile.full_state_dict`; every rank must call it)."""
        return gathered_state_dict(self.model, self.shadow.__getitem__, rank0_only, cpu)
