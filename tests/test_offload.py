"""Offloaded optimizer state (zerocompile.offload): the same training, bit for bit, with the state
in a file that the process does not keep mapped between steps (`offload="disk"`), or in host memory
with the update on host copies of the shards (`offload="cpu"`; on these CPU parameters the copies
are CPU to CPU, the code the same as on an accelerator).

Each case trains tests/matrix_optimizers.py's MuonGPT (a tied embedding, matrices whose shards end
mid-row, a 1x3 with fewer elements than ranks) for 5 steps at N = 2, in memory, on disk and in host
memory, from the same seed and batches, and compares every parameter shard and every state tensor
with torch.equal: the offloaded step runs the optimizer's own code on the same values, so nothing
may differ. The step buckets are made small (4 KiB of state) so that every step runs in many
buckets, as a large model's does. After each step no page of the file may be resident in the rank
(/proc/self/smaps): the state went back to the disk, not to memory.

Bad input (one rank): no optimizer, a missing directory, a full disk (a 64 KiB tmpfs in a mount
namespace of the test's own; and a file size limit, where namespaces are not allowed), a learning-rate scheduler built before
`shard()`, an optimizer built after it: each a clear error, raised before the model changed.

Checkpoints: a run saved at N = 2, stage 3 with its state on disk loads at N = 4 stage 2 and N = 2
stage 1, again on disk and in host memory, and trains on exactly as the same sequence in memory
does; `zc.load` reads the state straight into the store (nothing left resident from the file), and
torch's `load_state_dict` moves what it installs back into the file.
"""

from __future__ import annotations

import gc
import json
import re
import resource
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest
import torch
from torch import nn

import zerocompile as zc
import zerocompile.offload
import zerocompile.offload_files
import zerocompile.optim
import zerocompile.sharding
from matrix_optimizers import STEPS, MuonGPT, train_step
from models import global_batch
from ranks import run_cases, run_on_ranks
from zerocompile.dtensor_parameters import flat_state
from zerocompile.sharded_parameters import shard_of_parameter

# The step's mechanics lean on torch.optim's internals (the hooked step, the state's layout): the
# core tier runs them on every supported torch.
pytestmark = pytest.mark.core

SMALL_BUCKETS = 4096


def _optimizers(kind: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers of a case, built on the model before shard() (offload needs them there)."""
    params = list(model.parameters())
    if kind == "adamw":
        return [torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)]
    if kind == "sgd":  # plain SGD with momentum: a wrong scale of the state moves it
        return [torch.optim.SGD(params, lr=0.1, momentum=0.9)]
    if kind == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-2)]
    hidden = [p for name, p in model.named_parameters() if p.dim() == 2 and not name.startswith(("gpt.wte", "gpt.wpe"))]
    rest = [p for p in params if all(p is not h for h in hidden)]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]


def resident_bytes(path: Path) -> int:
    """Bytes of `path`'s mapping resident in this process (/proc/self/smaps' Rss)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    total, inside = 0, False
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = line.endswith(str(path))
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def _train(rank: int, world_size: int, kind: str, stage: int, settings: dict) -> dict:
    torch.manual_seed(0)
    model = MuonGPT(side_dtype=settings.get("param_dtype", torch.float32))
    optimizers = _optimizers(kind, model)
    zc.shard(model, stage=stage, optimizer=optimizers, compiler="eager", **settings)
    compiled = torch.compile(model, backend="zero")
    resident = []
    for step in range(STEPS):
        train_step(compiled, model, optimizers, step, rank, world_size, "plain", None)
        if settings.get("offload") == "disk":
            resident.append(sum(resident_bytes(zerocompile.offload.offloaded_state(o).path) for o in optimizers))
    names = {p: n for n, p in model.named_parameters()}
    states = {
        f"{names[p]}.{key}": value.clone()
        for optimizer in optimizers
        for p, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }
    held = zc.model_state_bytes(model, optimizers)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        # The weights at full precision: the store's masters where it keeps them (offload_masters).
        "precise": {n: zerocompile.offload.full_precision(p).clone() for n, p in model.named_parameters()},
        "full": zc.full_state_dict(model, rank0_only=False),
        "states": states, "resident": resident, "held": held,
    }  # fmt: skip


