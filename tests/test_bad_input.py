"""Bad input to shard(), to a sharded model and to load(): each either works (odd shapes, integer
buffers, another world size) or fails with an error naming what is wrong and the fix -- never a
crash inside torch, a hang, or a silently wrong result.

The checks that need several ranks (parity, broadcast, errors agreed without a hang) share one
spawned 2-rank run; everything else runs in this process on a one-rank group.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import UnevenMLP
from ranks import raised, run_on_ranks
from training import train
from zerocompile.checkpoint_files import CheckpointError

EAGER = {"compiler": "eager"}


# ---------------------------------------------------------------------------------------------
# Shapes that must work: 0-d, empty, and fewer elements than ranks (every shard padding but one)


class OddShapes(nn.Module):
    """A 0-d scale, an empty (0, 3) matrix, a one-element offset and an integer step counter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.offset = nn.Parameter(torch.tensor([0.3]))
        self.linear = nn.Linear(3, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("use_offset", torch.tensor(True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = self.offset * self.use_offset + self.empty.sum()
        return (self.linear(x) * self.scale + offset).square().mean()


def _odd_shapes_differing_by_rank(rank: int) -> OddShapes:
    """Same parameters on every rank, buffers that differ: sharding must broadcast rank 0's, as
    DDP does (the reference gets the same buffers, so equal results mean equal broadcasts)."""
    torch.manual_seed(0)
    model = OddShapes()
    model.calls.fill_(7 + rank)
    model.use_offset.fill_(rank == 0)
    return model


def _odd_batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(step)).chunk(world_size)[rank]


def _train_odd(forward: Callable, model: nn.Module, rank: int, world_size: int) -> None:
    batches = (_odd_batch(step, rank, world_size) for step in range(3))
    train(forward, torch.optim.AdamW(model.parameters(), lr=1e-2), batches)


def two_rank_checks(rank: int, world_size: int, root: str) -> dict:
    report: dict = {"odd_shapes": {}}
    for stage, compiled in [(0, True), (1, True), (2, True), (3, True), (3, False)]:
        torch._dynamo.reset()
        model = _odd_shapes_differing_by_rank(rank)
        zc.shard(model, stage=stage)
        report["odd_shapes"][(stage, compiled)] = {"buffers": (model.calls.item(), model.use_offset.item())}
        forward = torch.compile(model, backend="zero", options=EAGER) if compiled else model
        _train_odd(forward, model, rank, world_size)
        reference = nn.parallel.DistributedDataParallel(_odd_shapes_differing_by_rank(rank))
        _train_odd(reference, reference, rank, world_size)
        full = zc.full_state_dict(model, rank0_only=False)
        expected = reference.module.state_dict()
        report["odd_shapes"][(stage, compiled)]["error"] = max(
            (full[k].double() - v.double()).abs().max().item() for k, v in expected.items() if v.numel()
        )
        report["odd_shapes"][(stage, compiled)]["shapes"] = {k: tuple(v.shape) for k, v in full.items()}

    # .data replaced on every rank: the next optimizer step says so, before it changes anything (the
    # compiled graph reads the shard, which the replacement cut loose from). A DTensor keeps its
    # local rows through `.data = full` of the same shape, as FSDP2's do: docs/limits.md.
    torch._dynamo.reset()
    model = zc.shard(UnevenMLP(), stage=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="zero", options=EAGER)
    compiled(torch.randn(2, 7)).backward()
    model.fc2._parameters["weight"].data = torch.randn(13, 11)
    report["data_replaced"] = raised(optimizer.step)

    # A 2-rank checkpoint missing one rank's file, damaged on one rank's share of the hashing, or
    # truncated: both ranks raise (agreed before any collective), neither hangs.
    torch.manual_seed(0)
    model = zc.shard(UnevenMLP(), stage=3)
    zc.save(Path(root, "ckpt"), model, step=1)
    dist.barrier()
    if rank == 0:
        for name, damage in [("file_deleted", _delete_rank1_state), ("byte_flipped", _flip_rank1_state_byte)]:
            shutil.copytree(Path(root, "ckpt"), Path(root, name))
            damage(Path(root, name))
    dist.barrier()
    for name in ("file_deleted", "byte_flipped"):
        report[name] = raised(lambda: zc.load(Path(root, name), zc.shard(UnevenMLP(), stage=3)))
    return report


def _rank1_state_file(directory: Path) -> Path:
    (path,) = (directory / "state").glob("shard-00002-*.safetensors")
    return path


def _delete_rank1_state(directory: Path) -> None:
    _rank1_state_file(directory).unlink()


def _flip_rank1_state_byte(directory: Path) -> None:
    path = _rank1_state_file(directory)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # inside the last tensor's values: the header still parses
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("bad-input")
    return run_on_ranks(2, two_rank_checks, str(root), timeout=600), root


@pytest.mark.parametrize("stage,compiled", [(0, True), (1, True), (2, True), (3, True), (3, False)])
def test_0d_empty_and_tiny_parameters_train_like_ddp(two_ranks, stage: int, compiled: bool) -> None:
    for report in two_ranks[0]:
        outcome = report["odd_shapes"][(stage, compiled)]
        assert outcome["error"] <= 1e-6, outcome
        assert outcome["shapes"]["scale"] == () and outcome["shapes"]["empty"] == (0, 3)


def test_integer_and_bool_buffers_are_broadcast_from_rank_0(two_ranks) -> None:
    for report in two_ranks[0]:
        assert {o["buffers"] for o in report["odd_shapes"].values()} == {(7, True)}


def test_data_replaced_after_shard_fails_at_the_next_step(two_ranks) -> None:
    for report in two_ranks[0]:
        message = report["data_replaced"]
        assert "parameter 'fc2.weight' holds a tensor of shape (13, 11)" in message, message
        # 11 rows of 13 over 2 ranks: 6 rows each
        assert "sharded to (78,)" in message and "stage 3" in message and "before it" in message, message


@pytest.mark.parametrize("damage", ("file_deleted", "byte_flipped"))
def test_damage_on_one_ranks_file_fails_on_every_rank(two_ranks, damage: str) -> None:
    reports, root = two_ranks
    file = str(_rank1_state_file(root / "ckpt").name)
    for report in reports:
        assert "CheckpointError" in report[damage] or "failed, so this rank stops too" in report[damage], report[damage]
        assert file in report[damage] and "the checkpoint is damaged" in report[damage], report[damage]


def test_a_2_rank_checkpoint_loads_on_1_rank_at_stage_3(two_ranks, single_rank) -> None:
    """Another world size is DCP's resharding: 1 rank reads both ranks' files."""
    _reports, root = two_ranks
    model = zc.shard(UnevenMLP(), stage=3)
    assert zc.load(root / "ckpt", model) == {"step": 1}
    torch.manual_seed(0)
    assert all(torch.equal(zc.full_state_dict(model)[k], v) for k, v in UnevenMLP().state_dict().items())


# ---------------------------------------------------------------------------------------------
# Parameters shard() cannot take: an error naming the parameter and the fix, before any collective


class ComplexScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.phase = nn.Parameter(torch.randn(3, dtype=torch.complex64))


def _sparse_weight() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 2))
    model[0].weight = nn.Parameter(torch.randn(2, 3).to_sparse())
    return model


