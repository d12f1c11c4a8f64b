"""Muon through Hugging Face's `Trainer`: `zerocompile.muon_adamw.MuonWithAdamW` (Muon for the hidden matrices,
AdamW for embeddings, norms and head) as Trainer's one optimizer.

`ZeroTrainer` at stage 3 on 2 gloo ranks trains test_hf_trainer's tiny Llama 5 steps on 4 random
sequences, 2 per rank, so every step's global batch is the whole set, whatever order Trainer's
sampler draws. The reference is one process and no class of ours: the unsharded model, the 4
sequences in one batch, `torch.optim.Muon` and `torch.optim.AdamW` in Trainer's groups (weight
decay on the 2-D parameters, none on the norms), each with LambdaLR on Trainer's linear schedule.
Both routes into Trainer (`optimizers=(opt, None)`, `optimizer_cls_and_kwargs=`) must end within
test_muon's TOLERANCE of it, the bound of Muon's parity with DDP (Newton-Schulz in bfloat16
amplifies the order of the ranks' sums); measured 3.7e-9 here (2026-12-02). Muon left unscheduled
ends 3.4e-2 away, every parameter given to AdamW 4.2e-2, the head given to Muon 6.1e-2. A run
resumed from step 3's checkpoint (`save_steps`, `resume_from_checkpoint`) must end where the
uninterrupted one does, to the bit: the same ranks compute the same sums (AdamW's state left out
of the checkpoint moved it 1.6e-3, within TOLERANCE, hence no tolerance).

In one process, bit for bit (one rank: Newton-Schulz on the owner is torch's): the groups and
state after each step (the process hooks swap each inner optimizer's groups onto the shards for
its own step, once, and leave the DTensor parameters), and `state_dict()` against torch's Muon and
AdamW on the unsharded model, which also holds each group's settings (weight decay too small to
move the parameters past TOLERANCE in 5 steps); `state_dict()` round trip; an LR scheduler
scaling both optimizers' groups.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zerocompile as zc
from ranks import run_on_ranks
from test_hf_trainer import _tiny_llama
from test_muon import ADAMW_LR, MUON_LR, TOLERANCE
from training import full_parameters
from zerocompile.muon_adamw import MuonWithAdamW, hidden_matrices

STEPS = 5
SAVED_AT = 3
WEIGHT_DECAY = 0.1
SEQUENCES, SEQ_LEN = 4, 16  # the whole set is every step's global batch: 2 per rank on 2 ranks
MUON = {"lr": MUON_LR}
ADAMW = {"lr": ADAMW_LR}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return _tiny_llama()


def _sequences() -> torch.Tensor:
    return torch.randint(0, 64, (SEQUENCES, SEQ_LEN), generator=torch.Generator().manual_seed(5))


def _linear(step: int) -> float:
    """Trainer's default schedule (linear, no warmup) over STEPS steps."""
    return max(0.0, (STEPS - step) / STEPS)


def _trainer_groups(model: torch.nn.Module) -> list[dict]:
    """Trainer's two groups for this Llama: decay on the 2-D parameters, none on the norms."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() == 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0},
    ]


def _torch_optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch's Muon on the hidden matrices (named here, not by `hidden_matrices`) and AdamW on the
    rest, in Trainer's groups."""
    hidden = [p for name, p in model.named_parameters() if p.dim() == 2 and name not in ("model.embed_tokens.weight", "lm_head.weight")]
    rest = [{**g, "params": [p for p in g["params"] if not any(p is h for h in hidden)]} for g in _trainer_groups(model)]
    return [torch.optim.Muon(hidden, lr=MUON_LR, weight_decay=WEIGHT_DECAY), torch.optim.AdamW(rest, lr=ADAMW_LR)]


