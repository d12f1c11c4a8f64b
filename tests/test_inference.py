"""Inference on sharded parameters, and `with zerocompile.gathered(model):`.

Inference: a compiled `eval()` + `no_grad()` forward gathers just in time and reduces nothing; it
must match the plain unsharded model's forward, and switching train -> eval -> train on one
compiled model must keep training in parity with DDP.

gathered(): full parameters for eager code; what is written inside reaches every rank's shards
(rank 0's values), and training afterwards matches DDP fed the same modified weights.

One spawned 2-rank group per compiler runs every case and reports; the tests assert on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch
from torch import nn

import zerocompile as zc
from models import UnevenMLP, local_batch
from ranks import raised, run_cases, run_on_ranks
from training import full_parameters, train
from zerocompile.sharded_parameters import shard_info
from zerocompile.tools.gpt import GPT, SIZES

STAGES = (0, 1, 2, 3)
WORLD_SIZE = 2
EAGER_TOLERANCE = 1e-5
INDUCTOR_TOLERANCE = 1e-4
REDUCTIONS = {"reduce_scatter", "all_to_all", "all_reduce"}
SWITCHING = ("train", "eval", "train", "eval", "train")


@dataclasses.dataclass(frozen=True)
class Case:
    """A model, its data, how a training step and an inference call use it."""

    build: Callable[[], nn.Module]
    data: str  # tests/models.py batch kind
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    infer: Callable[[nn.Module, torch.Tensor], torch.Tensor]


CASES = {
    # Tied embeddings, LayerNorm, attention; inference returns the logits.
    "gpt": Case(lambda: GPT(SIZES["tiny"]), "tied_gpt", lambda m, b: m(b[:, :-1], b[:, 1:]), lambda m, b: m(b[:, :-1])),
    # Padded shards everywhere; small enough for Inductor to compile quickly.
    "mlp": Case(lambda: UnevenMLP(loss=False), "uneven_mlp", lambda m, b: m(b).square().mean(), lambda m, b: m(b)),
}


def _step(forward: nn.Module, optimizer: torch.optim.Optimizer, case: Case, batch) -> float:
    """One training step on `case`'s loss; the loss."""
    return train(lambda b: case.loss(forward, b), optimizer, [batch])[0]


def _max_difference(params: dict[str, torch.Tensor], reference: nn.Module) -> float:
    return max((params[k] - p.detach()).abs().max().item() for k, p in reference.named_parameters())


def _inference_case(case: Case, stage: int, rank: int, compiler: str, schedule: tuple[str, ...]) -> dict[str, Any]:
    """Run `schedule` ("train" steps, "eval" forwards) on one compiled sharded model and on DDP."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = case.build()
    ddp = nn.parallel.DistributedDataParallel(reference)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    torch.manual_seed(0)
    model = zc.shard(case.build(), stage=stage)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # One parameter per collective, so the stage-3 window is a parameter and the prefetched one.
    compiled = torch.compile(model, backend="zero", options={"compiler": compiler, "bucket_bytes": 0})
    loss_error = eval_error = 0.0
    with zc.record_graphs() as graphs:
        for step, mode in enumerate(schedule):
            batch = local_batch(case.data, step, rank, WORLD_SIZE)
            if mode == "train":
                loss = _step(compiled, optimizer, case, batch)
                loss_error = max(loss_error, abs(loss - _step(ddp, reference_optimizer, case, batch)))
                continue
            model.eval()
            reference.eval()
            with torch.no_grad():
                output = case.infer(compiled, batch)
                eval_error = max(eval_error, (output - case.infer(reference, batch)).abs().max().item())
            model.train()
            reference.train()
    inference = [g for g in graphs if g.kind == "inference"]
    # gathered buffers hold the padding too
    gathered_numels = {p: info.shard_numel * WORLD_SIZE for p in model.parameters() if (info := shard_info(p))}
    tied = [n for p, n in gathered_numels.items() if len(shard_info(p).names) > 1]
    untied = {p: n for p, n in gathered_numels.items() if len(shard_info(p).names) == 1}
    biases = [n for p, n in untied.items() if len(shard_info(p).shape) == 1]
    weights = sorted(n for p, n in untied.items() if len(shard_info(p).shape) > 1)
    return {
        "loss_error": loss_error,
        "eval_error": eval_error,
        "param_error": _max_difference(full_parameters(model), reference),
        "kinds": sorted(g.kind for g in graphs),
        "inference_ops": [[e.op for e in g.ledger.entries] for g in inference],
        "peak_gathered": [g.peak_gathered_numel for g in inference],
        # stage 3: a tied weight stays gathered across its uses; any other parameter only while in
        # use (a weight and its bias meet in one addmm) or prefetched: at most three beside it.
        # Inductor's graph of the MLP gathers the biases first (addmm's first argument), so there
        # every bias stays gathered until its layer, beside the weight in use and the prefetched one.
        "window_bound": sum(tied)
        + (sum(biases) + sum(weights[-2:]) if compiler == "inductor" else sum(sorted(untied.values())[-3:])),
        "gathered_numel": sum(gathered_numels.values()),
    }


def inference_report(rank: int, world_size: int, case_name: str, compiler: str, schedule: tuple[str, ...]) -> dict:
    cases = [(stage, lambda stage=stage: _inference_case(CASES[case_name], stage, rank, compiler, schedule)) for stage in STAGES]
    return {"schedule": schedule, **run_cases(cases)}


# ----------------------------------------------------------------------------------- gathered()


def _new_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Values a user might write inside the block: fixed per parameter name, the same everywhere."""
    generator = torch.Generator().manual_seed(7)
    return {fqn: 0.05 * torch.randn(shape_of(p), generator=generator) for fqn, p in model.named_parameters()}


