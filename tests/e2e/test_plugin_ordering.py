"""Many vGPU pods landing on one node at once: every container starts with its own pod's limits.

kubelet's Allocate never names the pod; the plugin must serve the pod kubelet is admitting.
Eight pods applied in one `kubectl apply`, created within seconds, pinned to one node,
each asking for a different amount of memory and compute: the env the kubelet stand-in
recorded for each container must be exactly its own pod's allocation (memory, SM limit,
cards, priority, and the region folder named after its own pod UID). Repeated a few rounds,
since the order in which the scheduler binds them varies.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import pytest
from vgpu_sandbox.cluster import Sandbox
from vgpu_sandbox.kubelet import ERROR_ANNOTATION, RECORD_ANNOTATION

from tests.support import container, pod
from vgpu.core.annotations import ALLOCATION_ANNOTATION, PHASE_ANNOTATION, decode_allocation
from vgpu.kube.lease import parse_time

NODE = "vgpu-node-1"
PODS = 8
ROUNDS = 3


def _limits(i: int) -> tuple[int, int, int]:
    """Memory (MiB), cores (%) and priority of pod ``i``: no two pods alike."""
    return 1000 + 250 * i, 5 + 3 * i, i % 2


def _pods(round_id: str) -> list[dict[str, Any]]:
    pods = []
    for i in range(PODS):
        mem, cores, priority = _limits(i)
        pods.append(
            pod(
                f"order-{round_id}-{i}",
                container(gpu=1, gpumem=mem, gpucores=cores, priority=priority),
                labels={"order": round_id},
                node_selector={"kubernetes.io/hostname": NODE},
            )
        )
    return pods


def _listed(sandbox: Sandbox, round_id: str) -> list[dict[str, Any]]:
    out = sandbox.kubectl("get", "pods", "-n", "default", "-l", f"order={round_id}", "-o", "json").stdout
    return list(json.loads(out)["items"])


def _settled(pod: dict[str, Any]) -> bool:
    ann = pod["metadata"].get("annotations") or {}
    return RECORD_ANNOTATION in ann and (
        ann.get(PHASE_ANNOTATION) in ("allocated", "failed") or ann.get(ERROR_ANNOTATION) is not None
    )


@pytest.mark.parametrize("round_no", range(ROUNDS))
def test_pods_applied_at_once_on_one_node_each_start_with_their_own_limits(
    sandbox: Sandbox, round_no: int
) -> None:
    round_id = f"{round_no}{secrets.token_hex(2)}"
    manifest = {"apiVersion": "v1", "kind": "List", "items": _pods(round_id)}
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    try:
        deadline = time.monotonic() + 120
        pods = _listed(sandbox, round_id)
        while time.monotonic() < deadline:
            pods = _listed(sandbox, round_id)
            if len(pods) == PODS and all(_settled(p) for p in pods):
                break
            time.sleep(0.5)
        assert len(pods) == PODS
        unsettled = [p["metadata"]["name"] for p in pods if not _settled(p)]
        assert not unsettled, sandbox.kubectl("describe", "pod", "-n", "default", *unsettled).stdout
        # applied at once, so the node admits them side by side: within a second or two on a quiet
        # machine; the API server's writes spread them over 4 s under a writeback flood
        created = sorted(t.timestamp() for p in pods if (t := parse_time(p["metadata"]["creationTimestamp"])))
        assert len(created) == PODS, [p["metadata"]["creationTimestamp"] for p in pods]
        assert created[-1] - created[0] <= 10, (
            f"not applied at once: created over {created[-1] - created[0]} s"
        )

        for pod in pods:
            meta, ann = pod["metadata"], pod["metadata"]["annotations"]
            name, uid = meta["name"], meta["uid"]
            assert ann.get(ERROR_ANNOTATION) is None, f"{name}: {ann.get(ERROR_ANNOTATION)}"
            assert pod["spec"]["nodeName"] == NODE
            alloc = decode_allocation(ann[ALLOCATION_ANNOTATION])
            [container] = alloc.containers
            [device] = container.devices
            mem, cores, priority = _limits(int(name.rsplit("-", 1)[1]))
            assert (device.memory_mib, device.cores) == (mem, cores), name
            record = json.loads(ann[RECORD_ANNOTATION])["main"]
            envs = record["envs"]
            folders = [
                m["containerPath"]
                for m in record["mounts"]
                if m["containerPath"].startswith("/var/lib/vgpu/")
            ]
            assert folders == [f"/var/lib/vgpu/containers/{uid}_main"], name
            assert envs["NVIDIA_VISIBLE_DEVICES"] == device.uuid, name
            assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{device.memory_mib}m", name
            assert envs["CUDA_DEVICE_SM_LIMIT_0"] == str(device.cores), name
            assert envs["CUDA_TASK_PRIORITY"] == str(priority), name
            assert (
                envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == f"/var/lib/vgpu/containers/{uid}_main/vgpu.region"
            )
            assert ann[PHASE_ANNOTATION] == "allocated", name
    finally:
        sandbox.kubectl(
            "delete", "pods", "-n", "default", "-l", f"order={round_id}", "--wait=false", check=False
        )
