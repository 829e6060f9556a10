"""The Grafana dashboard the chart ships: rendered by the real helm, and every metric its panels
query checked against what the node monitor and the extender really export.

The exported names come from the real collectors: the monitor's ``NodeCollector`` (with its
arbiter) over a real region file and the fake NVML backend, and the extender's metrics as they
register in prometheus_client. A panel naming a metric that neither exports fails the test."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chart_support import CHART, KUBE_VERSION, NS, find, helm, render
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.region import format_region
from vgpu.monitor.arbiter import Arbiter
from vgpu.monitor.collector import NodeCollector, make_registry
from vgpu.monitor.compute_metrics import ComputeCollector
from vgpu.monitor.enforce import HostCollector
from vgpu.monitor.service import NodeMonitor
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.paths import REGION_FILE_NAME, HostPaths

NAME = "vgpu-grafana-dashboard"
ENABLED = ["--set", "monitoring.grafanaDashboard.enabled=true"]

# -- PromQL: the metric names an expression selects ------------------------------------------

# Words of PromQL that are not metric names where they stand outside parentheses' label lists.
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-zA-Z_]+")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_:.])(?:0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression, as Prometheus would look them up (with their
    _bucket/_sum/_count/_total suffixes): strings, label matchers, ranges, grouping label lists,
    offsets, Grafana variables and numbers are stripped, then every word followed by ``(`` is a
    function or aggregation and every keyword is dropped."""
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GRAFANA_VAR.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        if re.match(r"\s*\(", text[m.end() :]) or word.lower() in KEYWORDS:
            continue  # a function, an aggregation, or a keyword
        names.add(word)
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('vgpu_card_memory_used_bytes{node=~"$node", uuid=~"$uuid"}', {"vgpu_card_memory_used_bytes"}),
        (
            "histogram_quantile(0.99, sum by (le, verb) "
            '(rate(vgpu_scheduler_verb_duration_seconds_bucket{verb!="x"}[$__rate_interval])))',
            {"vgpu_scheduler_verb_duration_seconds_bucket"},
        ),
        (
            "sum(rate(a_sum[5m])) without (pod) / on (node) group_left(uuid) "
            "sum(rate(a_count[5m] offset 1h)) by (node)",
            {"a_sum", "a_count"},
        ),
        ("count(vgpu_card_healthy == 0) or vector(0)", {"vgpu_card_healthy"}),
        ("rate(vgpu_scheduler_binds_total[${__range}]) > bool 1e-3", {"vgpu_scheduler_binds_total"}),
        ('label_replace(up, "a", "$1", "b", "(by)")', {"up"}),
        ("vgpu_x unless vgpu_y and vgpu_z or vgpu_w", {"vgpu_x", "vgpu_y", "vgpu_z", "vgpu_w"}),
    ],
)
def test_the_tokenizer_finds_exactly_the_metric_names(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


# -- what the product exports ----------------------------------------------------------------


def _series_names(name: str, kind: str) -> set[str]:
    """The sample names a family of this type shows in the exposition format (``_created``
    aside: nothing a dashboard plots)."""
    if kind == "counter":
        return {name + "_total"}
    if kind == "histogram":
        return {name + "_bucket", name + "_sum", name + "_count"}
    if kind == "summary":
        return {name, name + "_sum", name + "_count"}
    return {name}


def monitor_series(tmp: Path) -> set[str]:
    """Every series the node monitor serves, from its real collector and arbiter over a real
    region file and the fake NVML backend, with its memory enforcer and compute gate (the fake
    backend lists processes where the file names a processDir)."""
    gpus = tmp / "gpus.yaml"
    (tmp / "procs").mkdir()
    gpus.write_text(
        f"processDir: {tmp / 'procs'}\n"
        "gpus:\n  - {uuid: GPU-a, memoryMiB: 1000, memoryUsedMiB: 100, utilization: 30}\n"
    )
    discovery = FakeDiscovery(gpus)
    paths = HostPaths(tmp / "root")
    folder = paths.container_dir("uid-1", "train")
    folder.mkdir(parents=True)
    format_region(folder / REGION_FILE_NAME, ["GPU-a"], limits=[1 << 30], sm_limits=[30])
    clock = iter(range(10**12, 10**13, 5 * 10**9))  # CLOCK_MONOTONIC, 5 s per reading
    arbiter = Arbiter(paths.containers_dir, clock=lambda: next(clock))
    arbiter.rescan()
    arbiter.run_pass()
    state = DeviceState(discovery.cards(), NodeConfig())
    collector = NodeCollector("n1", state, discovery, paths, arbiter=arbiter)
    registry = make_registry(collector)
    # the enforcer's and the gate's families, as NodeMonitor serves them beside the collector's
    monitor = NodeMonitor("n1", state, discovery, paths, arbiter=None)
    assert monitor.enforcer is not None and monitor.compute is not None
    registry.register(HostCollector(monitor.enforcer))
    registry.register(ComputeCollector(monitor.compute))
    families = list(registry.collect())
    names = {n for f in families for n in _series_names(f.name, f.type)}
    # the rule above agrees with the real exposition: every sample served is one of those names
    served = {
        s.name
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
        if not s.name.endswith("_created")
    }
    assert served <= names and "vgpu_container_sm_busy_ratio" in served
    arbiter.stop()
    return names


def extender_series() -> set[str]:
    """The extender's metrics, as vgpu.extender.metrics registers them with prometheus_client."""
    import vgpu.extender.metrics  # noqa: F401 - registering is what importing it does

    return {
        n for f in REGISTRY.collect() if f.name.startswith("vgpu_") for n in _series_names(f.name, f.type)
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    names = monitor_series(tmp_path_factory.mktemp("monitor")) | extender_series()
    # both sources answered: a card series of each, so an empty set cannot pass the checks
    assert {"vgpu_card_memory_used_bytes", "vgpu_card_memory_allocated_bytes"} <= names
    return names


# -- the dashboard ---------------------------------------------------------------------------


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    stack = list(dashboard.get("panels", []))
    while stack:
        p = stack.pop(0)
        yield p
        stack.extend(p.get("panels", []))


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    for p in panels(dashboard):
        for t in p.get("targets", []):
            yield f"panel {p.get('title')!r} {t.get('refId')}", t["expr"]
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_]\w*\s*\)\s*", q)
        yield f"variable {v['name']}", m.group(1) if m else q