def shape_of(param: torch.Tensor) -> tuple[int, ...]:
    info = shard_info(param)
    return info.shape if info is not None else tuple(param.shape)


def _build_gpt_with_frozen_norm() -> nn.Module:
    model = GPT(SIZES["tiny"])
    model.ln_f.requires_grad_(False)
    return model


def _gathered_case(stage: int, rank: int, param_dtype: torch.dtype | None) -> dict[str, Any]:
    """Train a step, write new values inside gathered() (rank 1 writes others: rank 0's must win),
    train two more; DDP gets the same values written between the same steps."""
    case = dataclasses.replace(CASES["gpt"], build=_build_gpt_with_frozen_norm)
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = case.build()
    ddp = nn.parallel.DistributedDataParallel(reference)
    reference_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3)
    torch.manual_seed(0)
    model = zc.shard(case.build(), stage=stage, param_dtype=param_dtype)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    batches = [local_batch(case.data, step, rank, WORLD_SIZE) for step in range(3)]
    losses = [_step(compiled, optimizer, case, batches[0])]
    reference_losses = [_step(ddp, reference_optimizer, case, batches[0])]
    shards_before = {fqn: (p.data_ptr(), tuple(p.shape)) for fqn, p in model.named_parameters()}
    values = _new_values(reference)
    facts: dict[str, Any] = {}
    with zc.gathered(model) as full:
        facts["tied_is_one_tensor"] = full.lm_head.weight is full.wte.weight
        facts["full_shapes"] = all(tuple(p.shape) == shape_of(p) for p in full.parameters())
        facts["master_dtype"] = {p.dtype for p in full.parameters()} == {torch.float32}
        facts["frozen_kept"] = not full.ln_f.weight.requires_grad
        with torch.no_grad():
            batch = batches[0]
            weights = {fqn: p.detach().clone() for fqn, p in full.named_parameters()}
            unsharded = torch.func.functional_call(reference, weights, (batch[:, :-1],))
            facts["eager_forward_error"] = (case.infer(full, batch) - unsharded).abs().max().item()
            for fqn, param in full.named_parameters():
                param.copy_(values[fqn] + rank)  # rank 1 writes other values: rank 0's must win
    with torch.no_grad():
        for fqn, param in reference.named_parameters():
            param.copy_(values[fqn])
    facts["written_error"] = max((full_parameters(model)[k] - v).abs().max().item() for k, v in values.items())
    facts["shards_in_place"] = shards_before == {fqn: (p.data_ptr(), tuple(p.shape)) for fqn, p in model.named_parameters()}
    with zc.record_graphs() as graphs_after:  # only uncompiled code runs before, in the block
        for batch in batches[1:]:
            losses.append(_step(compiled, optimizer, case, batch))
            reference_losses.append(_step(ddp, reference_optimizer, case, batch))
    facts["new_graphs_after_block"] = len(graphs_after)
    if param_dtype is not None:
        facts["loss_finite"] = all(torch.isfinite(torch.tensor(losses)))
        return facts
    facts["loss_error"] = max(abs(a - b) for a, b in zip(losses, reference_losses))
    facts["param_error"] = _max_difference(full_parameters(model), reference)
    return facts