def _fully_sharded() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(nn.Sequential(nn.Linear(3, 2)))


def _ddp_inside() -> nn.Module:
    return nn.Sequential(nn.parallel.DistributedDataParallel(nn.Linear(3, 2)), nn.ReLU())


@pytest.mark.parametrize(
    "build,expected",
    [
        (lambda: nn.Sequential(nn.Embedding(10, 4, sparse=True)), r"module '0' \(Embedding\) has sparse=True.*sparse=False"),
        (_sparse_weight, r"parameter '0.weight' is a torch.sparse_coo tensor.*to_dense\(\)"),
        (ComplexScale, r"parameter 'phase' is complex \(torch.complex64\).*view_as_real"),
        (_fully_sharded, r"the model is already sharded by FSDP.*without FSDP/fully_shard"),
        (_ddp_inside, r"submodule '0' is wrapped in DistributedDataParallel.*stage=0"),
        (lambda: nn.parallel.DistributedDataParallel(nn.Linear(3, 2)), r"not a DistributedDataParallel wrapper: pass model.module"),
    ],
    ids=["sparse_embedding", "sparse_parameter", "complex", "fsdp2", "ddp_inside", "ddp"],
)
def test_unshardable_parameters_are_refused_naming_the_fix(single_rank, build, expected: str) -> None:
    model = build()
    with pytest.raises((TypeError, ValueError), match=expected):
        zc.shard(model, stage=3)
    assert getattr(model, "_zero_config", None) is None


_BAD_BUDGET = r"memory_budget must be None or a number of bytes >= 0 \(gathered parameters kept for the backward at stage 3\), got "


