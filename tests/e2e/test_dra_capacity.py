"""DRA with consumable capacity (KEP-5075) on the sandbox's control plane (Kubernetes 1.36).

The test publishes a ResourceSlice for one KWOK node, as the vGPU DRA driver will for a node's
cards: one device of the driver ``vgpu.openaios.io`` with the capacities ``memory`` and ``cores``,
each with a ``requestPolicy``, and ``allowMultipleAllocations: true``. The real kube-scheduler then
allocates ResourceClaims that consume a share of that device: two share it, a third that does not
fit waits, and gets its share once one of the first two is gone. No DRA driver runs here (KWOK
nodes have no kubelet): this is the API server's validation and kube-scheduler's allocator.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from vgpu_sandbox import nodes
from vgpu_sandbox.cluster import Sandbox

from tests.support import poll
from tests.support.dra import resource_claim
from vgpu.dra.slices import DRIVER, build_slice
from vgpu.node.discovery import Card

NODE = nodes.node_name(0)
DEVICE = "gpu-0"
CARD_MIB = 8192  # two claims of 3000Mi fit, a third does not
PREFIX = "dra-cap"


def _slice() -> dict[str, Any]:
    """The node's slice as `vgpu dra-plugin` builds it (vgpu/dra/slices.py), under this test's name."""
    card = Card(nodes.gpu_uuid(NODE, 0), 0, "NVIDIA H100 80GB HBM3", CARD_MIB, compute_capability="9.0")
    obj = build_slice(NODE, [card], 1, driver_version="570.124.6")
    obj["metadata"]["name"] = f"{PREFIX}-{NODE}"
    return obj


def _device_class() -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }


def _pod(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {"name": "cuda", "image": "cuda:fake", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }


def _get(sandbox: Sandbox, kind: str, name: str) -> dict[str, Any]:
    return json.loads(sandbox.kubectl("get", kind, name, "-o", "json").stdout)  # type: ignore[no-any-return]


def _create(sandbox: Sandbox, *objs: dict[str, Any]) -> None:
    sandbox.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)})
    )


def _allocated(sandbox: Sandbox, claim: str) -> dict[str, Any] | None:
    """The claim's single allocated device, once the claim is allocated and reserved for its pod."""
    status = _get(sandbox, "resourceclaim", claim).get("status") or {}
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    return results[0] if results and status.get("reservedFor") else None


def _unschedulable(sandbox: Sandbox, pod: str) -> str | None:
    for c in _get(sandbox, "pod", pod)["status"].get("conditions", []):
        if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
            return str(c.get("message", ""))
    return None


@pytest.fixture
def vgpu_slice(sandbox: Sandbox) -> Iterator[None]:
    served = json.loads(sandbox.kubectl("get", "--raw", "/apis/resource.k8s.io").stdout)
    versions = [v["version"] for v in served.get("versions", [])]
    assert "v1" in versions, (
        f"the API server serves resource.k8s.io {versions}, not v1: the control plane is older than "
        "1.34; point VGPU_BIN_DIR at the 1.36 cache (tools/versions.env KUBE_VERSION)"
    )
    owned_class = not sandbox.kubectl("get", "deviceclass", DRIVER, check=False).stdout.strip()
    if owned_class:
        _create(sandbox, _device_class())
    _create(sandbox, _slice())
    try:
        yield
    finally:
        sandbox.kubectl(
            "delete", "pods", f"{PREFIX}-a", f"{PREFIX}-b", f"{PREFIX}-c",
            "--grace-period=0", "--force", "--ignore-not-found", check=False,
        )  # fmt: skip
        sandbox.kubectl(
            "delete", "resourceclaims", f"{PREFIX}-a", f"{PREFIX}-b", f"{PREFIX}-c",
            "--ignore-not-found", "--wait=false", check=False,
        )  # fmt: skip
        sandbox.kubectl("delete", "resourceslice", f"{PREFIX}-{NODE}", "--ignore-not-found", check=False)
        if owned_class:
            sandbox.kubectl("delete", "deviceclass", DRIVER, "--ignore-not-found", check=False)


