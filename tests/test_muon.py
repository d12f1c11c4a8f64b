"""Muon on sharded parameters equals DDP with `torch.optim.Muon`, at stages 1-3, N = 2 and 4.

nanoGPT style: Muon for the hidden matrices (and two odd ones: a 7x13 whose shards end mid-row,
and a 1x3 with fewer elements than 4 ranks), AdamW for embeddings, norms and biases. Each case
trains 5 steps against DDP from the same seed and global batches: plain; with gradient
accumulation over 4 micro-steps (Newton-Schulz must run once per optimizer step, on the summed
gradient: run per micro-step it fails the bound); with clipping; and with `torch.optim.Muon` and
AdamW built before `shard()`, stepped once, and handed to it (`optimizer=[muon, adamw]`). A
deliberately wrong variant, Newton-Schulz on each rank's shard instead of the whole matrix, must
fail the same bound.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerocompile as zc
from zerocompile.dtensor_parameters import flat_state
import zerocompile.optim
from matrix_optimizers import STEPS, MuonGPT, case_id, largest_difference, parity_report, report_of, train_step
from zerocompile.tools import dump as dump_tool
from zerocompile.tools.plan.model import count_model, muon_exchange, muon_matrices
from models import global_batch, local_batch
from ranks import run_cases, run_on_ranks
from training import train, written_bytes
from zerocompile.matrix_owners import assign_owners

MUON_LR = 0.02
ADAMW_LR = 1e-3
# Both sides run torch's Newton-Schulz on averaged gradients that differ only in the order the ranks'
# contributions were summed (DDP's all-reduce; our all-to-all and sum; stage 3 reduces a tied
# embedding's two uses apart; Inductor fuses differently), and Newton-Schulz in bfloat16 amplifies
# such rounding: a correct data-parallel run carries ~1.5e-3 of it here after 5 steps (measured
# 2026-11-28, N = 4: DDP + torch.compile against DDP eager 1.51e-3, every rank training on the
# whole batch alone against DDP 1.40e-3; ours 1.13e-3 to 1.65e-3). The bound is under 3x that noise;
# the wrong variant below (Newton-Schulz per shard) moved them 5.6e-2 (N = 4) and 6.4e-2 (N = 2).
TOLERANCE = 4e-3
# Where the summation order is DDP's (two addends, either order; stages 1-2 reduce the tied
# embedding's uses together; the eager compiler runs the ops as written), equal to the bit.
EXACT_AT_2_RANKS = {(stage, "eager", variant) for stage in (1, 2) for variant in ("plain", "accumulate")}


def _is_hidden_matrix(name: str, shape: torch.Size) -> bool:
    return len(shape) == 2 and not name.startswith(("gpt.wte", "gpt.wpe"))


def _split(
    model: nn.Module, muon_class: type[torch.optim.Optimizer], rest_class: type[torch.optim.Optimizer]
) -> list[torch.optim.Optimizer]:
    hidden = [p for n, p in model.named_parameters() if _is_hidden_matrix(n, zc.full_shape(p))]
    rest = [p for n, p in model.named_parameters() if not _is_hidden_matrix(n, zc.full_shape(p))]
    return [muon_class(hidden, lr=MUON_LR), rest_class(rest, lr=ADAMW_LR)]


def _muon_and_adamw(model: nn.Module, ours: bool) -> list[torch.optim.Optimizer]:
    return _split(model, zerocompile.optim.Muon if ours else torch.optim.Muon, torch.optim.AdamW)


def _momentum_is_one_shard(optimizers: list[torch.optim.Optimizer]) -> None:
    for param, state in flat_state(optimizers[0]).items():  # Muon's state is 1/N: one shard's momentum
        assert state["momentum_buffer"].shape == (zc.sharded_parameters.shard_info(param).shard_numel,)


# Each case costs a compile on every rank (4 ranks share 2 cores in CI), so the cases cover every
# stage and compiler at 2 ranks, each variant, and at 4 ranks the stage that keeps whole matrices
# nowhere (3) and one that keeps them everywhere (1), rather than every combination. Stage 2 differs
# from stage 1 only in how gradients reach the owners (reduced to shards rather than whole), which
# the 2-rank stage-2 cases check. At 4 ranks the eager compiler: Muon's step runs outside the
# compiled graphs, and Inductor's code for them is checked at 2 ranks (a cold Inductor compile on 4
# ranks sharing 2 cores was most of this module's 200 s at 4 ranks).
CASES = {
    2: [
        (1, "eager", "plain"),
        (1, "inductor", "clip"),
        (2, "eager", "accumulate"),
        (2, "inductor", "taken_over"),
        (3, "eager", "plain"),
    ],
    4: [(1, "eager", "plain"), (3, "eager", "accumulate")],
}


def _newton_schulz_per_shard(slices, shapes, owners, group, compute):
    """The wrong variant: each rank orthogonalises its own slice as a 1-row matrix."""
    return [compute(i, piece.view(1, -1)).reshape(-1) for i, piece in enumerate(slices)]


def _step_bytes(rank: int, world_size: int, directory: str) -> dict:
    """Bytes this rank sent during its second Muon step (gloo's sockets: /proc/self/io wchar), Φ of
    Muon's matrices, and every rank's prediction by the ledger `zerocompile dump` read from the dump."""
    torch.manual_seed(0)
    model = zc.shard(MuonGPT(), stage=3, dump_dir=directory)
    muon, _adamw = _muon_and_adamw(model, True)
    for step in range(2):  # the first step writes the ledger to the dump (a file write counts in wchar)
        model(local_batch("tied_gpt", step, rank, world_size)).backward()
        dist.barrier()
        before = written_bytes()
        muon.step()
        sent = written_bytes() - before
        muon.zero_grad()
    phi = sum(math.prod(zc.full_shape(p)) for p in muon.param_groups[0]["params"])
    dist.barrier()  # every rank's ledger written
    dumped = [dump_tool.rank_summary(graphs)["sent"] for graphs in dump_tool.load(directory).values()]
    return {"sent": sent, "predicted": zerocompile.optim.exchange_bytes(muon), "dumped": dumped, "phi": phi}


def muon_report(rank: int, world_size: int, directory: str) -> dict:
    wrong = {"per shard": ("compute_on_owners", _newton_schulz_per_shard)} if world_size == 2 else {}
    report = parity_report(_muon_and_adamw, _momentum_is_one_shard, CASES[world_size], rank, world_size, wrong)
    report.update(run_cases([("bytes", lambda: _step_bytes(rank, world_size, directory))]))
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> Callable[[int], dict]:
    """The ranks' report at a world size, run when a test first asks for it."""
    directory, runs = tmp_path_factory.mktemp("muon-dump"), {}
    return lambda world_size: report_of(runs, world_size, muon_report, str(directory / str(world_size)))


@pytest.mark.parametrize("world_size,case", [(n, case) for n, cases in CASES.items() for case in cases], ids=case_id)
def test_muon_equals_ddp(reports, world_size: int, case: tuple) -> None:
    outcome = reports(world_size)[case]
    assert not isinstance(outcome, str), outcome
    bound = 0.0 if world_size == 2 and case in EXACT_AT_2_RANKS else TOLERANCE
    assert outcome <= bound, f"parameters differ from DDP + torch.optim.Muon by {outcome:.3g}"


def test_newton_schulz_per_shard_fails_the_bound(reports) -> None:
    outcome = reports(2)["per shard"]
    assert not isinstance(outcome, str), outcome
    assert outcome > 5 * TOLERANCE, f"the wrong variant came within {outcome:.3g} of DDP"


@pytest.mark.parametrize("world_size", CASES)
def test_muon_step_sends_what_the_owners_need(reports, world_size: int) -> None:
    outcome, ranks = reports(world_size)["bytes"], world_size
    assert not isinstance(outcome, str), outcome
    # Within 2 exchanges of (N-1)/N^2 of each matrix in fp32 (+2 %); ours travel in bf16.
    assert outcome["sent"] <= 2 * outcome["phi"] * (ranks - 1) / ranks**2 * 4 * 1.02
    # What the owners need, plus gloo's framing of each of the 2 (N - 1) messages (measured
    # 2026-11-28: 144 bytes a message at N = 4, 19,552 predicted and 20,416 sent).
    assert outcome["predicted"] <= outcome["sent"] <= outcome["predicted"] + 2 * (ranks - 1) * 256
    # The dump holds only the Muon step's ledger here (nothing was compiled): `zerocompile dump`
    # counts what the rank's ledger predicts, and `zerocompile plan --muon` the busiest rank's.
    assert outcome["dumped"][0] == outcome["predicted"]
    with torch.device("meta"):
        counted = count_model(MuonGPT(), "MuonGPT")
    muon = muon_matrices(counted, r"^(gpt\.blocks|mix|gate)\.")
    hidden = [name for name, param in MuonGPT().named_parameters() if _is_hidden_matrix(name, param.shape)]
    assert [param.fqn for param in muon] == hidden
    assert max(muon_exchange(muon, ranks)) == max(outcome["dumped"])


@pytest.mark.fast
def test_owners_balance_newton_schulz_cost() -> None:
    # The costliest first, each to the least loaded rank (lowest on ties).
    assert assign_owners([1.0, 8.0, 8.0, 3.0, 2.0], 2) == [1, 0, 1, 0, 1]
    assert assign_owners([5.0, 5.0], 4) == [0, 1]
    assert assign_owners([], 3) == []
    loads = [0.0] * 3
    costs = [float(max(m, n) * min(m, n) ** 2) for m, n in [(96, 32), (32, 32), (128, 32), (32, 128), (7, 13), (1, 3)]]
    for cost, owner in zip(costs, assign_owners(costs, 3)):
        loads[owner] += cost
    assert max(loads) <= sum(costs) / 3 + max(costs)  # LPT's bound


@pytest.mark.fast
def test_muon_refuses_a_parameter_that_is_no_matrix() -> None:
    with pytest.raises(ValueError, match=r"2-D parameters.*shape \(5,\).*zerocompile.full_shape"):
        zerocompile.optim.Muon([nn.Parameter(torch.ones(5))])
    with pytest.raises(ValueError, match="Learning rate"):  # torch's own checks of the settings
        zerocompile.optim.Muon([nn.Parameter(torch.ones(2, 2))], lr=-1.0)


def test_torch_muon_not_handed_to_shard_is_refused_before_stepping(single_rank) -> None:
    model = MuonGPT()
    muon = torch.optim.Muon([model.mix.weight], lr=MUON_LR)
    zc.shard(model, stage=3)
    model(global_batch("tied_gpt", 0)).backward()
    shard = dict(model.named_parameters())["mix.weight"]
    before = shard.detach().clone()
    with pytest.raises(TypeError, match=r"torch.optim.Muon cannot step.*optimizer=muon.*zerocompile.optim.Muon"):
        muon.step()
    assert torch.equal(shard.detach(), before) and not muon.state


@pytest.mark.core
@pytest.mark.parametrize("stage", [0, 3])
def test_muon_steps_as_torchs_on_one_rank(single_rank, stage: int) -> None:
    """On one rank: whole parameters (stage 0) and a flat shard sent to its owner and back
    (stage 3, in bf16) both step bit for bit as torch.optim.Muon - on every torch of the window
    (CI's core tier), which would catch a change in torch's Newton-Schulz or lr adjustment."""
    torch.manual_seed(0)
    ours, theirs = MuonGPT(), MuonGPT()
    theirs.load_state_dict(ours.state_dict())
    zc.shard(ours, stage=stage)
    matrices = [dict(model.named_parameters())["mix.weight"] for model in (ours, theirs)]
    optimizers = [zerocompile.optim.Muon([matrices[0]], lr=MUON_LR), torch.optim.Muon([matrices[1]], lr=MUON_LR)]
    initial = theirs.mix.weight.detach().clone()
    for model, optimizer in zip((ours, theirs), optimizers):
        inputs = torch.Generator().manual_seed(0)
        batches = (torch.randn(4, 13, generator=inputs) for _ in range(2))
        train(lambda x, model=model: F.mse_loss(model.mix(x), torch.zeros(4, 7)), optimizer, batches)
    with zc.gathered(ours):
        assert torch.equal(ours.mix.weight.detach(), theirs.mix.weight.detach())
    assert not torch.equal(theirs.mix.weight.detach(), initial)  # it did step


def _checkpoint_run(rank: int, world_size: int, stage: int, root: str, role: str) -> dict[str, torch.Tensor]:
    """Muon for the hidden matrices and Adafactor (whose row and column statistics are whole on
    every rank) for the rest. "save": steps 0-2, save, steps 3-4 (the uninterrupted run).
    "resume": a model of another seed loads the checkpoint (with both optimizers' state, or
    "weights only") and runs steps 3-4."""
    torch._dynamo.reset()
    torch.manual_seed(0 if role == "save" else 1)
    model = zc.shard(MuonGPT(), stage=stage)
    optimizers = _split(model, zerocompile.optim.Muon, zerocompile.optim.Adafactor)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    if role == "save":
        for step in range(3):
            train_step(compiled, model, optimizers, step, rank, world_size, "plain", None)
        zc.save(root, model, optimizers)
    else:
        zc.load(root, model, optimizers if role == "resume" else None)
    for step in range(3, STEPS):
        train_step(compiled, model, optimizers, step, rank, world_size, "plain", None)
    with zc.gathered(model):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_saved_at_stage_3_on_2_ranks_resumes_at_stage_2_on_4(tmp_path) -> None:
    root = str(tmp_path / "checkpoint")
    uninterrupted = run_on_ranks(2, _checkpoint_run, 3, root, "save")[0]
    resumed = run_on_ranks(4, _checkpoint_run, 2, root, "resume")[0]
    weights_only = run_on_ranks(4, _checkpoint_run, 2, root, "weights only")[0]
    assert largest_difference(resumed, uninterrupted) <= TOLERANCE
    # The optimizers' state matters: without it the run goes elsewhere.
    assert largest_difference(weights_only, uninterrupted) > 5 * TOLERANCE
