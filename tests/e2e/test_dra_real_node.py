"""DRA on a real node: the upstream kubelet 1.36 and containerd 2 run pods whose ResourceClaims
``vgpu dra-plugin`` prepares through CDI, and the hook holds each container to its claim.

- a pod whose claim asks for 3000Mi and 30 cores runs, and inside its container the stub driver's
  memory is refused past 3000 MiB (the context's charge included);
- two claims share one card; a third that does not fit what is left stays Pending with the
  scheduler's reason; the capacity comes back when a pod goes;
- a kubelet restart keeps the prepared claims prepared (the pod keeps running, no second prepare);
- a card going unhealthy shows in the status of the pod that holds it, through the kubelet's
  DRAResourceHealth stream.

Needs what tests/e2e/test_real_node.py needs (``make setup`` as root: the 1.36 kubelet and
control plane, containerd 2 with CDI on); skipped, naming what is missing, where they are not
built. Run it under the machine's real-node lock:
``flock /tmp/vgpu-realnode.lock pytest tests/e2e/test_dra_real_node.py``.

The sandbox's real node must run containerd 2 with CDI
(``vgpu_sandbox.realnode.configs.CDI_SPEC_DIRS``, from the 1.36 work); with the Debian containerd
1.6 node there is no CDI and the test is skipped. The sandbox's kubelet has a ``--root-dir`` of its
own, so the plugin is pointed at its registry.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from vgpu_sandbox import binaries
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.realnode import layout, lifecycle, prechecks, sample

from tests.support import start, stop, wait_for
from tests.support.dra import claim_template, resource_health, vgpu_config
from tests.support.groups import REAL_NODE
from vgpu.hookabi.grant import read_grant

NODE = layout.NAME
CARD_MIB = 8192
HOOK = Path(__file__).resolve().parents[2] / "native/hook/build/libvgpu.so"
VGPU = Path(sys.executable).with_name("vgpu")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.xdist_group(REAL_NODE)]


def _why_not() -> str | None:
    why = prechecks.why_not()
    if why:
        return why
    containerd = binaries.bin_dir() / "containerd"
    if not containerd.exists():
        return f"containerd 2 is not built at {containerd}"
    version = subprocess.run([str(containerd), "--version"], capture_output=True, text=True, check=False)
    if not re.search(r"\sv?2\.", version.stdout):
        return f"{containerd} is not containerd 2.x (no CDI): {version.stdout.strip()}"
    return None


@pytest.fixture(scope="module")
def node() -> Iterator[Sandbox]:
    why = _why_not()
    if why:
        pytest.skip(f"no real node with CDI here: {why}")
    top = Path(tempfile.mkdtemp(prefix="vgpu-dra-rn-", dir="/tmp"))
    sb = Sandbox(top / "sandbox")
    try:
        sb.up(Spec(nodes=0, real_node=True, gpus_per_node=1, gpu_memory_mib=CARD_MIB, product=False))
        yield sb
    finally:
        sb.down()
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def plugin(node: Sandbox) -> Iterator[subprocess.Popen[bytes]]:
    """``vgpu dra-plugin`` as root on the machine, on the real node's kubelet folders, the node
    labelled for DRA and the DeviceClass made as the chart makes it."""
    lay = layout.layout_of(node)
    node.kubectl("label", "node", NODE, "openaios.io/gpu-mode=dra", "--overwrite")
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "vgpu.openaios.io"},
        "spec": {"selectors": [{"cel": {"expression": 'device.driver == "vgpu.openaios.io"'}}]},
    }
    node.kubectl("apply", "-f", "-", input=json.dumps(device_class))
    argv = [
        str(VGPU), "dra-plugin", f"--node-name={NODE}", f"--kubeconfig={node.kubeconfig}",
        # the sandbox's kubelet has a --root-dir of its own: its plugin watcher looks there
        f"--registry-dir={lay.kubelet_root / 'plugins_registry'}",
        f"--plugin-dir={lay.kubelet_root / 'plugins' / 'vgpu.openaios.io'}",
        # the grants and region folders in the sandbox's folder, not the machine's /var/lib/vgpu
        f"--state-dir={_state_dir(node)}",
        f"--fake-nvml={lay.gpus_file}", f"--hook-library={HOOK}", "--slice-interval=1",
    ]  # fmt: skip
    proc = start(argv, node.logs_dir / "dra-plugin.log")
    try:
        wait_for(
            lambda: node.kubectl("get", "resourceslices", "-o", "name", check=False).stdout.strip(),
            "the real node's ResourceSlice",
            timeout=60,
            every=1,
        )
        yield proc
    finally:
        node.kubectl("delete", "pods", "--all", "-n", "default", "--wait=true", "--timeout=60s", check=False)
        stop(proc)
        # what the kubelet did not unprepare (a failed test) goes with the node: the specs are in
        # the machine's /var/run/cdi, which containerd reads
        for record in (_state_dir(node) / "dra/claims").glob("*.json"):
            (CDI_DIR / f"vgpu.openaios.io-claim_{record.stem}.json").unlink(missing_ok=True)


CDI_DIR = Path("/var/run/cdi")


def _state_dir(node: Sandbox) -> Path:
    return layout.layout_of(node).root / "vgpu-dra"


WORKLOAD = "t_alloc link alloc 256; echo holding; sleep infinity"


def _pod(name: str, memory: str, cores: str, **config: Any) -> list[dict[str, Any]]:
    """A claim template asking for ``memory`` and ``cores`` (with ``config``: its vgpu
    configuration, contract 8) and a pod of the sample image under it."""
    template = claim_template(name, memory=memory, cores=cores)
    if config:
        template["spec"]["spec"]["devices"]["config"] = [vgpu_config(["gpu"], **config)]
    pod = sample.sample_pod(name, WORKLOAD, None, CARD_MIB)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": name}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return [template, pod]


def _apply(node: Sandbox, objects: list[dict[str, Any]]) -> None:
    node.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))


def _get(node: Sandbox, *args: str) -> dict[str, Any]:
    return json.loads(node.kubectl("get", *args, "-o", "json").stdout)


def _logs(node: Sandbox, name: str) -> str:
    return node.kubectl("logs", "-n", "default", name, check=False).stdout


def _running(node: Sandbox, name: str, timeout: float = 180) -> str:
    """The pod's log once its workload holds its memory; on time-out an error with what the
    pod, its claims and the plugin say."""
    try:
        wait_for(lambda: "holding" in _logs(node, name), f"{name} holding", timeout=timeout, every=2)
    except AssertionError as err:
        described = node.kubectl("describe", "pod", "-n", "default", name, check=False).stdout
        claims = node.kubectl("get", "resourceclaims", "-A", "-o", "yaml", check=False).stdout
        plugin_log = (node.logs_dir / "dra-plugin.log").read_text(errors="replace")[-3000:]
        kubelet = (node.logs_dir / "kubelet.log").read_text(errors="replace")
        dra_lines = "\n".join(
            line for line in kubelet.splitlines() if "dra" in line.lower() or "plugin" in line.lower()
        )[-3000:]
        raise AssertionError(
            f"{err}\n--- pod\n{described[-3000:]}\n--- claims\n{claims[-3000:]}\n--- plugin\n{plugin_log}"
            f"\n--- kubelet (DRA)\n{dra_lines}"
        ) from err
    return _logs(node, name)


def _fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+)=(.*)$", text, re.M))


def test_a_claim_of_3000mi_holds_its_container_and_claims_share_the_card(
    node: Sandbox, plugin: subprocess.Popen[bytes]
) -> None:
    _apply(node, _pod("dra-a", "3000Mi", "30"))
    fields = _fields(_running(node, "dra-a"))
    print(f"[dra real node] dra-a (3000Mi, 30 cores): chunks={fields['chunks']} refused={fields['refused']}")
    # 640 MiB of context charge and 9 chunks of 256 MiB fit in 3000 MiB; the 10th is refused
    assert (fields["chunks"], fields["refused"]) == ("9", "2"), _logs(node, "dra-a")
    # a second claim on the same card: 4000Mi and 50 cores still fit beside the first; its
    # configuration makes it first on the card, through the CDI edits containerd applied
    _apply(node, _pod("dra-b", "4000Mi", "50", priority=0, smPolicy="elastic"))
    _running(node, "dra-b")
    env = node.kubectl(
        "exec", "-n", "default", "dra-b", "--", "/bin/sh", "-c", "echo $CUDA_TASK_PRIORITY $CUDA_SM_POLICY"
    ).stdout.split()
    assert env == ["0", "elastic"], env
    claim_b = next(
        c
        for c in _get(node, "resourceclaims", "-n", "default")["items"]
        if any(o["name"] == "dra-b" for o in c["metadata"].get("ownerReferences") or [])
    )
    grant = read_grant(_state_dir(node) / "grants" / f"dra_{claim_b['metadata']['uid']}_gpu.limits")
    assert (grant.priority, grant.sm_policy, grant.sm_limits) == (0, 1, (50,))
    print(
        f"[dra real node] dra-b configured priority 0, elastic: container env {env}, grant {grant.priority}"
    )
    claims = _get(node, "resourceclaims", "-n", "default")["items"]
    devices = {r["device"] for c in claims for r in c["status"]["allocation"]["devices"]["results"]}
    assert devices == {"gpu-0"}  # both on the one card
    # a third that does not fit what is left (30 + 50 + 30 > 100 cores) stays Pending
    _apply(node, _pod("dra-c", "1000Mi", "30"))

    def unschedulable() -> str:
        pod = _get(node, "pod", "-n", "default", "dra-c")
        cond = next((c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"), {})
        return cond.get("message", "") if cond.get("reason") == "Unschedulable" else ""

    message = wait_for(unschedulable, "dra-c unschedulable", timeout=60, every=1)
    print(f"[dra real node] dra-c Pending: {message}")
    assert "cannot allocate all claims" in message or "resourceclaim" in message.lower(), message
    # the capacity comes back when a pod goes
    node.kubectl("delete", "pod", "-n", "default", "dra-b", "--wait=true", timeout=120)
    _running(node, "dra-c")


def test_a_kubelet_restart_keeps_the_prepared_claims(node: Sandbox, plugin: subprocess.Popen[bytes]) -> None:
    log = node.logs_dir / "dra-plugin.log"
    prepared = log.read_text().count("prepared ResourceClaim default/dra-a")
    lifecycle.restart(node, "kubelet")
    wait_for(
        lambda: _get(node, "pod", "-n", "default", "dra-a")["status"]["phase"] == "Running",
        "dra-a running after the kubelet restart",
        timeout=120,
        every=1,
    )
    assert log.read_text().count("prepared ResourceClaim default/dra-a") == prepared
    # the kubelet deletes the node's slices when it starts; the plugin publishes its slice again
    wait_for(
        lambda: "real-node-0-vgpu.openaios.io" in node.kubectl("get", "resourceslices", "-o", "name").stdout,
        "the slice after the kubelet restart",
        timeout=60,
        every=1,
    )
    assert _get(node, "pod", "-n", "default", "dra-a")["status"]["containerStatuses"][0]["restartCount"] == 0


def _resource_health(node: Sandbox, pod: str) -> dict[str, tuple[str, str]]:
    return resource_health(_get(node, "pod", "-n", "default", pod))


def test_a_card_going_unhealthy_shows_in_the_status_of_the_pod_holding_it(
    node: Sandbox, plugin: subprocess.Popen[bytes]
) -> None:
    """The kubelet 1.36 watches the plugin's DRAResourceHealth stream (ResourceHealthStatus, beta
    and on): the card marked unhealthy (here in the fake NVML file, as an Xid would through NVML)
    shows Unhealthy, with why, in the status of the pod whose claim holds it, and Healthy again
    when it comes back."""
    gpus = layout.layout_of(node).gpus_file
    was = gpus.read_text()
    claim_a = next(
        c
        for c in _get(node, "resourceclaims", "-n", "default")["items"]
        if any(o["name"] == "dra-a" for o in c["metadata"].get("ownerReferences") or [])
    )
    card = (
        f"vgpu.openaios.io/claim={claim_a['metadata']['uid']}-gpu"  # the kubelet names it by its CDI device
    )
    wait_for(lambda: _resource_health(node, "dra-a").get(card, ("",))[0] == "Healthy", "Healthy", 60, every=1)
    doc = yaml.safe_load(was)
    doc["gpus"][0]["healthy"] = False
    try:
        gpus.write_text(yaml.safe_dump(doc))
        health, message = wait_for(
            lambda: (got := _resource_health(node, "dra-a").get(card)) and got[0] == "Unhealthy" and got,
            "dra-a's card Unhealthy in its status",
            timeout=60,
            every=1,
        )
        print(f"[dra real node] dra-a's card: {health}, {message!r}")
        assert "marked unhealthy in" in message
    finally:
        gpus.write_text(was)
    wait_for(
        lambda: _resource_health(node, "dra-a").get(card, ("",))[0] == "Healthy", "Healthy again", 60, every=1
    )
    # and the card is offered again
    wait_for(
        lambda: _get(node, "resourceslices")["items"][0]["spec"].get("devices"), "the card in the slice", 60
    )


def test_deleting_the_pods_unprepares_their_claims(node: Sandbox, plugin: subprocess.Popen[bytes]) -> None:
    """The kubelet calls NodeUnprepareResources once a pod's containers are gone: the spec, the
    grant, the region folder and the record go, and the checkpoint forgets the claim."""
    state = _state_dir(node)
    prepared = [p.stem for p in (state / "dra/claims").glob("*.json")]
    assert prepared, "the tests above left no prepared claim to unprepare"
    node.kubectl("delete", "pods", "--all", "-n", "default", "--wait=true", "--timeout=120s", timeout=150)

    def all_gone() -> bool:
        return not any(
            (CDI_DIR / f"vgpu.openaios.io-claim_{uid}.json").exists() for uid in prepared
        ) and not list((state / "dra/claims").glob("*.json"))

    wait_for(all_gone, "the claims unprepared", timeout=60, every=1)
    assert not list((state / "containers").glob("dra_*")) and not list((state / "grants").glob("dra_*"))
    assert json.loads((state / "dra/checkpoint.json").read_text())["claims"] == {}
