"""No two modules of vgpu/ import each other, directly or round a circle, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted((root / "vgpu").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(root: Path) -> dict[str, set[str]]:
    """Module -> the vgpu modules it imports anywhere in its body (inside functions too)."""
    known = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_vgpu_is_in_an_import_cycle() -> None:
    graph = imports(ROOT)
    assert graph["vgpu.plugin.cli"] >= {"vgpu.plugin.node"}
    assert "vgpu.plugin.cli" not in graph["vgpu.plugin.daemon"]
    assert cycles(graph) == []


def test_the_node_is_wired_in_one_place_the_commands_only_call_it() -> None:
    graph = imports(ROOT)
    for command in ("vgpu.plugin.cli", "vgpu.plugin.monitor.cli"):
        assert "vgpu.plugin.node" in graph[command]
        assert not graph[command] & {"vgpu.plugin.daemon", "vgpu.plugin.devices", "vgpu.kube.client"}


def test_a_cycle_is_found_lazy_imports_included(tmp_path: Path) -> None:
    package = tmp_path / "vgpu"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from vgpu import b\n")
    (package / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "c.py").write_text("import vgpu.a\n")
    (package / "d.py").write_text("from vgpu.a import x\n")
    assert cycles(imports(tmp_path)) == [["vgpu.a", "vgpu.b", "vgpu.c"]]
