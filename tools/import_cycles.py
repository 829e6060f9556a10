"""Fails when modules of the product or the sandbox import each other in a circle.

import-linter's contracts (pyproject.toml, `lint-imports`) keep the floors apart; this closes
the gap they leave: a cycle between two modules of one floor, such as a command module and the
daemon it starts importing each other, lazily or not. Every import statement counts, including
those inside functions. Run by `make lint`:

    python tools/import_cycles.py [package ...]     (default: vgpu vgpu_sandbox)
"""

from __future__ import annotations

import sys

import grimp


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in graph.modules:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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
    return found


def main(argv: list[str]) -> int:
    packages = argv or ["vgpu", "vgpu_sandbox"]
    graph = grimp.build_graph(*packages)
    found = cycles(graph)
    for component in found:
        print("import cycle: " + " <-> ".join(component), file=sys.stderr)
        for a in component:
            for b in component:
                if a != b and graph.direct_import_exists(importer=a, imported=b):
                    lines = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
                    print(f"  {a} imports {b} (line {', '.join(map(str, lines))})", file=sys.stderr)
    if found:
        print(f"{len(found)} import cycle(s): move what both sides need into a module both import", file=sys.stderr)
        return 1
    print(f"no import cycle among {len(graph.modules)} modules of {', '.join(packages)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
