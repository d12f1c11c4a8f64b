"""load_weights / save_weights: full weights in Hugging Face's safetensors layout, to and from shards.

The files the error cases and the Hugging Face cases read are written here, in the test process,
from unsharded models. One spawned 2-rank run then does every sharded case and reports (shards
compared on the ranks, files written there compared here); a 4-rank run loads the 2-rank run's
files and writes its own. The ranks unmap freed tensors at once (MALLOC_MMAP_THRESHOLD_), so
their peak RSS follows live tensors.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

import zerocompile as zc
import zerocompile.weights as weights
from models import FrozenAndBuffer, GraphBreak, TiedGPT, UnevenMLP
from ranks import run_cases, run_on_ranks
from test_hf_models import build_model
from zerocompile.sharded_parameters import shard_info

pytestmark = pytest.mark.core

MODELS: dict[str, Callable[[], nn.Module]] = {"uneven_mlp": UnevenMLP, "tied_gpt": TiedGPT, "frozen_buffer": FrozenAndBuffer}
ROUND_TRIPS = [(name, saved, loaded) for name in MODELS for saved, loaded in ((0, 3), (3, 1))]
HF_MODELS = ("gpt2", "llama")
INDEX_BYTES = 30_000  # several files for TiedGPT (~140 kB) and the tiny HF models
BIG_LAYERS, BIG_WIDTH = 8, 2048  # 8 tensors of 16 MiB: holding them all is 128 MiB
RSS_SLACK = 64 * 2**20
HF_TOLERANCE = 1e-6


def _built(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def _expected_file(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict as save_pretrained stores it: tied names once, the first."""
    first: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        first.setdefault(id(tensor), name)
    state = model.state_dict()
    return {name: state[name] for name in first.values()}


