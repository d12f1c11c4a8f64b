"""Activation checkpointing (`torch.utils.checkpoint`, non-reentrant, per block) under ZeRO.

Stage 3: parity with DDP, and the backward re-gathers the parameters the recomputed blocks need
instead of the forward saving them. Stages 1-2: parity, and checkpointing recomputes activations
but not gathers (those stages hold full parameters through the step; gathering again would send
Φ more for nothing).

One spawned 2-rank group per compiler trains every stage and reports; the tests assert on it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import zerocompile as zc
from fx_helpers import on, trace
from models import CheckpointedMLP, local_batch
from ranks import run_cases, run_on_ranks
from training import full_parameters, train
from zerocompile.passes.markers import UNSHARD
from zerocompile.passes.recompute_gathers import tag_gathers_for_recompute
from zerocompile.tools.gpt import GPT, SIZES

WORLD_SIZE = 2
STEPS = 4
EAGER_TOLERANCE = 1e-5
INDUCTOR_TOLERANCE = 1e-4
# (build, batch kind): the tied GPT with every block checkpointed, and a quick one for Inductor.
MODELS = {
    "gpt": (lambda: GPT(dataclasses.replace(SIZES["tiny"], activation_checkpointing=True)), "tied_gpt"),
    "mlp": (CheckpointedMLP, "uneven_mlp"),
}


def _train(model: nn.Module, forward: nn.Module, name: str, rank: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = (lambda batch: forward(batch[:, :-1], batch[:, 1:])) if name == "gpt" else forward
    return train(loss, optimizer, (local_batch(MODELS[name][1], step, rank, WORLD_SIZE) for step in range(STEPS)))


def checkpointing_report(rank: int, world_size: int, name: str, stages: list[int], compiler: str) -> dict:
    build = MODELS[name][0]
    torch.manual_seed(0)
    reference = build()
    reference_losses = _train(reference, nn.parallel.DistributedDataParallel(reference), name, rank)

    def facts(stage: int) -> dict[str, Any]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = zc.shard(build(), stage=stage)
        # One parameter per collective: each gather in the ledger names one parameter.
        compiled = torch.compile(model, backend="zero", options={"compiler": compiler, "bucket_bytes": 0})
        with zc.record_graphs() as records:
            losses = _train(model, compiled, name, rank)
        params = full_parameters(model)
        graphs = {g.kind: g for g in records}
        return {
            "loss_error": max(abs(a - b) for a, b in zip(losses, reference_losses)),
            "param_error": max((params[k] - p.detach()).abs().max().item() for k, p in reference.named_parameters()),
            "kinds": sorted(g.kind for g in records),
            "saved_gathered": graphs["forward"].saved_gathered,
            "gathers": {
                kind: Counter(fqn for e in g.ledger.entries if e.op == "all_gather" for fqn in e.params)
                for kind, g in graphs.items()
            },
            # a Linear's forward (addmm) in the backward: only recomputing a block puts it there
            "backward_recomputes": "aten.addmm.default(" in graphs["backward"].code,
            "block_params": [fqn for fqn, _ in model.named_parameters() if fqn.startswith("blocks.")],
        }

    return run_cases((stage, lambda stage=stage: facts(stage)) for stage in stages)


@pytest.fixture(scope="module")
def eager_report() -> dict:
    return run_on_ranks(WORLD_SIZE, checkpointing_report, "gpt", [1, 2, 3], "eager", timeout=600)[0]


@pytest.fixture(scope="module")
def inductor_report() -> dict:
    return run_on_ranks(WORLD_SIZE, checkpointing_report, "mlp", [3], "inductor", timeout=900)[0]


def _outcome(report: dict, stage: int) -> dict:
    outcome = report[stage]
    assert not isinstance(outcome, str), outcome
    return outcome


def _assert_stage3_regathers(outcome: dict) -> None:
    assert outcome["kinds"] == ["backward", "forward"]
    assert outcome["backward_recomputes"], "the backward does not recompute the checkpointed blocks"
    assert outcome["saved_gathered"] == [], f"the forward saves gathered parameters: {outcome['saved_gathered']}"
    backward = outcome["gathers"]["backward"]
    # every block weight (the recomputation and the input gradients need them all) is gathered
    # again, once; a bias may not be needed (a block's output is saved at the region boundary)
    weights = {fqn for fqn in outcome["block_params"] if fqn.endswith(".weight")}
    assert weights <= set(backward), sorted(weights - set(backward))
    assert max(backward.values()) == 1, backward


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpointed_gpt_matches_ddp_eager(eager_report, stage: int) -> None:
    outcome = _outcome(eager_report, stage)
    assert outcome["loss_error"] <= EAGER_TOLERANCE, f"losses differ from DDP by {outcome['loss_error']:.3g}"
    assert outcome["param_error"] <= EAGER_TOLERANCE, f"parameters differ from DDP by {outcome['param_error']:.3g}"


def test_stage3_backward_regathers_instead_of_saving(eager_report) -> None:
    _assert_stage3_regathers(_outcome(eager_report, 3))


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_checkpointing_recomputes_activations_not_gathers(eager_report, stage: int) -> None:
    outcome = _outcome(eager_report, stage)
    assert outcome["backward_recomputes"], "the backward does not recompute the checkpointed blocks"
    assert outcome["gathers"].get("backward", Counter()) == Counter(), outcome["gathers"]["backward"]
    assert max(outcome["gathers"]["forward"].values()) == 1


def test_checkpointed_mlp_stage3_inductor(inductor_report) -> None:
    outcome = _outcome(inductor_report, 3)
    assert outcome["loss_error"] <= INDUCTOR_TOLERANCE and outcome["param_error"] <= INDUCTOR_TOLERANCE, outcome
    _assert_stage3_regathers(outcome)


@pytest.mark.usefixtures("group_name")
def test_checkpoint_tags_on_stage_1_2_gathers_are_dropped_and_stage_3_must_recompute(group_name) -> None:
    def f(s1, s2, s3, x):
        return [x @ UNSHARD(s, [3, 5], stage, *on(group_name)).t() for s, stage in ((s1, 1), (s2, 2), (s3, 3))]

    gm = trace(f, (4,), (4,), (4,), (2, 5))
    for node in gm.graph.nodes:  # what torch.utils.checkpoint puts on every op of its region
        if node.op == "call_function":
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    tag_gathers_for_recompute(gm.graph)
    unshards = [n for n in gm.graph.nodes if n.target is UNSHARD]
    assert [n.meta.get("recompute") for n in unshards] == [None, None, CheckpointPolicy.MUST_RECOMPUTE]
