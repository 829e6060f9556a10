"""Import rules read from the source (every import counts, in a function or under TYPE_CHECKING
too): the sandbox has no import cycle, only vgpu/kube/ imports the kubernetes package, and
nothing in vgpu/ imports the sandbox."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(folder: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((folder / package).rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                found.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, path)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return found


def test_the_sandbox_has_no_import_cycle() -> None:
    mods = modules(ROOT / "sandbox", "vgpu_sandbox")
    assert "vgpu_sandbox.cluster" in mods
    graph = {m: {d for d in imported(p) if d in mods and d != m} for m, p in mods.items()}
    assert graph["vgpu_sandbox.cluster"] >= {"vgpu_sandbox.product", "vgpu_sandbox.realnode"}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_only_vgpu_kube_imports_kubernetes_and_vgpu_never_imports_the_sandbox() -> None:
    mods = modules(ROOT, "vgpu")
    assert "vgpu.kube.client" in mods
    kubernetes = sorted(
        m for m, p in mods.items() if any(n.split(".")[0] == "kubernetes" for n in imported(p))
    )
    assert kubernetes and all(m.startswith("vgpu.kube.") for m in kubernetes), kubernetes
    sandbox = sorted(
        m for m, p in mods.items() if any(n.split(".")[0] == "vgpu_sandbox" for n in imported(p))
    )
    assert sandbox == []
