"""The chart's scheduler as a pod, on a real node: the extender, the webhook and kube-scheduler
all in the scheduler Deployment's pod, TLS and RBAC as the chart makes them.

The sandbox starts without its own extender, kube-scheduler and webhook (``--scheduler-in-cluster``);
`helm install` with the values the sandbox writes for its real node (realnode/values.py)
puts the chart's scheduler pod on the real node, from the images `make images` built: the
extender's and kube-scheduler's of the cluster's version. The node has no kube-proxy, so the pod
runs in the node's network and the API server calls the webhook at the Service's endpoint
(--enable-aggregator-routing). Pods asking for vGPUs are then mutated and validated by the
webhook in that pod, placed by the kube-scheduler in that pod through the extender beside it, on
the KWOK GPU nodes and on the real node, where the kubelet runs one and the hook holds it to its
grant.

Needs what test_real_node.py needs (root, containerd, runc, the kubelet, the images); skipped
with the reason otherwise. Run it under `flock /tmp/vgpu-realnode.lock`: a machine holds one real
node.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from vgpu_sandbox import nodes
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.realnode import daemons, layout, sample

from tests.support import wait_for
from tests.support.sandboxes import real_node_sandbox
from vgpu.core import annotations as ann

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vgpu"
NODE = layout.NAME
NAMESPACE = "kube-system"  # the release's, as roles/vgpu_scheduler installs it
RELEASE = "vgpu"
KWOK_NODES = 2
CARD_MIB = 8192
SPLIT = 4
KUBE_VERSION = dict(
    line.split("=", 1) for line in (REPO / "tools" / "versions.env").read_text().splitlines() if "=" in line
)["KUBE_VERSION"]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

_FLAKY = (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError)


def _log(message: str) -> None:
    print(f"[scheduler-pod {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Cluster:
    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.lay = layout.layout_of(sandbox)

    def get(self, *args: str) -> Any:
        return json.loads(self.sandbox.kubectl("get", *args, "-o", "json").stdout)

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.sandbox.kubectl(*args, **kw)

    def scheduler_pod(self) -> dict[str, Any]:
        listed = self.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=scheduler")
        (pod,) = [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]
        return dict(pod)

    def logs(self, pod: str, container: str) -> str:
        return self.kubectl("logs", "-n", NAMESPACE, pod, "-c", container, check=False).stdout


def _helm(sandbox: Sandbox, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(sandbox.bin("helm")), f"--kubeconfig={sandbox.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with real_node_sandbox("vgpu-sp-") as sandbox:
        started = time.monotonic()
        spec = Spec(
            nodes=KWOK_NODES,
            gpus_per_node=2,
            gpu_memory_mib=CARD_MIB,
            split=SPLIT,
            real_node=True,
            local_scheduler=False,
        )
        sandbox.up(spec, progress=_log)
        _log(f"vgpu sandbox up --real-node --scheduler-in-cluster: {time.monotonic() - started:.1f}s")
        # The values `up` wrote for the playbook's chart install (inventory.yml), given to helm
        # here; the role's own steps on the node are test_real_node's.
        inventory = yaml.safe_load(layout.inventory_file(sandbox).read_text())
        values = inventory["all"]["children"]["kube_control"]["vars"]["vgpu_scheduler_values"]
        values_file = sandbox.state_dir / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        # The real node is a GPU node too (the role labels it so): the chart's device plugin runs there.
        sandbox.kubectl("label", "node", NODE, "gpu=on")
        t0 = time.monotonic()
        _helm(
            sandbox, "install", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values_file), "--wait",
            "--timeout=5m",
        )  # fmt: skip
        _log(f"helm install --wait: {time.monotonic() - t0:.1f}s")
        cluster = Cluster(sandbox)
        # helm's --wait counts the Deployment ready at once (maxUnavailable 100%): wait for the pod.
        _wait_ready(cluster)
        _log(f"the scheduler pod ready: {time.monotonic() - t0:.1f}s after helm install")
        yield cluster


def _wait_ready(cluster: Cluster) -> None:
    def ready() -> bool:
        statuses = cluster.scheduler_pod()["status"].get("containerStatuses") or []
        return len(statuses) == 2 and all(s["ready"] for s in statuses)

    try:
        wait_for(
            ready, "the chart's scheduler pod to be ready on the real node", 180, every=1.0, ignore=_FLAKY
        )
    except Exception:
        listed = cluster.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=scheduler")
        for pod in listed["items"]:
            name = pod["metadata"]["name"]
            print(json.dumps(pod["status"], indent=1)[-4000:])
            for c in ("kube-scheduler", "extender"):
                print(f"--- {name} {c}\n" + cluster.logs(name, c)[-4000:])
        raise


def test_the_charts_scheduler_pod_runs_on_the_real_node_from_the_built_images(cluster: Cluster) -> None:
    state = cluster.sandbox.state()
    assert state is not None
    # No local stand-in: the only extender and vgpu-scheduler are the pod's.
    assert not [c.name for c in state.components if c.name in ("vgpu-extender", "vgpu-scheduler")]
    pod = cluster.scheduler_pod()
    spec, status = pod["spec"], pod["status"]
    assert spec["nodeName"] == NODE and spec["hostNetwork"] is True, spec
    assert spec["serviceAccountName"] == f"{RELEASE}-scheduler"
    images = {s["name"]: s for s in status["containerStatuses"]}
    assert set(images) == {"kube-scheduler", "extender"}
    assert all(s["ready"] and "running" in s["state"] for s in images.values()), images
    assert images["kube-scheduler"]["image"] == f"registry.k8s.io/kube-scheduler:{KUBE_VERSION}"
    assert images["extender"]["image"] == "docker.io/vgpu/scheduler:dev"
    # containerd runs both, from the images tools/images.sh built and the sandbox imported.
    listed = json.loads(daemons.crictl(cluster.lay, "ps", "-o", "json").stdout)["containers"]
    running = {c["metadata"]["name"] for c in listed if c["state"] == "CONTAINER_RUNNING"}
    assert {"kube-scheduler", "extender"} <= running, running
    # kube-scheduler is the cluster's version, as the chart renders it.
    ks_log = cluster.logs(pod["metadata"]["name"], "kube-scheduler")
    assert f'"Starting Kubernetes Scheduler" version="{KUBE_VERSION}"' in ks_log, ks_log[-3000:]
    # It leads on the chart's Lease; the extender behind the Service is ready (it holds its own).
    lease = cluster.get("lease", "-n", NAMESPACE, "kube-scheduler-vgpu-scheduler")
    assert lease["spec"]["holderIdentity"], lease
    slices = cluster.get(
        "endpointslices", "-n", NAMESPACE, "-l", f"kubernetes.io/service-name={RELEASE}-extender"
    )
    ready = [
        (a, p["port"])
        for s in slices["items"]
        for e in s.get("endpoints") or []
        if e["conditions"].get("ready")
        for a in e["addresses"]
        for p in s["ports"]
    ]
    assert ready == [(layout.NODE_IP, state.ports["real-node-extender"])], slices
    _log(
        f"scheduler pod {pod['metadata']['name']} on {NODE}: kube-scheduler {KUBE_VERSION}, "
        f"extender at {layout.NODE_IP}:{state.ports['real-node-extender']}; Lease held by "
        f"{lease['spec']['holderIdentity']}"
    )


def _vgpu_pod(name: str, gpumem: int, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod for the KWOK GPU nodes (its image is never pulled there), no schedulerName: the
    webhook sets it. The real node's reservation keeps it off the real node."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"test": "scheduler-pod"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/cuda:none",
                    "resources": {
                        "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(gpumem), **(extra or {})}
                    },
                }
            ],
        },
    }


def test_vgpu_pods_are_admitted_by_the_pods_webhook_and_placed_by_its_kube_scheduler_and_extender(
    cluster: Cluster,
) -> None:
    kwok = {nodes.node_name(i) for i in range(KWOK_NODES)}
    # The validating webhook, reached by the API server at the pod on the real node, refuses
    # what can never fit, naming the field.
    greedy = _vgpu_pod("too-many-cores", 1000, {"nvidia.com/gpucores": "150"})
    refused = cluster.kubectl("apply", "-f", "-", input=json.dumps(greedy), check=False)
    assert refused.returncode != 0 and "validate.vgpu.openaios.io" in refused.stderr, refused.stderr
    assert "nvidia.com/gpucores" in refused.stderr, refused.stderr
    _log(f"webhook refusal: {refused.stderr.strip()[:300]}")

    names = [f"vgpu-{i}" for i in range(3)]
    for name in names:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(_vgpu_pod(name, 3000)))
    # A pod for the real node: it runs there, its grant held by the hook.
    runner = sample.sample_pod(
        "vgpu-real", "t_alloc link alloc 256", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"}, CARD_MIB
    )
    cluster.kubectl("apply", "-f", "-", input=json.dumps(runner))

    def placed() -> dict[str, dict[str, Any]] | None:
        got = {n: cluster.get("pod", "-n", "default", n) for n in [*names, "vgpu-real"]}
        done = all(
            p["spec"].get("nodeName")
            and ann.ALLOCATION_ANNOTATION in (p["metadata"].get("annotations") or {})
            for p in got.values()
        )
        return got if done else None

    got = wait_for(placed, "the four vGPU pods to be placed and annotated", 120, every=1.0, ignore=_FLAKY)
    for name, pod in got.items():
        assert pod["spec"]["schedulerName"] == "vgpu-scheduler", name  # the mutating webhook
        annotations = pod["metadata"]["annotations"]
        allocation = ann.decode_allocation(annotations[ann.ALLOCATION_ANNOTATION])
        node = pod["spec"]["nodeName"]
        assert allocation.node == node and (node in kwok) == (name != "vgpu-real"), (name, node)
        (container,) = allocation.containers
        (device,) = container.devices
        # a card of that node, from the inventory its device plugin wrote
        inventory = ann.decode_devices(
            cluster.get("node", node)["metadata"]["annotations"][ann.DEVICES_ANNOTATION]
        )
        assert device.memory_mib == 3000 and device.uuid in {d.uuid for d in inventory.devices}, allocation
        assert annotations.get(ann.PHASE_ANNOTATION) in (ann.PHASE_BOUND, ann.PHASE_ALLOCATED), annotations
        _log(
            f"{name}: {node} {device.uuid} {device.memory_mib} MiB ({annotations.get(ann.PHASE_ANNOTATION)})"
        )

    # It was the pod's kube-scheduler that bound them, through the pod's extender.
    pod = cluster.scheduler_pod()["metadata"]["name"]
    ks_log = cluster.logs(pod, "kube-scheduler")
    for name in [*names, "vgpu-real"]:
        assert re.search(rf'"Successfully bound pod to node" pod="default/{name}"', ks_log), ks_log[-3000:]

    # On the real node the kubelet asked the chart's device plugin, and the hook holds the grant.
    def ran() -> str:
        out = cluster.kubectl("logs", "-n", "default", "vgpu-real", check=False).stdout
        return out if "alive=1" in out else ""

    fields = dict(re.findall(r"^(\w+)=(.*)$", wait_for(ran, "vgpu-real's output", 180, every=1.0), re.M))
    assert int(fields["refused"]) == 2 and 8 <= int(fields["chunks"]) <= 11, fields
    assert cluster.get("pod", "-n", "default", "vgpu-real")["metadata"]["annotations"][
        ann.PHASE_ANNOTATION
    ] == (ann.PHASE_ALLOCATED)
    _log(f"vgpu-real on {NODE}: t_alloc chunks={fields['chunks']} refused={fields['refused']} (256 MiB each)")


def test_a_pod_that_cannot_fit_stays_pending_with_the_extenders_reason(cluster: Cluster) -> None:
    big = CARD_MIB + 808
    cluster.kubectl("apply", "-f", "-", input=json.dumps(_vgpu_pod("too-big", big)))

    def reason() -> str:
        out = cluster.kubectl(
            "get", "events", "-n", "default", "--field-selector", "involvedObject.name=too-big", "-o", "json"
        )
        found = [e for e in json.loads(out.stdout)["items"] if e.get("reason") == "FailedScheduling"]
        return str(found[-1]["message"]) if found else ""

    message = wait_for(reason, "a FailedScheduling event for too-big", 60, every=1.0, ignore=_FLAKY)
    pod = cluster.get("pod", "-n", "default", "too-big")
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName"), pod["status"]
    assert pod["spec"]["schedulerName"] == "vgpu-scheduler"
    # The extender's reason, per card, through kube-scheduler's event.
    assert f"smaller than asked ({CARD_MIB} MiB)" in message and f"{big} MiB" in message, message
    event = [
        e
        for e in cluster.get("events", "-n", "default", "--field-selector", "involvedObject.name=too-big")[
            "items"
        ]
        if e.get("reason") == "FailedScheduling"
    ][-1]
    assert (event.get("reportingComponent") or event["source"].get("component")) == "vgpu-scheduler", event
    _log(f"too-big ({big} MiB) Pending: {message[:300]}")