CASES = [("adamw", 1), ("adamw", 2), ("adamw", 3), ("muon", 1), ("muon", 2), ("muon", 3), ("adafactor", 3), ("sgd", 2)]


def _differing_states(in_memory: dict, offloaded: dict) -> list[str]:
    return sorted(k for k, v in in_memory["states"].items() if not torch.equal(v, offloaded["states"].get(k, torch.empty(0))))


def _parameter_differences(in_memory: dict, offloaded: dict) -> dict:
    return {
        "params_differ": sorted(n for n, p in in_memory["params"].items() if not torch.equal(p, offloaded["params"][n])),
        "states_differ": _differing_states(in_memory, offloaded),
    }


def _compare(rank: int, world_size: int, directory: str, cases: list, base: dict, differences: Callable = _parameter_differences) -> dict:
    """Each case trained in memory, on disk and in host memory with `base`'s settings: what
    `differences` finds between the in-memory run and each offloaded one, and their bytes."""

    def case(kind: str, stage: int) -> dict:
        in_memory = _train(rank, world_size, kind, stage, base)
        with mock.patch.object(zerocompile.offload, "STEP_BUCKET_BYTES", SMALL_BUCKETS):
            on_disk = _train(rank, world_size, kind, stage, {**base, "offload": "disk", "offload_dir": directory})
            on_host = _train(rank, world_size, kind, stage, {**base, "offload": "cpu"})
        return {
            "disk": differences(in_memory, on_disk),
            "host": differences(in_memory, on_host),
            "states": len(in_memory["states"]),
            "resident": on_disk["resident"],
            "held_in_memory": in_memory["held"],
            "held_on_disk": on_disk["held"],
            "held_on_host": on_host["held"],
        }

    return run_cases([((kind, stage), lambda kind=kind, stage=stage: case(kind, stage)) for kind, stage in cases])


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    return run_on_ranks(2, _compare, str(tmp_path_factory.mktemp("offload")), CASES, {})


@pytest.mark.parametrize("store", ["disk", "host"])
@pytest.mark.parametrize("kind, stage", CASES, ids=[f"{kind}-stage{stage}" for kind, stage in CASES])
def test_offloaded_state_trains_bit_for_bit_as_in_memory(reports, kind: str, stage: int, store: str) -> None:
    for rank, report in enumerate(reports):
        result = report[(kind, stage)]
        differ = result[store]
        assert result["states"] > 0
        assert not differ["params_differ"], f"rank {rank}: parameters differ from the in-memory run: {differ['params_differ']}"
        assert not differ["states_differ"], f"rank {rank}: optimizer state differs: {differ['states_differ']}"


@pytest.mark.parametrize("kind, stage", CASES, ids=[f"{kind}-stage{stage}" for kind, stage in CASES])
def test_no_state_stays_in_memory_between_steps(reports, kind: str, stage: int) -> None:
    for report in reports:
        result = report[(kind, stage)]
        assert result["resident"] == [0] * STEPS
        memory, disk = result["held_in_memory"], result["held_on_disk"]
        assert disk["optimizer_on_disk"] > 0
        # What stays in memory is what is not shaped like a parameter (Adafactor's row/column means).
        assert disk["optimizer"] + disk["optimizer_on_disk"] == memory["optimizer"]
        if kind != "adafactor":
            assert disk["optimizer"] == 0
        host = result["held_on_host"]
        assert host["optimizer_on_host"] == disk["optimizer_on_disk"] and host["optimizer"] == disk["optimizer"]


# Master weights in the store (offload_masters, the default): with param_dtype=bfloat16 the run in
# memory keeps fp32 shards and casts them for the compute; the offloaded run keeps bf16 shards in
# memory and the fp32 masters in the store. Gradients are reduced in bf16 in both (the default
# reduce_dtype) and land as the same values, so every master must equal the in-memory fp32 shard,
# every bf16 shard that shard rounded, and checkpoints must carry the masters both ways.
MASTER_CASES = [("adamw", 1), ("adamw", 3), ("muon", 2), ("muon", 3), ("sgd", 3)]
MIXED = {"param_dtype": torch.bfloat16}


