"""The layers: the passes import neither the runtime nor the tools, the runtime does not import the
tools (ARCHITECTURE.md, "Layers").

    passes/       zerocompile.passes   torch only: graphs in, graphs out
    zerocompile/  zerocompile          the runtime: shard(), the backend, checkpoints, ...
    tools/        zerocompile.tools    the console script and what spawns ranks

Each layer may import those before it. Read from the sources with `ast`, every import counts:
top level or inside a function (a lazy import is still a dependency), `import x`, `from x import
y`, relative imports, and `importlib.import_module` of a literal name.

Inside and across the layers, no modules import each other (a cycle, however many modules long;
only imports under `if TYPE_CHECKING:`, never run, are left out), and no module takes a private
name (`_x`) of another: what another module needs is public.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable, Collection
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


@dataclasses.dataclass(frozen=True)
class Import:
    """One name an import statement brings in."""

    line: int
    statement: str
    name: str  # dotted: a module, or for `from origin import x` possibly a name in origin
    origin: str  # the module `from ... import` reads it from; `name` itself for `import name`
    binds: tuple[str, str] | None  # (local name, the dotted name it is), if it binds one
    for_annotations: bool  # under `if TYPE_CHECKING:`, never run


def imports(source: str, module: str, is_package: bool) -> list[Import]:
    """Every import in `source`, the source of `module`, top level or inside a function."""
    tree = ast.parse(source)
    annotations_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    found = []
    for node in ast.walk(tree):
        pairs: list[tuple[str, str, tuple[str, str] | None]] = []  # (name, origin, binds)
        if isinstance(node, ast.Import):
            # `import a.b` binds a; `import a.b as c` binds c to a.b.
            pairs = [
                (alias.name, alias.name, (alias.asname, alias.name) if alias.asname else (alias.name.split(".")[0],) * 2)
                for alias in node.names
            ]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # The package the import is relative to: the module's own for an __init__.py.
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            for alias in node.names:
                name = base if alias.name == "*" else f"{base}.{alias.name}"
                pairs.append((name, base, None if alias.name == "*" else (alias.asname or alias.name, name)))
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
            pairs = [(name.value.rstrip("."), name.value.rstrip("."), None)]
        statement = ast.unparse(node) if pairs else ""
        found.extend(
            Import(node.lineno, statement, name, origin, binds, id(node) in annotations_only)
            for name, origin, binds in pairs
        )
    return found


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str, str]]:
    """(line, statement, imported module) for every import in `source`, the source of `module`."""
    # `from zerocompile import tools` imports the package zerocompile.tools, of another layer than
    # zerocompile's: such a name is the import, anything else (a name in its origin) is the origin.
    return [
        (found.line, found.statement, found.name if layer_of(found.name) != layer_of(found.origin) else found.origin)
        for found in imports(source, module, is_package)
    ]


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


def our_modules() -> dict[str, tuple[str, bool]]:
    """Each module of ours by its dotted name: (its source's path from the root, whether a package)."""
    return {
        module_name(package, ROOT / directory, path): (str(path.relative_to(ROOT)), path.name == "__init__.py")
        for path, package, directory in sources()
    }


def resolved(found: Import, modules: Collection[str]) -> str | None:
    """The module of ours `found` imports (for `from m import x`: m.x if that is a module, else m);
    None outside ours. A package's parents, which Python imports on the way, are not counted."""
    target = found.name if found.name in modules else found.origin
    while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
    return target if target in modules and layer_of(target) is not None else None


def import_graph(read: Callable[[str], str], modules: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of its first such import}, annotations-only imports left out."""
    graph: dict[str, dict[str, int]] = {}
    for module, (where, is_package) in modules.items():
        edges = graph.setdefault(module, {})
        for found in imports(read(where), module, is_package):
            target = resolved(found, modules)
            if target is not None and target != module and not found.for_annotations:
                edges.setdefault(target, found.line)
    return graph


def cycles(graph: dict[str, dict[str, int]], where: Callable[[str], str] = str) -> list[str]:
    """Each set of modules that import each other (a strongly connected component), one line with
    its modules, then one line per import among them: file:line, importer -> imported."""
    reaches = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for target in graph.get(todo.pop(), {}):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        reaches[start] = seen
    found, placed = [], set()
    for module in sorted(graph):
        members = sorted(other for other in reaches[module] if module in reaches[other])
        if module in placed or len(members) < 2:
            continue
        placed.update(members)
        found.append(f"a cycle of {len(members)} modules: {', '.join(members)}")
        found += [
            f"    {where(importer)}:{line}: {importer} -> {target}"
            for importer in members
            for target, line in sorted(graph[importer].items(), key=lambda edge: edge[1])
            if target in members
        ]
    return found


def test_no_import_cycles():
    modules = our_modules()
    graph = import_graph(lambda where: (ROOT / where).read_text(), modules)
    assert sum(map(len, graph.values())) > 100, f"found only {sum(map(len, graph.values()))} imports among our modules"
    problems = cycles(graph, lambda module: modules[module][0])
    assert not problems, "modules that import each other (function-level imports count):\n" + "\n".join(problems)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names_used(source: str, module: str, is_package: bool, modules: Collection[str], where: str) -> list[str]:
    """Where `source` (of `module`) takes a private name (`_x`) of another of our modules: imports
    it (`from m import _x`, or a private module `m._x`), or reads it off a module it imported (`m._x`)."""
    problems = []
    bound: dict[str, str] = {}  # local name -> the module of ours it is
    for found in imports(source, module, is_package):
        if layer_of(found.name) is None:
            continue
        if any(map(is_private, found.name.split("."))) and resolved(found, modules) != module:
            problems.append(f"{where}:{found.line}: `{found.statement}` imports the private {found.name}")
        if found.binds is not None and found.binds[1] in modules:
            bound[found.binds[0]] = found.binds[1]
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        head, *rest = ast.unparse(node.value).split(".")
        if head not in bound:
            continue
        owner = ".".join([bound[head], *rest])
        if owner in modules and owner != module:
            problems.append(f"{where}:{node.lineno}: `{ast.unparse(node)}` reads the private {node.attr} of {owner}")
    return problems


def test_no_private_names_cross_modules():
    """A name another module needs is public: `_x` stays inside its module."""
    modules = our_modules()
    problems = []
    for module, (where, is_package) in modules.items():
        problems += private_names_used((ROOT / where).read_text(), module, is_package, modules, where)
    assert not problems, "private names used across modules:\n" + "\n".join(problems)


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


SOURCES = {  # a made-up runtime
    "zerocompile": ("zerocompile/__init__.py", True),
    "zerocompile.low": ("zerocompile/low.py", False),
    "zerocompile.high": ("zerocompile/high.py", False),
    "zerocompile.typed": ("zerocompile/typed.py", False),
}


@pytest.mark.parametrize(
    "low, high",
    [
        ("def f():\n    from zerocompile.high import shard\n", "from zerocompile.low import x\n"),
        ("def f():\n    from zerocompile import high\n", "import zerocompile.low\n"),
        ("from . import high\n", "from .low import x\n"),
        ("import importlib\nimportlib.import_module('zerocompile.high')\n", "from zerocompile import low as l\n"),
    ],
)
def test_cycles_are_found(low, high):
    text = {"zerocompile/low.py": low, "zerocompile/high.py": high}
    heading, *edges = cycles(import_graph(lambda where: text.get(where, ""), SOURCES))
    assert heading == "a cycle of 2 modules: zerocompile.high, zerocompile.low"
    assert [edge.split(": ", 1)[1] for edge in edges] == ["zerocompile.high -> zerocompile.low", "zerocompile.low -> zerocompile.high"]


def test_annotations_only_imports_make_no_cycle():
    text = {
        "zerocompile/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zerocompile.high import Shard\n",
        "zerocompile/high.py": "from zerocompile.low import x\n",
        "zerocompile/typed.py": "import typing\nif typing.TYPE_CHECKING:\n    import zerocompile.high\nelse:\n    import os\n",
    }
    assert cycles(import_graph(lambda where: text.get(where, ""), SOURCES)) == []


@pytest.mark.parametrize(
    "source, found",
    [
        ("from zerocompile.low import _helper\n", "imports the private zerocompile.low._helper"),
        ("def f():\n    from .low import x, _helper\n", "imports the private zerocompile.low._helper"),
        ("from zerocompile._watcher import MARK\n", "imports the private zerocompile._watcher.MARK"),
        ("from zerocompile import low\nlow._helper()\n", "reads the private _helper of zerocompile.low"),
        ("import zerocompile as zc\nzc.low._helper\n", "reads the private _helper of zerocompile.low"),
        ("import zerocompile.low as l\nl._CACHE.clear()\n", "reads the private _CACHE of zerocompile.low"),
    ],
)
def test_private_names_are_found(source, found):
    (problem,) = private_names_used(source, "zerocompile.high", False, SOURCES, "here.py")
    assert problem.startswith("here.py:") and problem.endswith(found), problem


@pytest.mark.parametrize(
    "source",
    [
        "from zerocompile.low import helper\nfrom torch.distributed import _functional_collectives\n",
        "from zerocompile import low\nlow.helper()\nlow.__name__\n",
        "_CACHE = {}\n_CACHE.clear()\nimport torch\ntorch._dynamo.reset()\n",
    ],
)
def test_public_names_pass(source):
    assert private_names_used(source, "zerocompile.high", False, SOURCES, "here.py") == []


# A module a newcomer can read in one sitting: no source file of the package or the benchmarks
# grows past this many lines (issue 58); split it by concern, as tools/bench/ and tools/plan/ are.
MOST_LINES = 700


def test_no_module_is_too_long_to_read():
    too_long = {
        str(path.relative_to(ROOT)): count
        for directory in (*LAYERS, "benchmarks")
        for path in sorted((ROOT / directory).rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > MOST_LINES
    }
    assert not too_long, f"modules over {MOST_LINES} lines (split them by concern): {too_long}"
