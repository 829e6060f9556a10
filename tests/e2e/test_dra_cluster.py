"""DRA's cluster side against the sandbox's real API server and kube-scheduler (Kubernetes 1.34+;
shares of a card 1.36+): the chart's DRA objects accepted by the server, and the example claim
templates allocated by kube-scheduler's own DRA allocator from a ResourceSlice of the shape the
vgpu DRA plugin publishes, on a KWOK node labelled openaios.io/gpu-mode=dra.

On a control plane older than 1.34 (tools/versions.env pins 1.36) the module skips, naming why.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from vgpu_sandbox.cluster import Sandbox

from tests.support import wait_for
from tests.support.dra import vgpu_config
from vgpu.core.claimconfig import VgpuConfig
from vgpu.dra.claims import plan
from vgpu.dra.slices import DRIVER, build_slice
from vgpu.node.discovery import Card

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vgpu"
NS = "vgpu-dra-e2e"
TAINT = "vgpu.openaios.io/dra-e2e"


def server_version(sandbox: Sandbox) -> str:
    out = sandbox.kubectl("version", "-o", "json")
    return str(json.loads(out.stdout)["serverVersion"]["gitVersion"])


@pytest.fixture(scope="module")
def dra(sandbox: Sandbox) -> Iterator[str]:
    version = server_version(sandbox)
    if "resource.k8s.io/v1" not in sandbox.kubectl("api-versions").stdout.split():
        pytest.skip(
            f"the sandbox's API server ({version}) serves no resource.k8s.io/v1 (Kubernetes 1.34+): "
            "run `make setup` (tools/versions.env pins 1.36)"
        )
    sandbox.kubectl("create", "namespace", NS)
    try:
        yield version
    finally:
        sandbox.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        sandbox.kubectl("delete", "deviceclass", DRIVER, "--ignore-not-found", check=False)


def render(sandbox: Sandbox, version: str) -> str:
    result = subprocess.run(
        [str(sandbox.bin("helm")), "template", "vgpu", str(CHART), "-n", NS, "--set", "dra.enabled=true"]
        + ["--kube-version", version.lstrip("v").split("+")[0]],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_api_server_accepts_every_dra_object_of_the_chart(sandbox: Sandbox, dra: str) -> None:
    rendered = render(sandbox, dra)
    result = sandbox.kubectl("apply", "--dry-run=server", "-n", NS, "-f", "-", input=rendered)
    applied = result.stdout
    for what in (
        "deviceclass.resource.k8s.io/vgpu.openaios.io",
        "daemonset.apps/vgpu-dra-plugin",
        "validatingadmissionpolicy.admissionregistration.k8s.io/vgpu-vgpu-dra-e2e-dra-plugin-slices",
        "clusterrole.rbac.authorization.k8s.io/vgpu-vgpu-dra-e2e-dra-plugin",
    ):
        assert f"{what} created (server dry run)" in applied, applied


def _node(name: str) -> dict[str, Any]:
    res = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {"kubernetes.io/hostname": name, "type": "kwok", "openaios.io/gpu-mode": "dra"},
        },
        "spec": {"taints": [{"key": TAINT, "value": "only", "effect": "NoSchedule"}]},
        "status": {"capacity": res, "allocatable": res},
    }


def _slice(node: str, model: str, memory_mib: int) -> dict[str, Any]:
    """The node's slice as `vgpu dra-plugin` builds it (vgpu/dra/slices.py): one card."""
    card = Card(f"GPU-{node}", 0, model, memory_mib, compute_capability="9.0")
    return build_slice(node, [card], 1, driver_version="570.124.6")


def _example(kind: str, name: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all((REPO / "examples" / "dra.yaml").read_text()):
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            doc["metadata"]["namespace"] = NS
            return dict(doc)
    raise AssertionError(f"examples/dra.yaml has no {kind} {name}")


def _pod(name: str, template: str, node: str) -> dict[str, Any]:
    pod = _example("Pod", "dra-small-slice")
    pod["metadata"] = {"name": name, "namespace": NS}
    pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = template
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    pod["spec"]["tolerations"] = [{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}]
    pod["spec"]["terminationGracePeriodSeconds"] = 0
    return pod


def _apply(sandbox: Sandbox, *objs: dict[str, Any]) -> None:
    doc = {"apiVersion": "v1", "kind": "List", "items": list(objs)}
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(doc))


def _get(sandbox: Sandbox, *args: str) -> Any:
    return json.loads(sandbox.kubectl("get", "-o", "json", *args).stdout)


def _claim_of(sandbox: Sandbox, pod: str) -> dict[str, Any] | None:
    for claim in _get(sandbox, "resourceclaims", "-n", NS)["items"]:
        owners = claim["metadata"].get("ownerReferences") or []
        if any(o.get("name") == pod for o in owners) and (claim.get("status") or {}).get("allocation"):
            return dict(claim)
    return None


def _scheduled_message(sandbox: Sandbox, pod: str) -> str:
    p = _get(sandbox, "pod", "-n", NS, pod)
    conds = [c for c in p.get("status", {}).get("conditions") or [] if c["type"] == "PodScheduled"]
    return str(conds[0].get("message", "")) if conds and conds[0]["status"] == "False" else ""