def _master_differences(in_memory: dict, offloaded: dict) -> dict:
    return {
        "masters_differ": sorted(n for n, p in in_memory["precise"].items() if not torch.equal(p, offloaded["precise"][n])),
        "shards_differ": sorted(n for n, p in in_memory["params"].items() if not torch.equal(p.bfloat16(), offloaded["params"][n])),
        "full_differ": sorted(n for n, t in in_memory["full"].items() if not torch.equal(t, offloaded["full"][n])),
        "states_differ": _differing_states(in_memory, offloaded),
    }


@pytest.fixture(scope="module")
def master_reports(tmp_path_factory) -> list[dict]:
    return run_on_ranks(2, _compare, str(tmp_path_factory.mktemp("offload-masters")), MASTER_CASES, MIXED, _master_differences)


@pytest.mark.parametrize("store", ["disk", "host"])
@pytest.mark.parametrize("kind, stage", MASTER_CASES, ids=[f"{kind}-stage{stage}" for kind, stage in MASTER_CASES])
def test_offloaded_masters_train_bit_for_bit_as_fp32_shards_in_memory(master_reports, kind: str, stage: int, store: str) -> None:
    for rank, report in enumerate(master_reports):
        result = report[(kind, stage)]
        differ, memory, held = result[store], result["held_in_memory"], result[f"held_on_{store}"]
        assert not differ["masters_differ"], f"rank {rank}: masters differ from the in-memory fp32 shards: {differ['masters_differ']}"
        assert not differ["shards_differ"], f"rank {rank}: bf16 shards are not the masters rounded: {differ['shards_differ']}"
        assert not differ["full_differ"], f"rank {rank}: full_state_dict differs: {differ['full_differ']}"
        assert not differ["states_differ"], f"rank {rank}: optimizer state differs: {differ['states_differ']}"
        assert store == "host" or result["resident"] == [0] * STEPS, "masters stayed mapped in memory between steps"
        # Half the parameter bytes stay in memory; the store holds the state and the fp32 masters.
        assert held["params"] * 2 == memory["params"]
        stored = held["optimizer_on_disk" if store == "disk" else "optimizer_on_host"]
        assert stored + held["optimizer"] == memory["optimizer"] + memory["params"]


def _masters_through_checkpoints(rank: int, world_size: int, root: str) -> dict:
    """A run with its masters on disk saves after 3 steps; an in-memory run loads it, and a run
    with masters on disk loads the in-memory run's checkpoint: both go on as the saving run."""
    def trained(settings: dict, seed: int = 0, load: str | None = None, steps: range = range(3)):
        torch.manual_seed(seed)
        model = MuonGPT(side_dtype=torch.bfloat16)
        optimizers = _optimizers("adamw", model)
        zc.shard(model, stage=3, optimizer=optimizers, compiler="eager", **MIXED, **settings)
        if load is not None:
            zc.load(load, model, optimizers)
        compiled = torch.compile(model, backend="zero")
        for step in steps:
            train_step(compiled, model, optimizers, step, rank, world_size, "plain", None)
        return model, optimizers

    on_disk = {"offload": "disk", "offload_dir": root}
    saved = {}
    for name, settings in (("memory", {}), ("disk", on_disk)):
        model, optimizers = trained(settings)
        zc.save(f"{root}/{name}", model, optimizers)
        saved[name] = zc.full_state_dict(model, rank0_only=False)
    later = {}
    for name, settings, source in (("memory", {}, "disk"), ("disk", on_disk, "memory")):
        model, optimizers = trained(settings, seed=1, load=f"{root}/{source}", steps=range(3, 5))
        later[name] = zc.full_state_dict(model, rank0_only=False)
    return {
        "saved_differ": sorted(n for n, t in saved["memory"].items() if not torch.equal(t, saved["disk"][n])),
        "later_differ": sorted(n for n, t in later["memory"].items() if not torch.equal(t, later["disk"][n])),
        "dtypes": sorted({str(t.dtype) for t in later["disk"].values()}),
    }