def _held(model: nn.Module) -> dict[str, torch.Tensor]:
    """What this rank holds: each parameter's shard (padding included) and each buffer."""
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _scrambled(model: nn.Module) -> nn.Module:
    """Every value a load must overwrite, padding included, set to something it never holds."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(7.0)
    return model


# ---------------------------------------------------------------------------------------------
# The files read by the ranks, written here from unsharded models


def _write_error_cases(root: Path) -> None:
    """Damaged or mismatched weights for UnevenMLP. A wrong tensor comes last in the model's order,
    so a load that checked tensor by tensor would already have changed the others."""
    full = UnevenMLP().state_dict()
    cases = root / "errors"
    cases.mkdir()
    save_file({k: v for k, v in full.items() if k != "fc2.bias"}, cases / "missing.safetensors")
    save_file({**full, "extra.weight": torch.ones(2)}, cases / "unexpected.safetensors")
    save_file({**{k: v for k, v in full.items() if k != "fc2.bias"}, "extra.weight": torch.ones(2)}, cases / "both.safetensors")
    save_file({**full, "fc3.weight": torch.zeros(3, 12)}, cases / "wrong_shape.safetensors")
    torch.save(full, cases / "pytorch_model.bin")
    save_file(GraphBreak().state_dict(), cases / "another_model.safetensors")
    (cases / "empty").mkdir()
    for damage in ("truncated", "file_missing", "key_missing"):
        _write_index_directory(cases / damage, full)
    last = sorted((cases / "truncated").glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-4])
    sorted((cases / "file_missing").glob("model-*.safetensors"))[-1].unlink()
    index_path = cases / "key_missing" / weights.INDEX_FILE
    index = json.loads(index_path.read_text())
    index["weight_map"]["fc3.bias"] = index["weight_map"]["fc1.weight"]
    index_path.write_text(json.dumps(index))


def _write_index_directory(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """save_pretrained's sharded layout, one tensor per file."""
    directory.mkdir()
    files = {name: f"model-{i:05d}-of-{len(state):05d}.safetensors" for i, name in enumerate(state, 1)}
    for name, file in files.items():
        save_file({name: state[name]}, directory / file)
    (directory / weights.INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": files}))


ERRORS = {  # case: (path under errors/, strict, what the message must say)
    "missing": ("missing.safetensors", True, r"missing keys 'fc2\.bias'"),
    "unexpected": ("unexpected.safetensors", True, r"unexpected keys 'extra\.weight'"),
    "wrong_shape": ("wrong_shape.safetensors", True, r"'fc3\.weight' is \[3, 12\] in .*wrong_shape.safetensors but \[3, 11\]"),
    "wrong_shape_not_strict": ("wrong_shape.safetensors", False, r"'fc3\.weight' is \[3, 12\]"),
    "truncated": ("truncated", True, r"model-00006-of-00006\.safetensors is not a readable safetensors file"),
    "pickle": ("pytorch_model.bin", True, r"pytorch_model\.bin is not a readable safetensors file"),
    "file_missing": ("file_missing", True, r"places 'fc3\.bias' in model-00006-of-00006\.safetensors, which does not exist"),
    "key_missing": ("key_missing", True, r"places 'fc3\.bias' in .*model-00001-of-00006\.safetensors, which does not hold"),
    "another_model": ("another_model.safetensors", True, r"None of the model's tensors is in it: .*another model"),
    "no_weights": ("empty", True, r"holds neither model\.safetensors nor model\.safetensors\.index\.json"),
}


def _write_hf_models(root: Path) -> None:
    """save_pretrained of random tiny models: GPT-2 as one file, Llama as an index and its files."""
    for name in HF_MODELS:
        torch.manual_seed(0)
        model = build_model(name)
        model.save_pretrained(root / name, max_shard_size=INDEX_BYTES if name == "llama" else "5GB")


# ---------------------------------------------------------------------------------------------
# What the ranks do


class _CountingSlice:
    """A safetensors slice that counts the elements each read returns, and which tensors its
    file mapping has read."""

    def __init__(self, inner: Any, reads: list[int], name: str, mapping: set[str]) -> None:
        self.inner, self.reads, self.name, self.mapping = inner, reads, name, mapping

    def __getitem__(self, index: Any) -> torch.Tensor:
        values = self.inner[index]
        self.reads.append(values.numel())
        self.mapping.add(self.name)
        return values

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()


class _CountingOpen:
    """`safe_open` whose reads are counted: slices' reads and whole tensors alike."""

    reads: list[int] = []
    mappings: list[set[str]] = []  # per opened file: the tensors read through that one mapping

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = _REAL_SAFE_OPEN(*args, **kwargs)
        self.read_here: set[str] = set()
        self.mappings.append(self.read_here)

    def __enter__(self) -> _CountingOpen:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self.inner.get_slice(name), self.reads, name, self.read_here)

    def get_tensor(self, name: str) -> torch.Tensor:
        values = self.inner.get_tensor(name)
        self.reads.append(values.numel())
        self.read_here.add(name)
        return values


_REAL_SAFE_OPEN = weights.safe_open


def _round_trip(root: Path, name: str, saved: int, loaded: int) -> dict[str, Any]:
    """Save at stage `saved`, load into another random model at stage `loaded`: its shards must be
    exactly those of sharding the original at `loaded`."""
    path = root / f"{name}-stage{saved}.safetensors"
    zc.save_weights(zc.shard(_built(name, 0), stage=saved), path)
    model = _scrambled(zc.shard(_built(name, 1), stage=loaded))
    result = zc.load_weights(model, path)
    return {"file": str(path), "result": result, "shards_equal": _equal(_held(model), _held(zc.shard(_built(name, 0), stage=loaded)))}


def _index_round_trip(root: Path) -> dict[str, Any]:
    path = root / "tied_gpt-index"
    zc.save_weights(zc.shard(_built("tied_gpt", 0), stage=3), path, max_shard_size=INDEX_BYTES)
    listing = sorted(p.name for p in path.iterdir())
    model = _scrambled(zc.shard(_built("tied_gpt", 1), stage=2))
    zc.load_weights(model, path)
    return {"dir": str(path), "listing": listing, "shards_equal": _equal(_held(model), _held(zc.shard(_built("tied_gpt", 0), stage=2)))}


