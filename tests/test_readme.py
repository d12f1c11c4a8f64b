"""README.md is for users: short, undated, its links resolve, its commands exist and its Python
runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 250


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


@pytest.mark.fast
def test_the_readme_is_short_and_carries_no_lab_history() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"README.md has {len(text.splitlines())} lines; depth goes to docs/"
    dates = re.findall(r"\b20\d\d-\d\d(?:-\d\d)?\b", text)
    assert not dates, f"dated measurements belong in docs/results/, not the README: {dates}"
    hashes = [word for word in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", word) and re.search(r"\d", word)]
    assert not hashes, f"commit hashes in README.md: {hashes}"


@pytest.mark.fast
def test_every_relative_link_resolves() -> None:
    for page in [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md"]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"


@pytest.mark.fast
def test_its_commands_exist() -> None:
    from zerocompile.tools.cli import SUBCOMMANDS

    shell = "\n".join(_blocks("bash")) + "\n".join(re.findall(r"^    (zerocompile .*)$", README.read_text(), re.M))
    named = set(re.findall(r"^zerocompile (\w+)", shell, re.M)) | set(re.findall(r"`zerocompile (\w+)", README.read_text()))
    assert named, "the README names no zerocompile command"
    assert named <= set(SUBCOMMANDS), f"the README names commands that do not exist: {sorted(named - set(SUBCOMMANDS))}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    for marker in re.findall(r"pytest -m (\w+)", README.read_text()):
        assert re.search(rf'"{marker}: ', pyproject), f"`pytest -m {marker}` names no marker pyproject.toml registers"


def test_its_python_runs_as_written(tmp_path: Path) -> None:
    """The API example, one rank in a fresh interpreter (as `python example.py` would run it)."""
    (code,) = _blocks("python")
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    state = eval(done.stdout.strip().splitlines()[-1])  # the printed model_state_bytes
    assert set(state) == {"params", "grads", "optimizer"} and state["params"] > 0, done.stdout
    assert (tmp_path / "weights" / "model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "step-3").is_dir()