def test_offloaded_masters_go_through_checkpoints_at_full_precision(tmp_path) -> None:
    for rank, report in enumerate(run_on_ranks(2, _masters_through_checkpoints, str(tmp_path))):
        assert report["saved_differ"] == [], f"rank {rank}: the checkpoint of the run with masters on disk differs"
        assert report["later_differ"] == [], f"rank {rank}: after loading across the two, the runs part"
        assert report["dtypes"] == ["torch.float32"]


# zc.save -> zc.load across world sizes and stages: the same sequence in memory, on disk and in host memory.
SAVED_AT = (2, 3)  # world size, stage of the saving run
LOADED_AT = [(4, 2), (2, 1)]  # and of the loading runs


def _save_after_steps(rank: int, world_size: int, root: str) -> None:
    for offload in (False, True):
        torch.manual_seed(0)
        model = MuonGPT()
        optimizers = _optimizers("muon", model)
        settings = {"offload": "disk", "offload_dir": root} if offload else {}
        zc.shard(model, stage=SAVED_AT[1], optimizer=optimizers, compiler="eager", **settings)
        compiled = torch.compile(model, backend="zero")
        for step in range(3):
            train_step(compiled, model, optimizers, step, rank, world_size, "plain", None)
        zc.save(f"{root}/checkpoint-{offload}", model, optimizers)


def _load_and_step(rank: int, world_size: int, root: str, stage: int) -> dict:
    results = {}
    # The offloaded runs (on disk, and in host memory) load the checkpoint saved with its state on disk.
    for store, settings in [("memory", {}), ("disk", {"offload": "disk", "offload_dir": root}), ("host", {"offload": "cpu"})]:
        torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
        model = MuonGPT()
        optimizers = _optimizers("muon", model)
        zc.shard(model, stage=stage, optimizer=optimizers, compiler="eager", **settings)
        zc.load(f"{root}/checkpoint-{bool(settings)}", model, optimizers)
        stores = [zerocompile.offload.offloaded_state(o) for o in optimizers] if settings else []
        resident = sum(resident_bytes(s.path) for s in stores) if store == "disk" else 0
        not_in_store = [
            f"{key} of {tuple(p.shape)}"
            for o, s in zip(optimizers, stores)
            for p, st in flat_state(o).items()
            for key in s.regions[p]
            if st[key] is not s.view(p, key)
        ]  # fmt: skip
        compiled = torch.compile(model, backend="zero")
        for step in range(3, 5):
            train_step(compiled, model, optimizers, step, rank, world_size, "plain", None)
        # Plain tensors (the shards, the state the step sees) travel back: a DTensor compared in
        # the test's process would reduce over a group that is not there.
        names = {shard_of_parameter(p): n for n, p in model.named_parameters()}
        results[store] = {
            "params": {n: shard_of_parameter(p).detach().clone() for n, p in model.named_parameters()},
            "states": {f"{names[p]}.{k}": v.clone() for o in optimizers for p, st in flat_state(o).items() for k, v in st.items() if isinstance(v, torch.Tensor)},
            "resident_after_load": resident,
            "loaded_outside_the_store": not_in_store,
        }
    return results


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory) -> dict[tuple[int, int], list[dict]]:
    root = str(tmp_path_factory.mktemp("offload-checkpoints"))
    run_on_ranks(SAVED_AT[0], _save_after_steps, root)
    return {(n, stage): run_on_ranks(n, _load_and_step, root, stage) for n, stage in LOADED_AT}


@pytest.mark.parametrize("store", ["disk", "host"])
@pytest.mark.parametrize("world_size, stage", LOADED_AT, ids=[f"N{n}-stage{s}" for n, s in LOADED_AT])
def test_saved_and_loaded_offloaded_state_trains_as_in_memory(reloaded, world_size: int, stage: int, store: str) -> None:
    for rank, result in enumerate(reloaded[(world_size, stage)]):
        memory, offloaded = result["memory"], result[store]
        assert [n for n, p in memory["params"].items() if not torch.equal(p, offloaded["params"][n])] == [], f"rank {rank}"
        assert sorted(memory["states"]) == sorted(offloaded["states"])
        assert [k for k, v in memory["states"].items() if not torch.equal(v, offloaded["states"][k])] == [], f"rank {rank}"
        assert offloaded["resident_after_load"] == 0
        assert offloaded["loaded_outside_the_store"] == []


