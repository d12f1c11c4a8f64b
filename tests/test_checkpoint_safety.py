"""Checkpoint safety, in this process and without ranks (a plain model needs no process group):
a save killed at any point leaves the previous checkpoint loadable, a planted pickle is refused
unopened, another model's checkpoint fails naming what differs, and `convert` streams."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import zerocompile as zc
from models import UnevenMLP
from zerocompile.tools.gpt import GPT, GPTConfig
from zerocompile.checkpoint_files import CheckpointError
from zerocompile.tools.convert import convert


def _filled(value: float) -> nn.Module:
    model = UnevenMLP()
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(value)
    return model


def _loaded_values(path: Path) -> tuple[set[float], dict]:
    model = _filled(0.0)
    extra = zc.load(path, model)
    return {p.unique().item() for p in model.parameters()}, extra


# A save by another process, stopped for good at one point of its progress.
_KILLED_SAVE = """
import os, sys, time
import safetensors.torch
import torch
import zerocompile as zc
from torch import nn

path, ready, when = sys.argv[1:4]
model = nn.Sequential(nn.Linear(7, 13), nn.Linear(13, 11), nn.Linear(11, 3))  # UnevenMLP's shapes
with torch.no_grad():
    for param in model.parameters():
        param.fill_(2.0)

def stop_here():
    open(ready, "w").close()
    time.sleep(600)

real_save, real_rename = safetensors.torch.save, os.rename
if when == "writing_shards":
    safetensors.torch.save = lambda *args, **kwargs: stop_here()
else:
    def rename(source, target):
        if when == "between_renames":
            real_rename(source, target)
        stop_here()
    os.rename = rename
zc.save(path, model, step=2)
"""


def _kill_a_save(path: Path, when: str, ready: Path) -> None:
    """Start a save to `path` in another process and SIGKILL it at `when`."""
    ready.unlink(missing_ok=True)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(path), str(ready), when])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, f"the saving process exited ({child.returncode}) before the kill point"
            assert time.monotonic() < deadline, "the saving process never reached the kill point"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL


@pytest.mark.parametrize("when", ("writing_shards", "before_publish", "between_renames"))
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path, when: str) -> None:
    path = tmp_path / "latest"
    zc.save(path, _filled(1.0), step=1)
    _kill_a_save(path, when, tmp_path / "ready")
    if when == "between_renames":
        assert not path.exists()
        with pytest.warns(UserWarning, match="interrupted") as caught:
            assert _loaded_values(path) == ({1.0}, {"step": 1})
        # Attributed to the code that called zc.load (this file), not to zerocompile's helpers.
        assert {w.filename for w in caught if "interrupted" in str(w.message)} == {__file__}
        # Only the renamed-aside copy is left now: a save killed before publishing keeps it.
        _kill_a_save(path, "before_publish", tmp_path / "ready")
        with pytest.warns(UserWarning, match="interrupted"):
            assert _loaded_values(path) == ({1.0}, {"step": 1})
    else:
        assert _loaded_values(path) == ({1.0}, {"step": 1})
    # The next save replaces it and clears what the killed ones left.
    zc.save(path, _filled(3.0), step=3)
    assert _loaded_values(path) == ({3.0}, {"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "ready"]


class _Payload:
    """Unpickling this creates a directory: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


@pytest.mark.parametrize(
    "planted", ("state/.metadata", "state/shard-00001-model-00001-of-00001.safetensors", "extra/rank0.safetensors", "zerocompile.json")
)
def test_a_planted_pickle_is_refused_without_running_it(tmp_path: Path, planted: str) -> None:
    path = tmp_path / "ckpt"
    zc.save(path, _filled(1.0), step=1)
    marker = tmp_path / "code-ran"
    payload = pickle.dumps(_Payload(marker))
    (path / planted).write_bytes(payload)
    with pytest.raises(CheckpointError, match="refusing|not a safetensors|not valid JSON"):
        zc.load(path, _filled(0.0))
    with pytest.raises(CheckpointError):
        convert(path, tmp_path / "out.safetensors")
    assert not marker.exists()
    pickle.loads(payload)  # the payload is live: unpickled, it does run
    assert marker.exists()