def unknown_metrics(dashboard: dict[str, Any], exported: set[str]) -> list[str]:
    """``where: name`` for every metric a query names that the product does not export, and
    ``where: no metric`` for a query naming none."""
    wrong = []
    for where, expr in queries(dashboard):
        names = promql_metric_names(expr)
        if not names:
            wrong.append(f"{where}: no metric")
        wrong += [f"{where}: {n}" for n in sorted(names - exported)]
    return wrong


def rendered_dashboard(*args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    cm = find(render(*ENABLED, *args), "ConfigMap", NAME)
    return cm, json.loads(cm["data"]["vgpu.json"])


def test_no_dashboard_is_rendered_unless_asked_for() -> None:
    objs = render()
    assert [o for o in objs if o["metadata"]["name"] == NAME] == []
    assert not any("grafana_dashboard" in (o["metadata"].get("labels") or {}) for o in objs)


def test_the_dashboard_configmap_carries_the_sidecar_label_namespace_and_annotations(tmp_path: Path) -> None:
    cm, dashboard = rendered_dashboard()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NS
    assert "annotations" not in cm["metadata"]
    assert dashboard == json.loads((CHART / "dashboards" / "vgpu.json").read_text())
    kubernetes_validate.validate(cm, KUBE_VERSION, strict=True)

    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "monitoring": {
                    "grafanaDashboard": {
                        "namespace": "monitoring",
                        "label": "example.com/dashboard",
                        "labelValue": "vgpu",
                        "annotations": {"grafana_folder": "GPU"},
                    }
                }
            }
        )
    )
    cm, _ = rendered_dashboard("-f", str(values))
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["example.com/dashboard"] == "vgpu"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["annotations"] == {"grafana_folder": "GPU"}
    kubernetes_validate.validate(cm, KUBE_VERSION, strict=True)


def test_the_chart_with_the_dashboard_passes_helm_lint_strict() -> None:
    result = helm("lint", "--strict", str(CHART), *ENABLED, "--kube-version", KUBE_VERSION)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_label_value_that_is_not_a_string_is_refused() -> None:
    result = helm(
        "template", "vgpu", str(CHART), *ENABLED, "--set", "monitoring.grafanaDashboard.labelValue=1"
    )
    assert result.returncode != 0 and "labelValue" in result.stderr


def test_the_dashboard_has_a_datasource_variable_and_filters_by_node_card_namespace_and_pod() -> None:
    _, dashboard = rendered_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert {"node", "uuid", "namespace", "pod"} <= set(variables)
    # every panel and query reads from the chosen data source, none from a fixed one
    for p in panels(dashboard):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p[
            "title"
        ]
    # container panels filter by all four; the card panels by node and card
    for where, expr in queries(dashboard):
        if "vgpu_container_memory" in expr or "vgpu_container_sm_" in expr:
            for var in ("$node", "$uuid", "$namespace", "$pod"):
                assert var in expr, (where, var)