def _misuse_case(rank: int) -> dict[str, Any]:
    """Errors and their aftermath, stage 3: the shards must be untouched and compiling must work."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = zc.shard(GPT(SIZES["tiny"]), stage=3)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    batch = local_batch("tied_gpt", 0, rank, WORLD_SIZE)
    before = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    sharded_class = type(model.wte)
    wpe_weight = model.wpe._parameters["weight"]
    outcome: dict[str, Any] = {}

    def nested() -> None:
        with zc.gathered(model), zc.gathered(model.blocks[0]):
            pass

    def fails_everywhere() -> None:
        with zc.gathered(model) as full, torch.no_grad():
            full.wte.weight.zero_()
            raise ValueError("user code failed")

    def fails_on_rank1() -> None:
        with zc.gathered(model) as full, torch.no_grad():
            full.wte.weight.zero_()
            if rank == 1:
                raise ValueError("user code failed on rank 1")

    def compiled_inside() -> None:
        with zc.gathered(model):
            compiled(batch[:, :-1], batch[:, 1:])

    def replaced_inside() -> None:
        with zc.gathered(model) as full:
            full.wpe.weight = nn.Parameter(torch.zeros(shape_of(full.wpe.weight)))

    def discarded() -> None:
        with zc.gathered(model, writeback=False) as full, torch.no_grad():
            full.wte.weight.fill_(3.0)

    for name, fn in [
        ("nested", nested),
        ("fails_everywhere", fails_everywhere),
        ("fails_on_rank1", fails_on_rank1),
        ("compiled_inside", compiled_inside),
        ("replaced_inside", replaced_inside),
        ("discarded", discarded),
        ("unsharded", lambda: zc.gathered(nn.Linear(2, 2)).__enter__()),
    ]:
        outcome[name] = raised(fn)
    outcome["shards_unchanged"] = all(torch.equal(before[k], p) for k, p in model.named_parameters())
    outcome["classes_restored"] = type(model.wte) is sharded_class and all(
        hasattr(type(m), "_zero_plain_class") for m in model.modules() if hasattr(m, "_zero_access")
    )
    outcome["replaced_parameter_restored"] = model.wpe._parameters["weight"] is wpe_weight
    outcome["compiled_after"] = raised(lambda: compiled(batch[:, :-1], batch[:, 1:]).backward())
    with zc.gathered(model.blocks[0]) as block, torch.no_grad():  # a submodule alone
        block.ln1.bias.fill_(float(rank + 1))
    outcome["submodule_written"] = full_parameters(model)["blocks.0.ln1.bias"].unique().tolist()
    return outcome


def _eager_inside_case(rank: int) -> dict[str, Any]:
    """Plain eager use inside the block: buffers leave it as group rank 0's (as shard() leaves
    them), and with mixed precision the model computes in its fp32 master weights."""
    from models import FrozenAndBuffer

    model = zc.shard(FrozenAndBuffer(), stage=3)
    with zc.gathered(model) as full:
        full.scale.fill_(float(rank))
    facts: dict[str, Any] = {"buffers_from_rank0": bool((model.scale == 0).all())}
    torch.manual_seed(0)
    unsharded = UnevenMLP(loss=False)
    model = zc.shard(UnevenMLP(loss=False), stage=3, param_dtype=torch.bfloat16)
    x = local_batch("uneven_mlp", 0, rank, WORLD_SIZE)
    with zc.gathered(model, writeback=False) as full, torch.no_grad():
        output = full(x)
        weights = {fqn: p.detach().clone() for fqn, p in full.named_parameters()}
        facts["mixed_precision_dtype"] = output.dtype
        facts["mixed_precision_error"] = (output - torch.func.functional_call(unsharded, weights, (x,))).abs().max().item()
    return facts


def eager_report(rank: int, world_size: int) -> dict:
    report: dict[Any, Any] = {"inference": inference_report(rank, world_size, "gpt", "eager", SWITCHING)}
    cases = [
        *[(("gathered", stage), lambda s=stage: _gathered_case(s, rank, None)) for stage in STAGES],
        (("gathered", "bf16"), lambda: _gathered_case(3, rank, torch.bfloat16)),
        ("misuse", lambda: _misuse_case(rank)),
        ("eager_inside", lambda: _eager_inside_case(rank)),
    ]
    return {**report, **run_cases(cases)}


@pytest.fixture(scope="module")
def eager_reports() -> list[dict]:
    return run_on_ranks(WORLD_SIZE, eager_report, timeout=600)


@pytest.fixture(scope="module")
def inductor_report() -> dict:
    # Eval only: switching modes is Dynamo's business, already covered on the eager compiler.
    return run_on_ranks(WORLD_SIZE, inference_report, "mlp", "inductor", ("eval",), timeout=900)[0]


def _outcome(report: dict, key: Any) -> dict:
    outcome = report[key]
    assert not isinstance(outcome, str), outcome
    return outcome


def _assert_inference(report: dict, stage: int, tolerance: float) -> None:
    outcome = _outcome(report, stage)
    assert outcome["eval_error"] <= 1e-5, f"eval forward differs from the unsharded model by {outcome['eval_error']:.3g}"
    assert outcome["loss_error"] <= tolerance and outcome["param_error"] <= tolerance, outcome
    # one training graph pair (if it trains) and one inference graph, however often modes switch
    trains = "train" in report["schedule"]
    assert outcome["kinds"] == (["backward", "forward"] if trains else []) + ["inference"]
    (ops,) = outcome["inference_ops"]
    assert not REDUCTIONS & set(ops), f"an inference graph reduces: {ops}"
    assert set(ops) == (set() if stage == 0 else {"all_gather"})
    (peak,) = outcome["peak_gathered"]
    if stage in (1, 2, 3):
        # Gathered prefetch-ahead and, with no backward to save them for, freed after last use
        # (stages 1-2 as well: their training forward keeps them only because it saves them).
        assert peak <= outcome["window_bound"] < outcome["gathered_numel"], outcome


@pytest.mark.parametrize("stage", STAGES)
def test_eager_compiled_eval_matches_unsharded_forward(eager_reports, stage: int) -> None:
    _assert_inference(eager_reports[0]["inference"], stage, EAGER_TOLERANCE)


@pytest.mark.parametrize("stage", STAGES)
def test_inductor_compiled_eval_matches_unsharded_forward(inductor_report, stage: int) -> None:
    _assert_inference(inductor_report, stage, INDUCTOR_TOLERANCE)


@pytest.mark.parametrize("stage", STAGES)
def test_gathered_writes_rank0_values_and_training_matches_ddp(eager_reports, stage: int) -> None:
    for rank_report in eager_reports:
        facts = _outcome(rank_report, ("gathered", stage))
        assert facts["tied_is_one_tensor"] and facts["full_shapes"] and facts["master_dtype"], facts
        assert facts["frozen_kept"], facts
        assert facts["eager_forward_error"] <= 1e-6, facts
        assert facts["written_error"] == 0.0, facts  # rank 0's values, exactly, on every rank
        assert facts["shards_in_place"], facts
        assert facts["new_graphs_after_block"] == 0, facts  # the compiled step still hits its guards
        assert facts["loss_error"] <= EAGER_TOLERANCE and facts["param_error"] <= EAGER_TOLERANCE, facts


def test_gathered_with_mixed_precision_gives_fp32_master_weights(eager_reports) -> None:
    for rank_report in eager_reports:
        facts = _outcome(rank_report, ("gathered", "bf16"))
        assert facts["master_dtype"] and facts["tied_is_one_tensor"], facts
        assert facts["eager_forward_error"] <= 1e-6, facts  # the fp32 model's forward
        assert facts["written_error"] == 0.0 and facts["shards_in_place"], facts  # into fp32 shards
        assert facts["new_graphs_after_block"] == 0, facts
        assert facts["loss_finite"], facts  # bf16 steps after the block (fp32 DDP is no reference)


def test_gathered_misuse_errors_name_the_fix_and_leave_shards_intact(eager_reports) -> None:
    for rank, rank_report in enumerate(eager_reports):
        outcome = _outcome(rank_report, "misuse")
        assert outcome["nested"].startswith("RuntimeError") and "use the outer block" in outcome["nested"]
        assert outcome["fails_everywhere"] == "ValueError: user code failed"
        if rank == 1:
            assert outcome["fails_on_rank1"] == "ValueError: user code failed on rank 1"
        else:  # the other rank is told, instead of waiting for a write-back that never comes
            assert outcome["fails_on_rank1"].startswith("RuntimeError: group ranks [1] failed"), outcome
        assert "call the uncompiled model inside the block" in outcome["compiled_inside"], outcome
        assert "'wpe.weight' was replaced" in outcome["replaced_inside"], outcome
        assert outcome["discarded"] == "nothing"
        assert "call zerocompile.shard(model" in outcome["unsharded"], outcome
        assert outcome["shards_unchanged"] and outcome["classes_restored"], outcome
        assert outcome["replaced_parameter_restored"], outcome
        assert outcome["compiled_after"] == "nothing", outcome
        assert outcome["submodule_written"] == [1.0], outcome  # group rank 0 wrote 1


def test_gathered_eager_use_inside_the_block(eager_reports) -> None:
    for rank_report in eager_reports:
        facts = _outcome(rank_report, "eager_inside")
        assert facts["buffers_from_rank0"], facts
        # with param_dtype=bf16 the inputs are not cast inside: fp32 weights, fp32 compute
        assert facts["mixed_precision_dtype"] == torch.float32, facts
        assert facts["mixed_precision_error"] <= 1e-6, facts
