"""`MuonWithAdamW`: Muon for a model's hidden matrices and AdamW for the rest, as one optimizer.

Muon is made for the hidden matrices alone; embeddings, norms, biases and the output head take AdamW
beside it (the Moonlight/Kimi recipe, as the nanoGPT speedrun's). Hugging Face's `Trainer` takes
one optimizer: it steps it, hands it to accelerate (which reads `state`, `param_groups`, `defaults`
and round-trips `state_dict()`), schedules its `param_groups` and checkpoints it. `MuonWithAdamW`
is that one optimizer, holding a `zerocompile.optim.Muon` and a `torch.optim.AdamW`.

It is a `torch.optim.Optimizer` (LR schedulers and accelerate accept nothing else, and `Trainer`
calls only an Optimizer subclass as `cls(params, **kwargs)`), built without
`Optimizer.__init__`, as accelerate's own wrapper is: that would wrap `step` in torch's step hooks,
and zerocompile's (`zerocompile.process_hooks`) would then swap the groups it shares with its two
optimizers onto the flat shards around this step, and again around each inner step. Each inner
optimizer's step is hooked as any optimizer's is, once.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.optim.optimizer import ParamsT

from zerocompile.optim import Muon, loss_of
from zerocompile.sharded_parameters import full_shape, shard_of_parameter


class MuonWithAdamW(torch.optim.Optimizer):
    """`zerocompile.optim.Muon` on `muon_params` and `torch.optim.AdamW` on every other parameter of
    `params`, as one optimizer (for Hugging Face's `Trainer`, or any loop that takes one).

    `params`: parameters or param groups, as any optimizer's (`Trainer`'s two groups, weight decay
    and none). Each group is split in two, a Muon group and an AdamW group, both with the group's
    settings (its `weight_decay` applies to both halves); a half without parameters is left out.

    `muon_params`: the parameters Muon steps, given as the model's parameters before or after
    `zerocompile.shard()` (either object names the same parameter). Every one must be 2-D by its
    full shape. `hidden_matrices(model)` chooses them by the usual rule: 2-D, neither an
    `nn.Embedding`'s weight (nor tied to one) nor the output head.

    `muon`, `adamw`: keyword arguments of `zerocompile.optim.Muon` (`torch.optim.Muon`'s) and of
    `torch.optim.AdamW`, their own defaults otherwise; typically two learning rates.

    Seen as one optimizer: `param_groups` are Muon's groups then AdamW's, the very dicts the two
    step with, so an LR scheduler scales each group's own lr; `state` is both optimizers' state
    (read-only); `defaults` are Muon's (schedules that read `defaults["lr"]` read Muon's);
    `state_dict()` is `{"muon": ..., "adamw": ...}`. `zc.save`, `zc.load` and `zc.shard(optimizer=)`
    take it as the list `[muon, adamw]`: its checkpoint is theirs.

        optimizer = MuonWithAdamW(model.parameters(), muon_params=hidden_matrices(model),
                                  muon={"lr": 0.02}, adamw={"lr": 3e-4, "betas": (0.9, 0.95)})
    """

    def __init__(
        self,
        params: ParamsT,
        *,
        muon_params: Iterable[torch.Tensor],
        muon: dict[str, Any] | None = None,
        adamw: dict[str, Any] | None = None,
    ) -> None:
        self._muon_ids = {id(shard_of_parameter(param)) for param in muon_params}
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        halves = [self._split(group) for group in groups]
        muon_groups = [muon_half for muon_half, _ in halves if muon_half["params"]]
        if not muon_groups:
            raise ValueError(
                "MuonWithAdamW: no parameter of params is in muon_params, so Muon would step nothing: pass "
                "muon_params=zerocompile.muon_adamw.hidden_matrices(model) of the model these parameters are"
            )
        # Empty halves are left out (no group without parameters to schedule or save), but AdamW
        # needs a group to exist: a model of hidden matrices alone gives it an empty one.
        adamw_groups = [adamw_half for _, adamw_half in halves if adamw_half["params"]] or [halves[0][1]]
        self.muon = Muon(muon_groups, **(muon or {}))
        self.adamw = torch.optim.AdamW(adamw_groups, **(adamw or {}))

    def _split(self, group: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        settings = {key: value for key, value in group.items() if key != "params"}
        mine = [id(shard_of_parameter(param)) in self._muon_ids for param in params]
        return (
            {**settings, "params": [param for param, is_muon in zip(params, mine) if is_muon]},
            {**settings, "params": [param for param, is_muon in zip(params, mine) if not is_muon]},
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        # Read afresh: `load_state_dict` gives the inner optimizers new group dicts.
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:  # type: ignore[override]
        return {**self.muon.state, **self.adamw.state}

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.muon.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Split as the constructor splits each group: its Muon half and its AdamW half, either
        left out if empty."""
        for optimizer, half in zip((self.muon, self.adamw), self._split(param_group)):
            if half["params"]:
                optimizer.add_param_group(half)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = loss_of(closure)  # once, for both: the gradients it makes are both optimizers'
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` Muon is for: 2-D by their full shape, neither an `nn.Embedding`'s
    weight (nor tied to one) nor the output head (`model.get_output_embeddings()`, which every
    Hugging Face model has; name another model's untied head yourself). Sharded or not."""
    # Read from `_parameters`: a sharded module's `weight` property would gather the whole weight.
    kept_out = [module._parameters["weight"] for module in model.modules() if isinstance(module, nn.Embedding)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        kept_out.append(head._parameters["weight"])
    excluded = {id(shard_of_parameter(param)) for param in kept_out}
    return [p for p in model.parameters() if len(full_shape(p)) == 2 and id(shard_of_parameter(p)) not in excluded]
