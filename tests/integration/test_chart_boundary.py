"""The chart's tenant boundary, rendered offline (charts/vgpu/templates/tenant-boundary.yaml): which
accounts its admission policies trust, what the values change, and what the chart refuses. What
the API server makes of the policies, tried as a tenant and as a node's token, is in
tests/e2e/test_tenant_boundary.py."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.integration.chart_support import NS, find, render, template

POLICIES = ("placements", "node-agent-nodes", "node-agent-pods", "node-agent-leases", "priority")
SCHEDULER = f"system:serviceaccount:{NS}:vgpu-scheduler"
PLUGIN = f"system:serviceaccount:{NS}:vgpu-device-plugin"


def _policies(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    prefix = f"vgpu-{NS}-"
    return {
        o["metadata"]["name"].removeprefix(prefix): o
        for o in objs
        if o["kind"] == "ValidatingAdmissionPolicy"
    }


def _text(obj: dict[str, Any]) -> str:
    spec = obj["spec"]
    parts = [c["expression"] for c in spec.get("matchConditions", [])]
    parts += [v["expression"] for v in spec.get("variables", [])]
    parts += [v["expression"] for v in spec.get("validations", [])]
    return "\n".join(parts)


def test_every_policy_is_rendered_bound_and_valid_for_kubernetes_1_33_and_1_36() -> None:
    for kube in ("1.33.0", "1.36.0"):
        objs = render(kube_version=kube)
        policies = _policies(objs)
        assert set(policies) == {f"{p}" for p in POLICIES}
        for name in POLICIES:
            binding = find(objs, "ValidatingAdmissionPolicyBinding", f"vgpu-{NS}-{name}")
            assert binding["spec"]["policyName"] == f"vgpu-{NS}-{name}"
            assert binding["spec"]["validationActions"] == ["Deny"]
            assert policies[name]["spec"]["failurePolicy"] == "Fail"
            kubernetes_validate.validate(policies[name], kube, strict=True)
            kubernetes_validate.validate(binding, kube, strict=True)


def test_placements_trust_the_scheduler_pods_account_and_the_plugin_only_on_its_node() -> None:
    policies = _policies(render())
    placements = _text(policies["placements"])
    assert f'variables.user == "{SCHEDULER}"' in placements
    assert f'variables.user == "{PLUGIN}"' in placements
    assert "authentication.kubernetes.io/node-name" in placements
    rules = policies["placements"]["spec"]["matchConstraints"]["resourceRules"][0]
    # a Binding's annotations land on the pod: both ways of writing one are covered
    assert set(rules["resources"]) == {"pods", "pods/status", "pods/binding", "bindings"}
    for kind in ("nodes", "pods", "leases"):
        agent = policies[f"node-agent-{kind}"]["spec"]
        assert agent["matchConditions"][0]["expression"] == f'request.userInfo.username == "{PLUGIN}"'
    assert "request.name == 'vgpu-' + variables.node" in _text(policies["node-agent-leases"])
    assert f"request.namespace == '{NS}'" in _text(policies["node-agent-leases"])


def test_high_priority_namespaces_reach_the_policy_and_the_webhooks_flag() -> None:
    objs = render("--set", "tenantBoundary.highPriorityNamespaces={serving,batch-hi}")
    condition = _policies(objs)["priority"]["spec"]["matchConditions"][0]["expression"]
    assert condition == '!(request.namespace in ["serving","batch-hi"])'
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    extender = next(c for c in pod["containers"] if c["name"] == "extender")
    assert "--high-priority-namespaces=serving,batch-hi" in extender["command"]
    default = _policies(render())["priority"]["spec"]["matchConditions"][0]["expression"]
    assert default == "!(request.namespace in [])"  # none: priority 0 is refused everywhere


def test_a_namespace_selector_narrows_the_placement_and_priority_rules_but_never_the_node_agents() -> None:
    objs = render("--set-json", 'tenantBoundary.namespaceSelector={"matchLabels":{"team":"gpu"}}')
    for name in POLICIES:
        binding = find(objs, "ValidatingAdmissionPolicyBinding", f"vgpu-{NS}-{name}")["spec"]
        selector = (binding.get("matchResources") or {}).get("namespaceSelector")
        expected = None if name.startswith("node-agent") else {"matchLabels": {"team": "gpu"}}
        assert selector == expected, name


def test_without_policies_the_validating_webhook_also_sees_pod_updates_and_bindings() -> None:
    objs = render("--set", "tenantBoundary.policies=false")
    assert not _policies(objs)
    hook = find(objs, "ValidatingWebhookConfiguration", f"vgpu-{NS}")["webhooks"][0]
    ops = {(tuple(r["operations"]), tuple(r["resources"])) for r in hook["rules"]}
    assert ops == {
        (("CREATE",), ("pods",)),
        (("UPDATE",), ("pods", "pods/status")),
        (("CREATE",), ("bindings", "pods/binding")),
    }
    mutating = find(objs, "MutatingWebhookConfiguration", f"vgpu-{NS}")["webhooks"][0]
    assert [r["operations"] for r in mutating["rules"]] == [["CREATE"]]
    with_policies = find(render(), "ValidatingWebhookConfiguration", f"vgpu-{NS}")["webhooks"][0]
    assert [r["operations"] for r in with_policies["rules"]] == [["CREATE"]]


@pytest.mark.parametrize(
    ("args", "kube", "says"),
    [
        ((), "1.29.4", "tenantBoundary.policies=true needs Kubernetes 1.30 or newer"),
        (
            ("--set", "tenantBoundary.policies=false", "--set", "webhook.enabled=false"),
            "1.33.0",
            "tenantBoundary.policies=false and webhook.enabled=false leave the placement annotations",
        ),
        (("--set", "tenantBoundary.highPriorityNamespaces={Bad_NS}"), "1.33.0", "highPriorityNamespaces"),
    ],
)
def test_a_boundary_that_cannot_hold_is_refused_naming_the_value_and_the_fix(
    args: tuple[str, ...], kube: str, says: str
) -> None:
    result = template(*args, kube_version=kube)
    assert result.returncode != 0
    assert says in result.stderr


def test_before_1_30_the_webhook_takes_over_with_policies_off() -> None:
    objs = render("--set", "tenantBoundary.policies=false", kube_version="1.29.4")
    assert not _policies(objs)
    assert find(objs, "ValidatingWebhookConfiguration", f"vgpu-{NS}")
