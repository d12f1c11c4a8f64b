"""Which `torch.optim` optimizers cannot step on zerocompile's shards, and their refusal.

At stages 1-3 each parameter is held as a flat 1-D shard (a run of its row-major elements, padded).
An elementwise optimizer, one that updates each element from that element's own gradient and
state (SGD, Adam, AdamW, NAdam, ...), does on a shard exactly what it does on the full parameter.
The optimizers below do not: each would train differently from DDP without any error, so they
are refused before they step. `torch.optim.Muon` and `Adafactor` step on shards as their
`zerocompile.optim` equivalents, which `shard(..., optimizer=)` makes of them; one not handed to
`shard()` is refused. tests/test_optimizer_table.py trains every optimizer `torch.optim`
exports at every stage against DDP; an optimizer it finds differing belongs here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import torch

from zerocompile.muon_adamw import MuonWithAdamW
from zerocompile.optim import SHARDED_EQUIVALENTS
from zerocompile.passes.stages import STAGES

_SHARDED_STAGES = frozenset(stage for stage, policy in STAGES.items() if policy.shards_parameters)


@dataclasses.dataclass(frozen=True)
class _Unsupported:
    reason: str  # why it cannot step on the shards, completing "it ..."
    stages: frozenset[int]  # where it is refused
    instead: str = ""  # what works instead, if not "an elementwise optimizer"


_UNSUPPORTED: dict[type[torch.optim.Optimizer], _Unsupported] = {
    # Measured unguarded (tests/test_optimizer_table.py's model, 3 steps, 2 ranks): 7.1e-3 from DDP.
    torch.optim.Adafactor: _Unsupported(
        "reads parameter shapes, factoring each matrix's second moment into row and column "
        "averages; a flat 1-D shard has no rows or columns, so it would silently run unfactored and "
        "differ from DDP",
        _SHARDED_STAGES,
        "Pass it to zerocompile.shard(model, ..., optimizer=adafactor), which makes it a "
        "zerocompile.optim.Adafactor, or build zerocompile.optim.Adafactor (torch.optim.Adafactor's "
        "arguments) after shard()",
    ),
    # Unguarded, torch's own "Param gradient must be a 2D matrix", after making its state.
    torch.optim.Muon: _Unsupported(
        "reads parameter shapes, orthogonalising each parameter's update as a 2-D matrix; a flat "
        "1-D shard is no matrix",
        _SHARDED_STAGES,
        "Pass it to zerocompile.shard(model, ..., optimizer=muon), which makes it a "
        "zerocompile.optim.Muon, or build zerocompile.optim.Muon (torch.optim.Muon's arguments) "
        "after shard()",
    ),
    # Unguarded: 0.25 from DDP.
    torch.optim.LBFGS: _Unsupported(
        "is not elementwise: its direction and step length come from dot products over all "
        "parameters as one vector, of which each rank holds only its shards, so ranks would step "
        "in directions of their own",
        _SHARDED_STAGES,
    ),
    # Unguarded, torch's own "SparseAdam does not support dense gradients", as under DDP.
    torch.optim.SparseAdam: _Unsupported(
        "steps only on sparse gradients, and zerocompile's are always dense (shard() refuses "
        "Embedding(sparse=True), whose sparse gradients cannot be reduce-scattered)",
        frozenset({0, 1, 2, 3}),
    ),
}

_ELEMENTWISE = "an elementwise optimizer (SGD, Adam, AdamW, NAdam, RMSprop, ...: each element updated from its own gradient and state)"


def optimizer_list(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None) -> list[torch.optim.Optimizer]:
    """What an `optimizer=` argument (one, several, or none) holds, as a list; a `MuonWithAdamW` is
    its two optimizers, whose groups and state are the ones that step."""
    if optimizer is None:
        return []
    given = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    return [inner for one in given for inner in ([one.muon, one.adamw] if isinstance(one, MuonWithAdamW) else [one])]


def replicated_state_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The per-parameter state `optimizer` keeps whole and equal on every rank, not sharded
    (`zerocompile.optim.Adafactor`'s row and column statistics): never sliced, saved once."""
    return getattr(optimizer, "replicated_state", ())


def refuse_unsupported_optimizer(optimizer: torch.optim.Optimizer, stages: Collection[int]) -> None:
    """Raise TypeError if `optimizer` cannot step on parameters sharded at any of `stages`, naming
    it, why, and what works instead."""
    ours = tuple(SHARDED_EQUIVALENTS.values())

    for optimizer_class, unsupported in _UNSUPPORTED.items():
        refused = sorted(unsupported.stages.intersection(stages))
        if not isinstance(optimizer, optimizer_class) or isinstance(optimizer, ours) or not refused:
            continue
        name = f"torch.optim.{optimizer_class.__name__}"
        if type(optimizer) is not optimizer_class:
            name = f"{type(optimizer).__qualname__} (a {name})"
        if unsupported.instead:
            works = unsupported.instead
        elif 0 in unsupported.stages:
            works = f"Use {_ELEMENTWISE} instead, at any stage"
        else:
            works = (
                "It works at stage 0 (zerocompile.shard(model, stage=0): parameters keep their "
                f"shapes); at stages 1-3 use {_ELEMENTWISE}"
            )
        raise TypeError(
            f"{name} cannot step on parameters sharded at stage {', '.join(map(str, refused))}: it "
            f"{unsupported.reason}. {works}"
        )
