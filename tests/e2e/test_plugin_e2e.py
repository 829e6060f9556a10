"""From `kubectl apply` of a vGPU pod to the env its containers start with, through every real part.

The webhook routes the pod to vgpu-scheduler, the extender places it and writes the allocation,
KWOK runs it on a simulated node, whose kubelet stand-in calls the device plugin's Allocate over
the real socket and records the env. The env must carry the limits the scheduler chose.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from vgpu_sandbox.cluster import Sandbox
from vgpu_sandbox.kubelet import ERROR_ANNOTATION, RECORD_ANNOTATION

from tests.support import container, pod
from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    DEVICES_ANNOTATION,
    PHASE_ANNOTATION,
    decode_allocation,
    decode_devices,
)

NAME = "vgpu-e2e-plugin"
POD = pod(
    NAME,
    container("small", gpu=1, gpumem=3000, gpucores=30),
    container("pair", gpu=2, gpumem=2000, priority=0),
)


def _pod(sandbox: Sandbox) -> dict[str, Any]:
    return json.loads(sandbox.kubectl("get", "pod", "-n", "default", NAME, "-o", "json").stdout)


def test_an_applied_vgpu_pod_starts_with_the_limits_the_scheduler_chose(sandbox: Sandbox) -> None:
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(POD))
    try:
        deadline = time.monotonic() + 120
        pod = _pod(sandbox)
        while time.monotonic() < deadline:
            pod = _pod(sandbox)
            annotations = pod["metadata"].get("annotations") or {}
            if RECORD_ANNOTATION in annotations and annotations.get(PHASE_ANNOTATION) in (
                "allocated",
                "failed",
            ):
                break
            time.sleep(0.5)
        annotations = pod["metadata"].get("annotations") or {}
        described = sandbox.kubectl("describe", "pod", "-n", "default", NAME).stdout
        assert RECORD_ANNOTATION in annotations, described
        assert annotations.get(ERROR_ANNOTATION) is None, annotations.get(ERROR_ANNOTATION)
        assert annotations[PHASE_ANNOTATION] == "allocated"

        alloc = decode_allocation(annotations[ALLOCATION_ANNOTATION])
        assert alloc.node == pod["spec"]["nodeName"]
        node = json.loads(sandbox.kubectl("get", "node", alloc.node, "-o", "json").stdout)
        cards = {d.uuid for d in decode_devices(node["metadata"]["annotations"][DEVICES_ANNOTATION]).devices}
        record = json.loads(annotations[RECORD_ANNOTATION])
        assert set(record) == {"small", "pair"}
        for container in alloc.containers:
            envs = record[container.name]["envs"]
            uuids = envs["NVIDIA_VISIBLE_DEVICES"].split(",")
            assert uuids == [d.uuid for d in container.devices]
            assert set(uuids) <= cards
            for i, d in enumerate(container.devices):
                assert envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] == f"{d.memory_mib}m"
                assert envs[f"CUDA_DEVICE_SM_LIMIT_{i}"] == str(d.cores)
        small, pair = alloc.container("small"), alloc.container("pair")
        assert small is not None and pair is not None
        assert [(d.memory_mib, d.cores) for d in small.devices] == [(3000, 30)]
        assert [d.memory_mib for d in pair.devices] == [2000, 2000]
        assert len({d.uuid for d in pair.devices}) == 2  # each vGPU on its own card
        assert record["pair"]["envs"]["CUDA_TASK_PRIORITY"] == "0"
        assert record["small"]["envs"]["CUDA_TASK_PRIORITY"] == "1"

        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "vgpu.commands.cli",
                "status",
                f"--kubeconfig={sandbox.kubeconfig}",
                "-o",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        shares = [
            (s["pod"], s["container"], c["uuid"], s["memory_mib"], s["env"].get("CUDA_DEVICE_MEMORY_LIMIT_0"))
            for n in json.loads(status.stdout)
            if n["name"] == alloc.node
            for c in n["cards"]
            for s in c["shares"]
            if s["pod"] == "vgpu-e2e-plugin"
        ]
        assert ("vgpu-e2e-plugin", "small", small.devices[0].uuid, 3000, "3000m") in shares
        assert len(shares) == 3
    finally:
        sandbox.kubectl("delete", "pod", "-n", "default", NAME, "--wait=false", check=False)


def test_a_pod_giving_only_gpumem_gets_one_vgpu_and_its_limits(sandbox: Sandbox) -> None:
    """Contract 1: a vGPU resource without nvidia.com/gpu means one vGPU, and kubelet must call Allocate."""
    name = "vgpu-e2e-memory-only"
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(pod(name, container(gpumem=1500))))
    try:
        deadline = time.monotonic() + 120
        got: dict[str, Any] = {}
        while time.monotonic() < deadline:
            got = json.loads(sandbox.kubectl("get", "pod", "-n", "default", name, "-o", "json").stdout)
            annotations = got["metadata"].get("annotations") or {}
            if RECORD_ANNOTATION in annotations and annotations.get(PHASE_ANNOTATION) in (
                "allocated",
                "failed",
            ):
                break
            time.sleep(0.5)
        annotations = got["metadata"].get("annotations") or {}
        assert got["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert annotations.get(PHASE_ANNOTATION) == "allocated", annotations
        envs = json.loads(annotations[RECORD_ANNOTATION])["main"]["envs"]
        assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1500m"
        (device,) = decode_allocation(annotations[ALLOCATION_ANNOTATION]).containers[0].devices
        assert envs["NVIDIA_VISIBLE_DEVICES"] == device.uuid
    finally:
        sandbox.kubectl("delete", "pod", "-n", "default", name, "--wait=false", check=False)
