"""The floors (docs/architecture.md#floors), checked in the suite as `make lint` checks them: the
import contracts hold (import-linter), no modules import each other in a circle (every import
counts, lazy ones and those under TYPE_CHECKING too; tools/import_cycles.py finds a circle and only
a circle), the node's two commands only call its wiring, and no module of the product or the
sandbox grows past what a reader takes in at one sitting without saying why at its top."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
LONG = 450  # lines; a longer module says why in an "# Over 450 lines: ..." line near its top
GENERATED = {"vgpu/deviceplugin/api", "vgpu/dra/api"}


def _cycles_module():  # tools/ is not a package; load the script as the lint step runs it
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _graph(edges: list[tuple[str, str]]) -> grimp.ImportGraph:
    graph = grimp.ImportGraph()
    for a, b in edges:
        graph.add_module(a)
        graph.add_module(b)
        graph.add_import(importer=a, imported=b)
    return graph


def test_the_cycle_finder_reports_each_circle_once_with_its_members() -> None:
    cycles = _cycles_module().cycles
    graph = _graph(
        [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.f"), ("p.f", "p.e")]
    )
    assert sorted(cycles(graph)) == [["p.a", "p.b", "p.c"], ["p.e", "p.f"]]


def test_the_cycle_finder_passes_a_graph_that_only_fans_in() -> None:
    cycles = _cycles_module().cycles
    graph = _graph([("p.a", "p.b"), ("p.a", "p.c"), ("p.b", "p.c"), ("p.d", "p.c")])
    assert cycles(graph) == []


def test_a_lazy_import_inside_a_function_closes_a_circle(tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "floorpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from floorpkg import b\n")
    (package / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "c.py").write_text("import floorpkg.a\n")
    (package / "d.py").write_text("from floorpkg.a import x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles_module().cycles(grimp.build_graph("floorpkg")) == [
        ["floorpkg.a", "floorpkg.b", "floorpkg.c"]
    ]


def test_the_product_and_the_sandbox_have_no_import_cycle() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "import_cycles.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_the_import_contracts_hold() -> None:
    """The layers, the pure core, vgpu.kube alone on the kubernetes client, the sandbox out of
    the product ([tool.importlinter] in pyproject.toml)."""
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "0 broken" in result.stdout


def test_the_nodes_two_commands_only_call_their_wiring() -> None:
    graph = grimp.build_graph("vgpu")
    wiring = {
        "vgpu.commands.device_plugin": "vgpu.deviceplugin.node",
        "vgpu.monitor.cli": "vgpu.monitor.node",
    }
    for command, builds in wiring.items():
        assert graph.direct_import_exists(importer=command, imported=builds)
        for part in ("vgpu.deviceplugin.daemon", "vgpu.node.devices", "vgpu.kube.client"):
            if part == "vgpu.deviceplugin.daemon" and command == "vgpu.commands.device_plugin":
                continue  # it hands the Daemon its node monitor
            assert not graph.direct_import_exists(importer=command, imported=part), (command, part)


def test_the_device_plugin_dra_plugin_and_monitor_stand_side_by_side_on_the_node_floor() -> None:
    graph = grimp.build_graph("vgpu")
    sides = ("vgpu.deviceplugin", "vgpu.dra", "vgpu.monitor")
    for a in sides:
        for b in sides:
            if a != b:
                assert not graph.chain_exists(importer=a, imported=b, as_packages=True), (a, b)
    assert not graph.chain_exists(importer="vgpu.node", imported="vgpu.deviceplugin", as_packages=True)


def test_the_dra_plugin_command_only_calls_its_wiring_and_no_shell_imports_it() -> None:
    graph = grimp.build_graph("vgpu")
    assert graph.direct_import_exists(importer="vgpu.dra.cli", imported="vgpu.dra.node")
    for part in ("vgpu.dra.prepare", "vgpu.dra.server", "vgpu.dra.publish", "vgpu.kube.resourceapi"):
        assert not graph.direct_import_exists(importer="vgpu.dra.cli", imported=part), part
    for shell in (
        "vgpu.deviceplugin",
        "vgpu.monitor",
        "vgpu.node",
        "vgpu.extender",
        "vgpu.kube",
        "vgpu.core",
    ):
        assert not graph.chain_exists(importer=shell, imported="vgpu.dra", as_packages=True), shell


def test_no_module_of_the_product_or_the_sandbox_is_long_without_a_reason_at_its_top() -> None:
    long_without_reason = []
    for path in sorted([*(ROOT / "vgpu").rglob("*.py"), *(ROOT / "sandbox" / "vgpu_sandbox").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel.startswith(g) for g in GENERATED):
            continue
        lines = path.read_text().splitlines()
        if len(lines) > LONG and not any(line.startswith("# Over 450 lines:") for line in lines[:40]):
            long_without_reason.append(f"{rel} ({len(lines)} lines)")
    assert not long_without_reason, (
        f"split these or say why in an '# Over 450 lines: ...' line at the top: {long_without_reason}"
    )