class _WiderMLP(UnevenMLP):
    def __init__(self) -> None:
        super().__init__()
        self.fc2 = nn.Linear(13, 12)
        self.fc3 = nn.Linear(12, 3)


def test_another_models_checkpoint_fails_naming_what_differs(tmp_path: Path) -> None:
    zc.save(tmp_path / "ckpt", _filled(1.0))
    model = _WiderMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as error:
        zc.load(tmp_path / "ckpt", model)
    message = str(error.value)
    assert "fc2.weight: checkpoint (11, 13) float32, model (12, 13) float32" in message
    assert "fc2.bias: checkpoint (11,) float32, model (12,) float32" in message
    assert "fc3.weight: checkpoint (3, 11) float32, model (3, 12) float32" in message
    assert "fc1" not in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    other = nn.Sequential(nn.Linear(7, 13))
    with pytest.raises(ValueError, match=r"in the model but not the checkpoint: \['0.weight', '0.bias'\]"):
        zc.load(tmp_path / "ckpt", other)


def test_names_carry_no_wrapper_prefix(tmp_path: Path) -> None:
    zc.save(tmp_path / "ckpt", torch.compile(_filled(1.0)))
    convert(tmp_path / "ckpt", tmp_path / "full.pt", "torch")
    assert list(torch.load(tmp_path / "full.pt", weights_only=True)) == list(UnevenMLP().state_dict())


def test_bad_extra_fails_before_touching_the_previous_checkpoint(tmp_path: Path) -> None:
    zc.save(tmp_path / "ckpt", _filled(1.0), step=1)
    with pytest.raises(TypeError, match="extra value 'when' of type object"):
        zc.save(tmp_path / "ckpt", _filled(2.0), when=object())
    assert _loaded_values(tmp_path / "ckpt") == ({1.0}, {"step": 1})


# Peak RSS of one convert, and its growth over the RSS before it: the kernel's high-water mark is
# reset first (clear_refs 5).
_MEASURED_CONVERT = """
import re, sys
from zerocompile.tools.cli import main
# What converting imports, before measuring: the cli imports only the command's module when it runs.
import torch._dynamo, torch._subclasses.fake_tensor, zerocompile.tools.convert

def status_bytes(field):
    return 1024 * int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

open("/proc/self/clear_refs", "w").write("5")
before = status_bytes("VmRSS")
assert main(["convert", *sys.argv[1:]]) == 0
print(status_bytes("VmHWM"), status_bytes("VmHWM") - before)
"""


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A 124M-parameter GPT (GPT-2 small's sizes; largest tensor 154 MB) saved by one process."""
    model = GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768))
    path = tmp_path_factory.mktemp("gpt2") / "ckpt"
    zc.save(path, model)
    return path, model.state_dict()


@pytest.mark.parametrize("format", ("safetensors", "torch"))
def test_convert_of_a_124m_model_streams(gpt2_checkpoint, tmp_path: Path, format: str) -> None:
    checkpoint, expected = gpt2_checkpoint
    out = tmp_path / "full"
    run = subprocess.run(
        [sys.executable, "-c", _MEASURED_CONVERT, str(checkpoint), str(out), "--format", format],
        capture_output=True, text=True, timeout=300, check=True,
    )
    peak, growth = map(int, run.stdout.strip().splitlines()[-1].split())
    largest = max(t.numel() * t.element_size() for t in expected.values())
    assert peak < 1.5 * largest + 300e6, f"convert peaked at {peak / 1e6:.0f} MB"
    assert growth < largest / 4, f"convert grew its RSS by {growth / 1e6:.0f} MB"
    if format == "torch":
        converted = torch.load(out, weights_only=True, mmap=True)
        assert converted["wte.weight"].data_ptr() == converted["lm_head.weight"].data_ptr()  # stored once
    else:
        from safetensors.torch import load_file

        converted = load_file(out)
        assert "lm_head.weight" not in converted  # stored once, under the first name
        converted["lm_head.weight"] = converted["wte.weight"]
    assert sorted(converted) == sorted(expected)
    assert all(torch.equal(converted[k], v) for k, v in expected.items())