def _reference() -> dict[str, torch.Tensor]:
    """The unsharded model, one process, the whole batch, torch's Muon and AdamW."""
    model = _model()
    muon, adamw = _torch_optimizers(model)
    schedules = [torch.optim.lr_scheduler.LambdaLR(optimizer, _linear) for optimizer in (muon, adamw)]
    batch = _sequences()
    for _ in range(STEPS):
        model(input_ids=batch, labels=batch).loss.backward()
        for optimizer in (muon, adamw):
            optimizer.step()
            optimizer.zero_grad()
        for schedule in schedules:
            schedule.step()
    return full_parameters(model)


class _Sequences(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SEQUENCES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = _sequences()[index]
        return {"input_ids": ids, "labels": ids}


def _train(directory: str, route: str, resume: str | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """One ZeroTrainer run at stage 3 on this rank; the trained parameters whole (rank 0's)."""
    from transformers import TrainingArguments, default_data_collator

    from zerocompile.hf import ZeroTrainer

    args = TrainingArguments(
        output_dir=directory, per_device_train_batch_size=2, max_steps=STEPS, save_steps=SAVED_AT,
        weight_decay=WEIGHT_DECAY, max_grad_norm=0.0, logging_steps=1, seed=0, report_to=[], use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    model = _model(seed)
    common = dict(args=args, train_dataset=_Sequences(), data_collator=default_data_collator, compile_options={"compiler": "eager"})
    if route == "optimizers":
        zc.shard(model, stage=3)  # the optimizer is built on the parameters ZeroTrainer trains
        optimizer = MuonWithAdamW(_trainer_groups(model), muon_params=hidden_matrices(model), muon=MUON, adamw=ADAMW)
        trainer = ZeroTrainer(model=model, optimizers=(optimizer, None), **common)
    else:  # Trainer builds it from its own groups; the matrices named before ZeroTrainer shards
        kwargs = {"muon_params": hidden_matrices(model), "muon": MUON, "adamw": ADAMW}
        trainer = ZeroTrainer(model=model, zero_config=3, optimizer_cls_and_kwargs=(MuonWithAdamW, kwargs), **common)
    trainer.train(resume_from_checkpoint=resume)
    return zc.full_state_dict(trainer.model)


def _runs(rank: int, world_size: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    runs = {route: _train(str(Path(root, route)), route) for route in ("optimizers", "optimizer_cls_and_kwargs")}
    checkpoint = str(Path(root, "optimizer_cls_and_kwargs", f"checkpoint-{SAVED_AT}"))
    # Another seed: what it ends with comes from the checkpoint.
    runs["resumed"] = _train(str(Path(root, "resumed")), "optimizer_cls_and_kwargs", resume=checkpoint, seed=1)
    dist.barrier()
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    root = str(tmp_path_factory.mktemp("muon-trainer"))
    return run_on_ranks(2, _runs, root, fresh=True)[0]


def _largest_difference(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert ours.keys() == reference.keys()
    return max((ours[name] - reference[name]).abs().max().item() for name in reference)


@pytest.mark.parametrize("route", ["optimizers", "optimizer_cls_and_kwargs"])
def test_zero_trainer_equals_one_process(runs, route: str) -> None:
    difference = _largest_difference(runs[route], _reference())
    assert difference <= TOLERANCE, f"parameters differ from one process with torch's Muon and AdamW by {difference:.3g}"


def test_resume_equals_the_uninterrupted_run(runs) -> None:
    difference = _largest_difference(runs["resumed"], runs["optimizer_cls_and_kwargs"])
    assert difference == 0.0, f"the resumed run ends {difference:.3g} from the uninterrupted one"


# --- one process ------------------------------------------------------------------------------


def _step(forward: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    batch = _sequences()
    forward(input_ids=batch, labels=batch).loss.backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _full(value: object) -> object:
    return value.full_tensor() if isinstance(value, DTensor) else value


def test_groups_and_state_after_a_step(single_rank) -> None:
    """After each step the outer's and the inner optimizers' groups hold the DTensor parameters (the
    same group dicts), the state is keyed by them, and `state_dict()` holds what torch's Muon and
    AdamW hold for the unsharded model, bit for bit (one rank: Newton-Schulz on the owner is
    torch's)."""
    model, theirs = _model(), _model()
    zc.shard(model, stage=3)
    ours = MuonWithAdamW(_trainer_groups(model), muon_params=hidden_matrices(model), muon=MUON, adamw=ADAMW)
    reference = _torch_optimizers(theirs)
    forward = torch.compile(model, backend="zero", options={"compiler": "eager"})
    for _ in range(2):
        _step(forward, [ours])
        _step(theirs, reference)
        groups = ours.param_groups
        assert all(a is b for a, b in zip(groups, ours.muon.param_groups + ours.adamw.param_groups))
        parameters = [p for group in groups for p in group["params"]]
        assert all(isinstance(p, DTensor) for p in parameters)
        assert {id(p) for p in parameters} == {id(p) for p in model.parameters()}
        assert {id(p) for p in ours.state} == {id(p) for p in model.parameters()}
    saved = ours.state_dict()
    for name, optimizer in zip(("muon", "adamw"), reference):
        expected = optimizer.state_dict()
        assert saved[name]["param_groups"] == expected["param_groups"]
        assert saved[name]["state"].keys() == expected["state"].keys()
        for index, state in expected["state"].items():
            for key, value in state.items():
                assert torch.equal(_full(saved[name]["state"][index][key]), value), (name, index, key)


def test_state_dict_round_trip_and_scheduler(single_rank) -> None:
    """LambdaLR scales every group's own lr, Muon's and AdamW's; a second optimizer on a copy of the
    model, given the first's `state_dict()` (lrs and state), steps as the first does (the first
    through a closure)."""
    model = zc.shard(_model(), stage=3)
    first = MuonWithAdamW(model.parameters(), muon_params=hidden_matrices(model), muon=MUON, adamw=ADAMW)
    schedule = torch.optim.lr_scheduler.LambdaLR(first, lambda step: 0.5**step)
    forward = torch.compile(model, backend="zero", options={"compiler": "eager"})
    for step in range(2):
        _step(forward, [first])
        schedule.step()
        assert [group["lr"] for group in first.param_groups] == [MUON_LR * 0.5 ** (step + 1), ADAMW_LR * 0.5 ** (step + 1)]
    copied = zc.shard(_model(seed=1), stage=3)
    copied.load_state_dict(model.state_dict())
    second = MuonWithAdamW(copied.parameters(), muon_params=hidden_matrices(copied), muon={"lr": 1.0}, adamw={"lr": 1.0})
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # a copy: it holds the first's own tensors
    assert [group["lr"] for group in second.param_groups] == [group["lr"] for group in first.param_groups]
    batch = _sequences()

    def closure() -> torch.Tensor:  # the first steps through one: run once, gradients on
        first.zero_grad()
        loss = forward(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss

    assert first.step(closure) is not None
    _step(torch.compile(copied, backend="zero", options={"compiler": "eager"}), [second])
    assert _largest_difference(full_parameters(copied), full_parameters(model)) == 0.0


@pytest.mark.fast
def test_which_parameters_are_muons() -> None:
    """`hidden_matrices`: the 2-D parameters but the embedding and the head. A model of matrices
    alone leaves AdamW an empty group; parameters none of which is in `muon_params` are refused."""
    model = _model()
    names = {id(p): name for name, p in model.named_parameters()}
    assert [names[id(p)] for p in hidden_matrices(model)] == [
        f"model.layers.0.{module}.weight"
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    ]  # fmt: skip
    matrices = torch.nn.Linear(4, 4, bias=False)
    assert [len(g["params"]) for g in MuonWithAdamW(matrices.parameters(), muon_params=[matrices.weight]).param_groups] == [1, 0]
    with pytest.raises(ValueError, match="no parameter of params is in muon_params"):
        MuonWithAdamW(model.parameters(), muon_params=hidden_matrices(_model()))
