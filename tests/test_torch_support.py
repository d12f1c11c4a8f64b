"""One module knows the torch release (zerocompile/torch_support.py): nothing else reads or
compares torch's version, and Inductor is only ever patched with keys the running release has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerocompile import torch_support

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
_READS_THE_RELEASE = re.compile(r"torch\.__version__|TorchVersion|torch_version")


def test_only_the_probe_module_reads_torchs_version() -> None:
    readers = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("zerocompile", "passes", "tools")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "torch_support.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _READS_THE_RELEASE.search(line)
    ]
    assert readers == [], f"ask zerocompile.torch_support instead: {readers}"


def test_inductor_patches_keep_only_keys_the_release_has() -> None:
    patches = {"reorder_for_peak_memory": False, "a_key_no_release_has": 1}
    assert torch_support.inductor_config_patches(patches) == {"reorder_for_peak_memory": False}


def test_a_missing_pass_hook_names_the_supported_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_support, "_REQUIRED_INDUCTOR_KEYS", frozenset({"a_hook_no_release_has"}))
    with pytest.raises(RuntimeError, match=r"a_hook_no_release_has.*torch 2\.11 to 2\.15"):
        torch_support.inductor_config_patches({"a_hook_no_release_has": None})
