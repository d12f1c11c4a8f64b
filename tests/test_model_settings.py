"""Settings travel with the model: two models sharded on one group compile and train side by side,
each with its own stage, bucket size and prefetch, each equal to its own DDP twin.

Before, the compile-time settings lived in one registry per process group: the second `shard()`
replaced the first model's bucket size in every graph compiled afterwards.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import FrozenAndBuffer, UnevenMLP, local_batch
from ranks import run_on_ranks
from zerocompile.backend import compiled_graphs

STEPS = 4
# Plain SGD at a large rate: a gradient scaled wrongly (summed, or averaged twice) moves the
# parameters visibly. The tolerance is float32 rounding of a few steps of these small models.
LR = 0.5
TOLERANCE = 1e-5
ACTOR = {"stage": 3, "bucket_bytes": 0, "prefetch": 0}  # one all-gather per parameter
CRITIC = {"stage": 2, "bucket_bytes": 4 * 2**20, "prefetch": 1}  # its two gradients in one reduction


def _build(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return UnevenMLP(), FrozenAndBuffer()


def _train(models_and_forwards: list[tuple[nn.Module, object, str]], rank: int, world_size: int) -> None:
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR) for m, _f, _n in models_and_forwards]
    for step in range(STEPS):
        for (model, forward, name), optimizer in zip(models_and_forwards, optimizers):
            forward(local_batch(name, step, rank, world_size)).backward()
            optimizer.step()
            optimizer.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with zc.gathered(model):
        return {fqn: p.detach().clone() for fqn, p in model.named_parameters()}


def two_models_side_by_side(rank: int, world_size: int) -> dict:
    reference = _build(seed=0)
    _train(
        [(m, nn.parallel.DistributedDataParallel(m), n) for m, n in zip(reference, ("uneven_mlp", "frozen_buffer"))],
        rank,
        world_size,
    )
    torch._dynamo.reset()
    compiled_graphs.clear()
    actor, critic = _build(seed=0)
    zc.shard(actor, **ACTOR)
    zc.shard(critic, **CRITIC)
    options = {"compiler": "eager"}
    _train(
        [
            (actor, torch.compile(actor, backend="zero", options=options), "uneven_mlp"),
            (critic, torch.compile(critic, backend="zero", options=options), "frozen_buffer"),
        ],
        rank,
        world_size,
    )
    errors = {}
    for name, ours, theirs in (("actor", actor, reference[0]), ("critic", critic, reference[1])):
        full = _full(ours)
        errors[name] = max((full[fqn] - p).abs().max().item() for fqn, p in theirs.named_parameters())
    entries = [(g.kind, e.op, tuple(e.params)) for g in compiled_graphs for e in g.ledger.entries]
    return {"errors": errors, "entries": entries}


@pytest.mark.parametrize("world_size", [2, 4])
def test_two_models_on_one_group_keep_their_own_settings(world_size: int) -> None:
    report = run_on_ranks(world_size, two_models_side_by_side)[0]
    assert report["errors"]["actor"] <= TOLERANCE, report["errors"]
    assert report["errors"]["critic"] <= TOLERANCE, report["errors"]
    actor_params = {fqn for fqn, _ in UnevenMLP().named_parameters()}
    gathers = [(kind, params) for kind, op, params in report["entries"] if op == "all_gather"]
    actor_gathers = [(kind, params) for kind, params in gathers if set(params) <= actor_params]
    critic_gathers = [(kind, params) for kind, params in gathers if not set(params) & actor_params]
    assert len(actor_gathers) + len(critic_gathers) == len(gathers), gathers
    # The actor's bucket_bytes=0: every parameter gathered on its own, in the forward and again in
    # the backward (the critic's 4 MiB would put all six in one bucket). The critic's stage 2
    # gathers its updated parameters in one bucket (bucket_bytes=0 would make four).
    assert all(len(params) == 1 for _kind, params in actor_gathers), actor_gathers
    assert sorted(params for kind, params in actor_gathers if kind == "forward") == sorted((f,) for f in actor_params)
    assert [(kind, len(params)) for kind, params in critic_gathers] == [("forward", 4)], critic_gathers
    critic_reductions = [
        params for kind, op, params in report["entries"] if op != "all_gather" and set(params) <= {"head.weight", "head.bias"}
    ]
    assert critic_reductions == [("head.weight", "head.bias")] or critic_reductions == [("head.bias", "head.weight")], (
        report["entries"]
    )
    actor_reductions = [
        params for kind, op, params in report["entries"] if op != "all_gather" and set(params) <= actor_params
    ]
    assert all(len(params) == 1 for params in actor_reductions) and len(actor_reductions) == 6, report["entries"]


def one_graph_with_both_models(rank: int, world_size: int) -> str:
    actor, critic = _build(seed=0)
    zc.shard(actor, **ACTOR)
    zc.shard(critic, **CRITIC)
    both = torch.compile(
        lambda x, y: actor(x) + critic(y), backend="zero", options={"compiler": "eager"}
    )
    try:
        both(local_batch("uneven_mlp", 0, rank, world_size), local_batch("frozen_buffer", 0, rank, world_size))
    except Exception as error:  # Dynamo wraps what the backend raised
        dist.barrier()
        return str(error)
    return "compiled"


def test_one_graph_with_two_models_of_different_settings_is_refused() -> None:
    message = run_on_ranks(2, one_graph_with_both_models)[0]
    assert "different compile-time settings" in message, message
    assert "'fc1.weight'" in message and "'head.weight'" in message and "bucket_bytes=0" in message, message
