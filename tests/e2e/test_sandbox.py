"""The sandbox is a real control plane: the real kube-scheduler places pods on simulated GPU nodes."""

from __future__ import annotations

import json
import time

from vgpu_sandbox.cluster import Sandbox


def _wait(predicate, timeout: float = 60.0, every: float = 0.5):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def test_all_simulated_gpu_nodes_are_ready_and_labelled(sandbox: Sandbox) -> None:
    nodes = json.loads(sandbox.kubectl("get", "nodes", "-l", "gpu=on", "-o", "json").stdout)["items"]
    assert len(nodes) == 3
    for node in nodes:
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions["Ready"] == "True", node["metadata"]["name"]
        assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) > 0


def test_apiserver_reports_the_pinned_kubernetes_version(sandbox: Sandbox) -> None:
    version = json.loads(sandbox.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.33.")
    assert version["serverVersion"]["minor"] == "33"


def test_kube_scheduler_binds_a_pod_asking_for_one_gpu_to_a_simulated_node(sandbox: Sandbox) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "one-gpu", "namespace": "default"},
        "spec": {
            "containers": [
                {"name": "main", "image": "cuda:fake", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ]
        },
    }
    sandbox.kubectl("create", "-f", "-", input=json.dumps(pod))
    try:

        def running() -> dict | None:  # type: ignore[type-arg]
            got = json.loads(sandbox.kubectl("get", "pod", "one-gpu", "-o", "json").stdout)
            return got if got["status"].get("phase") == "Running" else None

        got = _wait(running, timeout=90)
        assert got is not None, sandbox.kubectl("describe", "pod", "one-gpu").stdout
        assert got["spec"]["nodeName"].startswith("vgpu-node-")
        conditions = {c["type"]: c["status"] for c in got["status"]["conditions"]}
        assert conditions["PodScheduled"] == "True"
    finally:
        sandbox.kubectl("delete", "pod", "one-gpu", "--wait=false", check=False)


def test_a_pod_asking_for_more_cpu_than_any_simulated_node_has_stays_pending(sandbox: Sandbox) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "too-much-cpu", "namespace": "default"},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "cuda:fake",
                    "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "1000"}},
                }
            ]
        },
    }
    sandbox.kubectl("create", "-f", "-", input=json.dumps(pod))
    try:

        def unschedulable() -> str | None:
            got = json.loads(sandbox.kubectl("get", "pod", "too-much-cpu", "-o", "json").stdout)
            for c in got["status"].get("conditions", []):
                if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                    return str(c.get("message", ""))
            return None

        message = _wait(unschedulable, timeout=60)
        assert message and "cpu" in message, message
        got = json.loads(sandbox.kubectl("get", "pod", "too-much-cpu", "-o", "json").stdout)
        assert not got["spec"].get("nodeName")
    finally:
        sandbox.kubectl("delete", "pod", "too-much-cpu", "--wait=false", check=False)
