"""A pod of the sample image (the stub driver's CUDA) on the real node: what the demo, the tests
and the bench run there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vgpu_sandbox.realnode.layout import NAME, RESERVED, TAINT

SAMPLE_IMAGE = "docker.io/vgpu/sample:dev"
STUB_PROCS_IN_POD = "/var/run/vgpu-stub-procs"


def sample_pod(
    name: str, command: str, limits: dict[str, str] | None, card_mib: int, stub_procs: Path | None = None
) -> dict[str, Any]:
    """A pod of the sample image on the real node, running ``command`` in a shell.

    ``card_mib`` is the stub driver's card (the fake NVML describes the same size to the plugin).
    The sandbox keeps its real node to pods that ask for it; the GPU node's own taint is tolerated
    by the API server's ExtendedResourceToleration for pods asking for GPUs, so only a pod without
    ``limits`` carries that toleration itself. With ``stub_procs`` (the layout's ``stub_procs``)
    the stub driver records each process's memory there, for the device plugin's host view."""
    container: dict[str, Any] = {
        "name": "cuda",
        "image": SAMPLE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", command],
        "env": [{"name": "STUB_CUDA_MEMORY_MIB", "value": str(card_mib)}],
    }
    spec_extra: dict[str, Any] = {}
    if stub_procs is not None:
        container["env"].append({"name": "STUB_CUDA_PROCESS_DIR", "value": STUB_PROCS_IN_POD})
        container["volumeMounts"] = [{"name": "stub-procs", "mountPath": STUB_PROCS_IN_POD}]
        spec_extra["volumes"] = [
            {"name": "stub-procs", "hostPath": {"path": str(stub_procs), "type": "Directory"}}
        ]
    tolerations = [{"key": RESERVED["key"], "operator": "Exists", "effect": "NoSchedule"}]
    if limits:
        container["resources"] = {"limits": limits}
    else:
        tolerations.append({"key": TAINT["key"], "operator": "Exists", "effect": "NoSchedule"})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": NAME},
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
            "tolerations": tolerations,
            **spec_extra,
        },
    }
