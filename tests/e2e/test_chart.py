"""The Helm chart against the sandbox's real API server, in a namespace of its own: server-side
dry runs of every scenario, bad values refused at install, install/upgrade/uninstall of a release,
the real extender and device plugin running with the chart's ServiceAccounts and command lines,
and the ServiceMonitor once the cluster serves its kind."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_local import local_extender_flags
from vgpu_sandbox.cluster import Sandbox
from vgpu_sandbox.procs import free_port

from tests import support
from tests.support.driver import fake_driver
from tests.support.tenant import token_kubeconfig
from vgpu.core.annotations import ALLOCATION_ANNOTATION, DEVICES_ANNOTATION, lease_name

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vgpu"
ROOT_HOOK = REPO / "native" / "hook"
SCENARIOS = sorted(CHART.glob("ci/*-values.yaml"))
NS = "vgpu-chart-test"
SCHEDULER = "vgpu-chart-test-scheduler"  # served by no kube-scheduler of the sandbox
RELEASE = "vgpu"
# Keep clear of the sandbox's own product: a webhook that selects no namespace (its pods are
# KWOK's: nothing answers behind the Service, and it fails closed), and tenant-boundary rules
# kept to this release's own namespace, which the namespace fixture labels for the sandbox's
# rules to leave alone (inventory/sandbox.yml): each release's rules trust its own scheduler.
ISOLATION = [
    "--set-json", 'webhook.namespaceSelector={"matchLabels":{"vgpu-chart-test/none":"true"}}',
    "--set", "webhook.timeoutSeconds=2",
    "--set-json",
    'tenantBoundary.namespaceSelector={"matchLabels":{"kubernetes.io/metadata.name":"' + NS + '"}}',
]  # fmt: skip
# the chart of EARLIER has neither key: its node ports are set apart from any other release's
EARLIER_ISOLATION = [
    "--set", "devicePlugin.monitor.service.nodePort=31892",
    "--set", "scheduler.metrics.service.nodePort=31893",
    "--set-json", 'webhook.namespaceSelector={"matchLabels":{"vgpu-chart-test/none":"true"}}',
    "--set", "webhook.timeoutSeconds=2",
]  # fmt: skip
CLUSTER_KINDS = (
    "clusterroles,clusterrolebindings,mutatingwebhookconfigurations,validatingwebhookconfigurations,"
    "validatingadmissionpolicies,validatingadmissionpolicybindings"
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
    cluster_wide = get(sandbox, CLUSTER_KINDS, "-l", selector)["items"]
    found = [o for o in cluster_wide if NS in o["metadata"]["name"]]  # not another namespace's release
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
    sandbox.kubectl("label", "namespace", NS, "vgpu.openaios.io/tenant-boundary=other-release")
    try:
        yield NS
    finally:
        helm(sandbox, "uninstall", RELEASE, "-n", NS, "--wait", check=False)
        sandbox.kubectl("delete", "namespace", NS, "--wait=false", check=False)


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name.removesuffix("-values.yaml"))
def test_the_api_server_accepts_every_object_of_the_scenario_in_a_server_side_dry_run(
    sandbox: Sandbox, namespace: str, values: Path
) -> None:
    # Rendered for the sandbox's own version, whatever helm was built to assume: a scenario that
    # pins kube-scheduler (the 1.33 renders of tests/integration) gets the server's tag here, as
    # the skew check requires.
    version = json.loads(sandbox.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    version = version.split("+")[0]
    for_server = [
        "--kube-version",
        version.lstrip("v"),
        "--set",
        f"scheduler.kubeScheduler.imageTag={version}",
    ]
    rendered = helm(
        sandbox, "template", RELEASE, str(CHART), "-n", namespace, "-f", str(values), *ISOLATION, *for_server
    )
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
    assert monitor["type"] == "ClusterIP"  # node ports are an opt-in
    metrics = get(sandbox, "service", f"{RELEASE}-scheduler-metrics", "-n", NS)["spec"]
    assert metrics["type"] == "ClusterIP"
    deploy = get(sandbox, "deployment", f"{RELEASE}-scheduler", "-n", NS)
    extender = next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "extender")
    assert "--node-policy=spread" in extender["command"] and "--gpu-policy=binpack" in extender["command"]
    assert "--default-mem=4096" in extender["command"]
    gpu_nodes = get(sandbox, "nodes", "-l", "gpu=on")["items"]
    ds = _daemonset(sandbox)
    assert ds["status"]["desiredNumberScheduled"] == len(gpu_nodes) > 0
    # the scheduler pod runs on its own projected token: no long-lived token Secret
    secrets_ = get(sandbox, "secrets", "-n", NS)["items"]
    assert not [x for x in secrets_ if x.get("type") == "kubernetes.io/service-account-token"]
    # the tenant boundary's policies, bound and kept to this release's namespace
    for name in ("placements", "priority"):
        binding = get(sandbox, "validatingadmissionpolicybinding", f"{RELEASE}-{NS}-{name}")
        assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": NS
        }
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


# The chart as main had it on 2026-12-05 (before the extender's client certificate and per-node
# enforcement): a release installed from it must upgrade in place, also with --reuse-values,
# which keeps that chart's values, so none of the keys added since.
EARLIER = "1a56719"


def test_a_release_of_an_earlier_chart_upgrades_in_place_with_its_values_reused(
    sandbox: Sandbox, namespace: str, tmp_path: Path
) -> None:
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", EARLIER, "charts/vgpu"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        pytest.skip(
            f"the earlier chart needs this checkout's git history ({EARLIER}): {archive.stderr[-200:]!r}"
        )
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    earlier = tmp_path / "charts" / "vgpu"
    helm(
        sandbox, "install", RELEASE, str(earlier), "-n", namespace, *EARLIER_ISOLATION,
        "--set", "devicePlugin.deviceSplitCount=7", "--wait",
    )  # fmt: skip
    try:
        assert "client.crt" not in get(sandbox, "secret", f"{RELEASE}-extender-tls", "-n", NS)["data"]
        for how in ("--reuse-values", "--reset-then-reuse-values"):
            # the node ports it had set keep their NodePort type; the new rules kept to the namespace
            helm(
                sandbox, "upgrade", RELEASE, str(CHART), "-n", namespace, how, *ISOLATION,
                "--set", "devicePlugin.monitor.service.type=NodePort",
                "--set", "scheduler.metrics.service.type=NodePort", "--wait",
            )  # fmt: skip
            assert _node_config(sandbox)["split"] == 7, how  # the user's value kept
            # what the new chart adds by default holds, though the old values never named it
            tls = get(sandbox, "secret", f"{RELEASE}-extender-tls", "-n", NS)["data"]
            assert {"client.crt", "client.key"} <= set(tls), how
            config = get(sandbox, "configmap", f"{RELEASE}-scheduler-config", "-n", NS)["data"]
            (ext,) = yaml.safe_load(config["scheduler-config.yaml"])["extenders"]
            assert ext["tlsConfig"]["certFile"] == "/etc/vgpu/extender-client/tls.crt", how
            deploy = get(sandbox, "deployment", f"{RELEASE}-scheduler", "-n", NS)["spec"]["template"]["spec"]
            extender = next(c for c in deploy["containers"] if c["name"] == "extender")
            assert "--client-ca-file=/etc/vgpu/tls/ca.crt" in extender["command"], how
    finally:
        helm(sandbox, "uninstall", RELEASE, "-n", namespace, "--wait", check=False)


def _build_hook(work: Path) -> Path:
    """libvgpu.so built here with the Makefile target the device plugin image uses."""
    shutil.copytree(ROOT_HOOK, work, ignore=shutil.ignore_patterns("build"))
    built = subprocess.run(
        ["make", "-C", str(work), "build/libvgpu.so"], capture_output=True, text=True, timeout=300
    )
    assert built.returncode == 0, built.stderr[-2000:]
    return work / "build" / "libvgpu.so"


@contextlib.contextmanager
def _running(argv: list[str], what: str, ready: Callable[[], bool]) -> Iterator[None]:
    """Runs ``vgpu ARGV`` until the block ends; fails if it is not ready in time or if any API
    call it made was refused."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vgpu.commands.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not ready():
            assert proc.poll() is None, f"{what} exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"{what} not ready within 90s"
            time.sleep(0.5)
        yield
        time.sleep(2)  # watches and renewals start after the first lists: give a refusal time to show
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
        print(output[-5000:])
    assert "forbidden" not in output.lower(), output[-3000:]