def _replacing_saves(root: Path) -> dict[str, list[str]]:
    """A save into a directory holding another save's files leaves only its own."""
    path = root / "replaced"
    listings = {}
    for kind, size in (("single", "5GB"), ("index", INDEX_BYTES), ("single_again", "5GB")):
        zc.save_weights(zc.shard(_built("tied_gpt", 0), stage=3), path, max_shard_size=size)
        listings[kind] = sorted(p.name for p in path.iterdir())
    return listings


def _bytes_read(root: Path, rank: int) -> dict[str, int]:
    """Elements this rank reads loading TiedGPT at stage 3, and the ones it holds."""
    model = zc.shard(_built("tied_gpt", 1), stage=3)
    _CountingOpen.reads, _CountingOpen.mappings = [], []
    with pytest.MonkeyPatch.context() as patch:  # in a spawned rank: no fixture, the same restoring patch
        patch.setattr(weights, "safe_open", _CountingOpen)
        zc.load_weights(model, root / "tied_gpt-stage0.safetensors")
    params = {id(p): p for p in model.parameters()}.values()
    return {
        "read": sum(_CountingOpen.reads),
        "largest_read": max(_CountingOpen.reads),
        "most_tensors_per_mapping": max(len(names) for names in _CountingOpen.mappings),
        "held": sum(shard_info(p).valid_numel for p in params) + sum(b.numel() for b in model.buffers()),
        "full": sum(shard_info(p).numel for p in params),
        "largest_full": max(shard_info(p).numel for p in params),
    }


def _cast(root: Path) -> dict[str, Any]:
    """A bf16 file into fp32 shards: the bf16 values, exactly, in fp32."""
    path = root / "uneven_mlp-bf16.safetensors"
    if dist.get_rank() == 0:
        save_file({k: v.bfloat16() for k, v in _built("uneven_mlp", 0).state_dict().items()}, path)
    dist.barrier()
    model = _scrambled(zc.shard(_built("uneven_mlp", 1), stage=3))
    zc.load_weights(model, path)
    rounded = _built("uneven_mlp", 0)
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(param.bfloat16().float())
    return {"shards_equal": _equal(_held(model), _held(zc.shard(rounded, stage=3)))}


def _error(root: Path, case: str) -> dict[str, Any]:
    """The error `case` raises on a stage-3 model, and whether the model is unchanged after it."""
    path, strict, _pattern = ERRORS[case]
    model = zc.shard(_built("uneven_mlp", 1), stage=3)
    before = _held(model)
    try:
        zc.load_weights(model, root / "errors" / path, strict=strict)
        message = "nothing raised"
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
    return {"message": message, "unchanged": _equal(before, _held(model))}


def _not_strict(root: Path) -> dict[str, Any]:
    """strict=False loads what matches and returns the rest, as load_state_dict does."""
    model = zc.shard(_built("uneven_mlp", 1), stage=3)
    before = _held(model)
    result = zc.load_weights(model, root / "errors" / "both.safetensors", strict=False)
    loaded = _held(zc.shard(_built("uneven_mlp", 0), stage=3))
    after = _held(model)
    return {
        "result": tuple(result),
        "type": type(result).__name__,
        "missing_unchanged": torch.equal(after["fc2.bias"], before["fc2.bias"]),
        "others_loaded": all(torch.equal(after[k], loaded[k]) for k in after if k != "fc2.bias"),
    }


