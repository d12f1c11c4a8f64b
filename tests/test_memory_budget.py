"""Budgeted unsharding (`ZeroConfig.memory_budget`, stage 3): the parameters kept gathered from the
forward for the backward, what the partitioner then saves, parity with DDP, and the bytes.

The pass is tested on joint graphs traced with make_fx (forward plus `torch.autograd.grad` through
the markers) naming a process group that does not exist; the rest runs on spawned gloo ranks, one
group per world size training every case against DDP and measuring test_stages' DeepMLP
(Φ ≈ 1.1M, so gloo's headers stay far below 5 % of the bytes written); the tests assert on the
reports. Budget 0 against plain stage 3's pinned graphs is in test_snapshots.py; bad budgets in
test_bad_input.py.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import zerocompile as zc
from zerocompile import backend
from fx_helpers import trace
from models import MODELS, local_batch
from ranks import run_cases, run_on_ranks
from test_parity import EAGER_TOLERANCE
from test_sgd_parity import FP32_TOLERANCE
from test_stages import DeepMLP
from training import train
from zerocompile.passes.lowering import NATIVE_REDUCE_SCATTER
from zerocompile.passes.markers import UNSHARD, is_unshard, unshard_args
from zerocompile.passes.recompute_gathers import KEPT, tag_gathers_for_recompute
from zerocompile.tools.plan import add_arguments as add_plan_arguments
from zerocompile.tools.plan.command import plan
from zerocompile.tools.plan.records import PlanError

ABSENT = ("no-such-group", 2, NATIVE_REDUCE_SCATTER)  # resolving it would raise: the pass never asks
# Full fp32 bytes of the traced joint graph's parameters.
SIZES = {"w0": 6 * 4 * 4, "w1": 6 * 6 * 4, "b1": 6 * 4, "w2": 3 * 6 * 4}


# --------------------------------------------------------------------------------- the pass


def _joint(input_grad: bool = False) -> fx.GraphModule:
    """A three-layer MLP's joint forward+backward graph as AOTAutograd hands it to the partitioner
    (placeholders `*_1`, the backward's seed `tangents_1`). The backward reads w0 only if the
    input needs a gradient; w1 and b1 are last used by one node (their product), w2 last."""

    def joint(s0, s1, sb, s2, x, tangents):
        inputs = [s0, s1, sb, s2] + ([x] if input_grad else [])
        for tensor in inputs:
            tensor.requires_grad_(True)
        w0 = UNSHARD(s0, [6, 4], 3, *ABSENT, "w0")
        w1 = UNSHARD(s1, [6, 6], 3, *ABSENT, "w1")
        b1 = UNSHARD(sb, [6], 3, *ABSENT, "b1")
        w2 = UNSHARD(s2, [3, 6], 3, *ABSENT, "w2")
        h = torch.tanh((x @ w0.t()) @ (w1 * b1))
        out = h @ w2.t()
        return out, *torch.autograd.grad(out, inputs, tangents)

    return trace(joint, (12,), (18,), (3,), (9,), (5, 4), (5, 3))


def _tagged(graph: fx.Graph) -> set[str]:
    """The parameters whose gather is tagged to be repeated in the backward."""
    return {unshard_args(n).param for n in graph.nodes if is_unshard(n) and "recompute" in n.meta}


def _kept(graph: fx.Graph) -> set[str]:
    return {n.meta[KEPT] for n in graph.nodes if is_unshard(n) and KEPT in n.meta}


@pytest.mark.parametrize("budget", [None, 0])
def test_no_budget_and_budget_0_tag_every_gather(budget: int | None) -> None:
    gm = _joint()
    tagged = tag_gathers_for_recompute(gm.graph, budget)
    assert tagged == sum("recompute" in n.meta for n in gm.graph.nodes) == 4 + 3  # + the transposes
    assert _tagged(gm.graph) == set(SIZES) and _kept(gm.graph) == set()
    gm.graph.lint()


def test_budget_above_the_model_tags_nothing_and_marks_every_gather_kept() -> None:
    gm = _joint(input_grad=True)
    assert tag_gathers_for_recompute(gm.graph, sum(SIZES.values())) == 0
    assert not any("recompute" in n.meta for n in gm.graph.nodes)
    assert _kept(gm.graph) == set(SIZES)
    # The marks reach the views the partitioner may save instead (w2's transpose is one).
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.t.default and KEPT in n.meta]
    assert {n.meta[KEPT] for n in views} == {"w0", "w2"}
    gm.graph.lint()


def test_a_parameter_the_backward_does_not_read_is_never_kept() -> None:
    """w0 only computes x @ w0.t(), and x needs no gradient: keeping it would save no gather."""
    gm = _joint()
    tag_gathers_for_recompute(gm.graph, 2**30)
    assert _kept(gm.graph) == {"w1", "b1", "w2"} and _tagged(gm.graph) == {"w0"}


@pytest.mark.parametrize(
    "budget, kept",
    [
        (SIZES["w2"], {"w2"}),  # used last in the forward: first in the backward
        (SIZES["w2"] + SIZES["w1"], {"w2", "w1"}),  # w1 and b1 last used together: larger first
        (SIZES["w2"] + SIZES["b1"], {"w2", "b1"}),  # w1 does not fit: first fit passes it over
        (SIZES["w2"] - 1, {"b1"}),  # w2 does not fit: the smaller one after it does
    ],
)
def test_a_middle_budget_keeps_the_parameters_used_last_that_fit(budget: int, kept: set[str]) -> None:
    gm = _joint(input_grad=True)
    tag_gathers_for_recompute(gm.graph, budget)
    assert _kept(gm.graph) == kept
    assert _tagged(gm.graph) == set(SIZES) - kept
    assert sum(SIZES[name] for name in kept) <= budget
    gm.graph.lint()


def test_the_choice_is_a_function_of_the_graph_alone() -> None:
    """Two traces (two ranks) choose the same parameters and tag the same nodes; a checkpointed
    region's tag on a kept gather is dropped (it would repeat the gather)."""
    outcomes = []
    for _ in range(2):
        gm = _joint(input_grad=True)
        for node in gm.graph.nodes:  # what torch.utils.checkpoint puts on every op of its region
            if node.op == "call_function":
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        tag_gathers_for_recompute(gm.graph, SIZES["w2"] + SIZES["w1"])
        outcomes.append([(n.name, n.meta.get("recompute"), n.meta.get(KEPT)) for n in gm.graph.nodes])
    assert outcomes[0] == outcomes[1]
    unshards = {name: (tag, kept) for name, tag, kept in outcomes[0] if kept or tag == CheckpointPolicy.MUST_RECOMPUTE}
    assert unshards["unshard_3"] == (None, "w2") and unshards["unshard_1"] == (None, "w1")
    assert unshards["unshard"] == (CheckpointPolicy.MUST_RECOMPUTE, None)


def test_the_backend_hands_the_budget_to_the_pass_the_cache_key_and_the_rank_guard(monkeypatch) -> None:
    """Inductor's cache must not serve a graph tagged under another budget, and ranks compiling
    with different budgets would save different values: the guard compares it."""
    keys = {budget: backend.TagGathersForRecompute(None, budget).uuid() for budget in (None, 0, 1024, 2048)}
    assert len(set(keys.values())) == 4
    compared = []
    monkeypatch.setattr(backend.guard, "check_ranks_agree", lambda graph, settings, compile_id: compared.append(settings))
    backend._check_ranks_agree(fx.Graph(), zc.ZeroConfig(stage=3, memory_budget=4096))
    assert compared[0]["memory_budget"] == 4096


# ------------------------------------------------------------------------ on spawned ranks

class BrokenPair(nn.Module):
    """Two graphs (a graph break in the middle), each with weights its backward reads: fc1 in the
    first (fc0's input needs no gradient), fc2 and fc3 in the second."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.fc1 = nn.Linear(9, 12), nn.Linear(12, 12)
        self.fc2, self.fc3 = nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(torch.tanh(self.fc0(x)))
        torch._dynamo.graph_break()
        return self.fc3(torch.tanh(self.fc2(torch.tanh(hidden)))).square().mean()


BUDGET_MODELS = {**MODELS, "broken_pair": BrokenPair}
STEPS = 5
# The budgets every case trains with, by name: half of the model's gathered (fp32) bytes, and
# more than all of them.
BUDGETS = ("half", "above")
DEEP_BUCKET = 2**20  # one hidden layer of DeepMLP per bucket


def _gathered_bytes(model: nn.Module) -> int:
    """Full fp32 bytes of every distinct parameter: what a step would gather."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _budget(name: str, model: nn.Module) -> int:
    return _gathered_bytes(model) // 2 if name == "half" else 2 * _gathered_bytes(model)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.1) if name == "sgd" else torch.optim.AdamW(params, lr=1e-3)


def _train(forward, optimizer: torch.optim.Optimizer, name: str, rank: int, world_size: int) -> None:
    batches = "graph_break" if name == "broken_pair" else name  # the same 9 input features
    train(forward, optimizer, (local_batch(batches, step, rank, world_size) for step in range(STEPS)))


def _ddp(name: str, optimizer: str, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = BUDGET_MODELS[name]()
    _train(nn.parallel.DistributedDataParallel(model), _optimizer(optimizer, model), name, rank, world_size)
    return {fqn: p.detach().clone() for fqn, p in model.named_parameters()}


def _budgeted(name: str, optimizer: str, budget: str, compiler: str, rank: int, world_size: int, reference: dict) -> dict:
    """Stage 3 within the budget: its largest parameter difference from DDP, and what its graphs
    keep and gather."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BUDGET_MODELS[name]()
    model = zc.shard(model, stage=3, memory_budget=_budget(budget, model))
    compiled = torch.compile(model, backend="zero", options={"compiler": compiler})
    with zc.record_graphs() as graphs:
        _train(compiled, _optimizer(optimizer, model), name, rank, world_size)
    with zc.gathered(model):
        error = max((p.detach() - reference[fqn]).abs().max().item() for fqn, p in model.named_parameters())
    return {"error": error, **_graph_facts(graphs)}


def _graph_facts(graphs: list) -> dict:
    """Per graph kind, over its graphs: the parameters kept (and bytes, per graph), those
    gathered, and the forward's saved gathered values."""
    facts: dict = {}
    for graph in graphs:
        record = facts.setdefault(graph.kind, {"kept": [], "kept_bytes": [], "gathers": [], "saved": []})
        record["kept"] += graph.ledger.kept_params
        record["kept_bytes"].append(graph.ledger.kept_bytes)
        record["gathers"] += [p for e in graph.ledger.entries if e.op == "all_gather" for p in e.params]
        record["saved"] += graph.saved_gathered
    return facts


def _deep_mlp_bytes(budget: str) -> dict:
    """One step of DeepMLP (Φ ≈ 1.1M) after warm-up: bytes written, and the ledger's figures."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DeepMLP()
    phi = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memory_budget = _budget(budget, model)
    zc.shard(model, stage=3, memory_budget=memory_budget)
    compiled = torch.compile(
        model, backend="zero", options={"compiler": "eager", "bucket_bytes": DEEP_BUCKET, "prefetch": 1}
    )
    x = torch.randn(4, 8)
    sent: list[int] = []
    with zc.record_graphs() as graphs:
        train(compiled, optimizer, [x] * 3, sent=sent)
    return {
        "phi": phi,
        "budget": memory_budget,
        "sent": sent[-1],
        "predicted": sum(graph.ledger.sent_bytes for graph in graphs),
        "peak": max(graph.ledger.peak_gathered_bytes for graph in graphs),
        "kept_bytes": max(graph.ledger.kept_bytes for graph in graphs),
        "backward_peak": next(g.ledger.peak_gathered_bytes for g in graphs if g.kind == "backward"),
        "optimizer_bytes": zc.model_state_bytes(model, optimizer)["optimizer"],
        "shard_numel": sum(zc.sharded_parameters.shard_info(p).shard_numel for p in model.parameters()),
    }


# (compiler, model, optimizer, budget) trained per world size, and the budgets DeepMLP's bytes are
# measured with. Few on purpose: every compile costs suite time.
CASES = {
    2: [
        *(("eager", "uneven_mlp", optimizer, budget) for optimizer in ("sgd", "adamw") for budget in BUDGETS),
        ("eager", "tied_gpt", "adamw", "half"),
        ("eager", "broken_pair", "adamw", "half"),
        ("inductor", "uneven_mlp", "sgd", "half"),
    ],
    4: [("eager", "uneven_mlp", "sgd", "half")],
}
BYTES_CASES = {2: BUDGETS, 4: ("above",)}


def budget_report(rank: int, world_size: int) -> dict:
    """{(compiler, model, optimizer, budget): facts} and {("bytes", budget): ...}, or tracebacks."""
    references: dict[tuple[str, str], dict] = {}
    cases = []
    for compiler, name, optimizer, budget in CASES[world_size]:
        if (name, optimizer) not in references:
            references[name, optimizer] = _ddp(name, optimizer, rank, world_size)
        reference = references[name, optimizer]
        cases.append(
            (
                (compiler, name, optimizer, budget),
                lambda c=compiler, n=name, o=optimizer, b=budget, r=reference: _budgeted(n, o, b, c, rank, world_size, r),
            )
        )
    cases += [(("bytes", budget), lambda b=budget: _deep_mlp_bytes(b)) for budget in BYTES_CASES[world_size]]
    return run_cases(cases)


@pytest.fixture(scope="module")
def reports() -> dict[int, dict]:
    return {world_size: run_on_ranks(world_size, budget_report)[0] for world_size in CASES}


def _case(reports: dict, world_size: int, case: tuple) -> dict:
    outcome = reports[world_size][case]
    assert not isinstance(outcome, str), outcome
    return outcome


@pytest.mark.parametrize("world_size, case", [(n, case) for n, cases in CASES.items() for case in cases], ids=str)
def test_budgeted_stage3_trains_like_ddp(reports, world_size: int, case: tuple) -> None:
    outcome = _case(reports, world_size, case)
    tolerance = FP32_TOLERANCE if case[2] == "sgd" else EAGER_TOLERANCE
    assert outcome["error"] <= tolerance, f"parameters differ from DDP's by {outcome['error']:.3g}"


@pytest.mark.parametrize(
    "case", [("eager", "uneven_mlp", "adamw", "half"), ("eager", "tied_gpt", "adamw", "half"), ("inductor", "uneven_mlp", "sgd", "half")], ids=str
)
def test_half_budget_keeps_some_parameters_and_gathers_only_the_others_again(reports, case: tuple) -> None:
    half = _case(reports, 2, case)
    forward, backward = half["forward"], half["backward"]
    assert set(forward["kept"]) == set(backward["kept"]) and forward["saved"], half  # what one saves, the other receives
    assert forward["kept"] and set(forward["kept"]).isdisjoint(backward["gathers"]), half
    assert backward["gathers"], f"half the budget gathers the rest again: {half}"
    assert sum(forward["kept_bytes"]) == sum(backward["kept_bytes"]) > 0, half


def test_budget_above_the_model_gathers_nothing_in_the_backward(reports) -> None:
    above = _case(reports, 2, ("eager", "uneven_mlp", "adamw", "above"))
    assert above["backward"]["gathers"] == [], f"nothing is gathered again: {above['backward']}"
    assert set(above["forward"]["kept"]) == set(above["backward"]["kept"]) and above["forward"]["kept"], above


def test_each_graph_of_a_broken_model_chooses_within_the_whole_budget(reports) -> None:
    """The stated limit: each graph keeps up to the budget on its own, so together they may keep
    more (half the model's 1884 B: fc1.weight in the first graph, fc3's and fc2's in the second)."""
    half = _case(reports, 2, ("eager", "broken_pair", "adamw", "half"))
    forward = half["forward"]
    assert sorted(forward["kept"]) == ["fc1.weight", "fc2.weight", "fc3.weight"], half
    assert forward["kept_bytes"] == [576, 720] and sum(forward["kept_bytes"]) > 1884 // 2, half
    assert set(half["backward"]["gathers"]) == set(), half


@pytest.mark.parametrize("world_size", [n for n, budgets in BYTES_CASES.items() if "above" in budgets])
def test_budget_above_the_model_sends_stage_2s_traffic(reports, world_size: int) -> None:
    """2Φ·(N−1)/N·4 B, predicted by the ledger (within 2 %) and written (within 0.3 %), while the
    optimizer state stays sharded: AdamW's two fp32 moments of this rank's shards."""
    r = _case(reports, world_size, ("bytes", "above"))
    stage2 = 2 * r["phi"] * (world_size - 1) / world_size * 4
    assert r["predicted"] == pytest.approx(stage2, rel=0.02), r
    # wchar: the ledger's payload plus gloo's framing, measured +0.06 to +0.12 %.
    assert r["sent"] == pytest.approx(r["predicted"], rel=0.003), r
    assert r["optimizer_bytes"] == 8 * r["shard_numel"], r
    # The backward gathers nothing, yet its peak counts the kept parameters it holds from its start.
    assert r["backward_peak"] == r["kept_bytes"] > 0, r


@pytest.mark.parametrize("world_size", [n for n, budgets in BYTES_CASES.items() if "half" in budgets])
def test_half_budget_ledger_predicts_bytes_sent_and_bounds_the_peak(reports, world_size: int) -> None:
    """Between stage 2's and stage 3's traffic, the ledger's prediction within 0.3 % of the bytes
    written, at most the budget kept, and a gathered peak within the budget plus one bucket."""
    r = _case(reports, world_size, ("bytes", "half"))
    stage2, stage3 = (volumes * r["phi"] * (world_size - 1) / world_size * 4 for volumes in (2, 3))
    assert stage2 < r["predicted"] < stage3, r
    # wchar: the ledger's payload plus gloo's framing, measured +0.06 %.
    assert r["sent"] == pytest.approx(r["predicted"], rel=0.003), r
    assert 0 < r["kept_bytes"] <= r["budget"], r
    assert r["peak"] <= r["budget"] + DEEP_BUCKET, r


def _plan(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return json.loads(plan(parser.parse_args([*argv, "--json"])))


@pytest.mark.parametrize("budget", BYTES_CASES[2])
def test_plan_shows_what_the_budget_does_to_the_bytes_sent(reports, budget: str) -> None:
    """`zerocompile plan --memory-budget`: stage 2's bytes when the budget holds the model, else a
    bound between stage 2's and stage 3's that the traced graphs' ledgers stay under."""
    r = _case(reports, 2, ("bytes", budget))
    planned = _plan(["--model", "test_stages:DeepMLP", "--ranks", "2", "--memory-budget", str(r["budget"])])
    stage2, stage3, row = planned["stages"][2], planned["stages"][3], planned["stages"][4]
    assert row["memory_budget"] == r["budget"] and row["model_state_bytes"] == stage3["model_state_bytes"]
    if budget == "above":
        assert not row["sent_is_upper_bound"] and row["sent_bytes_per_step"] == stage2["sent_bytes_per_step"]
        assert r["predicted"] == pytest.approx(row["sent_bytes_per_step"], abs=64)  # the ledger floors each collective
    else:
        assert row["sent_is_upper_bound"]
        assert stage2["sent_bytes_per_step"] < r["predicted"] <= row["sent_bytes_per_step"] < stage3["sent_bytes_per_step"]
    with pytest.raises(PlanError, match="--memory-budget is zerocompile's setting.*--model"):
        _plan(["--params", "1e9", "--ranks", "2", "--memory-budget", "1000"])
