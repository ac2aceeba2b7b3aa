"""The shape of the ``uniep`` package, read from its source (no import runs):

- no import circle among its modules, counting the imports inside functions, which a circle
  would otherwise hide behind (a module imported half-way through another's import);
- every ``from <module> import <name>`` of the package resolves: the module exists and defines
  the name at its top level. Many of these sit inside functions that only a GPU reaches, so a
  CPU run would not see a moved or renamed function there.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "python"
PACKAGE = "uniep"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _defined(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (functions, classes, assignments, imports)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node in tree.body:
                names.add(node.name)
    for node in tree.body:
        stack = [node]
        while stack:  # into if/try blocks at the top level, not into functions
            n = stack.pop()
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    names.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
            elif isinstance(n, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    stack.extend(getattr(n, field, []))
            elif isinstance(n, ast.ExceptHandler):
                stack.extend(n.body)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
    return names


def _imports(mods: dict[str, Path]) -> list[tuple[str, int, str, str]]:
    """(importer, line, module imported from, name) for every from-import of the package."""
    found = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                source = node.module
            else:
                continue
            for alias in node.names:
                found.append((mod, node.lineno, source, alias.name))
    return found


def _edges(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """importer -> {imported module: a line}. ``from . import _C`` names the extension, not the
    package's ``__init__`` (which every submodule's import runs first anyway)."""
    edges: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, line, source, name in _imports(mods):
        if name == "_C":
            continue
        target = f"{source}.{name}" if f"{source}.{name}" in mods else source
        if target in mods and target != mod:
            edges[mod].setdefault(target, line)
    return edges


def _cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    mods = _modules()
    edges = _edges(mods)
    cycles = _cycles(edges)
    lines = []
    for comp in cycles:
        lines.append("circle: " + ", ".join(comp))
        lines += [
            f"  {a}:{edges[a][b]} imports {b}" for a in comp for b in edges[a] if b in set(comp)
        ]
    assert not cycles, "\n".join(lines)


def test_every_package_import_resolves() -> None:
    mods = _modules()
    defined = {m: _defined(ast.parse(p.read_text())) for m, p in mods.items()}
    bad = []
    for mod, line, source, name in _imports(mods):
        if f"{source}.{name}" in mods or name == "*" or source == f"{PACKAGE}._C":
            continue
        if source not in mods:
            bad.append(f"{mods[mod].name}:{line}: no module {source}")
        elif name not in defined[source] and name != "_C":
            bad.append(f"{mods[mod].name}:{line}: {source} has no {name}")
    assert not bad, "\n".join(bad)


def test_the_checks_see_a_circle_and_a_missing_name(tmp_path: Path) -> None:
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _cycles(edges) == [["a", "b", "c"]]
    tree = ast.parse("import x\nfrom y import z as w\nif 1:\n    Q = 1\ndef f():\n    R = 2\n")
    assert _defined(tree) == {"x", "w", "Q", "f"}


def test_the_public_api_is_each_package_all() -> None:
    """``uniep`` and its public subpackages name their API in ``__all__``, and every name there
    exists (the re-exports too)."""
    import importlib
    import importlib.util

    public = ("uniep", "uniep.moe", "uniep.nn", "uniep.collectives", "uniep.gemm", "uniep.parm")
    public += ("uniep.tuning", "uniep.integrations")
    missing = []
    for name in public:
        mod = importlib.import_module(name)
        assert isinstance(getattr(mod, "__all__", None), list), f"{name} has no __all__"
        for x in mod.__all__:
            # A submodule listed (integrations.hf) is there once imported, as `import *` does.
            if not hasattr(mod, x) and importlib.util.find_spec(f"{name}.{x}") is None:
                missing.append(f"{name}.{x}")
    assert not missing, missing
    uniep = importlib.import_module("uniep")
    assert callable(uniep.tune) and callable(uniep.moe_forward)


def test_no_module_imports_another_modules_private_names() -> None:
    """What one module takes from another is named as shared (no leading underscore): a private
    name reached across modules is an API nobody declared."""
    bad = [
        f"{mod}:{line}: from {source} import {name}"
        for mod, line, source, name in _imports(_modules())
        if name.startswith("_") and name != "_C" and f"{source}.{name}" not in _modules()
    ]
    assert not bad, "\n".join(bad)


def test_every_attribute_of_an_imported_package_module_exists() -> None:
    """``module.name`` where ``module`` is a package module imported by name (``from . import
    ep``; ``ep.dispatch(...)``): the name exists. Many such calls sit in paths only a GPU
    reaches, so a renamed function would otherwise fail there first. ``_C`` is left out (a CPU
    build has no CUDA functions)."""
    import importlib

    mods = _modules()
    bad = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        found = {(line, name): f"{src}.{name}" for _, line, src, name in _imports({mod: path})}
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    target = found.get((node.lineno, a.name))
                    if target in mods:
                        aliases[a.asname or a.name] = target
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                target = importlib.import_module(aliases[node.value.id])
                if not hasattr(target, node.attr):
                    bad.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)
