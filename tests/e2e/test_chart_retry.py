"""A pod refused for lack of vGPU room is bound soon after the room frees, with the scheduler pod
the chart renders: its kube-scheduler command line and KubeSchedulerConfiguration (so
``retryRefusedSeconds`` and the back-off values as the chart passes them) run on the sandbox's
kube-scheduler binary, calling the extender on the chart's command line over the release's TLS.

What a pod's network and mounts would give the two containers is made local, and nothing else is
changed: the extender listens on 127.0.0.1 (kube-scheduler still verifies it against the release's
CA, under the Service's name, through ``tlsConfig.serverName``); kube-scheduler uses the sandbox's
admin kubeconfig, and the extender the scheduler's account as the sandbox's own extender does
(the chart's tenant-boundary policy lets that account alone write placements; the RBAC is
test_chart.py's subject; with the admin's, the test passed only after a test had uninstalled
the release and its policies); kube-scheduler
serves no health port (``--secure-port=0``: the pod's own 10259 is not ours to take here).
The node is a KWOK node of this test, tainted, with a fresh plugin Lease and an inventory
annotation of one card standing in for the device plugin.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from chart_local import local_extender_flags
from vgpu_sandbox import product
from vgpu_sandbox.cluster import Sandbox

from tests.support import container, pod, running, wait_for
from vgpu.core import annotations as ann
from vgpu.kube.client import now_micro

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vgpu"
NS = "vgpu-retry-e2e"
SCHEDULER = "vgpu-retry-e2e"
TAINT = "vgpu.openaios.io/retry-e2e"
CARD_MIB = 10000
POD_MIB = 6000  # two never fit one card together
BOUND_WITHIN_S = 15.0  # the acceptance: bound within 15 s of the room freeing


class Rendered:
    """The chart's scheduler pod: the two containers' command lines, the config and the TLS."""

    def __init__(self, sandbox: Sandbox) -> None:
        result = subprocess.run(
            [
                str(sandbox.bin("helm")), "template", "vgpu", str(CHART), "-n", NS,
                "--set", f"scheduler.schedulerName={SCHEDULER}",
            ],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        objs = [d for d in yaml.safe_load_all(result.stdout) if d]

        def one(kind: str, name: str) -> dict[str, Any]:
            (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
            return found

        pod = one("Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
        containers = {c["name"]: c for c in pod["containers"]}
        self.kube_scheduler: list[str] = containers["kube-scheduler"]["command"]
        self.extender: list[str] = containers["extender"]["command"]
        config = one("ConfigMap", "vgpu-scheduler-config")["data"]["scheduler-config.yaml"]
        self.config: dict[str, Any] = yaml.safe_load(config)
        self.tls = {k: base64.b64decode(v) for k, v in one("Secret", "vgpu-extender-tls")["data"].items()}


def node_manifest(name: str) -> dict[str, Any]:
    card = ann.Device(f"GPU-{name}-0", 0, "NVIDIA A100-SXM4-80GB", CARD_MIB, 100, 4, numa=0)
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "4"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                "kwok.x-k8s.io/node": "fake",
                ann.DEVICES_ANNOTATION: ann.encode_devices(ann.NodeInventory((card,))),
            },
            "labels": {"kubernetes.io/hostname": name, "type": "kwok", TAINT: "yes"},
        },
        "spec": {"taints": [{"key": TAINT, "value": "only", "effect": "NoSchedule"}]},
        "status": {"capacity": resources, "allocatable": resources},
    }


def pod_manifest(name: str) -> dict[str, Any]:
    return pod(
        name,
        container("main", "registry.invalid/cuda:none", gpumem=POD_MIB),
        namespace=NS,
        scheduler=SCHEDULER,
        node_selector={TAINT: "yes"},
        tolerations=[{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}],
        grace=0,
    )


def test_a_refused_pod_is_bound_within_15_s_of_the_room_freeing_with_the_charts_kube_scheduler(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    chart = Rendered(sandbox)
    # what is under test: the retry flag and back-off the chart gives kube-scheduler by default
    assert "--pod-max-in-unschedulable-pods-duration=10s" in chart.kube_scheduler
    assert chart.config["podMaxBackoffSeconds"] == 10

    # the extender, on the chart's command line, with the release's certificate
    for name, data in chart.tls.items():
        (tmp_path / name).write_bytes(data)
    port, flags = local_extender_flags(
        chart.extender, tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"
    )
    assert "--client-ca-file=/etc/vgpu/tls/ca.crt" in chart.extender  # only kube-scheduler may call
    extender = [
        sys.executable,
        "-m",
        "vgpu.commands.cli",
        "extender",
        f"--kubeconfig={product.account_kubeconfig(sandbox, 'vgpu-retry-e2e', product.SCHEDULER_ACCOUNT)}",
        *flags,
    ]

    # kube-scheduler: the chart's config, reaching the extender on 127.0.0.1 under the Service's name
    config = chart.config
    (ext,) = config["extenders"]
    service = urlsplit(ext["urlPrefix"])
    ext["urlPrefix"] = f"https://127.0.0.1:{port}"
    ext["tlsConfig"]["serverName"] = service.hostname
    # its client certificate from the release's Secret, where the chart mounts it in the pod
    assert ext["tlsConfig"]["certFile"] == "/etc/vgpu/extender-client/tls.crt"
    ext["tlsConfig"]["certFile"] = str(tmp_path / "client.crt")
    ext["tlsConfig"]["keyFile"] = str(tmp_path / "client.key")
    config["clientConnection"] = {"kubeconfig": str(sandbox.kubeconfig)}
    config_file = tmp_path / "scheduler-config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    assert chart.kube_scheduler[0] == "kube-scheduler"
    scheduler = [
        str(sandbox.bin("kube-scheduler")),
        *(f"--config={config_file}" if a.startswith("--config=") else a for a in chart.kube_scheduler[1:]),
        "--secure-port=0",
    ]

    node = "retry-e2e-" + uuid.uuid4().hex[:6]
    sandbox.kubectl("create", "namespace", NS, check=False)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    try:
        sandbox.kubectl("create", "-f", "-", input=json.dumps(node_manifest(node)))
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": ann.lease_name(node), "namespace": NS},
            "spec": {"holderIdentity": node, "leaseDurationSeconds": 3600, "renewTime": now_micro()},
        }
        sandbox.kubectl("create", "-f", "-", input=json.dumps(lease))

        def node_ready() -> bool:
            conds = sandbox.api_get(f"/api/v1/nodes/{node}").get("status", {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        wait_for(node_ready, f"node {node} Ready", 60, every=0.2)

        with (
            running(extender, tmp_path / "extender.log", env),
            running(scheduler, tmp_path / "kube-scheduler.log"),
        ):

            def pod(name: str) -> dict[str, Any]:
                got: dict[str, Any] = sandbox.api_get(f"/api/v1/namespaces/{NS}/pods/{name}")
                return got

            def refused(name: str) -> bool:
                for c in pod(name).get("status", {}).get("conditions") or []:
                    if c["type"] == "PodScheduled" and c["status"] == "False":
                        return "insufficient memory" in c.get("message", "")
                return False

            def bound(name: str) -> bool:
                return bool(pod(name)["spec"].get("nodeName"))

            def create(name: str) -> None:
                sandbox.kubectl("create", "-f", "-", input=json.dumps(pod_manifest(name)))

            create("holder-0")
            wait_for(partial(bound, "holder-0"), "the first pod bound", 90, every=0.2)
            # each round: a pod refused for lack of room, left waiting a while (so it sits in
            # kube-scheduler's unschedulable pods, its back-off over), then the room freed
            measured: list[float] = []
            holder = "holder-0"
            for i, wait_s in enumerate((2, 12, 20)):
                waiter = f"waiter-{i}"
                create(waiter)
                wait_for(partial(refused, waiter), f"{waiter} refused for lack of room", 60, every=0.2)
                time.sleep(wait_s)
                assert not bound(waiter)
                freed = time.monotonic()
                sandbox.kubectl("delete", "pod", holder, "-n", NS, "--wait=false")
                wait_for(partial(bound, waiter), f"{waiter} bound", 120, every=0.2)
                measured.append(time.monotonic() - freed)
                holder = waiter
            print(f"seconds from the room freeing to binding: {[round(m, 1) for m in measured]}")
            assert max(measured) < BOUND_WITHIN_S, measured
    finally:
        sandbox.kubectl("delete", "pods", "--all", "-n", NS, "--force", "--grace-period=0", check=False)
        sandbox.kubectl("delete", "node", node, "--wait=false", check=False)
        sandbox.kubectl("delete", "leases", "--all", "-n", NS, check=False)
        sandbox.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        for name in ("extender.log", "kube-scheduler.log"):
            if (tmp_path / name).exists():
                print(f"--- {name}\n" + (tmp_path / name).read_text()[-3000:])
