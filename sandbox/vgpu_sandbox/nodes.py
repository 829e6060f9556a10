"""The simulated GPU nodes: Node objects that KWOK keeps Ready, and their fake GPUs, and what KWOK
does with the pods bound to them (its stages)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import yaml

from vgpu.commands.status import RECORD_ANNOTATION  # vgpu status reads it
from vgpu.core.requests import RESOURCE_GPU

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_LABEL = ("gpu", "on")
# What the kubelet stand-in (vgpu_sandbox.kubelet) writes on a pod it admitted: each container's
# Allocate answer (RECORD_ANNOTATION, named where `vgpu status` reads it), and why admission failed
# (absent when it did not).
ERROR_ANNOTATION = "sandbox.vgpu.openaios.io/admission-error"
# The kubelet's registration socket under a KWOK node's folder, where its stand-in serves it.
KUBELET_SOCKET = "var/lib/kubelet/device-plugins/kubelet.sock"


@dataclass(frozen=True)
class GPUSpec:
    count: int
    memory_mib: int
    model: str
    split: int
    mig: str = "none"  # none, or the migStrategy of MIG_LAYOUTS the cards are partitioned for


# The simulated cards in MIG mode (``vgpu sandbox up --mig``): an H100 80GB each, its GPU
# instances by profile and start (memory slice), as the fake NVML's ``mig:`` section takes them.
MIG_MODEL = ("NVIDIA H100 80GB HBM3", 81559)
MIG_LAYOUTS: dict[str, list[dict[str, Any]]] = {
    "single": [{"profile": "1g.10gb", "start": s} for s in range(7)],
    "mixed": [
        {"profile": "1g.10gb", "start": 0},
        {"profile": "1g.10gb+me", "start": 1},
        {"profile": "2g.20gb", "start": 2},
        {"profile": "3g.40gb", "start": 4},
    ],
    "dynamic": [],  # cut on demand: no instance until a pod needs one
}


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
        if spec.mig != "none":
            gpus[-1].update(model=MIG_MODEL[0], memoryMiB=MIG_MODEL[1])
            gpus[-1]["mig"] = {"mode": "enabled", "instances": MIG_LAYOUTS[spec.mig]}
    return gpus


def manifest(name: str, spec: GPUSpec, advertise_gpus: bool) -> dict[str, Any]:
    """A Node that KWOK manages; without a device plugin, `nvidia.com/gpu` is set here directly."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "250", "ephemeral-storage": "1Ti"}
    if advertise_gpus:
        resources[RESOURCE_GPU] = str(spec.count * spec.split)
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


# The sandbox's pod stages, in KWOK's Stage API (KWOK takes either its built-in stages or the
# configuration's, so all of them are given here): a bound pod starts (its status as a kubelet
# would write it once every container runs), a Job's pod completes, a deleted pod goes. The
# status templates are Go templates over the pod, with KWOK's functions Now, Quote, NodeIPWith
# and PodIPWith (the pod's node, host network, uid, name and namespace give its IP).
_NOT_DELETED = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}
_NOT_STARTED = {"key": ".status.podIP", "operator": "DoesNotExist"}
_RUNNING = """\
{{ $at := Now | Quote }}
phase: Running
startTime: {{ $at }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName (or .spec.hostNetwork false) (or .metadata.uid "") (or .metadata.name "") (or .metadata.namespace "") | Quote }}
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $at }}}
- {type: ContainersReady, status: "True", lastTransitionTime: {{ $at }}}
- {type: Ready, status: "True", lastTransitionTime: {{ $at }}}
{{ range .spec.readinessGates }}
- {type: {{ .conditionType | Quote }}, status: "True", lastTransitionTime: {{ $at }}}
{{ end }}
initContainerStatuses:
{{ range .spec.initContainers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  restartCount: 0
  ready: true
{{ if eq .restartPolicy "Always" }}
  started: true
  state: {running: {startedAt: {{ $at }}}}
{{ else }}
  state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $at }}, finishedAt: {{ $at }}}}
{{ end }}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  restartCount: 0
  ready: true
  started: true
  state: {running: {startedAt: {{ $at }}}}
{{ end }}
"""  # noqa: E501  (one template line)
_SUCCEEDED = """\
{{ $at := Now | Quote }}
phase: Succeeded
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $at }}}
- {type: ContainersReady, status: "False", reason: PodCompleted, lastTransitionTime: {{ $at }}}
- {type: Ready, status: "False", reason: PodCompleted, lastTransitionTime: {{ $at }}}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  restartCount: 0
  ready: false
  started: false
  state: {terminated: {exitCode: 0, reason: Completed, finishedAt: {{ $at }}}}
{{ end }}
"""
# Every value a pod's containers (init containers too) give the device plugin's resource.
_ASKS_FOR_DEVICES = (
    "[(.spec.initContainers // [])[], (.spec.containers // [])[]] | .[] | "
    f'.resources.limits["{RESOURCE_GPU}"]'
)


def _stage(name: str, match: list[dict[str, Any]], next_: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": match},
            "next": next_,
        },
    }


def pod_stages() -> list[dict[str, Any]]:
    """The pod stages: a pod that asks for the device plugin's resource starts only once its
    node's kubelet stand-in admitted it (:data:`RECORD_ANNOTATION` written, no
    :data:`ERROR_ANNOTATION`), as a kubelet starts no container before the device plugin's
    Allocate answered. Without it KWOK runs, and finishes a Job's pod, before the stand-in calls
    Allocate, which then finds no pod waiting and the pod fails ``UnexpectedAdmissionError``."""
    ready = {"statusTemplate": _RUNNING}
    asks = {"key": _ASKS_FOR_DEVICES, "operator": "Exists"}
    return [
        _stage("pod-ready", [_NOT_DELETED, _NOT_STARTED, {**asks, "operator": "DoesNotExist"}], ready),
        _stage(
            "pod-ready-admitted",
            [
                _NOT_DELETED,
                _NOT_STARTED,
                asks,
                {"key": f'.metadata.annotations["{RECORD_ANNOTATION}"]', "operator": "Exists"},
                {"key": f'.metadata.annotations["{ERROR_ANNOTATION}"]', "operator": "DoesNotExist"},
            ],
            ready,
        ),
        _stage(
            "pod-complete",
            [
                _NOT_DELETED,
                {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                {"key": ".metadata.ownerReferences.[].kind", "operator": "In", "values": ["Job"]},
            ],
            {"statusTemplate": _SUCCEEDED},
        ),
        _stage(
            "pod-delete",
            [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}],
            {"finalizers": {"empty": True}, "delete": True},
        ),
    ]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the status templates) as YAML blocks, for a reader of kwok.yaml."""


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def kwok_config(stand_ins: bool) -> str:
    """KWOK's configuration: its default node stages (Ready, heartbeat); its default pod stages, or
    with ``stand_ins`` (the product's kubelet stand-ins run on the nodes) :func:`pod_stages`."""
    options = {
        "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
        "kind": "KwokConfiguration",
        "options": {"enableCNI": False, "nodeLeaseDurationSeconds": 40},
    }
    return yaml.dump_all([options, *(pod_stages() if stand_ins else [])], Dumper=_Dumper, sort_keys=False)