def test_load_state_dict_puts_the_state_back_on_disk(single_rank, tmp_path) -> None:
    model, optimizer = _model_and_adamw()
    zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=str(tmp_path))
    model(global_batch("tied_gpt", 0)).backward()
    optimizer.step()
    saved = optimizer.state_dict()  # its tensors are the file's: copied, as torch.save would
    saved["state"] = {k: {n: v.clone() for n, v in st.items()} for k, st in saved["state"].items()}
    expected = {id(p): {k: v.clone() for k, v in st.items()} for p, st in flat_state(optimizer).items()}
    disk = zerocompile.offload.offloaded_state(optimizer)
    for state in optimizer.state.values():
        state["exp_avg"].zero_()
    optimizer.load_state_dict(saved)
    assert resident_bytes(disk.path) == 0
    # Users' state shows DTensor views; the tensors behind them (what the step sees) are the file's.
    for param, state in flat_state(optimizer).items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key] is disk.view(param, key), f"{key} left in memory"
            assert torch.equal(state[key], expected[id(param)][key])


def _one_rank_without_its_directory(rank: int, world_size: int, root: str) -> str:
    model, optimizer = _model_and_adamw()
    directory = root if rank == 0 else f"{root}/absent"
    try:
        zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=directory)
    except Exception as error:
        assert _unchanged(model)
        return f"{type(error).__name__}: {error}"
    return "sharded"


def test_a_rank_that_cannot_reserve_stops_every_rank(tmp_path) -> None:
    """Not a hang: the others would wait in shard()'s broadcasts for the rank that gave up."""
    outcomes = run_on_ranks(2, _one_rank_without_its_directory, str(tmp_path), timeout=300)
    assert outcomes[1].startswith("FileNotFoundError: offload_dir") and "is not a directory" in outcomes[1]
    assert outcomes[0].startswith("RuntimeError: rank 1 failed, so this rank stops too: FileNotFoundError: offload_dir")
    assert not list(tmp_path.rglob("*.state"))


# Bad input, on one rank: a clear error before the model changed, and no file left behind.


def _model_and_adamw() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MuonGPT()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _unchanged(model: nn.Module) -> bool:
    return not hasattr(model, "_zero_config") and model.gpt.wte.weight.dim() == 2


def _our_directories(directory: Path) -> list[Path]:
    return list(directory.glob("zerocompile-offload-*"))


def test_offload_needs_the_optimizer(single_rank, tmp_path) -> None:
    model, _optimizer = _model_and_adamw()
    with pytest.raises(ValueError, match=r"pass it, zerocompile.shard\(model, ..., optimizer=optimizer\)"):
        zc.shard(model, stage=3, offload="disk", offload_dir=str(tmp_path))
    assert _unchanged(model) and not _our_directories(tmp_path)


def test_offload_dir_must_exist(single_rank, tmp_path) -> None:
    model, optimizer = _model_and_adamw()
    with pytest.raises(FileNotFoundError, match="is not a directory: create it"):
        zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=str(tmp_path / "absent"))
    assert _unchanged(model)


def test_a_disk_too_small_is_refused_before_anything_changes(single_rank, tmp_path) -> None:
    model, optimizer = _model_and_adamw()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel signals a file past the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limit[1]))
    try:
        with pytest.raises(OSError, match=r"needs [\d,]+ bytes in .* could not reserve them .* free space there or choose another offload_dir"):
            zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, ignored)
    assert _unchanged(model)
    assert not list(tmp_path.rglob("*.state"))


FULL_DISK_CHILD = """
import json, sys, warnings
import torch, zerocompile as zc
sys.path.insert(0, sys.argv[2])
from matrix_optimizers import MuonGPT
zc.init_distributed()
model = MuonGPT()
optimizer = torch.optim.AdamW(model.parameters())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=sys.argv[1])
        error = None
    except OSError as raised:
        error = str(raised)
print(json.dumps({"error": error, "warnings": [str(w.message) for w in caught],
                  "unchanged": not hasattr(model, "_zero_config") and model.gpt.wte.weight.dim() == 2}))
"""


