"""The product's own parts in the sandbox, started as a cluster would run them.

- the extender (Flask under gunicorn, HTTPS with a certificate from the sandbox's CA) and a
  second kube-scheduler, ``vgpu-scheduler``, that calls it over verified TLS;
- the admission webhooks, pointing the API server at the extender;
- per node: a kubelet stand-in (Registration service, Allocate on bind) and the device plugin
  with a fake NVML backend describing that node's simulated cards.

Each part starts only when its code is installed, so the sandbox works at every stage.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vgpu.core.annotations import DEVICES_ANNOTATION
from vgpu.core.boundary import NODE_CLAIM
from vgpu.core.mig import RESOURCE_PREFIX as MIG_PREFIX
from vgpu.core.mig import mig_resources
from vgpu.core.requests import RESOURCE_GPU, RESOURCES
from vgpu_sandbox import controlplane, nodes
from vgpu_sandbox.binaries import repo_root
from vgpu_sandbox.errors import SandboxError
from vgpu_sandbox.runtime import Handle, Spec

NAMESPACE = "kube-system"
SCHEDULER_NAME = "vgpu-scheduler"
MANAGED_RESOURCES = (
    *RESOURCES,
    *mig_resources(),  # a pod asking only for nvidia.com/mig-<profile> goes to the extender too
)
INVENTORY_ANNOTATION = DEVICES_ANNOTATION
# The product's parts run as the accounts the chart makes for release vgpu in kube-system (the
# playbook's, inventory/sandbox.yml), so the chart's tenant-boundary policies, which the sandbox
# applies at up, judge them as they judge the chart's own pods: the extender as the scheduler
# pod's account, each node's device plugin as the plugin's account with its node in the token's
# extra (authentication.kubernetes.io/node-name). The sandbox's "vgpu" identity impersonates them.
RELEASE = "vgpu"
SCHEDULER_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-scheduler"
PLUGIN_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-device-plugin"
BOUNDARY_TEMPLATE = "templates/tenant-boundary.yaml"


def hook_library() -> Path | None:
    """The hook `make native` built, which the plugins install as a node's DaemonSet would."""
    built = repo_root() / "native" / "hook" / "build" / "libvgpu.so"
    return built if built.is_file() else None


@dataclass(frozen=True)
class Parts:
    extender: bool
    plugins: bool


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def available() -> Parts:
    return Parts(
        extender=_installed("vgpu.extender.cli"),
        plugins=_installed("vgpu.commands.device_plugin") and _installed("vgpu_sandbox.kubelet"),
    )


def _vgpu(*args: str) -> list[str]:
    return [sys.executable, "-m", "vgpu.commands.cli", *args]


def start(sandbox: Handle, spec: Spec, parts: Parts, progress: Callable[[str], None]) -> None:
    if parts.plugins or parts.extender:
        grant_accounts(sandbox)
        apply_boundary(sandbox, progress)
    if parts.plugins:
        start_node_agents(sandbox, spec, progress)
    if parts.extender:
        start_extender(sandbox, progress)


def account_kubeconfig(sandbox: Handle, name: str, account: str, node: str | None = None) -> Path:
    """A kubeconfig of the sandbox's "vgpu" identity impersonating ``account`` (and, for a node's
    agent, with ``node`` as the token's node claim), as the product's parts run in the sandbox."""
    base = json.loads(sandbox.layout.identity_kubeconfig("vgpu").read_text())
    user = base["users"][0]["user"]
    user["as"] = account
    if node is not None:
        user["as-user-extra"] = {NODE_CLAIM: [node]}
    path = sandbox.layout.config / f"{name}.kubeconfig"
    path.touch(mode=0o600, exist_ok=True)
    path.write_text(json.dumps(base, indent=2) + "\n")
    return path


def grant_accounts(sandbox: Handle) -> None:
    """The accounts the parts impersonate may do anything: the sandbox checks the chart's policies
    on them, not its RBAC (tests/e2e/test_chart.py runs the parts on the chart's own roles)."""
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "vgpu-sandbox-product"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [
            {"kind": "ServiceAccount", "namespace": NAMESPACE, "name": account.rsplit(":", 1)[1]}
            for account in (SCHEDULER_ACCOUNT, PLUGIN_ACCOUNT)
        ],
    }
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(binding))


def chart_values() -> dict[str, Any]:
    """The chart values inventory/sandbox.yml gives the playbook's release: the sandbox's parts
    and policies follow the same tenantBoundary (high priority in the default namespace)."""
    inventory = yaml.safe_load((repo_root() / "inventory" / "sandbox.yml").read_text())
    values = inventory["all"]["children"]["kube_control"]["vars"]["vgpu_scheduler_values"]
    assert isinstance(values, dict)
    return values


