"""ARCHITECTURE.md is a map that stays true: at most 250 lines, every path it names exists, and every
module of passes/, zerocompile/, tools/ and benchmarks/ (recursively) is named in it.

How a module is named: its repository path in backticks, `zerocompile/offload.py`. A package's
directory in backticks with its trailing slash, `tools/bench/`, names that package's `__init__.py`
and `__main__.py`, and nothing else: each other module of the package is named by its own path.
Paths inside fenced code blocks, dotted names (`zerocompile.tools.spawn`) and bare file names
(`offload.py`) name nothing. Every backticked path that begins with one of the repository's
top-level directories (passes/, zerocompile/, tools/, benchmarks/, tests/, examples/, docs/) must
exist, file or directory.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
MAX_LINES = 250
MAPPED = ("passes", "zerocompile", "tools", "benchmarks")
TOP_LEVEL = (*MAPPED, "tests", "examples", "docs")
# What a package's directory names, besides being a path that must exist.
PACKAGE_FILES = ("__init__.py", "__main__.py")
PATH = re.compile(rf"(?:{'|'.join(TOP_LEVEL)})/[\w./-]*")


def named_paths(text: str) -> set[str]:
    """The repository paths `text` names: backticked spans outside fenced blocks that are paths."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {span for span in re.findall(r"`([^`\n]+)`", prose) if PATH.fullmatch(span)}


def modules() -> set[str]:
    """Every module file of the mapped packages, as a repository path."""
    return {
        path.relative_to(ROOT).as_posix()
        for top in MAPPED
        for path in (ROOT / top).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def modules_named(paths: set[str]) -> set[str]:
    """The module files `paths` name, under the convention of this file's docstring."""
    named = {path for path in paths if path.endswith(".py")}
    named |= {directory + name for directory in paths if directory.endswith("/") for name in PACKAGE_FILES}
    return named


def test_it_fits_on_a_few_screens() -> None:
    lines = len(ARCHITECTURE.read_text().splitlines())
    assert lines <= MAX_LINES, f"ARCHITECTURE.md has {lines} lines (at most {MAX_LINES}): it is a map; depth goes to docs/"


def test_every_path_it_names_exists() -> None:
    missing = sorted(path for path in named_paths(ARCHITECTURE.read_text()) if not (ROOT / path).exists())
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_module_is_named() -> None:
    unnamed = sorted(modules() - modules_named(named_paths(ARCHITECTURE.read_text())))
    assert not unnamed, (
        "modules ARCHITECTURE.md does not name (give each a row, by its path in backticks): " + ", ".join(unnamed)
    )


def test_the_convention_itself() -> None:
    text = "`tools/bench/` runs; `tools/bench/modes.py` lists; `zerocompile.tools.spawn`, `spawn.py`\n```\n`tools/gpt.py`\n```\n"
    paths = named_paths(text)
    assert paths == {"tools/bench/", "tools/bench/modes.py"}
    assert modules_named(paths) == {"tools/bench/__init__.py", "tools/bench/__main__.py", "tools/bench/modes.py"}
