"""The test suite's own layout (tests/README.md, "Parallel runs"): every test that starts the real
node, or reads the images it imports, lands in the ``realnode`` xdist group, so that `make test`'s
workers never run two such tests at once (one real node per machine: /var/lib/kubelet,
/var/log/pods, /var/lib/vgpu, the bridge vgpu-sbx0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import group_of, uses_real_node
from tests.support.groups import REAL_NODE, real_node_uses, starts_real_node

TESTS = Path(__file__).resolve().parents[1]
MODULES = sorted(TESTS.rglob("test_*.py"))


def test_the_real_node_modules_of_today_are_found_and_no_unit_test() -> None:
    users = {str(p.relative_to(TESTS)) for p in MODULES if starts_real_node(str(p))}
    assert {"e2e/test_real_node.py", "integration/test_images.py"} <= users
    assert not {u for u in users if u.startswith("unit/")}, users


def test_each_way_of_starting_the_real_node_is_found() -> None:
    source = (
        "def node(tmp_path):\n"
        "    spec = Spec(nodes=1, gpus_per_node=1, real_node=True)\n"
        "    Sandbox(tmp_path).up(spec, progress=print)\n"
        "def test_cli():\n"
        "    subprocess.run(['vgpu', 'sandbox', 'up', '--real-node'])\n"
        "IMAGES = layout.image_dir()\n"
        "def test_restart(sb):\n"
        "    lifecycle.restart(sb, 'kubelet')\n"
    )
    assert real_node_uses(source) == [
        "line 3: Sandbox.up(Spec(real_node=...))",
        "line 5: `vgpu sandbox up --real-node`",
        "line 6: layout.image_dir()",
        "line 8: lifecycle.restart()",
    ]


def test_what_only_looks_like_the_real_node_is_not_counted() -> None:
    source = (
        "def test_config(tmp_path):\n"
        "    spec = Spec(nodes=2, real_node=True)\n"  # rendered, never started
        "    values.chart_values(sb, spec, lay, 9555)\n"
        "    Sandbox(tmp_path).up(Spec(nodes=1, real_node=False))\n"
        "    demo.reuse_refusal(Sandbox(tmp_path), real_node=True)\n"
        "    run([sys.executable, '-m', 'vgpu_sandbox.demo', '--real-node', '--skip-playbook'])\n"
    )
    assert real_node_uses(source) == []
    assert real_node_uses(source.replace("real_node=False", "real_node=True")) == [
        "line 4: Sandbox.up(Spec(real_node=...))"
    ]


def test_every_collected_test_that_uses_the_real_node_is_in_its_group(request: pytest.FixtureRequest) -> None:
    """Over this run's tests (`make test`: all of them): tests/conftest.py grouped each one."""
    items = request.session.items
    assert items
    wrong = [i.nodeid for i in items if uses_real_node(i) and group_of(i) != REAL_NODE]
    assert wrong == []
    for item in items:
        if item.nodeid.startswith(("tests/e2e/test_real_node.py", "tests/integration/test_images.py")):
            assert uses_real_node(item) and group_of(item) == REAL_NODE, item.nodeid
        if item.nodeid.startswith("tests/unit/"):
            assert group_of(item) == item.nodeid.split("::")[0], item.nodeid