def _hugging_face(root: Path, name: str, rank: int) -> dict[str, Any]:
    """save_pretrained -> load_weights at stage 3 -> eval logits -> save_weights -> (from_pretrained here)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(root / name).eval()
    torch.manual_seed(1)
    model = zc.shard(build_model(name), stage=3)
    zc.load_weights(model, root / name)
    model.eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        error = (model(tokens).logits - reference(tokens).logits).abs().max().item()
    out = root / f"{name}-saved"
    zc.save_weights(model, out, max_shard_size=INDEX_BYTES if name == "llama" else "5GB")
    if rank == 0:
        model.config.save_pretrained(out)
    return {"logits_error": error, "dir": str(out)}


def _write_failure(root: Path) -> dict[str, Any]:
    """Group rank 0 fails only at the rename (a directory holds the name), after every shard was sent."""
    path = root / "taken.safetensors"
    if dist.get_rank() == 0:
        path.mkdir()
    dist.barrier()
    try:
        zc.save_weights(zc.shard(_built("tied_gpt", 0), stage=3), path)
        message = "nothing raised"
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
    return {"message": message, "left": sorted(p.name for p in root.iterdir() if p.name.startswith(".taken"))}


def _status_bytes(field: str) -> int:
    return 1024 * int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)[1])


def _save_peak(root: Path) -> dict[str, int]:
    """How far each rank's RSS rises while saving 8 tensors of 16 MiB sharded at stage 3."""
    torch.manual_seed(0)
    model = zc.shard(nn.Sequential(*(nn.Linear(BIG_WIDTH, BIG_WIDTH, bias=False) for _ in range(BIG_LAYERS))), stage=3)
    zc.save_weights(zc.shard(UnevenMLP(), stage=3), root / "warm-up.safetensors")  # first-use imports
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_bytes("VmRSS")
    zc.save_weights(model, root / "big.safetensors")
    rise = _status_bytes("VmHWM") - before
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "big.safetensors").unlink()
    return {"rise": rise, "largest": BIG_WIDTH * BIG_WIDTH * 4}


