"""Admission against the sandbox's real API server: a pod larger than every card is admitted and
waits Pending with the shortage in its scheduling reason; with the chart's
``scheduler.admission.rejectUnsatisfiable=true`` the same pod is denied, naming the field.

The opt-in runs as a real extender under gunicorn on the command line the chart renders for
that value, registered with the API server by a ValidatingWebhookConfiguration built from the
chart's own (its clientConfig pointed at this process, and its namespaceSelector at one
namespace of this test, so the sandbox's own webhook and every other test are left alone).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from chart_local import local_extender_flags
from vgpu_sandbox.cluster import Sandbox
from vgpu_sandbox.kubelet import RECORD_ANNOTATION
from vgpu_sandbox.pki import CertificateAuthority

from tests.support import container, pod, start, stop, wait_for
from tests.support.dra import resource_claim, vgpu_config

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vgpu"
CARD_MIB = 81920  # every sandbox card (tests/e2e/conftest.py)
pytestmark = pytest.mark.e2e

STRICT_NS = "vgpu-admission-strict"
STRICT_LABEL = "vgpu-admission-e2e/strict"


def big_pod(name: str, namespace: str) -> dict[str, Any]:
    big = container("main", "registry.invalid/cuda:none", gpumem=CARD_MIB + 20000)
    return pod(name, big, namespace=namespace, grace=0)


def get_pod(sandbox: Sandbox, namespace: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = sandbox.api_get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    return pod


def scheduling_message(pod: dict[str, Any]) -> str:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond["type"] == "PodScheduled" and cond["status"] == "False":
            return str(cond.get("message", ""))
    return ""


def test_a_pod_larger_than_every_card_is_admitted_and_waits_with_the_shortage_named(sandbox: Sandbox) -> None:
    """The sandbox's own webhook and vgpu-scheduler, with the chart's default (no opt-in)."""
    name = "adm-big-" + uuid.uuid4().hex[:6]
    created = sandbox.kubectl("create", "-f", "-", input=json.dumps(big_pod(name, "default")), check=False)
    try:
        assert created.returncode == 0, created.stderr
        assert get_pod(sandbox, "default", name)["spec"]["schedulerName"] == "vgpu-scheduler"
        shortage = f"smaller than asked ({CARD_MIB} MiB)"
        wait_for(
            lambda: shortage in scheduling_message(get_pod(sandbox, "default", name)),
            "a PodScheduled condition naming the card that is too small",
            60,
            every=0.5,
        )
        pod = get_pod(sandbox, "default", name)
        assert not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending"
        assert f"needs 1 vGPU(s) of {CARD_MIB + 20000} MiB" in scheduling_message(pod)
        events = sandbox.api_get(
            f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{name}"
        )["items"]
        failed = [e["message"] for e in events if e["reason"] == "FailedScheduling"]
        assert any(shortage in m for m in failed), failed
    finally:
        sandbox.kubectl("delete", "pod", name, "-n", "default", "--wait=false", check=False)


def test_gpumem_with_a_memory_unit_is_denied_saying_the_mib_meant_and_a_plain_number_admitted(
    sandbox: Sandbox,
) -> None:
    """The API server writes a plain 3000 as "3k" before the webhook sees it: that stays admitted."""

    def create(gpumem: str, annotations: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        pod = big_pod("adm-units", "default")
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = gpumem
        pod["metadata"]["annotations"] = annotations or {}
        return sandbox.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)

    denied = create("4Gi")
    assert denied.returncode != 0
    assert (
        "pod: spec.containers[0].resources.limits[nvidia.com/gpumem]: nvidia.com/gpumem is in MiB: "
        "did you mean 4096?" in denied.stderr
    )
    assert "did you mean 3815?" in create("4G").stderr
    assert "did you mean 4096?" in create("4294967296").stderr  # bytes, past 1 TiB per vGPU
    for plain in ("3000", "4096", "3k"):
        admitted = create(plain)
        assert admitted.returncode == 0, (plain, admitted.stderr)
    # a selection no card of the cluster matches is admitted (a card may join) with a warning
    warned = create("1000", {"nvidia.com/use-gputype": "NoSuchModel"})
    assert warned.returncode == 0, warned.stderr
    assert (
        "Warning: metadata.annotations[nvidia.com/use-gputype]: 'NoSuchModel' matches no card"
        in warned.stderr
    )


def test_gpumem_0_gets_the_whole_card_as_in_hami_and_another_scheduler_is_warned_of(sandbox: Sandbox) -> None:
    """Coming from HAMi (issue 37): ``gpumem: 0`` was refused with no fix; it reads as HAMi reads
    it, the card's memory, booked by the scheduler and granted by the node alike. A pod left on
    ``hami-scheduler`` was admitted silently and waited with no event: admission warns now."""
    name = "adm-zero-" + uuid.uuid4().hex[:6]
    zero = pod(name, container("main", "registry.invalid/cuda:none", gpu=1, gpumem=0), grace=0)
    created = sandbox.kubectl("create", "-f", "-", input=json.dumps(zero), check=False)
    try:
        assert created.returncode == 0, created.stderr

        def admitted() -> str | None:
            return (get_pod(sandbox, "default", name)["metadata"].get("annotations") or {}).get(
                RECORD_ANNOTATION
            )

        record = wait_for(admitted, "the node's stand-in to admit the pod", 60, every=0.5)
        assert json.loads(record)["main"]["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{CARD_MIB}m"
    finally:
        sandbox.kubectl("delete", "pod", name, "-n", "default", "--wait=false", check=False)
    hami = container("main", "registry.invalid/cuda:none", gpu=1, gpumem=3000)
    warned = sandbox.kubectl(
        "create",
        "--dry-run=server",
        "-f",
        "-",
        input=json.dumps(pod("adm-hami", hami, scheduler="hami-scheduler")),
        check=False,
    )
    assert warned.returncode == 0, warned.stderr
    assert "Warning: spec.schedulerName: 'hami-scheduler' is not 'vgpu-scheduler'" in warned.stderr


def render_chart(sandbox: Sandbox, namespace: str, *values: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [str(sandbox.bin("helm")), "template", "vgpu", str(CHART), "-n", namespace, *values],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def find(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


@contextlib.contextmanager
def strict_extender(sandbox: Sandbox, folder: Path) -> Iterator[tuple[str, str]]:
    """The chart's extender with rejectUnsatisfiable=true, serving HTTPS on 127.0.0.1; yields
    (base URL, CA bundle in base64) and stops it afterwards."""
    objs = render_chart(sandbox, STRICT_NS, "--set", "scheduler.admission.rejectUnsatisfiable=true")
    pod = find(objs, "Deployment")["spec"]["template"]["spec"]
    command = next(c for c in pod["containers"] if c["name"] == "extender")["command"]
    assert "--reject-unsatisfiable=true" in command
    ca = CertificateAuthority(folder / "pki")
    pair = ca.issue("extender", ["127.0.0.1"])
    port, flags = local_extender_flags(command, pair.cert, pair.key, ca.cert_path)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = start(
        [sys.executable, "-m", "vgpu.commands.cli", "extender", f"--kubeconfig={sandbox.kubeconfig}", *flags],
        folder / "extender.log",
        env,
    )
    url = f"https://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, (folder / "extender.log").read_text()[-3000:]
            try:
                return requests.get(url + "/readyz", verify=str(ca.cert_path), timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_for(ready, "the strict extender's /readyz", 90, every=0.5)
        yield url, base64.b64encode(ca.pem).decode()
    finally:
        stop(proc)


def test_with_reject_unsatisfiable_the_same_pod_is_denied_naming_the_field(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    sandbox.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": STRICT_NS, "labels": {STRICT_LABEL: "true"}},
            }
        ),
    )
    hook_name = "vgpu-admission-e2e-strict"
    try:
        with strict_extender(sandbox, tmp_path) as (url, ca_b64):
            objs = render_chart(sandbox, STRICT_NS)
            config = find(objs, "ValidatingWebhookConfiguration")
            (hook,) = config["webhooks"]
            hook["clientConfig"] = {"url": url + hook["clientConfig"]["service"]["path"], "caBundle": ca_b64}
            hook["namespaceSelector"] = {"matchLabels": {STRICT_LABEL: "true"}}
            config["metadata"] = {"name": hook_name}
            sandbox.kubectl("apply", "-f", "-", input=json.dumps(config))

            pod = json.dumps(big_pod("adm-big", STRICT_NS))

            def denied() -> bool:  # the API server picks up a new webhook configuration shortly
                dry = sandbox.kubectl("create", "--dry-run=server", "-f", "-", input=pod, check=False)
                return dry.returncode != 0

            wait_for(denied, "the strict webhook to be in force", 30, every=0.5)
            result = sandbox.kubectl("create", "-f", "-", input=pod, check=False)
            assert result.returncode != 0
            message = result.stderr
            assert 'admission webhook "validate.vgpu.openaios.io" denied the request' in message
            assert "spec.containers[0].resources.limits[nvidia.com/gpumem]" in message
            assert f"largest card has ({CARD_MIB} MiB); ask for at most {CARD_MIB}" in message
            assert "scheduler.admission.rejectUnsatisfiable" in message
            # what fits a card is still admitted there
            fits = big_pod("adm-fits", STRICT_NS)
            fits["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = "1000"
            ok = sandbox.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(fits), check=False)
            assert ok.returncode == 0, ok.stderr
            # and a selection that no card of the cluster matches is denied there, naming it
            fits["metadata"]["annotations"] = {"nvidia.com/use-gputype": "NoSuchModel"}
            no = sandbox.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(fits), check=False)
            assert no.returncode != 0
            assert "metadata.annotations[nvidia.com/use-gputype]: 'NoSuchModel' matches no card" in no.stderr
    finally:
        sandbox.kubectl("delete", "validatingwebhookconfiguration", hook_name, check=False)
        sandbox.kubectl("delete", "lease", "--all", "-n", STRICT_NS, check=False)
        sandbox.kubectl("delete", "namespace", STRICT_NS, "--wait=false", check=False)


def _claim_with(params: dict[str, Any], name: str) -> str:
    """A ResourceClaim asking the vgpu DeviceClass for a share, configured with ``params`` (contract 8)."""
    return json.dumps(resource_claim(name, config=[vgpu_config(["gpu"], **params)]))


def test_a_claim_whose_vgpu_configuration_is_malformed_is_denied_naming_the_field(sandbox: Sandbox) -> None:
    if "resource.k8s.io/v1" not in sandbox.kubectl("api-versions").stdout.split():
        pytest.skip(
            "the sandbox's API server serves no resource.k8s.io/v1 (Kubernetes 1.34+): run make setup"
        )
    bad = sandbox.kubectl(
        "create",
        "--dry-run=server",
        "-f",
        "-",
        input=_claim_with({"priority": "high"}, "adm-bad"),
        check=False,
    )
    assert bad.returncode != 0
    assert 'admission webhook "validate-config.vgpu.openaios.io" denied the request' in bad.stderr
    assert (
        "ResourceClaim default/adm-bad: spec.devices.config[0].opaque.parameters.priority: "
        "must be 0 (high) or 1 (normal)"
    ) in bad.stderr
    unknown = sandbox.kubectl(
        "create",
        "--dry-run=server",
        "-f",
        "-",
        input=_claim_with({"gpumem": 3000}, "adm-unknown"),
        check=False,
    )
    assert unknown.returncode != 0 and "parameters.gpumem: is not a field of VgpuConfig" in unknown.stderr
    good = sandbox.kubectl(
        "create",
        "--dry-run=server",
        "-f",
        "-",
        input=_claim_with({"priority": 0, "smPolicy": "elastic"}, "adm-good"),
        check=False,
    )
    assert good.returncode == 0, good.stderr


def test_a_claim_asking_more_cores_than_a_card_is_denied_and_memory_in_bytes_warned(sandbox: Sandbox) -> None:
    if "resource.k8s.io/v1" not in sandbox.kubectl("api-versions").stdout.split():
        pytest.skip(
            "the sandbox's API server serves no resource.k8s.io/v1 (Kubernetes 1.34+): run make setup"
        )
    over = json.dumps(resource_claim("adm-over", cores="150"))
    denied = sandbox.kubectl("create", "--dry-run=server", "-f", "-", input=over, check=False)
    assert denied.returncode != 0
    assert (
        "ResourceClaim default/adm-over: spec.devices.requests[0].exactly.capacity.requests.cores: "
        "asks for 150 percent of one card, and a card has 100"
    ) in denied.stderr
    small = json.dumps(resource_claim("adm-bytes", memory="3000"))
    warned = sandbox.kubectl("create", "--dry-run=server", "-f", "-", input=small, check=False)
    assert warned.returncode == 0, warned.stderr
    assert "Warning:" in warned.stderr and "Did you mean 3000Mi?" in warned.stderr
