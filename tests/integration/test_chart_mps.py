"""The chart's sharingMode (docs/mps.md) reaches the real device plugin's node config, per node."""

from __future__ import annotations

from pathlib import Path

import yaml
from vgpu_sandbox import realmps

from tests.integration.chart_support import container, find, render, template
from vgpu.node.config import parse_node_config


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


def test_the_sandboxs_mps_values_run_its_real_node_in_mps_mode_with_its_stub_driver_root(
    tmp_path: Path,
) -> None:
    """What `vgpu sandbox up --real-node --sharing-mode mps` adds to the chart's values
    (vgpu_sandbox.realmps): the node's own sharingMode and the plugin's driver root."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"driver": {"inject": "cdi"}, **realmps.chart_values(tmp_path, "rn-0")}))
    objs = render("-f", str(values))
    text = find(objs, "ConfigMap", "vgpu-device-plugin-config")["data"]["node-config.yaml"]
    assert parse_node_config(text, "rn-0", "chart").sharing_mode == "mps"
    assert parse_node_config(text, "vgpu-node-0", "chart").sharing_mode == "timeslice"
    pod = find(objs, "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    [root] = [v for v in pod["volumes"] if v["name"] == "driver-root"]
    assert root["hostPath"]["path"] == str(realmps.driver_root(tmp_path))
    assert "--driver-root=/driver-root" in container(pod, "device-plugin")["command"]
