"""The package's import graph (the README's layout): acyclic, and layered top to bottom.

Edges are read from the source with ast, imports inside functions included, so a cycle
that Python tolerates by importing late still fails here.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moe_xla"

# The layer pieces moe() and the EP layer share.
LAYER_PIECES = {"moe_xla.activations", "moe_xla.experts", "moe_xla.aux_losses", "moe_xla.fp8", "moe_xla.grouped",
                "moe_xla.routing_bias"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """The moe_xla modules `path` imports: `from moe_xla.a import b` names moe_xla.a (whose
    namespace b is read from) and moe_xla.a.b where that is a module."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)  # the names are read from base: it is imported first
            found.update(f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}"))
    return {m for m in found if m == "moe_xla" or m.startswith("moe_xla.")}


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _reach(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_graph_is_read():
    graph = _graph()
    assert "moe_xla.ep.layer" in graph["moe_xla.moe"]
    assert "moe_xla.grouped" in graph["moe_xla.experts"]
    assert "moe_xla.primitives.gmm" in graph["moe_xla.grouped"]


def test_import_graph_is_acyclic():
    try:
        tuple(graphlib.TopologicalSorter(_graph()).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


def test_reference_imports_nothing_from_the_package():
    imported = _graph()["moe_xla.reference"]
    assert not imported, f"moe_xla.reference, the independent oracle, imports {sorted(imported)}"


def test_layers_import_only_downwards():
    graph = _graph()
    above_primitives = {"moe_xla", "moe_xla.moe", "moe_xla.demo", "moe_xla.inspect"} | LAYER_PIECES
    for module in graph:
        reached = _reach(graph, module)
        if module.startswith("moe_xla.primitives"):
            bad = {m for m in reached if m in above_primitives or m.startswith("moe_xla.ep")}
            assert not bad, f"{module} (a primitive) reaches {sorted(bad)}"
        if module.startswith("moe_xla.ep") or module in LAYER_PIECES:
            bad = {m for m in reached if m in {"moe_xla", "moe_xla.moe", "moe_xla.demo", "moe_xla.inspect"}}
            assert not bad, f"{module} reaches {sorted(bad)}"
        if module in LAYER_PIECES:
            bad = {m for m in reached if m.startswith("moe_xla.ep")}
            assert not bad, f"{module} (a layer piece) reaches {sorted(bad)}"
