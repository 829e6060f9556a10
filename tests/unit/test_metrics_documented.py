"""Every Prometheus family the product serves is documented under the name Prometheus shows
(contract 6: docs/monitoring.md and docs/scheduling.md): a metric added without its row fails here.

The families are read from the source as the product declares them: prometheus_client's
``Gauge``/``Counter``/``Histogram`` (the extender), the collectors' ``GaugeMetricFamily``/
``CounterMetricFamily``, and the node collector's ``Metric(name, GAUGE|COUNTER, ...)`` table. A
counter is shown with ``_total``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAMILY = re.compile(r'\b(Gauge|Counter|Histogram)(?:MetricFamily)?\(\s*"(vgpu_[a-z0-9_]+)"')
TABLE = re.compile(r'\bMetric\(\s*"(vgpu_[a-z0-9_]+)",\s*(GAUGE|COUNTER)\b')


def families(source: str) -> dict[str, str]:
    """Each family's name as Prometheus shows it -> its kind."""
    found = {m.group(2): m.group(1) for m in FAMILY.finditer(source)}
    found.update({m.group(1): m.group(2).title() for m in TABLE.finditer(source)})
    return {f"{n}_total" if k == "Counter" and not n.endswith("_total") else n: k for n, k in found.items()}


def undocumented(source: str, docs: str) -> list[str]:
    """The families named in no table row's first cell (``| `name` |`` or ``| `a`, `b` |``)."""
    first_cells = re.findall(r"^\|([^|]*)\|", docs, re.M)
    rows = {name for cell in first_cells for name in re.findall(r"`(vgpu_[a-z0-9_]+)`", cell)}
    return sorted(name for name in families(source) if name not in rows)


def test_every_served_family_has_its_row_in_the_docs() -> None:
    source = "\n".join(
        p.read_text() for p in sorted((ROOT / "vgpu").rglob("*.py")) if "api" not in p.relative_to(ROOT).parts
    )
    docs = "\n".join((ROOT / "docs" / name).read_text() for name in ("monitoring.md", "scheduling.md"))
    found = families(source)
    assert len(found) >= 40, f"the declarations were not found (only {sorted(found)}): fix the patterns"
    assert "vgpu_compute_gate_sampling" in found and "vgpu_compute_gate_writes_total" in found
    assert undocumented(source, docs) == [], "add a row for each to docs/monitoring.md or docs/scheduling.md"


def test_an_undocumented_family_is_found_whatever_way_it_is_declared() -> None:
    source = (
        'X = Counter(\n    "vgpu_new_things", "help")\n'
        'y = GaugeMetricFamily("vgpu_new_gauge", "h", labels=[])\n'
        'Metric("vgpu_new_row", COUNTER, CARD, "h", f)\n'
    )
    docs = "| `vgpu_new_gauge` | `node` | what it is |\nsee `vgpu_new_row_total` in the text only\n"
    assert undocumented(source, docs) == ["vgpu_new_row_total", "vgpu_new_things_total"]
