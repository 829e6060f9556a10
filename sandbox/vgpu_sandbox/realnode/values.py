"""What the playbook gets for a sandbox with a real node: the Ansible inventory (the KWOK nodes
and the real node as GPU hosts) and the chart values the real node needs, the device plugin's
(:func:`chart_values`) and, with ``--scheduler-in-cluster``, the scheduler pod's
(:func:`scheduler_values`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from vgpu_sandbox import binaries, nodes, realruntime
from vgpu_sandbox.realnode.layout import (
    FAKE_NVML_MOUNT,
    NAME,
    TOLERATIONS,
    NodeLayout,
    layout_of,
    pod_cgroups,
)
from vgpu_sandbox.runtime import Handle, Spec


def merge(into: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` merged into ``into`` (dicts key by key, anything else replaced); returns ``into``."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
    return into


def inventory(sandbox: Handle, spec: Spec, ctk: Path | None, values: dict[str, Any]) -> dict[str, Any]:
    """``inventory/sandbox.yml`` with this sandbox's KWOK nodes and the real node as GPU hosts, and
    the chart values the real node needs merged into the control host's."""
    base = yaml.safe_load((binaries.repo_root() / "inventory" / "sandbox.yml").read_text())
    children = base["all"]["children"]
    control_vars = children["kube_control"].setdefault("vars", {})
    control_vars["vgpu_scheduler_values"] = merge(control_vars.get("vgpu_scheduler_values") or {}, values)
    kwok_vars = children["gpu_nodes"]["vars"]
    lay = layout_of(sandbox)
    real_vars = {
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "ansible_become": False,
        "gpu_node_prepare_host": True,
        # No driver: the fake NVML backend describes the cards, the sample image has the stub.
        "gpu_node_driver_check": False,
        # The toolkit's package comes from NVIDIA's repository; here nvidia-ctk is built from Go
        # modules (tools/build.sh nvidia-ctk), as a node image with the toolkit baked in has it.
        "gpu_node_install_toolkit": False,
        "gpu_node_nvidia_ctk": str(ctk) if ctk else "/usr/bin/nvidia-ctk",
        "gpu_node_container_runtime": "containerd",
        "gpu_node_containerd_config": str(lay.containerd_config),
        # NVIDIA's runtime, built from Go modules, containerd's default in CDI mode (realruntime)
        **realruntime.role_vars(lay.root),
        "gpu_node_backup": False,
        # containerd runs under the sandbox, not systemd.
        "gpu_node_containerd_restart_command": [
            str(Path(sys.executable).parent / "vgpu"),
            "sandbox",
            f"--dir={sandbox.state_dir}",
            "restart",
            "containerd",
        ],
    }
    children["gpu_nodes"] = {
        "hosts": {
            **{nodes.node_name(i): {**kwok_vars} for i in range(spec.nodes)},
            NAME: real_vars,
        },
    }
    return base


def chart_values(sandbox: Handle, spec: Spec, lay: NodeLayout, monitor_port: int) -> dict[str, Any]:
    """What the chart's device-plugin DaemonSet needs on this real node (and harmlessly on KWOK's)."""
    state = sandbox.state()
    assert state is not None
    api_port = state.ports["apiserver"]
    return {
        # The cards reach containers as CDI devices of the stub's spec (realruntime): no driver here
        # to hand out, and NVIDIA's runtime in the path refuses a container's own variable.
        "driver": {"inject": "cdi"},
        "devicePlugin": {
            "image": {
                "registry": "docker.io",
                "repository": "vgpu/device-plugin",
                "tag": "dev",
                "pullPolicy": "Never",
            },
            # The sandbox runs no kube-proxy: the pod reaches the API server on the node's
            # 127.0.0.1 through the host's network, at the address the API server advertises.
            "hostNetwork": True,
            "extraEnv": [
                {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)},
            ],
            "extraArgs": [f"--fake-nvml={FAKE_NVML_MOUNT}/gpus.yaml"],
            "extraVolumes": [
                {"name": "fake-nvml", "hostPath": {"path": str(lay.gpus_file.parent), "type": "Directory"}}
            ],
            "extraVolumeMounts": [{"name": "fake-nvml", "mountPath": FAKE_NVML_MOUNT, "readOnly": True}],
            "monitor": {"port": monitor_port},
            # the kubelet's pod cgroups here (cgroupfs driver), for the throttle's freezer alone
            "hostPaths": {"podCgroups": [str(pod_cgroups())]},
            "deviceSplitCount": spec.split,
            "tolerations": TOLERATIONS,
        },
    }


def scheduler_values(sandbox: Handle) -> dict[str, Any]:
    """What the chart's scheduler Deployment needs to run on this real node: the extender, its
    kube-scheduler and the webhook in one pod, TLS and RBAC as the chart makes them.

    The node has no kube-proxy, so the pod runs in the node's network (``hostNetwork``): both
    containers reach the API server at the 127.0.0.1 it advertises (``KUBERNETES_SERVICE_HOST``
    and ``_PORT``, the in-cluster client's address), kube-scheduler calls the extender of its own
    pod (``extender.route=pod``, TLS verified against the release's CA), and the API server
    calls the webhook at the Service's ready endpoint (``--enable-aggregator-routing``). The
    pod's three ports are the machine's, so each is a free one the sandbox records."""
    state = sandbox.state()
    assert state is not None
    env = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(state.ports["apiserver"])},
    ]
    return {
        "webhook": {"enabled": True},
        "scheduler": {
            "hostNetwork": True,
            "nodeSelector": {"kubernetes.io/hostname": NAME},
            "tolerations": TOLERATIONS,
            "kubeScheduler": {
                # the image tools/images.sh built from the cluster's own kube-scheduler, imported
                "image": {"pullPolicy": "Never"},
                "port": sandbox.port("real-node-kube-scheduler"),
                "extraEnv": env,
            },
            "extender": {
                "image": {"tag": "dev", "pullPolicy": "Never"},
                "port": sandbox.port("real-node-extender"),
                "route": "pod",
                "extraEnv": env,
            },
            "metrics": {"port": sandbox.port("real-node-scheduler-metrics")},
        },
    }
