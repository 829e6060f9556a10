"""Which of the hook's .c files calls which, through the HIDDEN functions of hook.h; fails on a cycle.

    python3 native/hook/calls.py        (or: make -C native/hook calls-check)

Each file of HOOK_SRC (the Makefile's list) is compiled on its own into an object file; ``nm``
then tells which hook.h functions each object defines and which it calls. An edge A -> B means
A calls a function B defines. The edges must form no cycle: two files that need each other are
one module in two pieces (grant.c and region.c once were). Only hook.h's HIDDEN functions count:
the ``real_*`` pointers are data, and the exported entry points that forward.c's lookup table
names are the driver's API, not calls between the hook's parts.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

HOOK = Path(__file__).resolve().parent
# a declaration at the start of a line: ``HIDDEN <type> name(`` (the extern data lines start otherwise)
_DECL = re.compile(r"^HIDDEN\s+[^;(]*?\b(\w+)\s*\(", re.M)


def hidden_functions(header: str) -> set[str]:
    """The names of the functions hook.h declares HIDDEN."""
    return set(_DECL.findall(header))


def sources(makefile: str) -> list[str]:
    """HOOK_SRC from the Makefile: the files libvgpu.so is built from."""
    found = re.search(r"^HOOK_SRC\s*:=\s*(.+)$", makefile, re.M)
    if found is None:
        raise SystemExit("calls.py: no HOOK_SRC line in native/hook/Makefile")
    return found.group(1).split()


def symbols(obj: Path) -> tuple[set[str], set[str]]:
    """(global symbols defined, symbols used but undefined) of one object file."""
    out = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1].isupper():
            defined.add(parts[2])
    return defined, undefined


def edges(
    defined: Mapping[str, set[str]], used: Mapping[str, set[str]], functions: set[str]
) -> dict[str, dict[str, list[str]]]:
    """``{caller: {callee: [functions]}}`` for every call from one file into another."""
    owner = {name: f for f, names in defined.items() for name in names if name in functions}
    graph: dict[str, dict[str, list[str]]] = {f: {} for f in defined}
    for f, names in used.items():
        for name in sorted(names):
            to = owner.get(name)
            if to is not None and to != f:
                graph[f].setdefault(to, []).append(name)
    return graph


def cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None when the graph has none."""
    state: dict[str, int] = {}  # 1 on the path being walked, 2 done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = walk(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return None


def main() -> int:
    cc = shlex.split(os.environ.get("CC", "cc"))
    functions = hidden_functions((HOOK / "hook.h").read_text())
    defined: dict[str, set[str]] = {}
    used: dict[str, set[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources((HOOK / "Makefile").read_text()):
            obj = Path(tmp) / (Path(src).stem + ".o")
            subprocess.run(
                [*cc, "-O2", "-fPIC", "-fvisibility=hidden", "-I", str(HOOK), "-c", str(HOOK / src), "-o", str(obj)],
                check=True,
            )
            defined[src], used[src] = symbols(obj)
    graph = edges(defined, used, functions)
    for caller in sorted(graph):
        for callee, names in sorted(graph[caller].items()):
            print(f"{caller} -> {callee}: {', '.join(names)}")
    found = cycle(graph)
    if found:
        print(f"calls.py: the hook's files call each other in a circle: {' -> '.join(found)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
