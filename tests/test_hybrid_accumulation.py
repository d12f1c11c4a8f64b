"""Hybrid sharding's accumulation that defers only the average across replicas:
`zc.no_sync(model, replicas_only=True)` over the micro-steps, then `zc.reduce_gradients(model)`.

4 ranks as 2 "nodes" x 2 (test_hybrid's layout). Each case trains STEPS optimizer steps of
MICRO_STEPS micro-steps with plain SGD (a wrong gradient scale moves its parameters at once)
against DDP on 4 ranks reducing every micro-step, and reports the first step's gradients, the
final parameters, the bytes each micro-step wrote and what the compiled graphs' ledgers send
between nodes. Tolerance: test_hybrid's SGD bound (1e-6): both sides average the same fp32
gradients in another order (here inside the group per micro-step, then across replicas once).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import MODELS, local_batch
from ranks import run_cases, run_on_ranks
from test_hybrid import SHARD_SIZE, TOLERANCE, WORLD
from test_hf_trainer import LOSS_TOLERANCE
from test_local_accumulation import NORM_TOLERANCE, _trainer
from test_local_accumulation import STEPS as STEPS_UNDER_TRAINER
from training import full_gradients, full_parameters, written_bytes

MICRO_STEPS = 3
STEPS = 2
MODEL = "uneven_mlp"
CASES = [(1, "eager"), (3, "eager"), (3, "inductor")]


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return local_batch(MODEL, step * MICRO_STEPS + micro, rank, WORLD)


def _accumulate(forward, model: nn.Module, block, after_block, rank: int) -> dict:
    """STEPS steps; each step's micro-steps inside `block()` (a context manager), `after_block()`
    after it, then the SGD step. Bytes written per micro-step of the last step; the graphs' bytes
    between nodes by kind, per run."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sent, grads = [], None
    with zc.record_graphs() as graphs:
        for step in range(STEPS):
            sent.clear()
            with block():
                for micro in range(MICRO_STEPS):
                    dist.barrier()
                    before = written_bytes()
                    (forward(_batch(step, micro, rank)) / MICRO_STEPS).backward()
                    sent.append(written_bytes() - before)
            after_block()
            if step == 0:
                grads = full_gradients(model)
            optimizer.step()
            optimizer.zero_grad()
    across = [graph.ledger.sent_across_nodes(SHARD_SIZE) for graph in graphs if graph.ledger is not None]
    return {"grads": grads, "params": full_parameters(model), "sent": list(sent), "graphs_across_nodes": across}


def _ddp(rank: int) -> dict:
    torch.manual_seed(0)
    model = MODELS[MODEL]()
    ddp = nn.parallel.DistributedDataParallel(model)
    return _accumulate(ddp, model, contextlib.nullcontext, lambda: None, rank)


