"""The chart's DRA side rendered offline by the real helm: off by default, refused before 1.34,
valid against the 1.34 and 1.36 schemas, the names of docs/dra.md, least privilege, and one mode
per node: the device plugin's DaemonSet and the DRA plugin's never land on the same node."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chart_support import CHART, REPO, container, find, helm, render, template

from vgpu.core.claimconfig import MPS_CLASS, VgpuConfig, check_entries
from vgpu.dra.migslices import MIG_CLASS, MIG_SELECTOR, MPS_SELECTOR, SHARED_SELECTOR
from vgpu.monitor import cli as monitor_cli

K134 = "1.34.0"
K136 = "1.36.0"
DRA = ("--set", "dra.enabled=true")
DRA_KINDS = {"DeviceClass", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def _pod(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return find(objs, "DaemonSet", name)["spec"]["template"]["spec"]


def test_dra_is_off_by_default_and_renders_nothing_of_its_own() -> None:
    objs = render(kube_version=K136)
    # the tenant boundary's policies are the chart's own; DRA's policy names its plugin
    assert not [o for o in objs if o["kind"] == "DeviceClass" or "dra" in o["metadata"]["name"]]


def test_dra_before_kubernetes_1_34_is_refused_naming_the_value_the_version_and_the_fix() -> None:
    result = template(*DRA, kube_version="1.33.5")
    assert result.returncode != 0
    assert "dra.enabled=true needs Kubernetes 1.34 or newer" in result.stderr
    assert "the cluster is v1.33.5" in result.stderr and "set dra.enabled=false" in result.stderr


@pytest.mark.parametrize("kube", [K134, K136])
def test_every_dra_object_is_valid_against_the_schemas_and_lint_passes(kube: str) -> None:
    objs = render(*DRA, kube_version=kube)
    assert DRA_KINDS <= {o["kind"] for o in objs}
    for obj in objs:
        kubernetes_validate.validate(obj, kube, strict=True)
    lint = helm("lint", "--strict", str(CHART), *DRA, "--kube-version", kube)
    assert lint.returncode == 0 and "0 chart(s) failed" in lint.stdout, lint.stdout + lint.stderr


def test_the_schema_check_rejects_a_misspelt_device_class_so_the_check_above_can_fail() -> None:
    dc = find(render(*DRA, kube_version=K136), "DeviceClass", "vgpu.openaios.io")
    dc["spec"]["selector"] = dc["spec"].pop("selectors")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dc, K136, strict=True)


def _config_hooks(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        hook
        for o in objs
        if o["kind"] == "ValidatingWebhookConfiguration"
        for hook in o["webhooks"]
        if hook["name"] == "validate-config.vgpu.openaios.io"
    ]


def test_the_webhook_checks_dra_configuration_only_with_dra_and_never_blocks_on_failure() -> None:
    assert _config_hooks(render(kube_version=K136)) == []
    [hook] = _config_hooks(render(*DRA, kube_version=K136))
    assert hook["clientConfig"]["service"]["path"] == "/webhook/validate-config"
    assert hook["failurePolicy"] == "Ignore"  # the DRA plugin checks again before a container starts
    [rule] = hook["rules"]
    assert rule["apiGroups"] == ["resource.k8s.io"] and rule["apiVersions"] == ["v1"]
    assert set(rule["resources"]) == {"resourceclaims", "resourceclaimtemplates", "deviceclasses"}
    assert rule["operations"] == ["CREATE", "UPDATE"] and rule["scope"] == "*"
    assert hook["matchPolicy"] == "Equivalent"  # v1beta1 and v1beta2 writes reach it as v1
    # the webhook off: none of it, DRA or not
    assert _config_hooks(render(*DRA, "--set", "webhook.enabled=false", kube_version=K136)) == []


def test_the_device_class_selects_the_driver_by_cel() -> None:
    dc = find(render(*DRA, kube_version=K136), "DeviceClass", "vgpu.openaios.io")
    assert dc["apiVersion"] == "resource.k8s.io/v1"
    assert dc["spec"]["selectors"] == [{"cel": {"expression": SHARED_SELECTOR}}]
    mig = find(render(*DRA, kube_version=K136), "DeviceClass", MIG_CLASS)
    assert mig["spec"]["selectors"] == [{"cel": {"expression": MIG_SELECTOR}}]
    mps = find(render(*DRA, kube_version=K136), "DeviceClass", MPS_CLASS)
    assert mps["spec"]["selectors"] == [{"cel": {"expression": MPS_SELECTOR}}]


def test_dra_sharing_mode_is_the_plugins_flag() -> None:
    def args(*extra: str) -> list[str]:
        pod = _pod(render(*DRA, *extra, kube_version=K136), "vgpu-dra-plugin")
        return list(container(pod, "dra-plugin")["command"])

    assert "--sharing-mode=timeslice" in args()
    assert "--sharing-mode=mps" in args("--set", "dra.sharingMode=mps")


# NVIDIA's runtime gives the plugins their cards, and the claims' folders are plain: nothing
# needs privilege (the defaults, driver.inject plugin and tmpfs folders, do: see below).
RUNTIME = ("--set", "driver.inject=runtime", "--set", "devicePlugin.containerFolder=directory")


def test_the_dra_plugin_runs_with_the_shared_flags_at_the_hosts_own_paths() -> None:
    objs = render(
        *DRA, *RUNTIME, "--set", "dra.extraArgs[0]=--fake-nvml=/etc/fake/gpus.yaml", kube_version=K136
    )
    pod = _pod(objs, "vgpu-dra-plugin")
    plugin = container(pod, "dra-plugin")
    assert plugin["command"] == [
        "vgpu",
        "dra-plugin",
        "--node-name=$(NODE_NAME)",
        "--plugin-dir=/var/lib/kubelet/plugins/vgpu.openaios.io",
        "--registry-dir=/var/lib/kubelet/plugins_registry",
        "--cdi-dir=/var/run/cdi",
        "--state-dir=/var/lib/vgpu",
        "--config=/etc/vgpu/device-plugin/node-config.yaml",
        "--mig=off",
        "--sharing-mode=timeslice",
        "--fake-nvml=/etc/fake/gpus.yaml",
    ]
    # the kubelet dials the socket and the runtime reads the CDI specs by the paths the plugin
    # writes: every host folder is mounted at its own path
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in plugin["volumeMounts"]:
        host = volumes[mount["name"]].get("hostPath")
        if host is not None:
            assert mount["mountPath"] == host["path"], mount
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {
        "/var/lib/kubelet/plugins/vgpu.openaios.io",
        "/var/lib/kubelet/plugins_registry",
        "/var/run/cdi",
        "/var/lib/vgpu",  # grants, regions and the hook's lib/<hash>/ folder, as the device plugin's
        # the monitor's, for enforcement.compute throttle (the default): the kubelet's part alone
        "/sys/fs/cgroup/kubepods.slice",
    }
    assert volumes["config"]["configMap"]["name"] == "vgpu-device-plugin-config"
    # the monitor beside it: the real `vgpu monitor` parses its flags, the fake cards included
    monitor = container(pod, "monitor")
    assert monitor["command"][:2] == ["vgpu", "monitor"]
    parser = argparse.ArgumentParser()
    monitor_cli.register(parser)
    args = parser.parse_args([a.replace("$(NODE_NAME)", "gpu-1") for a in monitor["command"][2:]])
    assert (args.node, args.listen, str(args.fake_nvml)) == ("gpu-1", "0.0.0.0:9394", "/etc/fake/gpus.yaml")


def test_the_dra_plugin_has_no_privilege_and_the_monitor_only_kill_where_it_kills() -> None:
    pod = _pod(render(*DRA, *RUNTIME, kube_version=K136), "vgpu-dra-plugin")
    plugin = container(pod, "dra-plugin")["securityContext"]
    assert plugin == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["hostPID"] is True and not pod.get("hostNetwork")
    assert container(pod, "monitor")["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
    report = render(*DRA, *RUNTIME, "--set", "devicePlugin.enforcement.memory=report", kube_version=K136)
    assert (
        "add" not in container(_pod(report, "vgpu-dra-plugin"), "monitor")["securityContext"]["capabilities"]
    )
    alone = _pod(render(*DRA, "--set", "dra.monitor.enabled=false", kube_version=K136), "vgpu-dra-plugin")
    assert [c["name"] for c in alone["containers"]] == ["dra-plugin"] and "hostPID" not in alone
    # the defaults: privileged for the driver and the claims' tmpfs folders, which the monitor
    # beside it sees through HostToContainer propagation
    default = _pod(render(*DRA, kube_version=K136), "vgpu-dra-plugin")
    assert container(default, "dra-plugin")["securityContext"]["privileged"] is True
    state = {
        c["name"]: next(m for m in c["volumeMounts"] if m["name"] == "state") for c in default["containers"]
    }
    assert state["dra-plugin"]["mountPropagation"] == "Bidirectional"
    assert state["monitor"]["mountPropagation"] == "HostToContainer"


def test_the_dra_monitor_gets_the_host_cgroups_and_kill_where_any_node_throttles_or_kills() -> None:
    """The monitor beside the DRA plugin runs the compute gate too: throttle (the default) needs
    the host's cgroups for its freezer; a node override's kill or evict needs its right."""
    quiet = (
        "--set",
        "devicePlugin.enforcement.memory=report",
        "--set",
        "devicePlugin.enforcement.compute=report",
    )
    override = ("--set", "devicePlugin.nodeOverrides[0].name=gpu-9", "--set")

    def rights(*values: str) -> tuple[list[str], bool, bool]:
        """(the monitor's added capabilities, whether it mounts the host's cgroups, whether the
        role may evict)."""
        objs = render(*DRA, *RUNTIME, *values, kube_version=K136)
        pod = _pod(objs, "vgpu-dra-plugin")
        mounts = {c["name"]: {m["mountPath"] for m in c["volumeMounts"]} for c in pod["containers"]}
        cgroups = "/sys/fs/cgroup/kubepods.slice"
        assert "/host" + cgroups not in mounts["dra-plugin"]
        cgroup = "/host" + cgroups in mounts["monitor"]
        assert cgroup == (cgroups in {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v})
        rules = find(objs, "ClusterRole", "vgpu-kube-system-dra-plugin")["rules"]
        evict = any("pods/eviction" in r["resources"] for r in rules)
        return container(pod, "monitor")["securityContext"]["capabilities"].get("add", []), cgroup, evict

    assert rights() == (["KILL"], True, False)  # memory kill, compute throttle
    assert rights(*quiet) == ([], False, False)
    assert rights(*quiet, *override, "devicePlugin.nodeOverrides[0].enforcement.compute=kill") == (
        ["KILL"],
        False,
        False,
    )
    assert rights(*quiet, *override, "devicePlugin.nodeOverrides[0].enforcement.compute=throttle") == (
        [],
        True,
        False,
    )
    assert rights(*quiet, *override, "devicePlugin.nodeOverrides[0].enforcement.memory=evict") == (
        [],
        False,
        True,
    )


def test_the_dra_plugins_rights_are_its_slices_claims_and_node_and_the_monitors() -> None:
    objs = render(*DRA, kube_version=K136)
    rules = find(objs, "ClusterRole", "vgpu-kube-system-dra-plugin")["rules"]
    granted = {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert granted == {
        *(
            ("resource.k8s.io", "resourceslices", v)
            for v in ("get", "list", "watch", "create", "update", "delete")
        ),
        ("resource.k8s.io", "resourceclaims", "get"),
        ("", "nodes", "get"),
        ("", "pods", "list"),
        ("", "events", "create"),
    }
    binding = find(objs, "ClusterRoleBinding", "vgpu-kube-system-dra-plugin")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "vgpu-dra-plugin", "namespace": "kube-system"}
    ]
    assert _pod(objs, "vgpu-dra-plugin")["serviceAccountName"] == "vgpu-dra-plugin"
    # writes to slices are held to the writer's own node, by the node its token names
    policy = find(objs, "ValidatingAdmissionPolicy", "vgpu-kube-system-dra-plugin-slices")["spec"]
    assert policy["matchConditions"][0]["expression"] == (
        'request.userInfo.username == "system:serviceaccount:kube-system:vgpu-dra-plugin"'
    )
    assert policy["matchConstraints"]["resourceRules"][0]["resources"] == ["resourceslices"]
    assert "variables.userNode == variables.sliceNode" in [v["expression"] for v in policy["validations"]]
    vapb = find(objs, "ValidatingAdmissionPolicyBinding", "vgpu-kube-system-dra-plugin-slices")["spec"]
    assert vapb == {"policyName": "vgpu-kube-system-dra-plugin-slices", "validationActions": ["Deny"]}
    evict = render(*DRA, "--set", "devicePlugin.enforcement.memory=evict", kube_version=K136)
    rules = find(evict, "ClusterRole", "vgpu-kube-system-dra-plugin")["rules"]
    assert any("pods/eviction" in r["resources"] for r in rules)


def _matches(pod: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a node with ``labels`` passes the pod's nodeSelector and required node affinity
    (In, NotIn, Exists, DoesNotExist: what the chart and its users write)."""
    if any(labels.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return False
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if not required:
        return True

    def holds(e: dict[str, Any]) -> bool:
        op, key = e["operator"], e["key"]
        return {
            "In": lambda: labels.get(key) in e["values"],
            "NotIn": lambda: labels.get(key) not in e["values"],
            "Exists": lambda: key in labels,
            "DoesNotExist": lambda: key not in labels,
        }[op]()

    return any(all(holds(e) for e in t.get("matchExpressions", [])) for t in required["nodeSelectorTerms"])


@pytest.mark.parametrize(
    "user_affinity",
    [
        None,
        '{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":'
        '[{"matchExpressions":[{"key":"pool","operator":"In","values":["a"]}]},'
        '{"matchExpressions":[{"key":"pool","operator":"In","values":["b"]}]}]}}}',
    ],
    ids=["no-affinity", "two-user-terms"],
)
def test_one_mode_per_node_the_two_daemonsets_never_share_a_node(user_affinity: str | None) -> None:
    args = [*DRA, "--set", "dra.nodeSelector.gpu=on"]
    if user_affinity:
        args += ["--set-json", f"devicePlugin.affinity={user_affinity}"]
    objs = render(*args, kube_version=K136)
    plugin, dra = _pod(objs, "vgpu-device-plugin"), _pod(objs, "vgpu-dra-plugin")
    assert dra["nodeSelector"] == {"openaios.io/gpu-mode": "dra", "gpu": "on"}
    for pool in ["a", "b"] if user_affinity else [None]:
        base = {"gpu": "on", **({"pool": pool} if pool else {})}
        assert _matches(plugin, base) and not _matches(dra, base)  # no label: device-plugin
        both = {**base, "openaios.io/gpu-mode": "device-plugin"}
        assert _matches(plugin, both) and not _matches(dra, both)
        on_dra = {**base, "openaios.io/gpu-mode": "dra"}
        assert not _matches(plugin, on_dra) and _matches(dra, on_dra)
    if user_affinity:  # the user's own terms still hold
        assert not _matches(plugin, {"gpu": "on", "pool": "c"})


def test_the_dra_monitor_is_scraped_with_the_node_monitors() -> None:
    objs = render(*DRA, kube_version=K136)
    svc = find(objs, "Service", "vgpu-dra-monitor")
    assert svc["metadata"]["labels"]["vgpu.openaios.io/metrics"] == "monitor"
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "dra-plugin"


def test_the_example_claim_templates_are_valid_and_ask_the_chart_s_device_class_for_memory_and_cores() -> (
    None
):
    docs = list(yaml.safe_load_all((REPO / "examples" / "dra.yaml").read_text()))
    for doc in docs:
        for kube in (K134, K136):
            kubernetes_validate.validate(doc, kube, strict=True)
    templates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceClaimTemplate"}
    share = templates["vgpu-3000mi-30"]["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert share["deviceClassName"] == "vgpu.openaios.io"
    assert share["capacity"]["requests"] == {"memory": "3000Mi", "cores": "30"}
    whole = templates["vgpu-whole-a100-80gb"]["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert whole["capacity"]["requests"]["cores"] == "100"
    first = templates["vgpu-8000mi-50-first"]["spec"]["spec"]["devices"]
    [entry] = check_entries(first["config"], "spec.devices.config", "example")
    assert entry.config == VgpuConfig(priority=0, sm_policy="elastic") and entry.requests == ("gpu",)
    pods = [d for d in docs if d["kind"] == "Pod"]
    assert {p["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] for p in pods} == set(templates)
    for p in pods:  # no extended resources beside the claim: the claim alone is the vGPU
        assert all("limits" not in c["resources"] for c in p["spec"]["containers"])


def test_values_say_which_kubernetes_each_path_needs() -> None:
    text = (CHART / "values.yaml").read_text()
    dra = text[text.index("\ndra:") - 900 : text.index("\ndra:")]
    for words in ("device plugin (devicePlugin) 1.33", "resource.k8s.io/v1) 1.34", "1.36 and newer"):
        assert words in dra.replace("\n# ", " "), words
    assert Path(REPO / "docs" / "dra.md").exists()


def test_dra_mig_dynamic_reaches_the_plugin_and_a_bad_value_is_refused() -> None:
    pod = _pod(render(*DRA, "--set", "dra.mig=dynamic", kube_version=K136), "vgpu-dra-plugin")
    assert "--mig=dynamic" in container(pod, "dra-plugin")["command"]
    refused = template(*DRA, "--set", "dra.mig=static", kube_version=K136)
    assert refused.returncode != 0 and "/dra/mig" in refused.stderr and "dynamic" in refused.stderr, (
        refused.stderr
    )
