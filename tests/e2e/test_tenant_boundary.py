"""The tenant boundary on the sandbox's real API server (docs/security.md): a pod gets only what
the scheduler gave it, and a node's token reaches only its node.

Each attack is made as a tenant would make it, a ServiceAccount bound to ``edit`` in its own
namespace only (``tests/support/tenant.py``), or with a node's own device-plugin identity, and
each must be refused by the rule that names it (the chart's ValidatingAdmissionPolicies, which
``vgpu sandbox up`` applies as release vgpu would install them) or held by the node; no
neighbour's booking may change. The same on the real node, with the NVIDIA runtime in the path:
tests/e2e/test_real_node_boundary.py.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from vgpu_sandbox import product
from vgpu_sandbox.cluster import Sandbox

from tests.support import container, pod, wait_for
from tests.support.dra import resource_claim, vgpu_config
from tests.support.tenant import AS_SCHEDULER, Tenant, as_kubeconfig, refused_by
from vgpu.core import annotations as ann

pytestmark = pytest.mark.e2e

NS = "tenant-a"


@pytest.fixture(scope="module")
def tenant(sandbox: Sandbox) -> Iterator[Tenant]:
    # another test may have uninstalled release vgpu, and its policies with it
    product.apply_boundary(sandbox, lambda _: None)
    t = Tenant(sandbox, NS)
    t.create()
    try:
        yield t
    finally:
        t.delete()


def _pod(sandbox: Sandbox, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        got: dict[str, Any] = sandbox.api_get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    except Exception:  # noqa: BLE001 - a 404 is the answer here
        return None
    return got


def _cards(sandbox: Sandbox, node: str) -> list[str]:
    raw = sandbox.api_get(f"/api/v1/nodes/{node}")["metadata"]["annotations"][ann.DEVICES_ANNOTATION]
    return [d.uuid for d in ann.decode_devices(raw).devices]


def _forged(node: str, card: str, asked_mib: int = 1000) -> dict[str, str]:
    """A placement of no memory and no cores (no limit at all) on ``card``."""
    allocation = ann.Allocation(node, (ann.ContainerAllocation("main", (ann.DeviceAllocation(card, 0, 0),)),))
    return {
        ann.ALLOCATION_ANNOTATION: ann.encode_allocation(allocation),
        ann.PHASE_ANNOTATION: ann.PHASE_BOUND,
    }


def _allocated_bytes(sandbox: Sandbox, node: str, card: str) -> float:
    """The extender's booking of ``card`` (vgpu_card_memory_allocated_bytes), from its /metrics."""
    port = sandbox.state().ports["extender-metrics"]  # type: ignore[union-attr]
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    want = f'vgpu_card_memory_allocated_bytes{{node="{node}",uuid="{card}"}} '
    for line in text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    return 0.0


def _untrusted(sandbox: Sandbox, kind: str) -> float:
    port = sandbox.state().ports["extender-metrics"]  # type: ignore[union-attr]
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    want = f'vgpu_scheduler_untrusted_placements_total{{kind="{kind}"}} '
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(want)), 0.0)


def _placed(sandbox: Sandbox, namespace: str, name: str) -> dict[str, Any]:
    def allocated() -> dict[str, Any] | None:
        got = _pod(sandbox, namespace, name)
        annotations = (got or {}).get("metadata", {}).get("annotations") or {}
        return got if annotations.get(ann.PHASE_ANNOTATION) == ann.PHASE_ALLOCATED else None

    return wait_for(allocated, f"pod {namespace}/{name} placed and allocated", 60, every=0.3)  # type: ignore[no-any-return]


def test_a_tenant_cannot_create_a_pod_that_carries_its_own_placement(
    sandbox: Sandbox, tenant: Tenant
) -> None:
    card = _cards(sandbox, "vgpu-node-0")[0]
    forged = pod(
        "forged", container(gpu=1, gpumem=1000), namespace=NS, node="vgpu-node-0",
        annotations=_forged("vgpu-node-0", card),
    )  # fmt: skip
    message = refused_by(tenant.apply(forged), "placements")
    assert message.startswith(
        "vgpu.openaios.io/allocation, phase and reason are written by the vgpu scheduler alone, "
        f"never by {tenant.user}"
    )
    assert _pod(sandbox, NS, "forged") is None
    # the same pod without them is the tenant's to create: it reaches the node unplaced, and the
    # node serves it nothing (tests/unit/test_plugin_allocate.py: "not placed by the vgpu scheduler")
    honest_shape = pod("no-placement", container(gpu=1, gpumem=1000), namespace=NS, node="vgpu-node-0")
    assert tenant.apply(honest_shape).returncode == 0