def test_the_api_server_keeps_the_devices_shared_capacity_and_its_request_policy(
    sandbox: Sandbox, vgpu_slice: None
) -> None:
    stored = _get(sandbox, "resourceslice", f"{PREFIX}-{NODE}")["spec"]["devices"][0]
    # Dropped silently where DRAConsumableCapacity is off: the API server clears disabled fields.
    assert stored.get("allowMultipleAllocations") is True, stored
    assert stored["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "1Mi", stored
    published = _slice()["spec"]["devices"][0]["capacity"]
    assert stored["capacity"]["cores"]["requestPolicy"] == published["cores"]["requestPolicy"], stored


def test_kube_scheduler_shares_one_device_between_claims_by_capacity_and_holds_back_one_that_does_not_fit(
    sandbox: Sandbox, vgpu_slice: None
) -> None:
    _create(
        sandbox, resource_claim(f"{PREFIX}-a"), resource_claim(f"{PREFIX}-b"), resource_claim(f"{PREFIX}-c")
    )
    _create(sandbox, _pod(f"{PREFIX}-a", f"{PREFIX}-a"), _pod(f"{PREFIX}-b", f"{PREFIX}-b"))

    shares = {}
    for name in (f"{PREFIX}-a", f"{PREFIX}-b"):
        got = poll(lambda name=name: _allocated(sandbox, name), timeout=60, every=0.5)
        assert got, (
            f"claim {name} was not allocated: "
            + sandbox.kubectl("describe", "pod", name, check=False).stdout[-2000:]
            + sandbox.kubectl("get", "resourceclaim", name, "-o", "yaml", check=False).stdout[-2000:]
        )
        assert (got["driver"], got["pool"], got["device"]) == (DRIVER, NODE, DEVICE), got
        assert got["consumedCapacity"] == {"memory": "3000Mi", "cores": "30"}, got
        assert got.get("shareID"), f"a shared device's allocation carries a shareID: {got}"
        shares[name] = got["shareID"]
        pod = _get(sandbox, "pod", name)
        assert pod["spec"].get("nodeName") == NODE, pod["spec"]
        reserved = _get(sandbox, "resourceclaim", name)["status"]["reservedFor"]
        assert [r["name"] for r in reserved] == [name], reserved
    assert shares[f"{PREFIX}-a"] != shares[f"{PREFIX}-b"], shares

    # 3000Mi + 3000Mi of 8192Mi used: a third 3000Mi does not fit (its 30 cores would).
    _create(sandbox, _pod(f"{PREFIX}-c", f"{PREFIX}-c"))
    message = poll(lambda: _unschedulable(sandbox, f"{PREFIX}-c"), timeout=60, every=0.5)
    assert message, sandbox.kubectl("describe", "pod", f"{PREFIX}-c", check=False).stdout[-2000:]
    assert not _get(sandbox, "pod", f"{PREFIX}-c")["spec"].get("nodeName")
    assert not (_get(sandbox, "resourceclaim", f"{PREFIX}-c").get("status") or {}).get("allocation")

    # The first pod gone, kube-controller-manager deallocates its claim and the third gets its share.
    sandbox.kubectl("delete", "pod", f"{PREFIX}-a", "--grace-period=0", "--force")
    got = poll(lambda: _allocated(sandbox, f"{PREFIX}-c"), timeout=90, every=0.5)
    assert got, sandbox.kubectl("describe", "pod", f"{PREFIX}-c", check=False).stdout[-2000:]
    assert got["device"] == DEVICE and got["consumedCapacity"] == {"memory": "3000Mi", "cores": "30"}, got
    assert _get(sandbox, "pod", f"{PREFIX}-c")["spec"].get("nodeName") == NODE
