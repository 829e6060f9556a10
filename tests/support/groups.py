"""The ``xdist_group`` names that keep tests which share something on one worker at a time
(tests/README.md, "Parallel runs"). ``make test`` runs ``pytest -n 2 --dist loadgroup``: tests of
one group run on one worker, one after the other; tests/conftest.py gives every test a group."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

# The real node: one per machine (/var/lib/kubelet, /var/log/pods, /var/lib/vgpu, the bridge
# vgpu-sbx0, containerd's images). tests/conftest.py puts every test in this group whose module, or
# a module one of its fixtures comes from, starts it or reads its images (real_node_uses below);
# a module may also say so itself: ``pytestmark = pytest.mark.xdist_group(REAL_NODE)``.
REAL_NODE = "realnode"
# Every module with a test that uses the session's sandbox (tests/e2e/conftest.py): one sandbox
# per run rather than one per worker, which two cores would not carry beside the other tests.
SANDBOX = "sandbox"


def _truthy_keyword(call: ast.Call, name: str) -> bool:
    return any(
        k.arg == name and not (isinstance(k.value, ast.Constant) and not k.value.value) for k in call.keywords
    )


def _called(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        return f"{owner}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else ""


def real_node_uses(source: str) -> list[str]:
    """What in a test module's ``source`` starts the real node or reads its images, each as
    "line N: what": ``.up(Spec(real_node=...))`` (or a name bound to such a Spec), a call of
    ``lifecycle.start``, ``lifecycle.restart`` or ``layout.image_dir`` (of vgpu_sandbox.realnode),
    or an argv holding ``up`` and ``--real-node``."""
    tree = ast.parse(source)

    def real_spec(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and _called(node).split(".")[-1] == "Spec"
            and _truthy_keyword(node, "real_node")
        )

    specs = {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and real_spec(n.value)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Call):
            called = _called(node)
            args = [*node.args, *(k.value for k in node.keywords)]
            if called.endswith(".up") and any(
                real_spec(a) or (isinstance(a, ast.Name) and a.id in specs) for a in args
            ):
                what = "Sandbox.up(Spec(real_node=...))"
            elif called in ("lifecycle.start", "lifecycle.restart", "layout.image_dir"):
                what = f"{called}()"
        elif isinstance(node, ast.List | ast.Tuple):
            strings = {n.value for n in node.elts if isinstance(n, ast.Constant)}
            if {"up", "--real-node"} <= strings:
                what = "`vgpu sandbox up --real-node`"
        if what:
            found.append((getattr(node, "lineno", 0), what))
    return [f"line {line}: {what}" for line, what in sorted(found)]


@functools.cache
def starts_real_node(path: str) -> bool:
    """Whether the module at ``path`` (a test module, or one a fixture comes from) uses the real node."""
    try:
        return bool(real_node_uses(Path(path).read_text()))
    except (OSError, SyntaxError, ValueError):
        return False
