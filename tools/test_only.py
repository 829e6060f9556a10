"""Lists the public functions, classes and methods of the product that only tests call.

For each public name defined in ``vgpu/`` (a top-level ``def`` or ``class``, or a method of a
public class), counts its uses in the code of the product and the sandbox (``vgpu/``,
``sandbox/vgpu_sandbox/``): a name, an attribute or an import of that spelling (docstrings and
comments are not uses; a dotted path in a string, ``"vgpu.extender.worker.LingeringThreadWorker"``,
is). A name used nowhere there but in
``tests/``, ``bench/`` or ``fuzz/`` is a test-only helper, which belongs in ``tests/support/``; one
used nowhere at all is dead code. Names the runtime calls by name are passed over: gRPC servicer
methods (CamelCase), dunders, ``main``, Flask routes and anything listed in a module's
``__all__``. A search by spelling over-counts (two unrelated methods of one name hide each other), so
the list is a floor: what it prints is test-only or dead; what it does not print may still be.

    python tools/test_only.py [--under vgpu/dra]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = (ROOT / "vgpu", ROOT / "sandbox" / "vgpu_sandbox")
TESTS = (ROOT / "tests", ROOT / "bench", ROOT / "fuzz")
GENERATED = ("vgpu/deviceplugin/api/", "vgpu/dra/api/")
ROUTES = ("route", "get", "post")  # Flask's decorators: the handler is called by its URL
DOTTED = re.compile(r"^[A-Za-z_][\w]*([.:][A-Za-z_]\w*)+$")  # a name given as a string


def _files(roots: tuple[Path, ...]) -> list[Path]:
    out = []
    for root in roots:
        if root.exists():
            out += [p for p in sorted(root.rglob("*.py")) if not _rel(p).startswith(GENERATED)]
    return out


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _words(paths: list[Path]) -> Counter[str]:
    """How often each name is used in code: a name, an attribute, an import (never a docstring,
    a comment or a definition's own name)."""
    counts: Counter[str] = Counter()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Name):
                counts[node.id] += 1
            elif isinstance(node, ast.Attribute):
                counts[node.attr] += 1
            elif isinstance(node, ast.alias):
                counts[node.name.rsplit(".", 1)[-1]] += 1
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.match(node.value):
                counts.update(re.split(r"[.:]", node.value))  # "pkg.module.Class", "pkg.module:main"
    return counts


def _exported(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            if isinstance(node.value, (ast.List, ast.Tuple)):
                names = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
                return {n for n in names if isinstance(n, str)}
    return set()


def _routed(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in ROUTES
        for d in node.decorator_list
    )


def definitions(path: Path) -> list[tuple[str, int, str]]:
    """(name, line, kind) of each public definition of the module."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _exported(tree) | {"main"}
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            if node.name not in skip and not _routed(node):
                found.append((node.name, node.lineno, "def"))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            if node.name not in skip:
                found.append((node.name, node.lineno, "class"))
            for item in node.body:
                if (
                    isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and not item.name.startswith("_")
                    and not item.name[0].isupper()  # gRPC methods, called by name
                    and not _routed(item)
                ):
                    found.append((f"{node.name}.{item.name}", item.lineno, "method"))
    return found


def report(under: str | None) -> list[tuple[str, str, int, int]]:
    """(file, name, uses in tests/bench/fuzz, line) of each definition the product never uses."""
    product = _files(PRODUCT)
    product_words = _words(product)
    test_words = _words(_files(TESTS))
    out = []
    for path in product:
        rel = _rel(path)
        if not rel.startswith("vgpu/") or (under and not rel.startswith(under.rstrip("/") + "/")):
            continue
        for name, line, _kind in definitions(path):
            word = name.rsplit(".", 1)[-1]
            if not product_words[word]:
                out.append((rel, name, test_words[word], line))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--under", help="only definitions in this folder (vgpu/dra)")
    args = parser.parse_args(argv)
    found = report(args.under)
    for rel, name, tests, line in found:
        what = f"test-only ({tests} uses in tests/bench/fuzz)" if tests else "dead (no use anywhere)"
        print(f"{rel}:{line}: {name}: {what}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