def test_a_workload_cannot_launder_a_placement_through_its_pod_template(
    sandbox: Sandbox, tenant: Tenant
) -> None:
    card = _cards(sandbox, "vgpu-node-1")[0]
    template = pod("x", container(gpu=1, gpumem=1000), annotations=_forged("vgpu-node-1", card))
    for key in ("apiVersion", "kind"):
        template.pop(key)
    template["metadata"].pop("name")
    template["metadata"].pop("namespace")
    template["metadata"]["labels"] = {"app": "laundered"}
    deploy = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "laundered", "namespace": NS},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "laundered"}}, "template": template},
    }
    assert tenant.apply(deploy).returncode == 0  # the Deployment itself holds no placement

    def refusal() -> str | None:
        events = sandbox.api_get(f"/api/v1/namespaces/{NS}/events")["items"]
        found = [e["message"] for e in events if e["reason"] == "FailedCreate"]
        return next((m for m in found if "vgpu-kube-system-placements" in m), None)

    message = wait_for(refusal, "the ReplicaSet's FailedCreate naming the placement policy", 60, every=0.5)
    assert "never by system:serviceaccount:kube-system:replicaset-controller" in message
    pods = sandbox.api_get(f"/api/v1/namespaces/{NS}/pods?labelSelector=app%3Dlaundered")["items"]
    assert pods == []


def test_a_tenant_cannot_rewrite_the_placement_of_its_running_pod_and_its_booking_stays(
    sandbox: Sandbox, tenant: Tenant
) -> None:
    assert tenant.apply(pod("big", container(gpu=1, gpumem=30000), namespace=NS)).returncode == 0
    placed = _placed(sandbox, NS, "big")
    allocation = ann.decode_allocation(placed["metadata"]["annotations"][ann.ALLOCATION_ANNOTATION])
    node, card = allocation.node, allocation.containers[0].devices[0].uuid
    wait_for(lambda: _allocated_bytes(sandbox, node, card) >= 30000 * 2**20, "the booking of the card", 10)
    booked = _allocated_bytes(sandbox, node, card)
    shrunk = ann.encode_allocation(
        ann.Allocation(node, (ann.ContainerAllocation("main", (ann.DeviceAllocation(card, 1, 0),)),))
    )
    for change in (
        ["annotate", "--overwrite", "pod", "big", f"{ann.ALLOCATION_ANNOTATION}={shrunk}"],
        ["annotate", "pod", "big", f"{ann.PHASE_ANNOTATION}-"],
        ["annotate", "pod", "big", f"{ann.REASON_ANNOTATION}=mine"],
    ):
        refused_by(tenant.kubectl(*change), "placements")
    # the rest of its pod is the tenant's own
    assert tenant.kubectl("label", "pod", "big", "team=a").returncode == 0
    # A placement rewritten past the policy (here: the scheduler's own account, which the policy
    # trusts) is not a new booking: the extender keeps what it bound, and counts the change.
    before = _untrusted(sandbox, "changed")
    sandbox.kubectl(
        *AS_SCHEDULER,
        "annotate",
        "--overwrite",
        "pod",
        "big",
        "-n",
        NS,
        f"{ann.ALLOCATION_ANNOTATION}={shrunk}",
    )
    wait_for(
        lambda: _untrusted(sandbox, "changed") > before, "the extender to count the changed placement", 10
    )
    assert _allocated_bytes(sandbox, node, card) == booked