def _hybrid(stage: int, compiler: str, deferred: bool, rank: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = zc.shard(MODELS[MODEL](), stage=stage, shard_size=SHARD_SIZE)
    compiled = torch.compile(model, backend="zero", options={"compiler": compiler})
    if deferred:
        return _accumulate(compiled, model, lambda: zc.no_sync(model, replicas_only=True), lambda: zc.reduce_gradients(model), rank)
    return _accumulate(compiled, model, contextlib.nullcontext, lambda: None, rank)


def _refusals(rank: int) -> dict[str, str]:
    model = zc.shard(MODELS[MODEL](), stage=3, shard_size=SHARD_SIZE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = {}
    with zc.no_sync(model, replicas_only=True):
        model(_batch(0, 0, rank)).backward()
        try:
            zc.reduce_gradients(model)
        except RuntimeError as error:
            errors["reduce inside"] = str(error)
    try:
        optimizer.step()
    except RuntimeError as error:
        errors["step before reduce"] = str(error)
    zc.reduce_gradients(model)
    optimizer.step()  # now fine
    with zc.no_sync(model):
        model(_batch(0, 1, rank)).backward()
    try:
        with zc.no_sync(model, replicas_only=True):
            pass
    except RuntimeError as error:
        errors["after a full block"] = str(error)
    zc.reduce_gradients(model)
    return errors


def _under_trainer(rank: int, out: str, sync_replicas: bool) -> dict:
    """test_local_accumulation's tiny Llama under ZeroTrainer, stage 3 in 2 x 2, 2 micro-steps."""
    trainer = _trainer(3, 2, True, out, shard_size=SHARD_SIZE, sync_replicas_each_micro_step=sync_replicas)
    trainer.train()
    logged = trainer.state.log_history
    return {
        "losses": [entry["loss"] for entry in logged if "loss" in entry],
        "grad_norms": [entry["grad_norm"] for entry in logged if "grad_norm" in entry],
    }


def hybrid_accumulation_report(rank: int, world_size: int, out: str) -> dict:
    report = {"ddp": _ddp(rank)}
    report.update(run_cases((("trainer", sync), lambda sync=sync: _under_trainer(rank, out, sync)) for sync in (True, False)))
    # Reducing every micro-step, for the bytes only: eager (Inductor's graphs send the same).
    runs = [(*case, True) for case in CASES] + [(stage, "eager", False) for stage in (1, 3)]
    cases = [(run, lambda run=run: _hybrid(*run, rank)) for run in runs]
    report.update(run_cases(cases))
    report["refusals"] = _refusals(rank)
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_on_ranks(WORLD, hybrid_accumulation_report, str(tmp_path_factory.mktemp("trainer")), timeout=600)[0]


def _case(report: dict, *case) -> dict:
    outcome = report[case]
    assert not isinstance(outcome, str), outcome
    return outcome


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_deferring_the_replicas_average_trains_like_ddp(report, case) -> None:
    ours, ddp = _case(report, *case, True), report["ddp"]
    for kind in ("grads", "params"):
        assert ours[kind].keys() == ddp[kind].keys()
        assert max((ours[kind][k] - ddp[kind][k]).abs().max().item() for k in ddp[kind]) <= TOLERANCE["sgd"], kind


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_micro_steps_send_nothing_between_nodes(report, case) -> None:
    """Every graph compiled inside the block (the deferred mode is the only one this run
    compiles) sends nothing between nodes; reducing every micro-step, the backward does."""
    ours, synced = _case(report, *case, True), _case(report, case[0], "eager", False)
    assert ours["graphs_across_nodes"] and not any(ours["graphs_across_nodes"])
    assert any(synced["graphs_across_nodes"])
    assert max(ours["sent"]) < min(synced["sent"])


def test_zero_trainer_defers_the_replicas_average_with_the_same_losses(report) -> None:
    """Tolerance: test_local_accumulation's (the same sums in another order)."""
    every, deferred = _case(report, "trainer", True), _case(report, "trainer", False)
    assert len(deferred["losses"]) == len(every["losses"]) == STEPS_UNDER_TRAINER
    assert max(abs(a - b) for a, b in zip(deferred["losses"], every["losses"])) <= LOSS_TOLERANCE
    assert deferred["grad_norms"] == pytest.approx(every["grad_norms"], rel=NORM_TOLERANCE)


def test_zero_trainer_refuses_the_replicas_setting_without_replicas(tmp_path) -> None:
    from transformers import TrainingArguments

    from zerocompile.hf import ZeroTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"has no replicas: shard it with shard_size="):
        ZeroTrainer(model=nn.Linear(2, 2), args=args, sync_replicas_each_micro_step=False)
    with pytest.raises(ValueError, match=r"drop sync_replicas_each_micro_step=False"):
        ZeroTrainer(model=nn.Linear(2, 2), args=args, sync_each_micro_step=False, sync_replicas_each_micro_step=False)


def test_misuse_is_refused_naming_the_fix(report) -> None:
    errors = report["refusals"]
    assert "call it after the block ends" in errors["reduce inside"]
    assert "call zerocompile.reduce_gradients(model) after the block" in errors["step before reduce"]
    assert "use one kind of block" in errors["after a full block"]


def test_replicas_only_without_replicas_names_shard_size(single_rank) -> None:
    model = zc.shard(nn.Linear(4, 2), stage=3)
    with pytest.raises(ValueError, match=r"has none: shard it with shard_size="):
        with zc.no_sync(model, replicas_only=True):
            pass