def high_priority_namespaces() -> list[str]:
    return list((chart_values().get("tenantBoundary") or {}).get("highPriorityNamespaces") or [])


def boundary_objects(sandbox: Handle) -> list[dict[str, Any]]:
    """The chart's tenant-boundary policies as release vgpu would install them with the sandbox
    inventory's values, owned by that release (Helm adopts them when the playbook installs it,
    and removes them with it)."""
    values = {"tenantBoundary": chart_values().get("tenantBoundary") or {}}
    rendered = subprocess.run(
        [
            str(sandbox.bin("helm")),
            "template",
            RELEASE,
            str(repo_root() / "charts" / "vgpu"),
            "--namespace",
            NAMESPACE,
            "--show-only",
            BOUNDARY_TEMPLATE,
            "--set-json",
            f"tenantBoundary={json.dumps(values['tenantBoundary'])}",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if rendered.returncode != 0:
        raise SandboxError(f"helm template of {BOUNDARY_TEMPLATE} failed: {rendered.stderr.strip()}")
    objects = [o for o in yaml.safe_load_all(rendered.stdout) if o]
    for obj in objects:
        obj["metadata"].setdefault("annotations", {}).update(
            {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": NAMESPACE}
        )
    return objects


def apply_boundary(sandbox: Handle, progress: Callable[[str], None]) -> None:
    """Apply the chart's tenant-boundary policies (again: an uninstalled release took them away),
    and wait until the API server enforces them: a policy's binding is taken up within about a second."""
    progress("applying the chart's tenant-boundary policies")
    objects = boundary_objects(sandbox)
    sandbox.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )
    names = [o["metadata"]["name"] for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]

    def checked() -> bool:
        for name in names:
            got = sandbox.api_get(f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}")
            status = got.get("status") or {}
            if status.get("observedGeneration") != got["metadata"].get("generation"):
                return False
        return True

    sandbox.wait_for("the API server to take up the tenant-boundary policies", checked, 30, "kube-apiserver")


def start_extender(sandbox: Handle, progress: Callable[[str], None]) -> None:
    assert sandbox.ca is not None
    layout = sandbox.layout
    progress("starting the vgpu extender, its kube-scheduler and the admission webhook")
    pair = sandbox.ca.issue("extender", ["127.0.0.1", "localhost"])
    # kube-scheduler's client certificate: the extender answers its scheduling verbs to it alone
    client = sandbox.ca.issue("vgpu-scheduler-extender-client", [], client=True)
    port, metrics_port = sandbox.port("extender"), sandbox.port("extender-metrics")
    sandbox.launch(
        "vgpu-extender",
        _vgpu(
            "extender",
            f"--kubeconfig={account_kubeconfig(sandbox, 'vgpu-scheduler', SCHEDULER_ACCOUNT)}",
            f"--listen=127.0.0.1:{port}",
            f"--cert-file={pair.cert}",
            f"--key-file={pair.key}",
            f"--client-ca-file={sandbox.ca.cert_path}",
            f"--metrics-listen=127.0.0.1:{metrics_port}",
            f"--namespace={NAMESPACE}",
            f"--scheduler-name={SCHEDULER_NAME}",
            f"--scheduler-account={SCHEDULER_ACCOUNT}",
            f"--node-agent-account={PLUGIN_ACCOUNT}",
            f"--high-priority-namespaces={','.join(high_priority_namespaces())}",
        ),
        port,
    )
    ctx = ssl.create_default_context(cafile=str(sandbox.ca.cert_path))

    def ready() -> bool:  # the extender's own HTTPS endpoint, not the API server: plain urllib
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", context=ctx, timeout=2) as resp:
            return bool(resp.status == 200)

    sandbox.wait_for("the extender's /readyz", ready, 60, "vgpu-extender")

    ca_b64 = base64.b64encode(sandbox.ca.pem).decode()
    config = layout.config / "vgpu-scheduler.json"
    config.write_text(
        controlplane.scheduler_config(
            layout.identity_kubeconfig("kube-scheduler"),
            scheduler_name=SCHEDULER_NAME,
            extender_url=f"https://127.0.0.1:{port}",
            extender_ca_b64=ca_b64,
            extender_client=(client.cert, client.key),
            managed_resources=MANAGED_RESOURCES,
        )
    )
    sandbox.launch(
        "vgpu-scheduler",
        controlplane.scheduler_argv(sandbox.bin("kube-scheduler"), config, requeue_unschedulable_s=10),
    )
    sandbox.kubectl(
        "apply", "-f", "-", input=json.dumps(webhook_configs(f"https://127.0.0.1:{port}", ca_b64))
    )


def webhook_configs(base_url: str, ca_b64: str) -> dict[str, object]:
    """Mutating (route to vgpu-scheduler) and validating (refuse impossible requests) for pod
    CREATE, and the check of DRA objects' vgpu configuration.

    failurePolicy Fail: a vGPU pod admitted without the webhook would reach the default scheduler
    and be placed without the ledger; refusing it while the extender is away is the safe side.
    The product's own namespace is left out so the extender can always be restarted.
    """

    def hook(name: str, path: str) -> dict[str, object]:
        return {
            "name": name,
            "clientConfig": {"url": f"{base_url}{path}", "caBundle": ca_b64},
            "rules": [
                {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
            ],
            "namespaceSelector": {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [NAMESPACE]}
                ]
            },
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 10,
        }

    # DRA claims, templates and classes whose vgpu configuration is malformed (contract 8), as the
    # chart registers it with dra.enabled; Ignore: the DRA plugin checks the same at prepare.
    config_hook = {
        **hook("validate-config.vgpu.openaios.io", "/webhook/validate-config"),
        "rules": [
            {
                "apiGroups": ["resource.k8s.io"],
                "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["resourceclaims", "resourceclaimtemplates", "deviceclasses"],
                "scope": "*",
            }
        ],
        "failurePolicy": "Ignore",
        "matchPolicy": "Equivalent",
    }
    del config_hook["namespaceSelector"]  # DeviceClasses have no namespace
    return {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": "vgpu-webhook"},
                "webhooks": [hook("mutate.vgpu.openaios.io", "/webhook/mutate")],
            },
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": "vgpu-webhook"},
                "webhooks": [hook("validate.vgpu.openaios.io", "/webhook/validate"), config_hook],
            },
        ],
    }


