"""The simulated GPU nodes: Node objects that KWOK keeps Ready, and their fake GPUs."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_LABEL = ("gpu", "on")


@dataclass(frozen=True)
class GPUSpec:
    count: int
    memory_mib: int
    model: str
    split: int


def node_name(i: int) -> str:
    return f"vgpu-node-{i}"


def gpu_uuid(node: str, index: int) -> str:
    """Stable per (node, index), shaped like NVML's UUIDs."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{node}.gpu{index}.vgpu-sandbox"))


def fake_gpus(node: str, spec: GPUSpec) -> list[dict[str, Any]]:
    """The fake NVML description of one node's cards; NVLink pairs (0,1), (2,3), ..."""
    gpus: list[dict[str, Any]] = []
    for i in range(spec.count):
        peers: dict[str, str] = {}
        for j in range(spec.count):
            if j != i:
                peers[gpu_uuid(node, j)] = "nvlink" if j // 2 == i // 2 else "pcie"
        gpus.append(
            {
                "uuid": gpu_uuid(node, i),
                "index": i,
                "model": spec.model,
                "memoryMiB": spec.memory_mib,
                "numa": 0 if i < max(1, spec.count // 2) else 1,
                "links": peers,
            }
        )
    return gpus


def manifest(name: str, spec: GPUSpec, advertise_gpus: bool) -> dict[str, Any]:
    """A Node that KWOK manages; without a device plugin, `nvidia.com/gpu` is set here directly."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "250", "ephemeral-storage": "1Ti"}
    if advertise_gpus:
        resources["nvidia.com/gpu"] = str(spec.count * spec.split)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                GPU_LABEL[0]: GPU_LABEL[1],
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
        },
        "spec": {},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "fake",
                "kubeProxyVersion": "fake",
                "osImage": "vgpu-sandbox",
                "kernelVersion": "",
                "containerRuntimeVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }
