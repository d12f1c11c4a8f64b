"""Pretrained weights straight into shards, without running init on them: `shard(model, stage,
init=fn, weights=path)` on a meta-built model and `zc.from_pretrained(path, stage)`.

Against transformers' own `from_pretrained(dir)` (the "pretrained" directory is written by
`save_pretrained` from a tiny random model; nothing is downloaded): the gathered state equal
tensor for tensor at stages 0-3, eval logits within 1e-6, and a task head the files lack (a
causal LM's files loaded into a 3-label classifier) given by the model's `_init_weights` from
rank 0's generator. Counted: which modules init is called on, and which writes init dispatches
actually run (a write to a loaded tensor must be skipped, never computed then dropped). Bad input
fails before anything is read, the model left on meta. One 2-rank spawn runs every case.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zerocompile as zc
from ranks import run_cases
from test_hf_models import VOCAB, build_model, report_offline
from test_hf_pretrained import LOGIT_TOLERANCE

MODELS = ("gpt2", "llama")
STAGES = (0, 1, 2, 3)
LABELS = 3
HEAD_SEED = 5
GENERATE = 17


def _pretrained_dirs(root: str) -> dict[str, str]:
    """Rank 0 writes each "pretrained" model, Llama's also as an index of several files; the
    others wait."""
    paths = {name: f"{root}/{name}" for name in MODELS} | {"llama-split": f"{root}/llama-split"}
    if dist.get_rank() == 0:
        for name in MODELS:
            torch.manual_seed(123)
            model = build_model(name)
            model.generation_config.max_new_tokens = GENERATE  # in generation_config.json only
            model.save_pretrained(paths[name])
        torch.manual_seed(123)
        build_model("llama").save_pretrained(paths["llama-split"], max_shard_size="20KB")
    dist.barrier()
    return paths


def _reference(path: str, model_class: type | None = None, **config: object) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return (model_class or AutoModelForCausalLM).from_pretrained(path, **config)


def _differing(model: nn.Module, reference: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Names whose gathered tensors (and non-persistent buffers, which every rank holds whole)
    are not equal to the reference's, on rank 0 where the gathered state lands."""
    state = zc.full_state_dict(model)
    reference_buffers = dict(reference.named_buffers())
    differing = [name for name, buffer in model.named_buffers() if not torch.equal(buffer, reference_buffers[name])]
    if dist.get_rank() != 0:
        return differing
    expected = {name: value for name, value in reference.state_dict().items() if name not in skip}
    differing += sorted(set(expected) ^ {name for name in state if name not in skip})
    return differing + [name for name in expected if name in state and not torch.equal(state[name], expected[name])]


def _equals_from_pretrained(path: str, stage: int) -> dict:
    model = zc.from_pretrained(path, stage=stage)
    reference = _reference(path)
    return {
        "differing": _differing(model, reference),
        "training": model.training,
        "loss_type": model.loss_type == reference.loss_type,
        "generation": model.generation_config.max_new_tokens == reference.generation_config.max_new_tokens,
    }


def _head_the_files_lack(path: str, stage: int) -> dict:
    """A causal LM's files into a classifier: the body equal to the files, the head what
    `_init_weights` draws from rank 0's generator (seeded differently on rank 1)."""
    from transformers import AutoConfig, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(path, num_labels=LABELS)
    torch.manual_seed(HEAD_SEED if dist.get_rank() == 0 else 99)
    model = zc.from_pretrained(path, stage, model_class=LlamaForSequenceClassification, config=config)
    torch.manual_seed(HEAD_SEED)
    head = torch.empty(LABELS, config.hidden_size).normal_(0.0, config.initializer_range)
    state = zc.full_state_dict(model)
    reference = _reference(path, LlamaForSequenceClassification, num_labels=LABELS)
    return {
        "differing": _differing(model, reference, skip=("score.weight",)),
        "head_by_init": dist.get_rank() != 0 or torch.equal(state["score.weight"], head),
    }


def _logits(path: str) -> float:
    model = zc.from_pretrained(path, stage=3)
    reference = _reference(path)
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return (model(prompt).logits - reference(prompt).logits).abs().max().item()


# --- counting: which modules init is called on, which of its writes run ----------------------


class Mixed(nn.Module):
    """Partly in the files: `loaded` is, `fresh` is not."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = nn.Parameter(torch.empty(5))
        self.fresh = nn.Parameter(torch.empty(7))


class Net(nn.Module):
    """Every tensor of its own numel, so a write that runs names its tensor by its size."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)  # in the files: 12 + 4
        self.mixed = Mixed()  # 5 in the files, 7 not
        self.head = nn.Linear(4, 2)  # not in the files: 8 + 2
        self.register_buffer("stats", torch.zeros(6))  # in the files: 6
        # Built off the meta device even inside its context (a real tensor), and in the files: 3.
        self.register_buffer("table", torch.arange(3.0, device="cpu"))


IN_FILES = {"body.weight", "body.bias", "mixed.loaded", "stats", "table"}


