"""The sandbox is a real control plane: the real kube-scheduler places pods on simulated GPU nodes."""

from __future__ import annotations

import json

from vgpu_sandbox import binaries
from vgpu_sandbox.cluster import Sandbox
from vgpu_sandbox.kubelet import RECORD_ANNOTATION

from tests.support import container, pod, poll


def test_all_simulated_gpu_nodes_are_ready_and_labelled(sandbox: Sandbox) -> None:
    nodes = json.loads(sandbox.kubectl("get", "nodes", "-l", "gpu=on", "-o", "json").stdout)["items"]
    assert len(nodes) == 3
    for node in nodes:
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions["Ready"] == "True", node["metadata"]["name"]
        assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) > 0


def test_apiserver_reports_the_pinned_kubernetes_version(sandbox: Sandbox) -> None:
    pins = dict(
        line.split("=", 1)
        for line in (binaries.repo_root() / "tools" / "versions.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    pinned = pins["KUBE_VERSION"]  # v1.36.3
    version = json.loads(sandbox.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == pinned, (
        f"the API server is {version['serverVersion']['gitVersion']}, tools/versions.env pins {pinned}: "
        "VGPU_BIN_DIR points at a cache of another version"
    )
    assert version["serverVersion"]["minor"] == pinned.split(".")[1]


def _running(sandbox: Sandbox, name: str) -> dict:  # type: ignore[type-arg]
    """Pod ``name`` once it runs (within 90 s)."""

    def running() -> dict | None:  # type: ignore[type-arg]
        got = json.loads(sandbox.kubectl("get", "pod", name, "-o", "json").stdout)
        return got if got["status"].get("phase") == "Running" else None

    got = poll(running, timeout=90, every=0.5)
    assert got is not None, sandbox.kubectl("describe", "pod", name).stdout
    return got


def test_kube_scheduler_binds_a_pod_asking_for_one_gpu_to_a_simulated_node(sandbox: Sandbox) -> None:
    sandbox.kubectl("create", "-f", "-", input=json.dumps(pod("one-gpu", container(gpu=1))))
    try:
        got = _running(sandbox, "one-gpu")
        assert got["spec"]["nodeName"].startswith("vgpu-node-")
        conditions = {c["type"]: c["status"] for c in got["status"]["conditions"]}
        assert conditions["PodScheduled"] == "True"
    finally:
        sandbox.kubectl("delete", "pod", "one-gpu", "--wait=false", check=False)


def test_a_pod_asking_for_more_cpu_than_any_simulated_node_has_stays_pending(sandbox: Sandbox) -> None:
    too_much = pod("too-much-cpu", container(gpu=1, limits={"cpu": "1000"}))
    sandbox.kubectl("create", "-f", "-", input=json.dumps(too_much))
    try:

        def unschedulable() -> str | None:
            got = json.loads(sandbox.kubectl("get", "pod", "too-much-cpu", "-o", "json").stdout)
            for c in got["status"].get("conditions", []):
                if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                    return str(c.get("message", ""))
            return None

        message = poll(unschedulable, timeout=60, every=0.5)
        assert message and "cpu" in message, message
        got = json.loads(sandbox.kubectl("get", "pod", "too-much-cpu", "-o", "json").stdout)
        assert not got["spec"].get("nodeName")
    finally:
        sandbox.kubectl("delete", "pod", "too-much-cpu", "--wait=false", check=False)


def test_a_started_pod_carries_the_status_a_kubelet_writes_init_containers_and_sidecars_included(
    sandbox: Sandbox,
) -> None:
    """The sandbox's own pod stages (vgpu_sandbox.nodes.pod_stages) write a running pod's status:
    an init container terminated Completed, a sidecar (an init container that restarts Always)
    running, every app container running and ready, the pod Ready with an IP."""
    spec = pod("with-init", container(gpu=1, gpumem=1000))
    spec["spec"]["initContainers"] = [
        {"name": "setup", "image": "busybox"},
        {"name": "proxy", "image": "busybox", "restartPolicy": "Always"},
    ]
    sandbox.kubectl("create", "-f", "-", input=json.dumps(spec))
    try:
        status = _running(sandbox, "with-init")["status"]
        assert status.get("podIP") and status.get("hostIP") and status.get("startTime"), status
        conditions = {c["type"]: c["status"] for c in status["conditions"]}
        assert conditions["Ready"] == conditions["ContainersReady"] == conditions["Initialized"] == "True"
        inits = {c["name"]: c for c in status["initContainerStatuses"]}
        assert inits["setup"]["state"]["terminated"]["reason"] == "Completed", inits
        assert "running" in inits["proxy"]["state"] and inits["proxy"]["started"] is True, inits
        (main,) = status["containerStatuses"]
        assert main["ready"] is True and "running" in main["state"], main
    finally:
        sandbox.kubectl("delete", "pod", "with-init", "--wait=false", check=False)


JOBS = 12


def test_short_jobs_on_the_simulated_nodes_all_succeed_each_allocated_before_it_ran(sandbox: Sandbox) -> None:
    """Issue 37: KWOK ran and finished a Job's pod before the kubelet stand-in called Allocate, which
    then found no pod waiting, and the pod failed UnexpectedAdmissionError (4 of 9). A real kubelet
    starts no container before Allocate answered; KWOK now waits for the stand-in's record."""
    jobs = [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"short-{i}", "namespace": "default"},
            "spec": {
                "backoffLimit": 0,  # a failed pod fails its Job: no retry hides it
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{**container(gpu=1, gpumem=7000), "command": ["true"]}],
                    }
                },
            },
        }
        for i in range(JOBS)
    ]
    names = [j["metadata"]["name"] for j in jobs]
    sandbox.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": jobs})
    )
    try:

        def finished() -> list[dict] | None:  # type: ignore[type-arg]
            listed = json.loads(sandbox.kubectl("get", "jobs", "-n", "default", "-o", "json").stdout)["items"]
            mine = [j for j in listed if j["metadata"]["name"] in names]
            done = [
                j for j in mine if j.get("status", {}).get("succeeded") or j.get("status", {}).get("failed")
            ]
            return mine if len(done) == JOBS else None

        got = poll(finished, timeout=120, every=1)
        assert got is not None, sandbox.kubectl("get", "jobs,pods", "-n", "default").stdout
        pods = json.loads(sandbox.kubectl("get", "pods", "-n", "default", "-o", "json").stdout)["items"]
        pods = [p for p in pods if p["metadata"].get("labels", {}).get("job-name") in names]
        failed = {
            p["metadata"]["name"]: f"{p['status'].get('reason')}: {p['status'].get('message')}"
            for p in pods
            if p["status"].get("phase") != "Succeeded"
        }
        assert not failed, failed
        assert sorted(j["metadata"]["name"] for j in got if j["status"].get("succeeded") == 1) == sorted(
            names
        )
        for p in pods:  # each ran with what Allocate gave its container
            record = json.loads(p["metadata"]["annotations"][RECORD_ANNOTATION])
            assert record["main"]["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "7000m", record
    finally:
        sandbox.kubectl(
            "delete", "jobs", *names, "-n", "default", "--cascade=foreground", "--wait=false", check=False
        )
