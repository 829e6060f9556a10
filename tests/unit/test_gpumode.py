"""One mode per node: the label openaios.io/gpu-mode keeps the device-plugin path off DRA nodes,
in the extender's filter and bind (docs/dra.md, "One mode per node")."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tests.support import FakeKube
from vgpu.core import annotations as ann
from vgpu.core.config import SchedulerConfig
from vgpu.core.gpumode import GPU_MODE_LABEL, device_plugin_refusal, gpu_mode
from vgpu.extender.state import SchedulerState

NOW = 2_000_000.0
INVENTORY = ann.encode_devices(ann.NodeInventory((ann.Device("GPU-0", 0, "m", 10000, 100, 10),)))


def test_a_node_without_the_label_is_a_device_plugin_node() -> None:
    assert gpu_mode(None) == gpu_mode({}) == gpu_mode({GPU_MODE_LABEL: ""}) == "device-plugin"
    assert gpu_mode({GPU_MODE_LABEL: "dra"}) == "dra"
    assert device_plugin_refusal({GPU_MODE_LABEL: "device-plugin"}) is None
    assert device_plugin_refusal({"gpu": "on"}) is None


@pytest.mark.parametrize("value", ["dra", "DRA", "both"])
def test_any_mode_but_device_plugin_keeps_the_device_plugin_path_off_with_the_fix(value: str) -> None:
    why = device_plugin_refusal({GPU_MODE_LABEL: value}) or ""
    assert f"{GPU_MODE_LABEL}=" in why and "device-plugin" in why
    assert "%" not in why  # kube-scheduler's event recorder reads it as a format
    if value == "dra":
        assert "ResourceClaims of the DeviceClass vgpu.openaios.io" in why
    else:
        assert "neither device-plugin nor dra" in why


def _lease(node: str) -> dict[str, Any]:
    t = dt.datetime.fromtimestamp(NOW, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"metadata": {"name": f"vgpu-{node}"}, "spec": {"renewTime": t, "leaseDurationSeconds": 40}}


def _node(name: str, mode: str | None) -> dict[str, Any]:
    labels = {GPU_MODE_LABEL: mode} if mode is not None else {}
    return {"metadata": {"name": name, "labels": labels, "annotations": {ann.DEVICES_ANNOTATION: INVENTORY}}}


def _state(*nodes: dict[str, Any]) -> SchedulerState:
    st = SchedulerState(SchedulerConfig(), clock=lambda: NOW)
    for n in nodes:
        st.apply_node(n)
        st.apply_lease(_lease(n["metadata"]["name"]))
    st.synced.set()
    st.leader.set()
    return st


def _pod() -> dict[str, Any]:
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"}
    return {
        "metadata": {"uid": "p1", "name": "p1", "namespace": "d"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


def test_filter_refuses_a_dra_node_even_with_a_device_plugin_inventory_on_it() -> None:
    st = _state(_node("dp", None), _node("dra", "dra"))
    assert st.filter(_pod(), ["dra", "dp"]).nodes == ["dp"]
    result = st.filter(_pod(), ["dra"])  # nothing fits: every node's reason (kube-scheduler's event)
    assert result.nodes == [] and set(result.unresolvable) == {"dra"}
    assert result.unresolvable["dra"].startswith("node(s) had label openaios.io/gpu-mode=dra (DRA mode)")
    assert st.skipped() == {"malformed_inventory": 0, "plugin_lease_expired": 0}


def test_relabelling_a_node_takes_effect_at_the_next_node_event_both_ways() -> None:
    st = _state(_node("n", "dra"))
    assert st.filter(_pod(), ["n"]).nodes == []
    st.apply_node(_node("n", "device-plugin"))
    assert st.filter(_pod(), ["n"]).nodes == ["n"]
    st.apply_node(_node("n", "dra"))
    result = st.filter(_pod(), ["n"])
    assert result.nodes == [] and "DRA mode" in result.unresolvable["n"]


def test_bind_refuses_a_node_that_turned_dra_after_filter_and_frees_the_hold() -> None:
    st = _state(_node("n", None))
    st.kube = FakeKube([_pod()])
    assert st.filter(_pod(), ["n"]).nodes == ["n"]
    st.apply_node(_node("n", "dra"))
    error, kind = st.bind("d", "p1", "p1", "n")
    assert kind == "conflict" and error.startswith("node n had label openaios.io/gpu-mode=dra (DRA mode)")
    assert st.ledger.usage("n") == {} and st.kube.bound == []