@pytest.fixture
def components_release(sandbox: Sandbox, namespace: str) -> Iterator[str]:
    """A release whose scheduler name no kube-scheduler of the sandbox serves; removed afterwards."""
    helm(
        sandbox,
        "install",
        RELEASE,
        str(CHART),
        "-n",
        namespace,
        *ISOLATION,
        "--set",
        f"scheduler.schedulerName={SCHEDULER}",
    )
    try:
        yield RELEASE
    finally:
        helm(sandbox, "uninstall", RELEASE, "-n", namespace, "--wait", check=False)
        sandbox.kubectl("delete", "lease", "--all", "-n", namespace, check=False)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with support.short_dir("vgpu-chart-") as path:
        yield path


def test_each_components_service_account_is_enough_for_the_real_component_and_no_more(
    sandbox: Sandbox, components_release: str, tmp_path: Path, short_dir: Path
) -> None:
    """A device plugin and the extender run here on the chart's command lines, with the tokens of
    the chart's ServiceAccounts and the release's certificate: the plugin writes its Node's
    inventory, renews its Lease and installs the hook library; the extender syncs, takes its
    Lease, answers over the release's TLS, and places a pod (allocation annotation, Binding).
    Then the API server's authorizer denies them the rest."""
    node = "vgpu-chart-test-node"
    sandbox.kubectl(
        "create",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}),
    )
    try:
        # the device plugin, with a token of its account bound to its node, as the pod's projected
        # token is (it names the node: the tenant boundary's node-agent rules read it)
        token = sandbox.kubectl(
            "create", "token", f"{RELEASE}-device-plugin", "-n", NS, "--bound-object-kind=Node",
            f"--bound-object-name={node}",
        ).stdout.strip()  # fmt: skip
        plugin_kubeconfig = token_kubeconfig(sandbox, token, tmp_path / "plugin.kubeconfig")
        root = short_dir / "root"  # the plugin's unix socket lives under it: 107 bytes at most
        (root / "var/lib/kubelet/device-plugins").mkdir(parents=True)
        gpus = tmp_path / "gpus.yaml"
        gpus.write_text(yaml.safe_dump({"gpus": [{"uuid": "GPU-chart-0", "memoryMiB": 16384}]}))
        node_config = tmp_path / "node-config.yaml"
        node_config.write_text(
            get(sandbox, "configmap", f"{RELEASE}-device-plugin-config", "-n", NS)["data"]["node-config.yaml"]
        )

        def reported() -> bool:
            annotations = get(sandbox, "node", node)["metadata"].get("annotations") or {}
            leases = get(sandbox, "leases", "-n", NS)["items"]
            return DEVICES_ANNOTATION in annotations and any(
                item["metadata"]["name"] == lease_name(node) for item in leases
            )

        # the DaemonSet's own command line, with what a node would provide made local
        library = _build_hook(tmp_path / "hook")
        daemonset = get(sandbox, "daemonset", f"{RELEASE}-device-plugin", "-n", NS)["spec"]["template"][
            "spec"
        ]
        command = next(c for c in daemonset["containers"] if c["name"] == "device-plugin")["command"]
        local = {
            "--config": str(node_config),
            "--monitor-listen": f"127.0.0.1:{free_port()}",
            "--hook-library": str(library),
            # the chart's default driverInject: plugin finds the driver's files under it
            "--driver-root": str(fake_driver(tmp_path / "driver")),
        }
        flags = [
            f"{k}={local.get(k, v.replace('$(NODE_NAME)', node))}"
            for k, v in (a.split("=", 1) for a in command[2:])
        ]
        plugin = [
            "device-plugin",
            *flags,
            f"--kubeconfig={plugin_kubeconfig}",
            f"--root={root}",
            f"--fake-nvml={gpus}",
        ]

        # the extender, with a token of the scheduler pod's account (its projected token), on the
        # chart's command line
        token = sandbox.kubectl("create", "token", f"{RELEASE}-scheduler", "-n", NS).stdout.strip()
        extender_kubeconfig = token_kubeconfig(sandbox, token, tmp_path / "ext.kubeconfig")
        tls = get(sandbox, "secret", f"{RELEASE}-extender-tls", "-n", NS)["data"]
        for name in ("tls.crt", "tls.key", "ca.crt", "client.crt", "client.key"):
            (tmp_path / name).write_bytes(base64.b64decode(tls[name]))
        deploy = get(sandbox, "deployment", f"{RELEASE}-scheduler", "-n", NS)["spec"]["template"]["spec"]
        command = next(c for c in deploy["containers"] if c["name"] == "extender")["command"]
        port, flags = local_extender_flags(
            command, tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"
        )
        extender = ["extender", f"--kubeconfig={extender_kubeconfig}", *flags]
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))  # the release's CA
        # kube-scheduler's client certificate from the release's Secret: the verbs answer it alone
        ctx.load_cert_chain(str(tmp_path / "client.crt"), str(tmp_path / "client.key"))

        def call(path: str, body: object | None = None) -> tuple[int, Any]:
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(
                f"https://127.0.0.1:{port}{path}", data=data, method="POST" if data else "GET"
            )
            req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
                    text = resp.read().decode()
                    return resp.status, json.loads(text) if body is not None else text
            except urllib.error.HTTPError as err:
                return err.code, None
            except OSError:
                return 0, None

        with _running(plugin, "the device plugin as vgpu-device-plugin", reported):
            with _running(extender, "the extender as vgpu-scheduler", lambda: call("/readyz")[0] == 200):
                assert get(sandbox, "lease", "vgpu-scheduler-extender", "-n", NS)["spec"]["holderIdentity"]
                pod = support.pod(
                    "vgpu-chart-test-pod",
                    support.container("cuda", "example.invalid/cuda:1", gpu=1, gpumem=1000),
                    namespace=NS,
                    scheduler=SCHEDULER,
                )
                created = json.loads(
                    sandbox.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(pod)).stdout
                )
                status, result = call("/filter", {"Pod": created, "NodeNames": [node]})
                assert status == 200 and result["NodeNames"] == [node], result
                meta = created["metadata"]
                args = {"PodName": meta["name"], "PodNamespace": NS, "PodUID": meta["uid"], "Node": node}
                status, result = call("/bind", args)
                assert status == 200 and not result["Error"], result
                bound = get(sandbox, "pod", meta["name"], "-n", NS)
                assert bound["spec"]["nodeName"] == node
                assert ALLOCATION_ANNOTATION in bound["metadata"]["annotations"]

        # the plugin installed the hook library from the path the chart gives it, under the
        # host's /var/lib/vgpu, with the ld.so.preload naming it, none of it world-writable
        (installed,) = (root / "var/lib/vgpu/lib").glob("*/libvgpu.so")
        assert installed.read_bytes() == library.read_bytes()
        preload = installed.with_name("ld.so.preload")
        assert preload.read_text().strip() == "/usr/local/vgpu/libvgpu.so"  # the path inside containers
        for path in (installed.parent, installed, preload):
            assert not path.stat().st_mode & stat.S_IWOTH, path
        # a new build goes to a new folder; the library in use is not touched
        in_use = installed.stat()
        library.write_bytes(library.read_bytes() + b"\0")
        with _running(
            plugin,
            "the device plugin with a new hook library",
            lambda: len(list(installed.parent.parent.iterdir())) == 2,
        ):
            pass
        assert installed.stat().st_ino == in_use.st_ino and installed.stat().st_mtime_ns == in_use.st_mtime_ns
        assert installed.read_bytes() != library.read_bytes()
    finally:
        sandbox.kubectl("delete", "pod", "--all", "-n", NS, "--force", "--grace-period=0", check=False)
        sandbox.kubectl("delete", "node", node, "--wait=false", check=False)

    # ... and nothing beyond: asked of the API server's own authorizer
    def can(account: str, *what: str) -> bool:
        who = f"--as=system:serviceaccount:{NS}:{RELEASE}-{account}"
        return sandbox.kubectl("auth", "can-i", *what, who, check=False).stdout.strip() == "yes"

    assert not can("scheduler", "get", "secrets", "-n", NS)
    assert not can("scheduler", "patch", "nodes")
    assert not can("device-plugin", "create", "bindings", "-n", "default")
    assert not can("device-plugin", "delete", "pods")
    assert not can("device-plugin", "get", "secrets", "-n", NS)
    # kube-scheduler and the extender share the pod's account: each Lease of theirs, none other
    assert can("scheduler", "update", f"leases/kube-scheduler-{SCHEDULER}", "-n", NS)
    assert can("scheduler", "update", "leases/vgpu-scheduler-extender", "-n", NS)
    assert not can("scheduler", "update", "leases/vgpu-other", "-n", NS)


