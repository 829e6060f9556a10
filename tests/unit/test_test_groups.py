"""The test suite's own layout (tests/README.md, "Parallel runs"): every module that starts the real
node, or reads the images it imports, is in the ``realnode`` xdist group, so that `make test`'s
workers never run two such tests at once (one real node per machine: /var/lib/kubelet,
/var/log/pods, /var/lib/vgpu, the bridge vgpu-sbx0). tests/gpu is left out: `make gpu-test` runs
without workers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.groups import REAL_NODE

TESTS = Path(__file__).resolve().parents[1]


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _attr_call(node: ast.Call, module: str, names: set[str]) -> bool:
    func = node.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr in names
        and isinstance(func.value, ast.Name)
        and func.value.id == module
    )


def real_node_uses(source: str) -> list[str]:
    """What in ``source`` starts the real node or reads its images, each as "line N: what"."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and node.func.attr == "up":
                real = [
                    k
                    for arg in node.args + [k.value for k in node.keywords]
                    for k in ast.walk(arg)
                    if isinstance(k, ast.keyword)
                    and k.arg == "real_node"
                    and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                ]
                if real:
                    what = "Sandbox.up(Spec(real_node=...))"
            elif _attr_call(node, "realnode", {"start", "restart", "image_dir"}):
                assert isinstance(node.func, ast.Attribute)
                what = f"realnode.{node.func.attr}()"
        elif isinstance(node, ast.List | ast.Tuple) and {"up", "--real-node"} <= _strings(node):
            what = "`vgpu sandbox up --real-node`"
        if what:
            found.append(f"line {getattr(node, 'lineno', '?')}: {what}")
    return found


def module_groups(source: str) -> set[str]:
    """The ``xdist_group`` names a module's ``pytestmark`` gives (a constant or ``REAL_NODE``)."""
    groups: set[str] = set()
    for node in ast.parse(source).body:
        if not (
            isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
        ):
            continue
        for call in ast.walk(node.value):
            if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "xdist_group" and call.args:
                arg = call.args[0]
                if isinstance(arg, ast.Constant):
                    groups.add(str(arg.value))
                elif isinstance(arg, ast.Name) and arg.id == "REAL_NODE":
                    groups.add(REAL_NODE)
    return groups


MODULES = sorted(p for p in TESTS.rglob("test_*.py") if "gpu" not in p.relative_to(TESTS).parts[:1])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(TESTS)))
def test_a_module_that_uses_the_real_node_is_in_its_group(path: Path) -> None:
    source = path.read_text()
    uses = real_node_uses(source)
    if uses and REAL_NODE not in module_groups(source):
        pytest.fail(
            f"{path.relative_to(TESTS.parent)} uses the real node ({'; '.join(uses)}) but is not in the "
            f'"{REAL_NODE}" xdist group: add `pytestmark = pytest.mark.xdist_group(REAL_NODE)` '
            "(from tests.support.groups import REAL_NODE) so that make test's workers never run it "
            "beside another real-node test (tests/README.md)"
        )


def test_the_real_node_modules_are_found() -> None:
    """The check finds what it is for: today's real-node modules, and nothing in the unit tests."""
    users = {str(p.relative_to(TESTS)) for p in MODULES if real_node_uses(p.read_text())}
    assert {"e2e/test_real_node.py", "integration/test_images.py"} <= users
    assert not {u for u in users if u.startswith("unit/")}


def test_the_check_names_a_real_node_start_outside_the_group() -> None:
    source = (
        "import pytest\n"
        "pytestmark = pytest.mark.e2e\n"
        "def test_x(tmp_path):\n"
        "    Sandbox(tmp_path).up(Spec(nodes=1, real_node=True))\n"
        "    vgpu('sandbox', '--dir', str(tmp_path))\n"
        "    subprocess.run(['vgpu', 'sandbox', 'up', '--real-node'])\n"
    )
    assert real_node_uses(source) == [
        "line 4: Sandbox.up(Spec(real_node=...))",
        "line 6: `vgpu sandbox up --real-node`",
    ]
    assert module_groups(source) == set()
    grouped = source.replace("pytest.mark.e2e", "[pytest.mark.e2e, pytest.mark.xdist_group(REAL_NODE)]")
    assert module_groups(grouped) == {REAL_NODE}
    assert real_node_uses("Sandbox(d).up(Spec(nodes=1))\nSpec(real_node=True)\n") == []