def test_a_tenant_cannot_bind_its_pod_itself(sandbox: Sandbox, tenant: Tenant) -> None:
    assert (
        tenant.apply(
            pod("unbound", container("main", limits={"cpu": "10m"}), namespace=NS, scheduler="nobody")
        ).returncode
        == 0
    )
    card = _cards(sandbox, "vgpu-node-2")[0]
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "unbound", "namespace": NS, "annotations": _forged("vgpu-node-2", card)},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "vgpu-node-2"},
    }
    result = tenant.kubectl("create", "--validate=false", "-f", "-", input=json.dumps(binding))
    assert result.returncode != 0
    assert 'cannot create resource "bindings"' in result.stderr, result.stderr


def test_priority_zero_is_refused_outside_the_namespaces_the_admin_lists(
    sandbox: Sandbox, tenant: Tenant
) -> None:
    high = pod("high", container(gpu=1, gpumem=1000, priority=0), namespace=NS)
    message = refused_by(tenant.apply(high), "priority")
    assert message.startswith("nvidia.com/priority: 0 (high priority: every priority-1 container")
    assert "tenantBoundary.highPriorityNamespaces, and tenant-a is not one of them" in message
    # the sandbox's inventory lists default (examples/pods.yaml's high-priority-inference)
    assert product.high_priority_namespaces() == ["default"]
    allowed = pod("high-" + uuid.uuid4().hex[:6], container(gpu=1, gpumem=1000, priority=0))
    dry = sandbox.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(allowed), check=False)
    assert dry.returncode == 0, dry.stderr
    claim = resource_claim("high", NS, config=[vgpu_config(priority=0)])
    assert refused_by(tenant.apply(claim), "priority").startswith("VgpuConfig priority: 0 (high priority")
    assert tenant.apply(resource_claim("normal", NS, config=[vgpu_config(priority=1)])).returncode == 0


def test_a_nodes_plugin_identity_writes_only_its_own_node_its_pods_and_its_lease(
    sandbox: Sandbox, tenant: Tenant
) -> None:
    node0 = sandbox.layout.config / "device-plugin-vgpu-node-0.kubeconfig"  # what node 0's plugin runs as
    assert tenant.apply(pod("on-node-1", container(gpu=1, gpumem=1000), namespace=NS)).returncode == 0
    placed = _placed(sandbox, NS, "on-node-1")
    node = placed["spec"]["nodeName"]
    own = "vgpu-node-0"
    if node == own:  # bound to node 0 by chance: judge it from node 2's plugin instead
        node0, own = sandbox.layout.config / "device-plugin-vgpu-node-2.kubeconfig", "vgpu-node-2"
    other_pod = refused_by(
        as_kubeconfig(sandbox, node0, "annotate", "--overwrite", "pod", "on-node-1", "-n", NS,
                      f"{ann.PHASE_ANNOTATION}={ann.PHASE_FAILED}"),
        "placements", "node-agent-pods",
    )  # fmt: skip
    assert f"the vgpu device plugin of node {own} may write" in other_pod
    assert f"on node {node}" in other_pod
    other_node = refused_by(
        as_kubeconfig(
            sandbox, node0, "annotate", "--overwrite", "node", node, f"{ann.DEVICES_ANNOTATION}=[]"
        ),
        "node-agent-nodes",
    )
    assert other_node.endswith(f"refused: UPDATE of nodes {node}")
    refused_by(as_kubeconfig(sandbox, node0, "label", "node", own, "team=mine"), "node-agent-nodes")
    lease = refused_by(
        as_kubeconfig(sandbox, node0, "annotate", "lease", ann.lease_name(node), "-n", "kube-system", "x=y"),
        "node-agent-leases",
    )
    assert lease.endswith(f"refused: UPDATE of leases kube-system/{ann.lease_name(node)}")
    # and what is its own it may write (the plugin renews that Lease every 10 s)
    mine = as_kubeconfig(sandbox, node0, "annotate", "--overwrite", "node", own, "vgpu.openaios.io/probe=1")
    assert mine.returncode == 0, mine.stderr
    sandbox.kubectl("annotate", "node", own, "vgpu.openaios.io/probe-")