@pytest.mark.parametrize(
    "stage, budget, expected",
    [
        (3, -1, _BAD_BUDGET + "-1"),
        (3, 1.5e6, _BAD_BUDGET + r"1500000\.0"),
        (3, True, _BAD_BUDGET + "True"),
        (2, 2**20, r"memory_budget applies to stage 3 only .*got stage 2: leave memory_budget=None or use stage=3"),
    ],
)
def test_a_bad_memory_budget_is_refused_before_anything_changes(single_rank, stage: int, budget, expected: str) -> None:
    model = UnevenMLP()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=expected):
        zc.shard(model, stage=stage, memory_budget=budget)
    assert getattr(model, "_zero_config", None) is None and not any(hasattr(p, "_zero") for p in model.parameters())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    # As a compile option (memory_budget is a compile-time setting) it fails at the compile.
    compiled = torch.compile(zc.shard(UnevenMLP(), stage=stage), backend="zero", options={"memory_budget": budget, **EAGER})
    with pytest.raises(Exception, match=expected):
        compiled(torch.randn(2, 7))


# ---------------------------------------------------------------------------------------------
# A model changed after shard(): refused where it happens, or at the next use


def _sharded_mlp(stage: int = 3) -> tuple[nn.Module, Callable, torch.optim.Optimizer]:
    model = zc.shard(UnevenMLP(), stage=stage)
    compiled = torch.compile(model, backend="zero", options=EAGER)
    optimizer = torch.optim.AdamW(model.parameters())
    compiled(torch.randn(2, 7)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, compiled, optimizer


def test_replacing_a_submodule_with_parameters_is_refused(single_rank) -> None:
    model, _compiled, _optimizer = _sharded_mlp()
    old = model.fc2
    with pytest.raises(RuntimeError, match=r"submodule 'fc2' of a sharded model was replaced after zerocompile.shard\(\).*before it"):
        model.fc2 = nn.Linear(13, 11)
    assert model.fc2 is old
    with pytest.raises(RuntimeError, match=r"submodule 'extra' of a sharded model was added"):
        model.add_module("extra", nn.Linear(2, 2))
    model.dropout = nn.Dropout()  # no parameters: nothing to shard, so allowed
    model.dropout = nn.Identity()


def test_new_or_replaced_parameters_are_refused(single_rank) -> None:
    model, _compiled, _optimizer = _sharded_mlp()
    with pytest.raises(RuntimeError, match=r"parameter 'fc1.weight' of a sharded model was given a new Parameter of shape \(13, 7\)"):
        model.fc1.weight = nn.Parameter(torch.randn(13, 7))
    with pytest.raises(RuntimeError, match=r"parameter 'fc3.gate' of a sharded model was given a new Parameter"):
        model.fc3.register_parameter("gate", nn.Parameter(torch.ones(1)))
    model.fc1.weight = model.fc1._parameters["weight"]  # the same object again changes nothing
    model(torch.randn(2, 7))
    model.fc3.bias = None  # torch runs no registration hook for None: the next use catches it
    with pytest.raises(RuntimeError, match=r"parameter 'fc3.bias' was removed after zerocompile.shard\(\)"):
        model(torch.randn(2, 7))


@pytest.mark.parametrize("stage", (0, 3))
def test_data_replaced_after_shard_fails_at_the_next_forward_or_step(single_rank, stage: int) -> None:
    model, compiled, optimizer = _sharded_mlp(stage)
    sharded = "(13, 7)" if stage == 0 else "(91,)"  # one rank: all 13 rows of 7
    weight = model.fc1._parameters["weight"]
    weight.data = torch.randn(5, 5)
    expected = rf"parameter 'fc1.weight' holds a tensor of shape \(5, 5\), but at stage {stage} it is sharded to {re.escape(sharded)}"
    with pytest.raises(RuntimeError, match=expected):
        model(torch.randn(2, 7))
    if stage == 0:  # at stage 3 the compiled graph reads the shard, which the replacement cut loose from
        with pytest.raises(RuntimeError, match=expected):
            compiled(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match=expected):
        optimizer.step()
    # Written directly into the dict, the registration hook never ran: the module property catches it.
    model.fc2._parameters["weight"] = nn.Parameter(torch.randn(11, 13))
    with pytest.raises(RuntimeError, match=r"parameter 'fc2.weight' was replaced after zerocompile.shard\(\) by a new Parameter of shape \(11, 13\)"):
        model.fc2.weight


def test_parameter_replaced_in_the_dict_by_one_of_its_shape_is_refused_at_the_next_eager_use(single_rank) -> None:
    """Written into `_parameters` directly (no registration hook runs), a DTensor of the same shape
    is caught by the module property's identity test; compiled code reads the shards, not the dict
    (docs/limits.md)."""
    model, _compiled, _optimizer = _sharded_mlp()
    held = model.fc2._parameters["weight"]
    model.fc2._parameters["weight"] = nn.Parameter(torch.zeros_like(held))
    with pytest.raises(RuntimeError, match=r"parameter 'fc2.weight' was replaced after zerocompile.shard\(\)"):
        model(torch.randn(2, 7))


def test_gathered_still_allows_full_parameters_and_reports_replacement_itself(single_rank) -> None:
    """Inside gathered() parameters are full by design; its own exit check names replacements."""
    model, compiled, optimizer = _sharded_mlp()
    with zc.gathered(model) as full, torch.no_grad():
        full.fc1.weight.fill_(0.25)
    assert zc.full_state_dict(model)["fc1.weight"].unique().tolist() == [0.25]
    with pytest.raises(RuntimeError, match="'fc1.weight' was replaced"):
        with zc.gathered(model) as full:
            full.fc1.weight = nn.Parameter(torch.zeros(13, 7))
    compiled(torch.randn(2, 7)).backward()
    optimizer.step()


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: a clear error naming the file, model and optimizer left as they were


def _truncate_state(directory: Path) -> Path:
    (path,) = (directory / "state").glob("*.safetensors")
    os.truncate(path, path.stat().st_size // 2)
    return path


def _corrupt_state_values(directory: Path) -> Path:
    (path,) = (directory / "state").glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a value's bits; sizes and header intact
    path.write_bytes(bytes(data))
    return path


def _corrupt_state_header(directory: Path) -> Path:
    (path,) = (directory / "state").glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[12] = ord("}")
    path.write_bytes(bytes(data))
    return path


def _truncate_metadata(directory: Path) -> Path:
    path = directory / "zerocompile.json"
    os.truncate(path, path.stat().st_size // 2)
    return path


def _drop_metadata_field(directory: Path) -> Path:
    import json

    path = directory / "zerocompile.json"
    metadata = json.loads(path.read_text())
    del metadata["params"]
    path.write_text(json.dumps(metadata))
    return path


def _delete_metadata(directory: Path) -> Path:
    (directory / "zerocompile.json").unlink()
    return directory


def _delete_state(directory: Path) -> Path:
    (path,) = (directory / "state").glob("*.safetensors")
    path.unlink()
    return path


def _delete_extra(directory: Path) -> Path:
    path = directory / "extra" / "rank0.safetensors"
    path.unlink()
    return path


def _truncate_extra(directory: Path) -> Path:
    path = directory / "extra" / "rank0.safetensors"
    os.truncate(path, 20)
    return path


DAMAGES = [
    _truncate_state, _corrupt_state_values, _corrupt_state_header, _truncate_metadata,
    _drop_metadata_field, _delete_metadata, _delete_state, _delete_extra, _truncate_extra,
]


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.__name__.strip("_") for d in DAMAGES])
def test_damaged_checkpoint_fails_naming_the_file_and_changes_nothing(single_rank, tmp_path: Path, damage) -> None:
    torch.manual_seed(0)
    model, _compiled, optimizer = _sharded_mlp()
    zc.save(tmp_path / "ckpt", model, optimizer, step=1)
    named = damage(tmp_path / "ckpt")

    torch._dynamo.reset()
    torch.manual_seed(1)
    other, _compiled, other_optimizer = _sharded_mlp()
    before = [p.detach().clone() for p in other.parameters()]
    state_before = {k: v.clone() for k, v in other_optimizer.state[other.fc1._parameters["weight"]].items()}
    with pytest.raises(CheckpointError) as error:
        zc.load(tmp_path / "ckpt", other, other_optimizer)
    message = str(error.value)
    assert named.name in message and "the checkpoint is damaged" in message, message
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    state_after = other_optimizer.state[other.fc1._parameters["weight"]]
    assert all(torch.equal(state_before[k], state_after[k]) for k in state_before)


def test_a_sound_checkpoint_still_loads_after_the_damage_checks(single_rank, tmp_path: Path) -> None:
    """The checks refuse damage, not checkpoints: the control for the test above."""
    torch.manual_seed(0)
    model, _compiled, optimizer = _sharded_mlp()
    zc.save(tmp_path / "ckpt", model, optimizer, step=1)
    torch._dynamo.reset()
    other, _compiled, other_optimizer = _sharded_mlp()
    assert zc.load(tmp_path / "ckpt", other, other_optimizer) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
