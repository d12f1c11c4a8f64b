"""A model torch's tensor parallelism already made DTensors (a `tp` dimension of a 2-D mesh) is
refused by `shard()` over the `dp` dimension, on every rank, with the message naming what is
missing and the route that works (fully_shard over `dp`), before anything changes: TP x ZeRO is a
limit (docs/limits.md), never a silent wrong answer."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zerocompile as zc
from ranks import raised, run_on_ranks


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _shard_tensor_parallel(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize_module(MLP(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    before = {name: (type(p), p.to_local().clone()) for name, p in model.named_parameters()}
    error = raised(lambda: zc.shard(model, stage=3, group=mesh["dp"].get_group()))
    after = dict(model.named_parameters())
    unchanged = all(
        type(after[name]) is kind and isinstance(after[name], DTensor) and torch.equal(after[name].to_local(), local)
        for name, (kind, local) in before.items()
    )
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank // 2))
    model(x).sum().backward()  # still the TP model it was
    return {"error": error, "unchanged": unchanged and not hasattr(model, "_zero_config")}


def test_tensor_parallel_model_is_refused_over_dp_on_every_rank() -> None:
    for rank, result in enumerate(run_on_ranks(4, _shard_tensor_parallel)):
        assert result["error"].startswith("TypeError: parameters ['up.weight', 'up.bias', 'down.weight'] are already DTensors"), (
            rank, result["error"])  # fmt: skip
        assert "(Shard(dim=0),) over mesh dimensions ('tp',)" in result["error"], (rank, result["error"])
        assert "TP x ZeRO) is not supported" in result["error"] and "fully_shard(model, mesh=mesh['dp'])" in result["error"]
        assert result["unchanged"], f"rank {rank}: the model changed before the refusal"