def start_node_agents(sandbox: Handle, spec: Spec, progress: Callable[[str], None]) -> None:
    """Per node: the kubelet stand-in first (it owns kubelet.sock), then the device plugin."""
    layout = sandbox.layout
    progress(f"starting a device plugin and a kubelet stand-in on each of {spec.nodes} nodes")
    gpu = nodes.GPUSpec(spec.gpus_per_node, spec.gpu_memory_mib, spec.gpu_model, spec.split, spec.mig)
    names = [nodes.node_name(i) for i in range(spec.nodes)]
    kubeconfig = layout.identity_kubeconfig("vgpu")  # the kubelet stand-in's
    hook = hook_library()
    hook_args = [f"--hook-library={hook}"] if hook else []
    if hook is None:
        progress("native/hook/build/libvgpu.so is not built (make native): containers get no hook mounts")
    for name in names:
        root = layout.node_root(name)
        root.mkdir(parents=True, mode=0o700, exist_ok=True)
        gpus_file = root / "gpus.yaml"
        gpus_file.write_text(yaml.safe_dump({"gpus": nodes.fake_gpus(name, gpu)}, sort_keys=False))
        # new cards for a new sandbox: their MIG instances start from gpus.yaml (vgpu/node/fake_mig.py)
        (root / "gpus.yaml.mig.json").unlink(missing_ok=True)
        config_file = root / "node-config.yaml"
        config_file.write_text(yaml.safe_dump({"split": spec.split, "migStrategy": spec.mig}))
        sandbox.launch(
            f"kubelet-{name}",
            [
                sys.executable,
                "-m",
                "vgpu_sandbox.kubelet",
                f"--node={name}",
                f"--kubeconfig={kubeconfig}",
                f"--root={root}",
            ],
        )
        monitor_port = sandbox.port(f"monitor-{name}")
        sandbox.launch(
            f"device-plugin-{name}",
            _vgpu(
                "device-plugin",
                f"--node={name}",
                f"--kubeconfig={account_kubeconfig(sandbox, f'device-plugin-{name}', PLUGIN_ACCOUNT, name)}",
                f"--namespace={NAMESPACE}",
                f"--root={root}",
                f"--fake-nvml={gpus_file}",
                f"--config={config_file}",
                f"--monitor-listen=127.0.0.1:{monitor_port}",
                *hook_args,
            ),
            monitor_port,
        )

    def inventories_written() -> bool:
        listed = sandbox.api_get("/api/v1/nodes?labelSelector=gpu%3Don")
        done = 0
        for item in listed.get("items", []):
            annotations = item["metadata"].get("annotations") or {}
            allocatable = item.get("status", {}).get("allocatable", {})
            offered = sum(
                int(v) for k, v in allocatable.items() if k == RESOURCE_GPU or k.startswith(MIG_PREFIX)
            )
            if INVENTORY_ANNOTATION in annotations and offered > 0:
                done += 1
        return done >= len(names)

    sandbox.wait_for(
        "every device plugin to report its node's GPUs (inventory annotation and nvidia.com/gpu or mig-*)",
        inventories_written,
        60 + spec.nodes * 0.5,
        [f"{kind}-{name}" for name in names for kind in ("kubelet", "device-plugin")],
    )
