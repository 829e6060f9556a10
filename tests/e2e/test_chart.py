"""The Helm chart against the sandbox's real API server: server-side dry runs of every scenario,
then install, upgrade and uninstall of one release in a namespace of its own."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from vgpu.sandbox.cluster import Sandbox

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vgpu"
SCENARIOS = sorted(CHART.glob("ci/*-values.yaml"))
NS = "vgpu-chart-test"
RELEASE = "vgpu"
# Keep clear of the sandbox's own product: other node ports, and a webhook that only sees this
# namespace (its pods are KWOK's: nothing answers behind the Service).
ISOLATION = [
    "--set", "devicePlugin.monitor.service.nodePort=31892",
    "--set", "scheduler.metrics.service.nodePort=31893",
    "--set-json", f'webhook.namespaceSelector={{"matchLabels":{{"kubernetes.io/metadata.name":"{NS}"}}}}',
    "--set", "webhook.timeoutSeconds=2",
]  # fmt: skip
CLUSTER_KINDS = (
    "clusterroles,clusterrolebindings,mutatingwebhookconfigurations,validatingwebhookconfigurations"
)
NAMESPACED_KINDS = "deployments,daemonsets,services,configmaps,secrets,serviceaccounts,roles,rolebindings"


def helm(sandbox: Sandbox, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(sandbox.bin("helm")), f"--kubeconfig={sandbox.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check:
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result


def get(sandbox: Sandbox, *args: str) -> Any:
    return json.loads(sandbox.kubectl("get", "-o", "json", *args).stdout)


def owned(sandbox: Sandbox) -> list[str]:
    """Every object of the release, cluster-wide and in its namespace, as kind/name."""
    selector = f"app.kubernetes.io/instance={RELEASE}"
    found = get(sandbox, CLUSTER_KINDS, "-l", selector)["items"]
    found += get(sandbox, NAMESPACED_KINDS, "-n", NS, "-l", selector)["items"]
    found += [
        s
        for s in get(sandbox, "secrets", "-n", NS)["items"]
        if s["metadata"]["name"].startswith(f"{RELEASE}-")  # the token Secret too, labelled or not
    ]
    return sorted({f"{o['kind']}/{o['metadata']['name']}" for o in found})


@pytest.fixture(scope="module")
def namespace(sandbox: Sandbox) -> Iterator[str]:
    sandbox.kubectl("create", "namespace", NS)
    try:
        yield NS
    finally:
        helm(sandbox, "uninstall", RELEASE, "-n", NS, "--wait", check=False)
        sandbox.kubectl("delete", "namespace", NS, "--wait=false", check=False)


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name.removesuffix("-values.yaml"))
def test_the_api_server_accepts_every_object_of_the_scenario_in_a_server_side_dry_run(
    sandbox: Sandbox, namespace: str, values: Path
) -> None:
    rendered = helm(sandbox, "template", RELEASE, str(CHART), "-n", namespace, "-f", str(values), *ISOLATION)
    result = sandbox.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=rendered.stdout)
    applied = [line for line in result.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(applied) == len([d for d in yaml.safe_load_all(rendered.stdout) if d])
    assert owned(sandbox) == []  # a dry run leaves nothing


def test_contradictory_values_fail_at_helm_install_naming_the_value_and_the_fix(
    sandbox: Sandbox, namespace: str
) -> None:
    result = helm(
        sandbox, "install", RELEASE, str(CHART), "-n", namespace, *ISOLATION,
        "--set", "devicePlugin.deviceMemoryScaling=1.5", check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "devicePlugin.deviceMemoryScaling=1.5" in result.stderr
    assert "Fix: set devicePlugin.virtualMemory.enabled=true" in result.stderr
    mistyped = helm(
        sandbox, "install", RELEASE, str(CHART), "-n", namespace, *ISOLATION,
        "--set", "devicePlugin.deviceSplitcount=4", check=False,
    )  # fmt: skip
    assert mistyped.returncode != 0 and "'deviceSplitcount' not allowed" in mistyped.stderr
    assert helm(sandbox, "status", RELEASE, "-n", namespace, check=False).returncode != 0
    assert owned(sandbox) == []


def _daemonset(sandbox: Sandbox) -> dict[str, Any]:
    ds: dict[str, Any] = get(sandbox, "daemonset", f"{RELEASE}-device-plugin", "-n", NS)
    return ds


def _revisions(sandbox: Sandbox) -> set[str]:
    ds = _daemonset(sandbox)
    revs = get(sandbox, "controllerrevisions", "-n", NS)["items"]
    return {
        r["metadata"]["name"]
        for r in revs
        if any(o["uid"] == ds["metadata"]["uid"] for o in r["metadata"].get("ownerReferences", []))
    }


def _node_config(sandbox: Sandbox) -> dict[str, Any]:
    cm = get(sandbox, "configmap", f"{RELEASE}-device-plugin-config", "-n", NS)
    doc: dict[str, Any] = yaml.safe_load(cm["data"]["node-config.yaml"])
    return doc


def test_install_upgrade_and_uninstall_of_a_release(sandbox: Sandbox, namespace: str) -> None:
    custom = CHART / "ci" / "custom-split-scaling-values.yaml"
    helm(sandbox, "install", RELEASE, str(CHART), "-n", namespace, "-f", str(custom), *ISOLATION, "--wait")

    # the objects exist, with the values given
    assert _node_config(sandbox)["split"] == 4
    assert _node_config(sandbox)["nodes"]["gpu-node-h200-0"]["split"] == 16
    monitor = get(sandbox, "service", f"{RELEASE}-monitor", "-n", NS)["spec"]
    assert [p["nodePort"] for p in monitor["ports"]] == [31892]
    metrics = get(sandbox, "service", f"{RELEASE}-scheduler-metrics", "-n", NS)["spec"]
    assert [p["nodePort"] for p in metrics["ports"]] == [31893]
    deploy = get(sandbox, "deployment", f"{RELEASE}-scheduler", "-n", NS)
    extender = next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "extender")
    assert "--node-policy=spread" in extender["command"] and "--gpu-policy=binpack" in extender["command"]
    assert {"name": "VGPU_DEFAULT_MEM", "value": "4096"} in extender["env"]
    gpu_nodes = get(sandbox, "nodes", "-l", "gpu=on")["items"]
    ds = _daemonset(sandbox)
    assert ds["status"]["desiredNumberScheduled"] == len(gpu_nodes) > 0
    # the token controller filled the extender's own ServiceAccount token
    token = get(sandbox, "secret", f"{RELEASE}-extender-token", "-n", NS)
    assert token["data"].get("token")
    tls = get(sandbox, "secret", f"{RELEASE}-extender-tls", "-n", NS)["data"]
    hook = get(sandbox, "mutatingwebhookconfiguration", f"{RELEASE}-{NS}")["webhooks"][0]
    assert hook["clientConfig"]["caBundle"] == tls["ca.crt"]

    # a new split count rolls the device plugin: new pod template, new ControllerRevision
    template_before = ds["spec"]["template"]
    revisions_before = _revisions(sandbox)
    helm(
        sandbox, "upgrade", RELEASE, str(CHART), "-n", namespace, "--reuse-values",
        "--set", "devicePlugin.deviceSplitCount=5", "--wait",
    )  # fmt: skip
    assert _node_config(sandbox)["split"] == 5
    template_after = _daemonset(sandbox)["spec"]["template"]
    assert (
        template_after["metadata"]["annotations"]["checksum/config"]
        != (template_before["metadata"]["annotations"]["checksum/config"])
    )
    assert _revisions(sandbox) - revisions_before, "no new ControllerRevision after the upgrade"
    # ... and the upgrade rotated the extender's certificate, everywhere at once
    tls_after = get(sandbox, "secret", f"{RELEASE}-extender-tls", "-n", NS)["data"]
    assert tls_after["tls.crt"] != tls["tls.crt"]
    hook_after = get(sandbox, "validatingwebhookconfiguration", f"{RELEASE}-{NS}")["webhooks"][0]
    assert hook_after["clientConfig"]["caBundle"] == tls_after["ca.crt"]

    # uninstall leaves nothing behind, cluster-scoped objects included
    assert len(owned(sandbox)) > 20
    helm(sandbox, "uninstall", RELEASE, "-n", namespace, "--wait")
    assert owned(sandbox) == []
    # the garbage collector removes the pods after their owners; KWOK finishes their deletion
    deadline = time.monotonic() + 120
    while get(sandbox, "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]:
        assert time.monotonic() < deadline, "the release's pods were never deleted"
        time.sleep(1)