def test_a_full_file_system_is_refused_before_anything_changes(tmp_path) -> None:
    """A 64 KiB tmpfs, mounted in a mount namespace of the test's own (nothing outside it sees it)."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user and mount namespaces here (unshare -rm): the file-size-limit test stands in")
    mount = tmp_path / "small"
    mount.mkdir()
    child = f"mount -t tmpfs -o size=64k tmpfs {mount} && exec {sys.executable} -c \"$0\" {mount} {Path(__file__).parent}"
    finished = subprocess.run(["unshare", "-rm", "sh", "-c", child, FULL_DISK_CHILD], capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    assert result["error"] is not None and "No space left on device" in result["error"]
    assert re.search(r"needs [\d,]+ bytes in .* \d[\d,]* bytes free\): free space there or choose another offload_dir", result["error"])
    assert any("is on tmpfs, which keeps files in memory" in w for w in result["warnings"])
    assert result["unchanged"]


def test_a_scheduler_built_before_shard_is_refused(single_rank, tmp_path) -> None:
    model, optimizer = _model_and_adamw()
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with pytest.raises(ValueError, match=r"build the LR scheduler after shard\(\)"):
        zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=str(tmp_path))
    assert _unchanged(model)


def test_an_optimizer_not_passed_to_shard_is_refused_at_its_step(single_rank, tmp_path) -> None:
    model, optimizer = _model_and_adamw()
    zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=str(tmp_path))
    later = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(global_batch("tied_gpt", 0)).backward()
    before = model.gpt.wte.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"keeps its state in memory: it was not passed to shard\(\)"):
        later.step()
    assert torch.equal(model.gpt.wte.weight, before)


def test_a_failed_write_back_stops_the_next_step_before_it_changes_anything(single_rank, tmp_path) -> None:
    model, optimizer = _model_and_adamw()
    zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=str(tmp_path))
    model(global_batch("tied_gpt", 0)).backward()
    optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    states = [v.clone() for st in optimizer.state.values() for v in st.values()]
    with mock.patch.object(zerocompile.offload.os, "fdatasync", side_effect=OSError(5, "Input/output error")):
        with pytest.raises(RuntimeError, match=r"could not be written to .* \(Input/output error\).*Restart from the last checkpoint"):
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(states, [v for st in optimizer.state.values() for v in st.values()]))


def test_the_file_goes_with_the_optimizer_and_leftovers_of_dead_processes_are_removed(single_rank, tmp_path) -> None:
    dead = tmp_path / f"zerocompile-offload-{socket.gethostname()}-{2**22 + 7}-123"  # no such pid
    dead.mkdir()
    (dead / "optimizer-x.state").write_bytes(b"\0" * 4096)
    model, optimizer = _model_and_adamw()
    with pytest.warns(UserWarning, match=r"removed .* \(4,096 bytes\), left by process 4194311") as caught:
        zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=str(tmp_path))
    # Attributed to the line that called shard(), not to one of zerocompile's helpers.
    assert {w.filename for w in caught if "left by process" in str(w.message)} == {__file__}
    assert not dead.exists()
    path = zerocompile.offload.offloaded_state(optimizer).path
    assert path.is_file() and path.stat().st_size > 0
    del optimizer
    gc.collect()
    assert not path.exists() and not _our_directories(tmp_path)


def test_memory_backed_directory_gets_a_warning(single_rank, tmp_path, monkeypatch) -> None:
    """The warning, attributed to the shard() call, for a directory the mount table calls tmpfs
    (made so here: a real tmpfs needs /dev/shm or a mount namespace, which the full-disk test uses
    where it may); the mount table itself is read in the next test."""
    real = zerocompile.offload_files.file_system
    monkeypatch.setattr(zerocompile.offload_files, "file_system", lambda d: "tmpfs" if d == tmp_path else real(d))
    model, optimizer = _model_and_adamw()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=str(tmp_path))
    assert [w.filename for w in caught if "is on tmpfs, which keeps files in memory" in str(w.message)] == [__file__]
    del optimizer
    gc.collect()


def test_the_file_system_is_read_from_the_mount_table() -> None:
    """/proc is procfs on every Linux host, and the deepest mount wins over / for paths under it."""
    assert zerocompile.offload_files.file_system(Path("/proc")) == "proc"
    assert zerocompile.offload_files.file_system(Path("/proc/self")) == "proc"
    assert zerocompile.offload_files.file_system(Path("/")) not in (None, "proc")


@pytest.mark.fast
@pytest.mark.parametrize(
    "settings, message",
    [
        ({"stage": 0, "offload": "disk", "offload_dir": "/tmp"}, "stage 0 does not shard it: use stage 1, 2 or 3"),
        ({"offload": "disk"}, "needs offload_dir"),
        ({"offload_dir": "/tmp"}, "only read with offload='disk'"),
        ({"offload": "nvme"}, r"offload must be one of \[None, 'disk', 'cpu'\]"),
        ({"stage": 0, "offload": "cpu"}, "stage 0 does not shard it: use stage 1, 2 or 3"),
        ({"offload": "cpu", "offload_dir": "/tmp"}, "only read with offload='disk'"),
    ],
)
def test_config_errors(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        zc.ZeroConfig(**settings)


def test_the_dump_says_what_the_file_holds_and_a_step_moves(single_rank, tmp_path) -> None:
    from zerocompile.tools import dump

    model, optimizer = _model_and_adamw()
    (tmp_path / "state").mkdir()
    zc.shard(model, stage=3, optimizer=optimizer, offload="disk", offload_dir=str(tmp_path / "state"), dump_dir=str(tmp_path / "dump"))
    model(global_batch("tied_gpt", 0)).backward()
    optimizer.step()
    (store,) = dump.load_offloads(str(tmp_path / "dump"))["rank0"].values()
    on_disk = zc.model_state_bytes(model, optimizer)["optimizer_on_disk"]
    assert (store["where"], store["state_bytes"], store["moved_bytes_per_step"]) == ("on disk", on_disk, 2 * on_disk)
    assert store["file"] == str(zerocompile.offload.offloaded_state(optimizer).path)


def test_offload_on_glibcs_malloc_warns_of_its_heap(single_rank, monkeypatch) -> None:
    """Offloading frees memory only to have glibc's heap keep each step's freed buffers (the 2.0B
    GPT of docs/results/2026-11-29-offload-capacity.md ran out of memory so): the warning names the
    fix; a process that applied it (MALLOC_MMAP_THRESHOLD_), or whose malloc is not glibc's (an
    allocator preloaded: heap.glibc_malloc_trim finds no glibc malloc, tested in test_heap), gets
    none. Which malloc this process has is set here for each case."""
    glibc = {"glibc": lambda: None, "preloaded": None}
    for malloc, threshold_set, warns in [("glibc", False, True), ("glibc", True, False), ("preloaded", False, False)]:
        monkeypatch.setattr(zerocompile.sharding, "glibc_malloc_trim", lambda malloc=malloc: glibc[malloc])
        if threshold_set:
            monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
        else:
            monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
        model, optimizer = _model_and_adamw()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zc.shard(model, stage=3, optimizer=optimizer, offload="cpu")
        warned = [w for w in caught if "glibc's malloc" in str(w.message)]
        assert len(warned) == int(warns), (malloc, threshold_set, [str(w.message) for w in warned])
        for warning in warned:
            assert warning.filename == __file__
            assert "MALLOC_MMAP_THRESHOLD_=65536" in str(warning.message) and "tcmalloc" in str(warning.message)


# Master weights in the store, one rank: what reads or writes the weights at full precision.


def _model_with_masters_on_host(**settings) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = _model_and_adamw()
    model.side_dtype = torch.bfloat16
    zc.shard(model, stage=3, optimizer=optimizer, offload="cpu", param_dtype=torch.bfloat16, **settings)
    return model, optimizer


def _a_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(global_batch("tied_gpt", 0)).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"reduce_dtype": torch.float32}, r"round the torch.float32 reductions reduce_dtype asks for: leave reduce_dtype unset"),
        ({"reduce_quant": "int8"}, r"round the fp32 sums of reduce_quant='int8': drop reduce_quant"),
    ],
)
def test_what_would_round_gradients_in_param_dtype_is_refused(single_rank, settings: dict, message: str) -> None:
    model, optimizer = _model_and_adamw()
    with pytest.raises(ValueError, match=message + r".*offload_masters=False"):
        zc.shard(model, stage=3, optimizer=optimizer, offload="cpu", param_dtype=torch.bfloat16, **settings)
    assert _unchanged(model) and model.gpt.wte.weight.dtype == torch.float32


def test_without_offload_masters_the_fp32_shards_stay_in_memory(single_rank) -> None:
    model, optimizer = _model_with_masters_on_host(offload_masters=False, reduce_dtype=torch.float32)
    store = zerocompile.offload.offloaded_state(optimizer)
    assert store.masters == {} and {p.dtype for p in model.parameters()} == {torch.float32}
    _a_step(model, optimizer)


def test_values_written_into_a_shard_become_its_master_with_a_warning(single_rank) -> None:
    model, optimizer = _model_with_masters_on_host()
    weight = model.gpt.wte._parameters["weight"]  # the DTensor parameter (the attribute gives the full tensor)
    assert weight.dtype == torch.bfloat16
    with torch.no_grad():
        weight.fill_(0.5)
    with pytest.warns(UserWarning, match=r"parameter 'gpt.wte.weight' was written outside .* rounded to torch.bfloat16"):
        full = zc.full_state_dict(model)
    assert torch.equal(full["gpt.wte.weight"], torch.full_like(full["gpt.wte.weight"], 0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # taken in once: the next reads and the step say nothing
        zc.full_state_dict(model)
        _a_step(model, optimizer)


def test_gathered_weights_files_and_ema_see_the_fp32_masters(single_rank, tmp_path) -> None:
    model, optimizer = _model_with_masters_on_host()
    ema = zc.EMA(model, decay=0.5)
    _a_step(model, optimizer)
    ema.update()
    masters = {n: zerocompile.offload.full_precision(p).clone() for n, p in model.named_parameters()}
    assert {m.dtype for m in masters.values()} == {torch.float32} and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # The masters hold values bf16 cannot: a reader of the shards would see them rounded.
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())
    assert {s.dtype for s in ema.shadow.values()} == {torch.float32}
    full = zc.full_state_dict(model)
    with zc.gathered(model):
        inside = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            model.mix.weight.add_(1e-3)  # a change bf16 would round away
    assert all(torch.equal(inside[n], full[n]) for n in inside)
    shard = shard_of_parameter(model.mix._parameters["weight"])
    assert torch.equal(zc.full_state_dict(model)["mix.weight"], full["mix.weight"] + 1e-3)
    assert torch.equal(shard.detach(), zerocompile.offload.full_precision(shard).bfloat16())
    zc.save_weights(model, tmp_path / "weights")
    fresh, fresh_optimizer = _model_with_masters_on_host()
    zc.load_weights(fresh, tmp_path / "weights")
    assert all(torch.equal(t, zc.full_state_dict(fresh)[n]) for n, t in zc.full_state_dict(model).items())
    assert all(torch.equal(shard_of_parameter(p), zerocompile.offload.full_precision(p).bfloat16()) for p in fresh.parameters())


def test_fp16_masters_refuse_the_grad_scaler(single_rank) -> None:
    model, optimizer = _model_and_adamw()
    model.side_dtype = torch.float16
    zc.shard(model, stage=3, optimizer=optimizer, offload="cpu", param_dtype=torch.float16)
    scaler = zc.ShardedGradScaler("cpu")
    scaler.scale(model(global_batch("tied_gpt", 0))).backward()
    before = zerocompile.offload.full_precision(model.mix.weight).clone()
    with pytest.raises(ValueError, match="unscaling them would underflow .* offload_masters=False"):
        scaler.step(optimizer)
    assert torch.equal(zerocompile.offload.full_precision(model.mix.weight), before)