def two_rank_report(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    cases: list[tuple[Any, Callable[[], Any]]] = [
        (("round_trip", *trip), lambda trip=trip: _round_trip(root, *trip)) for trip in ROUND_TRIPS
    ]
    cases += [
        ("index", lambda: _index_round_trip(root)),
        ("replacing", lambda: _replacing_saves(root)),
        ("bytes_read", lambda: _bytes_read(root, rank)),
        ("cast", lambda: _cast(root)),
        ("not_strict", lambda: _not_strict(root)),
        ("save_peak", lambda: _save_peak(root)),
        ("write_failure", lambda: _write_failure(root)),
    ]
    cases += [(("error", case), lambda case=case: _error(root, case)) for case in ERRORS]
    cases += [(("hf", name), lambda name=name: _hugging_face(root, name, rank)) for name in HF_MODELS]
    return run_cases(cases)


def four_rank_report(rank: int, world_size: int, root: str) -> dict:
    """The 2-rank run's stage-3 files loaded at N=4 (every UnevenMLP shard padded, some empty), and
    a save at N=4 for the test process to read."""
    root = Path(root)

    def load(name: str) -> bool:
        model = _scrambled(zc.shard(_built(name, 1), stage=3))
        zc.load_weights(model, root / f"{name}-stage3.safetensors")
        return _equal(_held(model), _held(zc.shard(_built(name, 0), stage=3)))

    def save(name: str) -> dict[str, str]:
        path = root / f"{name}-n4.safetensors"
        zc.save_weights(zc.shard(_built(name, 0), stage=2), path)
        return {"file": str(path)}

    cases = [(("load", name), lambda name=name: load(name)) for name in MODELS]
    cases += [(("save", name), lambda name=name: save(name)) for name in MODELS]
    return run_cases(cases)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    _write_error_cases(root)
    _write_hf_models(root)
    return root


@pytest.fixture(scope="module")
def reports(root: Path) -> list[dict]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
        patch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # RSS follows live tensors
        # New processes: a rank that ran other jobs has heap to spare, which would hide the rise.
        return run_on_ranks(2, two_rank_report, str(root), timeout=300, fresh=True)


@pytest.fixture(scope="module")
def four_rank_reports(root: Path, reports: list[dict]) -> list[dict]:
    return run_on_ranks(4, four_rank_report, str(root), timeout=300)


def _facts(reports: list[dict], case: Any, rank: int = 0) -> Any:
    outcome = reports[rank][case]
    assert not isinstance(outcome, str), outcome
    return outcome


# ---------------------------------------------------------------------------------------------
# The tests


@pytest.mark.parametrize("trip", ROUND_TRIPS, ids=lambda t: f"{t[0]}-stage{t[1]}-to-{t[2]}")
def test_round_trip(reports: list[dict], trip: tuple) -> None:
    name = trip[0]
    for rank in range(2):
        facts = _facts(reports, ("round_trip", *trip), rank)
        assert facts["result"] is None  # strict: nothing to report
        assert facts["shards_equal"], f"rank {rank}: loaded shards differ from sharding the original"
    assert _equal(load_file(facts["file"]), _expected_file(_built(name, 0)))


@pytest.mark.parametrize("name", MODELS)
def test_four_ranks_load_two_ranks_files_and_save_their_own(four_rank_reports: list[dict], name: str) -> None:
    for rank in range(4):
        assert _facts(four_rank_reports, ("load", name), rank), f"rank {rank}: loaded shards differ"
    assert _equal(load_file(_facts(four_rank_reports, ("save", name))["file"]), _expected_file(_built(name, 0)))


def test_unsharded_model_loads_a_sharded_models_file(four_rank_reports: list[dict]) -> None:
    model = _scrambled(_built("tied_gpt", 1))
    zc.load_weights(model, _facts(four_rank_reports, ("save", "tied_gpt"))["file"])
    assert _equal(_held(model), _held(_built("tied_gpt", 0)))


def test_index_directory_round_trip(reports: list[dict]) -> None:
    facts = _facts(reports, "index")
    assert _facts(reports, "index", 1)["shards_equal"] and facts["shards_equal"]
    files = [name for name in facts["listing"] if name != weights.INDEX_FILE]
    assert len(files) > 2 and facts["listing"] == sorted([*files, weights.INDEX_FILE])
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", name) for name in files)
    directory = Path(facts["dir"])
    index = json.loads((directory / weights.INDEX_FILE).read_text())
    stored = {}
    for file in files:
        held = load_file(directory / file)
        assert sum(t.numel() * t.element_size() for t in held.values()) <= INDEX_BYTES or len(held) == 1
        assert all(index["weight_map"][key] == file for key in held)
        stored.update(held)
    expected = _expected_file(_built("tied_gpt", 0))
    assert _equal(stored, expected) and sorted(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())


def test_a_save_replaces_the_previous_saves_files(reports: list[dict]) -> None:
    listings = _facts(reports, "replacing")
    assert listings["single"] == listings["single_again"] == [weights.SINGLE_FILE]
    assert weights.SINGLE_FILE not in listings["index"] and weights.INDEX_FILE in listings["index"]


def test_each_rank_reads_only_its_own_elements(reports: list[dict]) -> None:
    for rank in range(2):
        facts = _facts(reports, "bytes_read", rank)
        assert facts["read"] == facts["held"], f"rank {rank} read {facts['read']} elements, holds {facts['held']}"
        assert facts["held"] < 0.6 * facts["full"]
        assert facts["largest_read"] < facts["largest_full"]
        # Pages read through a mapping stay resident while it lives: one tensor per mapping.
        assert facts["most_tensors_per_mapping"] == 1


def test_bf16_file_into_fp32_shards(reports: list[dict]) -> None:
    assert _facts(reports, "cast")["shards_equal"] and _facts(reports, "cast", 1)["shards_equal"]


@pytest.mark.parametrize("case", ERRORS)
def test_error_names_the_problem_and_changes_nothing(reports: list[dict], case: str) -> None:
    facts = _facts(reports, ("error", case))
    assert re.search(ERRORS[case][2], facts["message"]), facts["message"]
    for rank in range(2):
        assert _facts(reports, ("error", case), rank)["unchanged"], f"rank {rank}: the model changed"
    assert _facts(reports, ("error", case), 1)["message"] == facts["message"]  # decided alike everywhere


def test_not_strict_returns_missing_and_unexpected_and_loads_the_rest(reports: list[dict]) -> None:
    for rank in range(2):
        facts = _facts(reports, "not_strict", rank)
        assert facts["type"] == "LoadResult"
        assert facts["result"] == (["fc2.bias"], ["extra.weight"])
        assert facts["missing_unchanged"] and facts["others_loaded"]


@pytest.mark.parametrize("name", HF_MODELS)
def test_hugging_face_models_load_and_save(reports: list[dict], root: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM

    for rank in range(2):
        error = _facts(reports, ("hf", name), rank)["logits_error"]
        assert error <= HF_TOLERANCE, f"rank {rank}: logits differ by {error:.3g}"
    original = AutoModelForCausalLM.from_pretrained(root / name).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(_facts(reports, ("hf", name))["dir"]).state_dict()
    assert _equal(saved, original)


def test_a_failed_write_raises_on_every_rank_and_leaves_nothing(reports: list[dict]) -> None:
    writer, sender = _facts(reports, "write_failure", 0), _facts(reports, "write_failure", 1)
    assert writer["message"].startswith("IsADirectoryError"), writer["message"]
    assert sender["message"].startswith("RuntimeError: group rank 0 failed to write the weights to"), sender["message"]
    assert writer["left"] == [], "a partial file was left behind"


def test_saving_streams_one_shard_at_a_time(reports: list[dict]) -> None:
    writer, sender = _facts(reports, "save_peak", 0), _facts(reports, "save_peak", 1)
    assert writer["rise"] <= writer["largest"] + RSS_SLACK, f"the writer's RSS rose by {writer['rise'] / 2**20:.0f} MiB"
    # The other rank only sends its shards as they are: nothing the size of a tensor is allocated.
    assert sender["rise"] < sender["largest"] / 2, f"the sending rank's RSS rose by {sender['rise'] / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------------------------
# In this process


def test_flat_ranges_read_exactly_their_elements(tmp_path: Path) -> None:
    """Every flat range of tensors of 0-4 dimensions, each read at most twice per dimension."""
    shapes = [(5,), (3, 4), (2, 3, 4), (2, 1, 3, 5), (4, 0, 2)]
    save_file({str(shape): torch.arange(math.prod(shape)).reshape(shape) for shape in shapes}, tmp_path / "t.safetensors")
    with weights.safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        for shape in shapes:
            numel = math.prod(shape)
            for begin in range(numel + 1):
                for end in range(begin, numel + 1):
                    reads: list[int] = []
                    pieces = list(weights._flat_range(_CountingSlice(f.get_slice(str(shape)), reads, str(shape), set()), shape, begin, end))
                    assert torch.equal(torch.cat([torch.arange(0), *pieces]), torch.arange(begin, end)), (shape, begin, end)
                    assert sum(reads) == end - begin and len(reads) <= 2 * len(shape)


@pytest.mark.parametrize("size, bytes_", [(1000, 1000), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("5gb", 5 * 10**9), ("1.5KiB", 1536)])
def test_max_shard_size_follows_hugging_face(size: int | str, bytes_: int) -> None:
    assert weights._parse_size(size) == bytes_


@pytest.mark.parametrize("size", ["5 apples", 0, -1, "0MB", True])
def test_bad_max_shard_size_is_refused(tmp_path: Path, size: Any) -> None:
    with pytest.raises(ValueError, match="max_shard_size must be a positive number of bytes"):
        zc.save_weights(UnevenMLP(), tmp_path, max_shard_size=size)
    assert not tmp_path.joinpath(weights.SINGLE_FILE).exists()