def test_every_metric_a_panel_queries_is_exported_by_the_monitor_or_the_extender(exported: set[str]) -> None:
    _, dashboard = rendered_dashboard()
    assert unknown_metrics(dashboard, exported) == []
    used = {n for _, expr in queries(dashboard) for n in promql_metric_names(expr)}
    # what the dashboard is for: memory, spill, SM busy (the time share too) and throttling per
    # container; scheduler decisions and latency; allocated against capacity
    assert {
        "vgpu_container_memory_used_bytes",
        "vgpu_container_memory_limit_bytes",
        "vgpu_container_memory_spilled_bytes",
        "vgpu_container_sm_busy_ratio",
        "vgpu_container_sm_busy_seconds_total",
        "vgpu_container_sm_throttled_seconds_total",
        "vgpu_scheduler_verb_duration_seconds_bucket",
        "vgpu_scheduler_binds_total",
        "vgpu_card_memory_allocated_bytes",
        "vgpu_card_memory_capacity_bytes",
        "vgpu_card_memory_used_bytes",
        # the node's enforcement: kills and evictions, throttles, gate holds
        "vgpu_memory_enforcement_actions_total",
        "vgpu_compute_enforcement_actions_total",
        "vgpu_container_compute_held",
        "vgpu_container_compute_throttled",
    } <= used


def test_the_dashboard_uses_no_deprecated_metric() -> None:
    """The node monitor keeps its old card names for one release (docs/monitoring.md); the
    dashboard already reads the one set of names."""
    _, dashboard = rendered_dashboard()
    used = {n for _, expr in queries(dashboard) for n in promql_metric_names(expr)}
    assert used & {"vgpu_card_memory_total_bytes", "vgpu_card_split"} == set()


def test_the_enforcement_row_and_the_error_panels_read_0_before_the_first_event() -> None:
    """A counter has no series before its first increment, so a panel of it read "No data"
    until the first error or action: each reads 0 (``or vector(0)``, or Grafana's noValue)."""
    _, dashboard = rendered_dashboard()
    by_title = {p["title"]: p for p in panels(dashboard)}
    row = [p["title"] for p in panels(dashboard) if p["type"] == "row"]
    assert row.index("Enforcement (node monitor)") == row.index("Scheduler decisions") - 1
    for title in (
        "Kills and evictions",
        "Compute throttles",
        "Containers held by the gate now",
        "Cards the gate cannot see",
        "Bad requests and inventory errors",
    ):
        p = by_title[title]
        assert p["fieldConfig"]["defaults"].get("noValue") == "0", title
        assert all("or vector(0)" in t["expr"] for t in p["targets"]), title


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("vgpu_container_gpu_busy_ratio", "no such metric"),
        ("vgpu_scheduler_binds", "a counter is served with _total only"),
        ("vgpu_scheduler_verb_duration_seconds", "a histogram is served as _bucket/_sum/_count"),
        ("vgpu_container_sm_busy_ratio_bucket", "a gauge has no buckets"),
        ("vgpu_container_sm_busy_seconds", "the busy counter without _total"),
    ],
)
def test_a_doctored_dashboard_naming_a_metric_nobody_exports_fails_the_check(
    exported: set[str], bad: str, why: str
) -> None:
    _, dashboard = rendered_dashboard()
    doctored = copy.deepcopy(dashboard)
    target = next(p for p in panels(doctored) if p["type"] == "timeseries")["targets"][0]
    target["expr"] = f'sum by (node) (rate({bad}{{node=~"$node"}}[$__rate_interval]))'
    wrong = unknown_metrics(doctored, exported)
    assert len(wrong) == 1 and wrong[0].endswith(f": {bad}"), (why, wrong)
    # a variable's query is checked too
    doctored = copy.deepcopy(dashboard)
    var = next(v for v in doctored["templating"]["list"] if v["name"] == "node")
    var["query"]["query"] = f"label_values({bad}, node)"
    assert unknown_metrics(doctored, exported) == [f"variable node: {bad}"], why


def test_the_service_monitor_keeps_the_monitors_namespace_pod_and_container_labels() -> None:
    sm = find(render("--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"), "ServiceMonitor", "vgpu")
    assert all(e["honorLabels"] is True for e in sm["spec"]["endpoints"])
