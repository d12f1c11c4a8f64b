"""The layers: the passes import neither the runtime nor the tools, the runtime does not import the
tools (ARCHITECTURE.md, "Layers").

    passes/       zerocompile.passes   torch only: graphs in, graphs out
    zerocompile/  zerocompile          the runtime: shard(), the backend, checkpoints, ...
    tools/        zerocompile.tools    the console script and what spawns ranks

Each layer may import those before it. Read from the sources with `ast`, every import counts:
top level or inside a function (a lazy import is still a dependency), `import x`, `from x import
y`, relative imports, and `importlib.import_module` of a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
# Source directory -> the package it ships as (pyproject.toml's package-dir), in layer order.
LAYERS = {"passes": "zerocompile.passes", "zerocompile": "zerocompile", "tools": "zerocompile.tools"}
NAMES = {"zerocompile.passes": "the passes", "zerocompile": "the runtime", "zerocompile.tools": "the tools"}
# What each layer may import of ours: itself and the layers before it.
ALLOWED = {
    package: set(list(LAYERS.values())[: index + 1]) for index, package in enumerate(LAYERS.values())
}


def layer_of(module: str) -> str | None:
    """Which of our layers `module` (a dotted name) belongs to; None outside zerocompile."""
    for package in sorted(LAYERS.values(), key=len, reverse=True):  # zerocompile.passes before zerocompile
        if module == package or module.startswith(package + "."):
            return package
    return None


def module_name(package: str, directory: Path, path: Path) -> str:
    parts = list(path.relative_to(directory).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str, str]]:
    """(line, statement, imported module) for every import in `source`, the source of `module`."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # The package the import is relative to: the module's own for an __init__.py.
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # `from zerocompile import tools` imports the package zerocompile.tools, of another layer
            # than zerocompile's: such a name is the import, anything else (a name in base) is base.
            targets = []
            for alias in node.names:
                name = f"{base}.{alias.name}"
                targets.append(name if alias.name != "*" and layer_of(name) != layer_of(base) else base)
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
        ):
            name = node.args[0]
            if isinstance(name, ast.JoinedStr) and name.values and isinstance(name.values[0], ast.Constant):
                name = name.values[0]  # f"zerocompile.tools.{command}": its literal head
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue
            targets = [name.value.rstrip(".")]
        else:
            continue
        statement = ast.unparse(node)
        found.extend((node.lineno, statement, target) for target in targets)
    return found


def violations(source: str, module: str, is_package: bool = False, where: str = "<source>") -> list[str]:
    """What `source` imports across the layers, one line each: file:line, the statement, the rule."""
    own = layer_of(module)
    problems = []
    for line, statement, target in imported_modules(source, module, is_package):
        theirs = layer_of(target)
        if theirs is not None and theirs not in ALLOWED[own]:
            problems.append(
                f"{where}:{line}: `{statement}` ({module}) imports {target}: {NAMES[own]} may not import "
                f"{NAMES[theirs]} ({theirs})"
            )
    return problems


def sources():
    for directory, package in LAYERS.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            yield path, package, directory


def test_layers_are_kept():
    problems, counted = [], 0
    for path, package, directory in sources():
        module = module_name(package, ROOT / directory, path)
        source = path.read_text()
        counted += len(imported_modules(source, module, path.name == "__init__.py"))
        problems += violations(source, module, path.name == "__init__.py", str(path.relative_to(ROOT)))
    assert counted > 100, f"read only {counted} imports: are the sources where {sorted(LAYERS)} say?"
    assert not problems, "imports across the layers (ARCHITECTURE.md, Layers):\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "module, is_package, source, imported",
    [
        # The runtime importing the tools, at top level, inside a function, absolute and relative.
        ("zerocompile.weights", False, "from zerocompile.tools.convert import TABLE\n", "zerocompile.tools.convert"),
        ("zerocompile.weights", False, "def f():\n    import zerocompile.tools.convert\n", "zerocompile.tools.convert"),
        ("zerocompile.weights", False, "from zerocompile import tools\n", "zerocompile.tools"),
        ("zerocompile.weights", False, "from .tools import convert\n", "zerocompile.tools"),
        ("zerocompile", True, "from .tools.cli import main\n", "zerocompile.tools.cli"),
        ("zerocompile.weights", False, "importlib.import_module('zerocompile.tools.convert')\n", "zerocompile.tools.convert"),
        # The passes importing the runtime or the tools.
        ("zerocompile.passes.markers", False, "from zerocompile.sharding import ShardInfo\n", "zerocompile.sharding"),
        ("zerocompile.passes.markers", False, "from .. import sharding\n", "zerocompile"),
        ("zerocompile.passes.markers", False, "from zerocompile import shard\n", "zerocompile"),
        ("zerocompile.passes.markers", False, "from ..tools import plan\n", "zerocompile.tools"),
        ("zerocompile.passes", True, "from .. import config\n", "zerocompile"),
        ("zerocompile.passes.markers", False, "if True:\n    import zerocompile\n", "zerocompile"),
    ],
)
def test_crossings_are_found(module, is_package, source, imported):
    (problem,) = violations(source, module, is_package, "here.py")
    assert problem.startswith("here.py:") and f"imports {imported}:" in problem, problem


@pytest.mark.parametrize(
    "module, is_package, source",
    [
        ("zerocompile.passes.markers", False, "from . import lowering\nfrom .stages import shard_numel\n"),
        ("zerocompile.passes", True, "from . import markers\nfrom zerocompile.passes import stages\n"),
        ("zerocompile.passes.markers", False, "from zerocompile import passes\n"),
        ("zerocompile.sharding", False, "from zerocompile.passes.markers import UNSHARD\nfrom . import config\n"),
        ("zerocompile.tools.cli", False, "from .. import sharding\nfrom ..passes import ledger\nfrom . import plan\n"),
        ("zerocompile.tools.cli", False, "importlib.import_module(f'zerocompile.tools.{name}')\n"),
        ("zerocompile.passes.markers", False, "import torch\nfrom torch.library import custom_op\n"),
    ],
)
def test_allowed_imports_pass(module, is_package, source):
    assert violations(source, module, is_package) == []
