"""The chart's sharingMode (docs/mps.md) reaches the real device plugin's node config, per node."""

from __future__ import annotations

from tests.integration.chart_support import find, render, template
from vgpu.plugin.config import parse_node_config


def test_sharing_mode_reaches_the_node_config_cluster_wide_and_per_node() -> None:
    objs = render(
        *("--set", "devicePlugin.nodeOverrides[0].name=mps-node"),
        *("--set", "devicePlugin.nodeOverrides[0].sharingMode=mps"),
    )
    text = find(objs, "ConfigMap", "vgpu-device-plugin-config")["data"]["node-config.yaml"]
    assert parse_node_config(text, "mps-node", "chart").sharing_mode == "mps"
    assert parse_node_config(text, "other", "chart").sharing_mode == "timeslice"
    objs = render("--set", "devicePlugin.sharingMode=mps")
    text = find(objs, "ConfigMap", "vgpu-device-plugin-config")["data"]["node-config.yaml"]
    assert parse_node_config(text, "any", "chart").sharing_mode == "mps"


def test_an_unknown_sharing_mode_is_refused_by_the_schema() -> None:
    result = template("--set", "devicePlugin.sharingMode=spatial")
    assert result.returncode != 0 and "sharingMode" in result.stderr
