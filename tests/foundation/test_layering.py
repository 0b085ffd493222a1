"""The import structure of ``shared/`` and ``plugins/``, read from the source with :mod:`ast`.

* No import cycle among their modules. Every ``import`` counts, at module level, inside functions
  and under ``if TYPE_CHECKING:`` (a function-level import hides a cycle, it does not remove it);
  relative imports are resolved. Importing ``a.b`` runs ``a/__init__.py`` too, but that parent edge
  is not counted: a package that imports its own submodules is not a cycle by itself.
* The layering contract: a plugin imports only public ``aipc_kernels`` modules (no path component
  with a leading underscore) and public names from them, under their current names (not the names
  before the split by concern that :mod:`aipc_kernels._moved` still resolves); no plugin imports another
  plugin; ``aipc_kernels`` imports no plugin. (``aipc_kernels._autoload`` names the plugins'
  post-import hooks as strings: the ``.pth`` activation table, resolved only when a framework is
  imported, not an import of the kernel layer.)
* Shipped code (``shared/``, ``plugins/``) imports nothing from ``tests`` (the test helpers,
  ``tests/helpers``, are not in the wheel).
* The kernel layer's sub-packages depend on each other only as :data:`SUBPACKAGE_DEPS` allows
  (``core`` on none of them; the checkpoint readers on the format, never on kernels).

The walk reads files, so modules added later are checked with no change here.
"""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = "aipc_kernels"
#: top-level packages under plugins/ that belong to another plugin, with the reason
PLUGIN_OF = {"optimum": "optimum_npu"}  # optimum_npu's CLI command, shipped in optimum's PEP 420 namespace
#: the top-level package of the test helpers, which shipped code may not import
TESTS = "tests"
#: sub-package of aipc_kernels -> the sub-packages it may import (the GPU kernels implement the low-bit
#: and decoder ops' contracts; the ops dispatch to them)
SUBPACKAGE_DEPS = {
    "core": set(),
    "lowbit": {"core", "gpu"},
    "decoder": {"core", "lowbit", "gpu"},
    "checkpoints": {"core", "lowbit"},
    "gpu": {"core", "lowbit", "decoder"},
    "tools": {"core"},
}


def old_name(module: str) -> bool:
    """Whether ``module`` is a kernel-layer name from before the split (resolved by aipc_kernels._moved)."""
    from aipc_kernels._moved import new_name
    return new_name(module) is not None