def test_the_node_refuses_a_placement_that_is_not_what_the_pod_asks_for_whoever_wrote_it(
    sandbox: Sandbox, tenant: Tenant
) -> None:
    """The second line: a placement that got past admission (here written with the scheduler's
    own account, as a compromised scheduler credential could) is refused by the node's plugin,
    which re-derives the request from the pod's spec."""
    node = "vgpu-node-1"
    card = _cards(sandbox, node)[1]
    forged = pod("past-admission", container(gpu=1, gpumem=1000), namespace=NS, node=node,
                 annotations=_forged(node, card))  # fmt: skip
    created = sandbox.kubectl(*AS_SCHEDULER, "create", "-f", "-", input=json.dumps(forged), check=False)
    assert created.returncode == 0, created.stderr

    def refused() -> dict[str, Any] | None:
        got = _pod(sandbox, NS, "past-admission") or {}
        return got if got.get("status", {}).get("phase") == "Failed" else None

    failed = wait_for(refused, "the node to refuse the pod and kubelet to fail it", 60, every=0.3)
    annotations = failed["metadata"]["annotations"]
    assert annotations[ann.PHASE_ANNOTATION] == ann.PHASE_FAILED
    assert "is given 0 MiB on card" in annotations[ann.REASON_ANNOTATION]
    assert "asks for 1000 MiB (nvidia.com/gpumem 1000)" in annotations[ann.REASON_ANNOTATION]
    events = sandbox.api_get(
        f"/api/v1/namespaces/{NS}/events?fieldSelector=involvedObject.name%3Dpast-admission"
    )["items"]
    assert [e for e in events if e["reason"] == "VgpuPlacementRefused" and e["source"]["host"] == node]
    grants = sandbox.layout.node_root(node) / "var/lib/vgpu/grants"
    assert not list(grants.glob(f"{failed['metadata']['uid']}_*.limits"))  # no grant was written


def test_where_the_policies_are_off_the_webhook_refuses_the_same_placements(
    sandbox: Sandbox, tenant: Tenant
) -> None:
    """tenantBoundary.policies=false: the validating webhook sees pod updates too (the chart's
    rules for that case, vgpu.webhookCommon) and the extender checks who writes a placement. Here
    the sandbox's own extender answers, registered for one namespace the policies leave alone."""
    other = Tenant(sandbox, "tenant-webhook")
    other.create()
    label = "vgpu.openaios.io/tenant-boundary=other-release"  # the sandbox's policies skip it
    sandbox.kubectl("label", "namespace", other.namespace, label)
    port = sandbox.state().ports["extender"]  # type: ignore[union-attr]
    ca = base64.b64encode(sandbox.ca.pem).decode()  # type: ignore[union-attr]
    hook = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "vgpu-tenant-e2e"},
        "webhooks": [
            {
                "name": "validate.vgpu.openaios.io",
                "clientConfig": {"url": f"https://127.0.0.1:{port}/webhook/validate", "caBundle": ca},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["UPDATE"],
                        "resources": ["pods"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": other.namespace}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
            }
        ],
    }
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(hook))
    try:
        # at creation the sandbox's own webhook (every namespace but kube-system) refuses it
        card = _cards(sandbox, "vgpu-node-0")[0]
        forged = pod(
            "forged", container(gpu=1, gpumem=1000), namespace=other.namespace, node="vgpu-node-0",
            annotations=_forged("vgpu-node-0", card),
        )  # fmt: skip
        created = other.apply(forged)
        assert 'admission webhook "validate.vgpu.openaios.io" denied' in created.stderr, created.stderr
        assert "written by the vgpu scheduler alone" in created.stderr
        # an update of a pod the scheduler placed, through the webhook's UPDATE rule
        assert (
            other.apply(pod("placed", container(gpu=1, gpumem=1000), namespace=other.namespace)).returncode
            == 0
        )
        _placed(sandbox, other.namespace, "placed")

        def refused() -> str | None:
            result = other.kubectl(
                "annotate", "--overwrite", "pod", "placed", f"{ann.PHASE_ANNOTATION}=bound"
            )
            return result.stderr if "denied the request" in result.stderr else None

        message = wait_for(refused, "the webhook to refuse the tenant's update", 20, every=0.5)
        assert f"written by the vgpu scheduler alone, never by {other.user}" in message
        assert other.kubectl("label", "pod", "placed", "team=b").returncode == 0  # the rest is its own
    finally:
        sandbox.kubectl("delete", "validatingwebhookconfiguration", "vgpu-tenant-e2e", check=False)
        other.delete()