class RunWrites(TorchDispatchMode):
    """Entered around shard(), so below the walk: sees the operations that actually run. The
    sentinel fills the counting init makes (each tensor filled with its own numel) are told from
    the walk's own by value: it fills with NaN only."""

    def __init__(self) -> None:
        super().__init__()
        self.filled: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.fill_.Scalar and args[1] == args[0].numel():
            self.filled.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def _counting_init(called: list[str], attempted: list[str], names: dict[nn.Module, str]):
    def init(module: nn.Module) -> None:
        called.append(names[module])
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            attempted.append(f"{names[module]}.{name}".lstrip("."))
            nn.init.constant_(tensor, float(tensor.numel()))

    return init


def _counted(root: str) -> dict:
    path = f"{root}/net.safetensors"
    torch.manual_seed(0)
    stored = {name: value.contiguous() for name, value in Net().state_dict().items() if name in IN_FILES}
    stored |= {"stats": torch.full((6,), -2.0), "table": torch.full((3,), -1.0)}  # not the values init or __init__ give
    if dist.get_rank() == 0:
        save_file(stored, path)
    dist.barrier()
    with torch.device("meta"):
        model = Net()
    names = {module: name for name, module in model.named_modules()}
    called, attempted, runs = [], [], RunWrites()
    with runs:
        zc.shard(model, stage=3, init=_counting_init(called, attempted, names), weights=path)
    full = zc.full_state_dict(model)
    return {
        "called": sorted(called),
        "attempted": sorted(attempted),
        "filled": sorted(runs.filled),
        "mixed.fresh": dist.get_rank() != 0 or torch.equal(full["mixed.fresh"], torch.full((7,), 7.0)),
        "loaded_equal": dist.get_rank() != 0 or all(torch.equal(full[name], stored[name]) for name in IN_FILES),
    }


def _hf_calls(path: str) -> dict:
    """A Llama classifier from causal-LM files: init is called on the head and on what holds
    tensors the files lack (the rotary embedding's, computed) and their parents, nowhere else;
    and the generators advanced by the head's draws alone."""
    from transformers import LlamaForSequenceClassification

    model = _meta(path, LlamaForSequenceClassification, num_labels=LABELS)
    names = {module: name for name, module in model.named_modules()}
    called = []

    def init(module: nn.Module) -> None:
        called.append(names[module])
        model._init_weights(module)

    torch.manual_seed(HEAD_SEED)
    zc.shard(model, stage=3, init=init, weights=path, weights_strict=False)
    after = torch.random.get_rng_state()
    torch.manual_seed(HEAD_SEED)
    torch.empty(LABELS, model.config.hidden_size).normal_()
    return {"called": sorted(called), "draws_for_head_only": torch.equal(after, torch.random.get_rng_state())}


# --- bad input: refused before anything is read, the model left on meta ------------------------


