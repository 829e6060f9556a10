"""The floors' checks themselves (docs/architecture.md#floors): the import-cycle finder that
`make lint` runs finds a circle and only a circle, and no module of the product grows past what a
reader takes in at one sitting without saying why at its top."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
LONG = 450  # lines; a longer module says why in a "# Long:" line near its top
GENERATED = {"vgpu/plugin/api"}


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


def test_no_module_of_the_product_is_long_without_a_reason_at_its_top() -> None:
    long_without_reason = []
    for path in sorted((ROOT / "vgpu").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel.startswith(g) for g in GENERATED):
            continue
        lines = path.read_text().splitlines()
        if len(lines) > LONG and not any(line.startswith("# Long:") for line in lines[:40]):
            long_without_reason.append(f"{rel} ({len(lines)} lines)")
    assert not long_without_reason, (
        f"split these or add a '# Long: why' line near the top: {long_without_reason}"
    )