SERVICE_MONITOR_CRD = {
    # the Prometheus operator's CRD reduced to what the API server needs to serve the kind
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "names": {"kind": "ServiceMonitor", "listKind": "ServiceMonitorList", "plural": "servicemonitors"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


def test_a_service_monitor_appears_only_once_the_cluster_serves_its_kind(
    sandbox: Sandbox, namespace: str
) -> None:
    helm(sandbox, "install", RELEASE, str(CHART), "-n", namespace, *ISOLATION)
    try:
        manifest = helm(sandbox, "get", "manifest", RELEASE, "-n", namespace).stdout
        assert "kind: ServiceMonitor" not in manifest
    finally:
        helm(sandbox, "uninstall", RELEASE, "-n", namespace, "--wait")
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(SERVICE_MONITOR_CRD))
    try:
        sandbox.kubectl("wait", "--for=condition=Established", "crd/servicemonitors.monitoring.coreos.com")
        helm(sandbox, "install", RELEASE, str(CHART), "-n", namespace, *ISOLATION)
        try:
            monitor = get(sandbox, "servicemonitors.monitoring.coreos.com", RELEASE, "-n", NS)
            assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/instance": RELEASE}
        finally:
            helm(sandbox, "uninstall", RELEASE, "-n", namespace, "--wait")
        assert get(sandbox, "servicemonitors.monitoring.coreos.com", "-n", NS)["items"] == []
    finally:
        sandbox.kubectl("delete", "crd", "servicemonitors.monitoring.coreos.com", "--wait=false")