def module_names(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` under ``root`` (``pkg/__init__.py`` -> ``pkg``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and "__pycache__" not in parts:
            names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> set[tuple[str, str]]:
    """``(module, imported name or "")`` for every import in the file, wherever it is; relative imports
    resolved against ``name``. ``from X import a`` gives ``(X.a, "")`` when ``X.a`` is a module of
    ``known``, else ``(X, "a")``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name, "") for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if package else []
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add((sub, "") if sub in known else (module, alias.name))
    return found


def import_graph(roots: list[Path]) -> tuple[dict[str, set[str]], dict[str, set[tuple[str, str]]]]:
    """(edges between the modules found under ``roots``, every import of each module)."""
    files = {}
    for root in roots:
        files.update(module_names(root))
    known = set(files)
    imports = {name: imports_of(name, path, known) for name, path in files.items()}
    graph = {name: {m for m, _ in found if m in known and m != name} for name, found in imports.items()}
    return graph, imports


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def plugin_of(module: str, plugins: set[str]) -> str | None:
    top = module.split(".")[0]
    top = PLUGIN_OF.get(top, top)
    return top if top in plugins else None


def layering_violations(imports: dict[str, set[tuple[str, str]]], plugins: set[str]) -> list[str]:
    """Every import that breaks the contract (see the module docstring), as readable lines."""
    bad = []
    for module, found in sorted(imports.items()):
        owner = plugin_of(module, plugins)
        for target, name in sorted(found):
            other, what = plugin_of(target, plugins), f"{target}.{name}" if name else target
            if owner is None and other is not None:
                bad.append(f"{module} (kernel layer) imports {what} of plugin {other}")
            elif owner is not None and other is not None and other != owner:
                bad.append(f"{module} (plugin {owner}) imports {what} of plugin {other}")
            elif target.split(".")[0] == TESTS:
                bad.append(f"{module} (shipped) imports {what}: a test helper, not in the wheel")
            elif owner is not None and target.split(".")[0] == KERNELS:
                if [p for p in what.split(".") if p.startswith("_")]:
                    bad.append(f"{module} (plugin {owner}) imports {what}: private")
                elif old_name(what):
                    bad.append(f"{module} (plugin {owner}) imports {what}: a name from before the split (deprecated)")
            elif owner is None and target.split(".")[0] == KERNELS and module.split(".")[0] == KERNELS:
                src, dst = (m.split(".")[1] if m.count(".") else "" for m in (module, target))
                if src in SUBPACKAGE_DEPS and dst != src and dst in SUBPACKAGE_DEPS and dst not in SUBPACKAGE_DEPS[src]:
                    bad.append(f"{module} (aipc_kernels.{src}) imports {what} of aipc_kernels.{dst}")
                elif src in SUBPACKAGE_DEPS and old_name(what):
                    bad.append(f"{module} imports {what}: a name from before the split (deprecated)")
    return bad


@pytest.fixture(scope="module")
def tree():
    plugins = {PLUGIN_OF.get(p.name, p.name) for p in (ROOT / "plugins").iterdir() if p.is_dir()}
    graph, imports = import_graph([ROOT / "shared", ROOT / "plugins"])
    assert any(m.startswith(f"{KERNELS}.") for m in graph) and plugins >= {"vllm_lowbit", "optimum_npu", "ipex_segment_kv"}
    return graph, imports, plugins


def test_no_import_cycle(tree):
    graph, _, _ = tree
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layering_contract(tree):
    _, imports, plugins = tree
    assert layering_violations(imports, plugins) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_checks_can_fail(tmp_path):
    """A synthetic tree with a cycle hidden in a function and each kind of contract breach."""
    shared = _write(tmp_path / "shared", {
        f"{KERNELS}/__init__.py": "",
        f"{KERNELS}/contract.py": "def f():\n    from .backend import g\n",
        f"{KERNELS}/backend.py": "from . import contract\n",
        f"{KERNELS}/_private.py": "",
        f"{KERNELS}/uses_plugin.py": "import plug_a.mod\n",
        f"{KERNELS}/core/__init__.py": "",
        f"{KERNELS}/core/base.py": "from aipc_kernels.lowbit import formats\n",
        f"{KERNELS}/lowbit/__init__.py": "",
        f"{KERNELS}/lowbit/formats.py": "import tests.helpers.references\n",
    })  # fmt: skip
    plugins = _write(tmp_path / "plugins", {
        "plug_a/__init__.py": "",
        "plug_a/mod.py": f"from {KERNELS} import _private\nfrom {KERNELS}.contract import _hidden\nfrom ..plug_b import x\n"
                         f"from {KERNELS} import formats\n",
        "plug_b/__init__.py": "from .sub import y\n",
        "plug_b/sub.py": "",
    })  # fmt: skip
    graph, imports = import_graph([shared, plugins])
    assert graph["plug_b"] == {"plug_b.sub"}
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {f"{KERNELS}.contract", f"{KERNELS}.backend"}
    bad = layering_violations(imports, {"plug_a", "plug_b"})
    assert bad == [
        f"{KERNELS}.core.base ({KERNELS}.core) imports {KERNELS}.lowbit.formats of {KERNELS}.lowbit",
        f"{KERNELS}.lowbit.formats (shipped) imports tests.helpers.references: a test helper, not in the wheel",
        f"{KERNELS}.uses_plugin (kernel layer) imports plug_a.mod of plugin plug_a",
        f"plug_a.mod (plugin plug_a) imports {KERNELS}.formats: a name from before the split (deprecated)",
        f"plug_a.mod (plugin plug_a) imports {KERNELS}._private: private",
        f"plug_a.mod (plugin plug_a) imports {KERNELS}.contract._hidden: private",
        "plug_a.mod (plugin plug_a) imports plug_b.x of plugin plug_b",
    ], bad
