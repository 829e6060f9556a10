"""docs/coming-from-hami.md names this product's metrics, chart values, annotations and sections:
each must exist, so the page cannot drift from the code it maps HAMi onto."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "coming-from-hami.md"


def _source() -> str:
    return "\n".join(p.read_text() for p in (REPO / "vgpu").rglob("*.py"))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_metric_it_names_is_one_the_product_serves() -> None:
    names = set(re.findall(r"`(vgpu_[a-z_]+)`", DOC.read_text()))
    assert names
    source = _source()
    missing = {n for n in names if f'"{n}"' not in source and f'"{n.removesuffix("_total")}"' not in source}
    assert missing == set()


def test_every_chart_value_it_names_is_in_values_yaml() -> None:
    values = yaml.safe_load((REPO / "charts" / "vgpu" / "values.yaml").read_text())
    # tables put HAMi's names in the first column: leave those out
    lines = DOC.read_text().splitlines()
    text = "\n".join("|".join(ln.split("|")[2:]) if ln.startswith("|") else ln for ln in lines)
    here = re.findall(r"`((?:scheduler|devicePlugin|monitoring)\.[A-Za-z.]+)(?::[^`]*)?`", text)
    assert here
    for path in here:
        node = values
        for key in path.split("."):
            assert isinstance(node, dict) and key in node, path
            node = node[key]


def test_the_annotations_it_calls_accepted_are_the_products() -> None:
    source = _source()
    for name in ("nvidia.com/use-gputype", "nvidia.com/nouse-gputype", "nvidia.com/use-gpuuuid"):
        assert f'"{name}"' in source
    for name in ("node-policy", "gpu-policy", "allocation", "phase", "devices"):
        assert f"vgpu.openaios.io/{name}" in DOC.read_text()
        assert f'PREFIX + "{name}"' in source


def test_every_link_to_another_doc_reaches_a_file_and_a_heading() -> None:
    for target, anchor in re.findall(r"\]\(([a-z-]+\.md)(?:#([a-z0-9-]+))?\)", DOC.read_text()):
        path = DOC.parent / target
        assert path.exists(), target
        if anchor:
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
            assert anchor in headings, f"{target}#{anchor}"
    own = {_slug(h) for h in re.findall(r"^#+ (.+)$", DOC.read_text(), re.M)}
    for anchor in re.findall(r"\]\(#([a-z0-9-]+)\)", DOC.read_text()):
        assert anchor in own, anchor