def test_kube_scheduler_shares_a_card_by_the_example_templates_capacities(sandbox: Sandbox, dra: str) -> None:
    node = "dra-e2e-" + uuid.uuid4().hex[:6]
    whole_node = node + "-a100"
    rendered = [d for d in yaml.safe_load_all(render(sandbox, dra)) if d and d["kind"] == "DeviceClass"]
    _apply(sandbox, *rendered, _node(node), _node(whole_node))
    try:
        _apply(
            sandbox, _slice(node, "NVIDIA A100", 10000), _slice(whole_node, "NVIDIA A100-SXM4-80GB", 81920)
        )
        _apply(sandbox, _example("ResourceClaimTemplate", "vgpu-3000mi-30"))
        _apply(sandbox, _example("ResourceClaimTemplate", "vgpu-whole-a100-80gb"))
        # a 10000 MiB card: three claims of 3000 MiB and 30 cores share it, the fourth has no room
        _apply(sandbox, *[_pod(f"share-{i}", "vgpu-3000mi-30", node) for i in range(4)])
        wait_for(
            lambda: sum(_claim_of(sandbox, f"share-{i}") is not None for i in range(4)) == 3,
            "three claims allocated on the card",
            120,
            every=0.5,
        )
        claims = [c for c in (_claim_of(sandbox, f"share-{i}") for i in range(4)) if c is not None]
        for claim in claims:
            [result] = claim["status"]["allocation"]["devices"]["results"]
            assert (result["driver"], result["pool"], result["device"]) == (DRIVER, node, "gpu-0")
            consumed = result["consumedCapacity"]
            assert (consumed["memory"], consumed["cores"]) == ("3000Mi", "30"), consumed
        assert len({c["status"]["allocation"]["devices"]["results"][0].get("shareID") for c in claims}) == 3
        left = next(f"share-{i}" for i in range(4) if _claim_of(sandbox, f"share-{i}") is None)
        wait_for(lambda: "cannot allocate all claims" in _scheduled_message(sandbox, left), "the reason", 60)
        # the whole A100: all its memory and cores, and no room beside it for any other claim
        _apply(
            sandbox,
            _pod("whole", "vgpu-whole-a100-80gb", whole_node),
            _pod("beside", "vgpu-3000mi-30", whole_node),
        )
        wait_for(lambda: _claim_of(sandbox, "whole") is not None, "the whole card allocated", 120, every=0.5)
        [result] = _claim_of(sandbox, "whole")["status"]["allocation"]["devices"]["results"]  # type: ignore[index]
        # 81920Mi, as the API server writes it
        assert result["consumedCapacity"] == {"memory": "80Gi", "cores": "100"}
        wait_for(
            lambda: "cannot allocate all claims" in _scheduled_message(sandbox, "beside"),
            "beside refused",
            60,
        )
    finally:
        sandbox.kubectl("delete", "pods", "-n", NS, "--all", "--wait=false", check=False)
        sandbox.kubectl("delete", "resourceslices", f"{node}-{DRIVER}", f"{whole_node}-{DRIVER}", check=False)
        sandbox.kubectl("delete", "nodes", node, whole_node, "--wait=false", check=False)


def test_kube_scheduler_hands_the_driver_the_classs_configuration_then_the_claims(
    sandbox: Sandbox, dra: str
) -> None:
    """Contract 8 end to end on the cluster side: a DeviceClass that makes its claims go first, a
    template that keeps its share capped; the real allocator copies both into the allocation, the
    class's first, and the DRA plugin's reading of that allocation gives the claim's word over the
    class's field by field."""
    node = "dra-e2e-" + uuid.uuid4().hex[:6]
    klass = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "vgpu-first.openaios.io"},
        "spec": {
            "selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}],
            "config": [vgpu_config(priority=0, smPolicy="elastic")],
        },
    }
    template = _example("ResourceClaimTemplate", "vgpu-8000mi-50-first")  # the example, as written
    template["metadata"]["name"] = "first-capped"
    devices = template["spec"]["spec"]["devices"]
    devices["requests"][0]["exactly"]["deviceClassName"] = klass["metadata"]["name"]
    devices["config"] = [vgpu_config(["gpu"], smPolicy="cap")]
    _apply(sandbox, klass, _node(node))
    try:
        _apply(sandbox, _slice(node, "NVIDIA A100", 10000))
        # the example as written asks for priority 0, which the sandbox allows in default alone
        # (tenantBoundary.highPriorityNamespaces, inventory/sandbox.yml): valid there, refused here
        as_written = _example("ResourceClaimTemplate", "vgpu-8000mi-50-first")
        as_written["metadata"]["namespace"] = "default"
        assert (
            sandbox.kubectl(
                "create", "--dry-run=server", "-f", "-", input=json.dumps(as_written), check=False
            ).returncode
            == 0
        )
        as_written["metadata"]["namespace"] = NS
        refused = sandbox.kubectl("create", "-f", "-", input=json.dumps(as_written), check=False)
        assert "VgpuConfig priority: 0" in refused.stderr, refused.stderr
        _apply(sandbox, template)
        _apply(sandbox, _pod("first", "first-capped", node))
        wait_for(lambda: _claim_of(sandbox, "first") is not None, "the claim allocated", 120, every=0.5)
        claim = _claim_of(sandbox, "first")
        assert claim is not None
        config = claim["status"]["allocation"]["devices"]["config"]
        assert [c["source"] for c in config] == ["FromClass", "FromClaim"]
        card = Card(f"GPU-{node}", 0, "NVIDIA A100", 10000)
        prepared = plan(claim, claim["metadata"]["uid"], {"gpu-0": card}, node)
        assert prepared.config("gpu") == VgpuConfig(priority=0, sm_policy="cap")
        assert [(s.memory_mib, s.cores) for s in prepared.shares] == [(8000, 50)]
    finally:
        sandbox.kubectl("delete", "pods", "-n", NS, "first", "--wait=false", check=False)
        sandbox.kubectl("delete", "resourceslices", f"{node}-{DRIVER}", check=False)
        sandbox.kubectl("delete", "nodes", node, "--wait=false", check=False)
        sandbox.kubectl("delete", "deviceclass", "vgpu-first.openaios.io", "--ignore-not-found", check=False)