def _refused(build, match: str, **shard_arguments) -> str:
    model = build()
    before = {name: (t.device, t.shape) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    try:
        zc.shard(model, stage=3, **shard_arguments)
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        after = {name: (t.device, t.shape) for name, t in [*model.named_parameters(), *model.named_buffers()]}
        sharded = [name for name, p in model.named_parameters() if hasattr(p, "_zero")]
        assert after == before and not sharded, f"changed before refusing: {sharded or after}"
        assert match in str(error), str(error)
        return str(error)
    raise AssertionError("not refused")


def _meta(path: str, model_class: type, **config: object) -> nn.Module:
    from transformers import AutoConfig

    with torch.device("meta"):
        return model_class._from_config(AutoConfig.from_pretrained(path, **config))


def _without_a_file(split: str, root: str) -> tuple[str, str]:
    """A copy of the split save missing its second file, and that file's name."""
    target = f"{root}/llama-missing-file"
    second = sorted(Path(split).glob("model-*-of-*.safetensors"))[1].name
    if dist.get_rank() == 0:
        shutil.copytree(split, target)
        Path(target, second).unlink()
    dist.barrier()
    return target, second


def _refusals(paths: dict[str, str], root: str) -> dict:
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    llama, init = paths["llama"], lambda module: None
    missing_file, second = _without_a_file(paths["llama-split"], root)
    return {
        "wrong_shape": lambda: _refused(
            lambda: _meta(llama, LlamaForCausalLM, intermediate_size=48), "size mismatch", init=init, weights=llama
        ),
        "missing_file": lambda: _refused(lambda: _meta(llama, LlamaForCausalLM), second, init=init, weights=missing_file),
        "no_weights": lambda: _refused(
            lambda: _meta(llama, LlamaForCausalLM), "no weights at", init=init, weights=f"{root}/nowhere"
        ),
        "unexpected": lambda: _refused(
            lambda: _meta(llama, LlamaForSequenceClassification), "weights_strict=False", init=init, weights=llama
        ),
        "real_model": lambda: _refused(lambda: build_model("llama"), "load_weights", weights=llama),
        "from_pretrained_wrong_shape": lambda: _from_pretrained_refused(llama, "size mismatch", intermediate_size=48),
    }


def _from_pretrained_refused(path: str, match: str, **config: object) -> str:
    from transformers import AutoConfig

    try:
        zc.from_pretrained(path, config=AutoConfig.from_pretrained(path, **config))
    except RuntimeError as error:
        assert match in str(error), str(error)
        return str(error)
    raise AssertionError("not refused")


def _report(rank: int, world_size: int, root: str) -> dict:
    paths = _pretrained_dirs(root)
    cases = []
    for stage in STAGES:
        for name in MODELS:
            cases.append(((name, stage), lambda n=name, s=stage: _equals_from_pretrained(paths[n], s)))
        cases.append((("llama-split", stage), lambda s=stage: _equals_from_pretrained(paths["llama-split"], s)))
        cases.append((("head", stage), lambda s=stage: _head_the_files_lack(paths["llama"], s)))
    cases += [(("logits", name), lambda n=name: _logits(paths[n])) for name in MODELS]
    cases += [("counted", lambda: _counted(root)), ("hf_calls", lambda: _hf_calls(paths["llama"]))]
    cases += [(("refused", key), case) for key, case in _refusals(paths, root).items()]
    return run_cases(cases)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> list[dict]:
    return report_offline(_report, str(tmp_path_factory.mktemp("load-without-init")))


def _facts(report: list[dict], key: object, rank: int) -> dict:
    outcome = report[rank][key]
    assert not (isinstance(outcome, str) and "Traceback" in outcome), outcome
    return outcome


# The parity tests are in the core tier: one spawn of ~10-15 s runs the whole file.
@pytest.mark.core
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", [*MODELS, "llama-split"])
def test_from_pretrained_equals_transformers_from_pretrained(report, name, stage):
    for rank in range(2):
        facts = _facts(report, (name, stage), rank)
        assert facts == {"differing": [], "training": False, "loss_type": True, "generation": True}, f"rank {rank}: {facts}"


@pytest.mark.core
@pytest.mark.parametrize("stage", STAGES)
def test_a_head_the_files_lack_is_initialised_by_init(report, stage):
    for rank in range(2):
        facts = _facts(report, ("head", stage), rank)
        assert facts == {"differing": [], "head_by_init": True}, f"rank {rank}: {facts}"


@pytest.mark.core
@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers_from_pretrained(report, name):
    for rank in range(2):
        assert _facts(report, ("logits", name), rank) <= LOGIT_TOLERANCE


def test_init_runs_only_where_the_files_lack_a_tensor(report):
    """`body` (all in the files) is never called; the writes to the loaded `mixed.loaded`, `stats`
    and `table` (a real buffer) are attempted but never run; what runs is exactly the writes of
    the tensors the files lack, and the loaded ones hold the files' values."""
    for rank in range(2):
        facts = _facts(report, "counted", rank)
        assert facts["called"] == ["", "head", "mixed"], facts
        assert facts["attempted"] == ["head.bias", "head.weight", "mixed.fresh", "mixed.loaded", "stats", "table"], facts
        assert facts["filled"] == [2, 7, 8], facts
        assert facts["mixed.fresh"] is True and facts["loaded_equal"] is True, facts


def test_init_is_not_called_on_modules_the_files_fill(report):
    for rank in range(2):
        facts = _facts(report, "hf_calls", rank)
        assert facts["called"] == ["", "model", "model.rotary_emb", "score"], facts
        assert facts["draws_for_head_only"] is True, facts


@pytest.mark.parametrize(
    "case", ["wrong_shape", "missing_file", "no_weights", "unexpected", "real_model", "from_pretrained_wrong_shape"]
)
def test_bad_input_is_refused_before_anything_changes(report, case):
    for rank in range(2):
        _facts(report, ("refused", case), rank)


def test_an_operation_writing_loaded_and_new_tensors_at_once_is_refused(single_rank, tmp_path):
    """Skipping it would leave the new tensor unwritten; running it would write the loaded one."""
    save_file({"loaded": torch.ones(5)}, str(tmp_path / "mixed.safetensors"))
    with torch.device("meta"):
        model = Mixed()

    def init(module: nn.Module) -> None:
        torch._foreach_zero_([module.loaded, module.fresh])

    with pytest.raises(RuntimeError, match="cannot skip half an operation"):
        zc.shard(model, stage=3, init=init, weights=tmp_path / "mixed.safetensors")
    assert all(p.is_meta and not hasattr(p, "_zero") for p in model.parameters())


def test_from_pretrained_without_transformers_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when absent
    with pytest.raises(ImportError, match=r'pip install "zerocompile\[hf\]"'):
        zc.from_pretrained(tmp_path)


def test_zerocompile_imports_without_transformers():
    blocked = "import sys; sys.modules['transformers'] = None; import zerocompile; print(zerocompile.from_pretrained.__name__)"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "from_pretrained", result.stderr
