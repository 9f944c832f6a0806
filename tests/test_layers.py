"""The package's layers, one way (docs/CONTRACTS.md "Layers"): the import-linter contract in
pyproject.toml holds, an upward import breaks it, no module reaches into another component's
private names or through the package root, and no modules import each other in a circle."""
from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple


ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bagualu2"


def _lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the repository's contract, on the ``bagualu2`` found in
    ``package_parent``."""
    assert importlib.util.find_spec("importlinter"), "import-linter is missing: pip install -e '.[test]'"
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
         "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
        cwd=package_parent, env={**os.environ, "PYTHONPATH": str(package_parent)}, capture_output=True, text=True,
        timeout=300)


def test_lint_imports_keeps_the_layers() -> None:
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout, done.stdout


def test_an_upward_import_inside_a_function_breaks_the_contract(tmp_path: Path) -> None:
    # the runtime's gate discovery reaching for the reference model, as it once did
    shutil.copytree(PACKAGE, tmp_path / "bagualu2", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    gates = tmp_path / "bagualu2" / "runtime" / "gates.py"
    gates.write_text(gates.read_text() + "\n\ndef _reference():\n    from bagualu2.models import TopKRouter\n"
                     "    return TopKRouter\n")
    done = _lint_imports(tmp_path)
    assert done.returncode != 0
    assert "bagualu2.runtime is not allowed to import bagualu2.models" in done.stdout, done.stdout
    assert "0 kept, 1 broken" in done.stdout


# --- private names and the package root ---------------------------------------------------------


def _modules() -> Iterator[Tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _component(module: str) -> str:
    """``bagualu2.<first name>``: the unit whose private names its modules share."""
    return ".".join(module.split(".")[:2])


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


COMPILED = {"bagualu2._C", "bagualu2._saves"}  # the extension modules: no Python source to read


def _reaches(module: str, path: Path, source: str) -> List[str]:
    """Where ``module`` (at ``path``, reading ``source``) reaches another component's private
    name: ``from m import _x`` or ``m._x`` with ``m`` a bagualu2 module it imported
    (``bagualu2._C`` and ``bagualu2._saves`` are the compiled modules, not private names)."""
    tree = ast.parse(source, str(path))
    bound: Dict[str, str] = {}  # local name -> the bagualu2 module it is
    found = []

    def foreign(target: str) -> bool:
        return target.startswith("bagualu2.") and _component(target) != _component(module)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("bagualu2.") and alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(module, path, node)
            for alias in node.names:
                target = f"{origin}.{alias.name}"
                if target in COMPILED:
                    continue
                if _is_module(target):
                    bound[alias.asname or alias.name] = target
                elif _private(alias.name) and foreign(origin):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {origin} import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr)
                and node.value.id in bound and foreign(bound[node.value.id])):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr} "
                         f"({bound[node.value.id]})")
    return found


def _root_imports(module: str, path: Path, source: str) -> List[str]:
    """Imports of the package root itself (its re-exports, the compiled modules through it),
    which the layer contract cannot see through: allowed in the command line only, above every
    layer. The compiled modules are imported from themselves (``from bagualu2._C import ...``)."""
    if _component(module) == "bagualu2.cli" or module == "bagualu2":
        return []
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        names: List[Optional[str]] = []
        if isinstance(node, ast.Import):
            names = [None for alias in node.names if alias.name == "bagualu2"]
        elif isinstance(node, ast.ImportFrom) and _absolute(module, path, node) == "bagualu2":
            names = [alias.name for alias in node.names if not _is_module(f"bagualu2.{alias.name}")]
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: " + (f"from bagualu2 import {n}" if n else "import bagualu2")
                  for n in names]
    return found


def test_no_module_reaches_another_components_private_names() -> None:
    found = [line for module, path in _modules() for line in _reaches(module, path, path.read_text())]
    assert not found, "private names reached from another component (make them public, or add a public way):\n" + \
        "\n".join(found)


def test_the_private_name_check_sees_what_it_flags() -> None:
    # a module of bagualu2.provision: another component's privates are flagged, its own and the
    # compiled module are not
    source = ("from bagualu2.runtime.recipes import _STATE\nfrom bagualu2.provision.state import _Refs\n"
              "from bagualu2 import _C\nfrom bagualu2.runtime import recipes\nrecipes._STATE\n"
              "import bagualu2.runtime.ledger as ledger\nledger._drain_graph\n"
              "from bagualu2.provision import state\nstate._Refs\n")
    found = _reaches("bagualu2.provision.example", PACKAGE / "provision" / "example.py", source)
    assert [line.split(": ", 1)[1] for line in found] == [
        "from bagualu2.runtime.recipes import _STATE",
        "recipes._STATE (bagualu2.runtime.recipes)", "ledger._drain_graph (bagualu2.runtime.ledger)"]


def test_only_the_command_line_imports_the_package_root() -> None:
    found = [line for module, path in _modules() for line in _root_imports(module, path, path.read_text())]
    assert not found, ("imports of the package root below the command line (import the module that "
                       "defines the name instead):\n" + "\n".join(found))


def test_the_root_import_check_sees_the_compiled_modules_through_the_root() -> None:
    source = "from bagualu2 import _C\nfrom bagualu2._C import Planner\nfrom bagualu2 import runtime\n"
    found = _root_imports("bagualu2.plan.example", PACKAGE / "plan" / "example.py", source)
    assert [line.split(": ", 1)[1] for line in found] == ["from bagualu2 import _C"]


# --- import cycles ----------------------------------------------------------------------------------


def _import_graph(sources: Dict[str, Tuple[str, bool]]) -> Dict[str, Set[str]]:
    """``module -> the bagualu2 modules it imports``, for ``sources`` (``module -> (its source,
    whether it is a package's __init__)``). Every import counts: at module level, inside a
    function, under ``TYPE_CHECKING``. ``from m import n`` imports ``m.n`` when that is a module,
    else ``m``; a name that is no module here (the compiled modules) stands for its nearest
    enclosing one. A module's import of a package that contains it is no edge: Python runs a
    package's ``__init__`` before any of its modules, whoever imports them."""

    def resolve(name: str) -> Optional[str]:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph: Dict[str, Set[str]] = {}
    for module, (source, is_package) in sources.items():
        targets: Set[str] = set()
        for node in ast.walk(ast.parse(source, module)):
            names: List[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    origin = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                names = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
            for name in names:
                target = resolve(name) if name.split(".")[0] == "bagualu2" else None
                if target is not None and target != module and not module.startswith(target + "."):
                    targets.add(target)
        graph[module] = targets
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of ``graph`` with more than one module, each sorted, in
    order (Tarjan's algorithm, iterative: no recursion limit to meet)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: List[Tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def test_no_modules_import_each_other_in_a_circle() -> None:
    # TYPE_CHECKING imports included: a circle held apart only by them is still one design
    # whose modules cannot be read, changed or moved one at a time
    sources = {module: (path.read_text(), path.name == "__init__.py") for module, path in _modules()}
    cycles = _cycles(_import_graph(sources))
    assert not cycles, "modules that import each other in a circle (move what both need below them):\n" + \
        "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_sees_what_it_flags() -> None:
    sources = {
        "bagualu2": ("from bagualu2 import _C\nfrom bagualu2.api import enable\n", True),
        "bagualu2.api": ("from bagualu2._C import Planner\nfrom bagualu2 import runtime\n"
                         "def f():\n    import bagualu2.cli\n", False),
        "bagualu2.cli": ("import bagualu2\nfrom bagualu2.api import enable\n", True),
        "bagualu2.runtime": ("from bagualu2.runtime.a import A\n", True),
        "bagualu2.runtime.a": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from bagualu2.runtime.c import C\n", False),
        "bagualu2.runtime.b": ("from . import a\n", False),
        "bagualu2.runtime.c": ("def f():\n    from .b import B\n", False),
    }
    graph = _import_graph(sources)
    # the compiled module and the root: a package that holds the importer, no edge
    assert graph["bagualu2.api"] == {"bagualu2.runtime", "bagualu2.cli"}
    assert graph["bagualu2.runtime.a"] == {"bagualu2.runtime.c"}
    assert _cycles(graph) == [["bagualu2.api", "bagualu2.cli"],
                              ["bagualu2.runtime.a", "bagualu2.runtime.b", "bagualu2.runtime.c"]]
    sources["bagualu2.runtime.a"] = ("", False)
    assert _cycles(_import_graph(sources)) == [["bagualu2.api", "bagualu2.cli"]]


# --- the frame's runtime-owned part ---------------------------------------------------------------


def _runtime_state_readers(module: str, path: Path, source: str) -> List[str]:
    """Where a module outside ``bagualu2.runtime`` reads or writes a frame's ``runtime_state``
    (the runtime's own ``FrameRun``: its owner alone changes how it is laid out)."""
    if _component(module) == "bagualu2.runtime":
        return []
    return [f"{path.relative_to(ROOT)}:{node.lineno}: .runtime_state"
            for node in ast.walk(ast.parse(source, str(path)))
            if isinstance(node, ast.Attribute) and node.attr == "runtime_state"]


def test_only_the_runtime_touches_a_frames_runtime_state() -> None:
    found = [line for module, path in _modules() for line in _runtime_state_readers(module, path, path.read_text())]
    found += [line for path in sorted((ROOT / "benchmarks").glob("*.py"))
              for line in _runtime_state_readers("benchmarks", path, path.read_text())]
    assert not found, "a frame's runtime state reached from outside the runtime (ask through Frame):\n" + \
        "\n".join(found)
    # and the check sees what it flags
    assert _runtime_state_readers("bagualu2.provision.example", PACKAGE / "provision" / "example.py",
                                  "frame.runtime_state.offloads\n")
    assert not _runtime_state_readers("bagualu2.runtime.example", PACKAGE / "runtime" / "example.py",
                                      "frame.runtime_state.offloads\n")
