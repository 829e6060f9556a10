"""The real node's configuration files and inventory, as `vgpu sandbox up --real-node` writes them
(tests/e2e/test_real_node.py runs them with the real kubelet and containerd)."""

from __future__ import annotations

import ipaddress
import subprocess
import tomllib
from pathlib import Path

import pytest
from vgpu_sandbox import binaries
from vgpu_sandbox.cluster import Sandbox, Spec, State
from vgpu_sandbox.errors import SandboxError
from vgpu_sandbox.realnode import configs, layout, prechecks, values


def test_containerd_keeps_every_path_under_the_node_and_sets_what_the_kubelet_needs(tmp_path: Path) -> None:
    lay = layout.NodeLayout(tmp_path / "real-node")
    config = tomllib.loads(configs.containerd_config(lay, "registry.k8s.io/pause:3.10", Path("/usr/lib/cni")))
    assert config["version"] == 3  # containerd 2's layout: the CRI split in images and runtime
    paths = [config["root"], config["state"], config["grpc"]["address"]]
    images = config["plugins"]["io.containerd.cri.v1.images"]
    runtime = config["plugins"]["io.containerd.cri.v1.runtime"]
    runc = runtime["containerd"]["runtimes"]["runc"]
    paths += [
        runc["options"]["Root"],
        runtime["cni"]["conf_dir"],
        config["plugins"]["io.containerd.internal.v1.opt"]["path"],
    ]
    assert all(p.startswith(str(lay.root) + "/") for p in paths), paths
    assert images["pinned_images"]["sandbox"] == "registry.k8s.io/pause:3.10"
    assert images["snapshotter"] == "overlayfs"
    assert runtime["restrict_oom_score_adj"] is True and runc["options"]["SystemdCgroup"] is False
    assert runtime["cni"]["bin_dirs"] == ["/usr/lib/cni"]
    # CDI, where DRA drivers (/var/run/cdi) and nvidia-ctk (/etc/cdi) put their device specs.
    assert runtime["enable_cdi"] is True and runtime["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
    # The shim that came with this containerd, never another one on PATH (Debian's 1.6).
    assert runc["runtime_path"] == str((binaries.bin_dir() / "containerd-shim-runc-v2").resolve())
    assert "io.containerd.nri.v1.nri" in config["disabled_plugins"]  # its socket is a host path


def test_without_containerd_2_built_the_reason_names_the_piece_to_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "current").mkdir()
    # a cache built before containerd was one of its pieces (with nvidia-ctk's runtime)
    for name in ("kubelet", "crictl", "nvidia-container-runtime"):
        (tmp_path / "current" / name).touch(mode=0o755)
    monkeypatch.setenv("VGPU_BIN_DIR", str(tmp_path))
    monkeypatch.setattr(prechecks.os, "geteuid", lambda: 0)
    monkeypatch.setattr(prechecks, "system_binary", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(prechecks, "cni_dir", lambda: Path("/usr/lib/cni"))
    monkeypatch.setattr(prechecks.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    reason = prechecks.why_not()
    assert reason is not None
    assert "containerd, containerd-shim-runc-v2, ctr not built" in reason, reason
    assert "tools/build.sh kubelet containerd crictl" in reason and "VGPU_BIN_DIR" in reason, reason


def test_the_kubelet_answers_only_the_sandboxs_ca_on_the_nodes_own_address(tmp_path: Path) -> None:
    lay = layout.NodeLayout(tmp_path)
    config = configs.kubelet_config(
        lay, 10250, 10248, tmp_path / "ca.crt", (tmp_path / "k.crt", tmp_path / "k.key")
    )
    assert config["address"] == layout.NODE_IP and config["readOnlyPort"] == 0
    assert config["authentication"]["anonymous"]["enabled"] is False
    assert config["authentication"]["x509"]["clientCAFile"] == str(tmp_path / "ca.crt")
    assert config["registerWithTaints"] == [layout.TAINT, layout.RESERVED]
    dra = configs.kubelet_config(
        lay, 10250, 10248, tmp_path / "ca.crt", (tmp_path / "k.crt", tmp_path / "k.key"), dra=True
    )
    assert dra["registerWithTaints"] == [layout.TAINT]  # a DRA pod tolerates a GPU node's taint only
    assert config["containerRuntimeEndpoint"] == f"unix://{lay.containerd_socket}"
    assert config["failCgroupV1"] is False  # the kubelet 1.35+ refuses cgroup v1 hosts otherwise
    # The node's address is the bridge's gateway, inside the pods' subnet and not loopback.
    ip = ipaddress.ip_address(layout.NODE_IP)
    assert ip in ipaddress.ip_network(layout.POD_SUBNET) and not ip.is_loopback
    bridge = configs.cni_config(lay)["plugins"][0]
    assert bridge["bridge"] == layout.BRIDGE and bridge["ipam"]["dataDir"] == str(lay.cni_data)


def test_the_inventory_adds_the_real_node_and_merges_its_chart_values(tmp_path: Path) -> None:
    sandbox = Sandbox(tmp_path)
    sandbox.layout.state_file.write_text(State(spec=Spec(), ports={"apiserver": 6443}).to_json())
    spec = Spec(nodes=2, split=4, real_node=True)
    lay = layout.layout_of(sandbox)
    chart_values = values.chart_values(sandbox, spec, lay, 9555)
    inventory = values.inventory(sandbox, spec, Path("/opt/ctk"), chart_values)
    children = inventory["all"]["children"]
    hosts = children["gpu_nodes"]["hosts"]
    assert set(hosts) == {"vgpu-node-0", "vgpu-node-1", layout.NAME}
    assert hosts["vgpu-node-0"]["gpu_node_prepare_host"] is False
    real = hosts[layout.NAME]
    assert real["gpu_node_containerd_config"] == str(lay.containerd_config)
    assert real["gpu_node_install_toolkit"] is False and real["gpu_node_nvidia_ctk"] == "/opt/ctk"
    assert real["gpu_node_containerd_restart_command"][-3:] == [
        f"--dir={sandbox.state_dir}",
        "restart",
        "containerd",
    ]
    chart = children["kube_control"]["vars"]["vgpu_scheduler_values"]
    assert chart["webhook"]["enabled"] is False  # inventory/sandbox.yml's own values are kept
    plugin = chart["devicePlugin"]
    assert plugin["monitor"]["port"] == 9555
    # inventory/sandbox.yml's tenant boundary is kept: the sandbox lets default ask for priority 0
    assert chart["tenantBoundary"]["highPriorityNamespaces"] == ["default"]
    assert plugin["deviceSplitCount"] == 4 and plugin["hostNetwork"] is True
    assert {t["key"] for t in plugin["tolerations"]} == {layout.TAINT["key"], layout.RESERVED["key"]}
    assert {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"} in plugin["extraEnv"]


def test_with_the_scheduler_in_cluster_the_charts_scheduler_pod_goes_to_the_real_node(tmp_path: Path) -> None:
    """The values up --scheduler-in-cluster merges into the inventory: the chart's webhook on, its
    scheduler pod on the real node's network, each port a free one the sandbox records."""
    sandbox = Sandbox(tmp_path)
    started = State(spec=Spec(), ports={"apiserver": 6443})
    sandbox.layout.state_file.write_text(started.to_json())
    sandbox.adopt(started)  # as during up: the ports are handed out into its record
    spec = Spec(nodes=1, real_node=True, local_scheduler=False)
    lay = layout.layout_of(sandbox)
    chart_values = values.merge(
        values.chart_values(sandbox, spec, lay, 9555), values.scheduler_values(sandbox)
    )
    chart = values.inventory(sandbox, spec, None, chart_values)["all"]["children"]["kube_control"]["vars"][
        "vgpu_scheduler_values"
    ]
    assert chart["webhook"]["enabled"] is True  # the pod's webhook replaces the sandbox's own
    assert chart["devicePlugin"]["hostNetwork"] is True  # the plugin's values are kept
    s = chart["scheduler"]
    assert s["hostNetwork"] is True and s["extender"]["route"] == "pod"
    assert s["nodeSelector"] == {"kubernetes.io/hostname": layout.NAME}
    assert {t["key"] for t in s["tolerations"]} == {layout.TAINT["key"], layout.RESERVED["key"]}
    api = {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}
    assert api in s["kubeScheduler"]["extraEnv"] and api in s["extender"]["extraEnv"]
    assert chart["tenantBoundary"]["highPriorityNamespaces"] == ["default"]  # the inventory's own values kept
    state = sandbox.state()
    assert state is not None
    ports = [s["kubeScheduler"]["port"], s["extender"]["port"], s["metrics"]["port"]]
    assert ports == [
        state.ports[f"real-node-{n}"] for n in ("kube-scheduler", "extender", "scheduler-metrics")
    ]
    assert len(set(ports)) == 3


def test_the_scheduler_in_cluster_needs_the_real_node() -> None:
    with pytest.raises(SandboxError, match="--scheduler-in-cluster needs --real-node"):
        Spec(local_scheduler=False).validate()
    Spec(local_scheduler=False, real_node=True).validate()


def test_without_root_the_reason_names_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prechecks.os, "geteuid", lambda: 1000)
    reason = prechecks.why_not()
    assert reason is not None and "needs root" in reason


def test_without_images_the_reason_names_make_images(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VGPU_IMAGE_DIR", str(tmp_path))
    assert layout.built_images() == {}
    (tmp_path / "images.json").write_text('{"pause": {"ref": "p", "file": "/nonexistent"}, "x": 1}')
    assert layout.built_images() == {}
