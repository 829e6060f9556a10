"""The path a user walks, on a real node: the upstream kubelet 1.36, containerd 2 and runc run the
images `make images` built; the playbook prepares the node (roles/gpu_node against the node's own
containerd) and installs the chart, whose device-plugin DaemonSet pod registers with the real
kubelet; a pod asking for part of a GPU is placed by the extender, the kubelet calls Allocate, and
inside the container `libvgpu.so`, loaded through /etc/ld.so.preload, refuses the stub driver's
memory past the grant.

Needs root, containerd, runc, the CNI plugins, the kubelet and crictl built, and the images built:
`make setup` does all of that where it can; where it cannot, every test here is skipped with the
reason. The sandbox runs in its own folder and is taken down at the end, pods and mounts included.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vgpu_sandbox import procs, realruntime
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.realnode import daemons, layout, lifecycle, sample

from playbooks import play, play_recap
from tests.support import wait_for
from tests.support.groups import REAL_NODE
from tests.support.sandboxes import real_node_sandbox

VGPU = Path(sys.executable).with_name("vgpu")
NODE = layout.NAME
CARD_MIB = 8192
SPLIT = 4
NAMESPACE = "kube-system"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.xdist_group(REAL_NODE)]


def _log(message: str) -> None:
    """Steps as they run, for the record (pytest -s shows them; -rA keeps them in the report)."""
    print(f"[real-node {time.strftime('%H:%M:%S')}] {message}", flush=True)


# what a check may raise while the node comes up: counted as not yet
_FLAKY = (subprocess.SubprocessError, OSError, ValueError, KeyError)


class Node:
    """The running sandbox with its real node, and what the module's tests share."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.lay = layout.layout_of(sandbox)
        self.inventory = layout.inventory_file(sandbox)
        self.plays: list[subprocess.CompletedProcess[str]] = []

    def play(self, playbook: str = "site.yml") -> subprocess.CompletedProcess[str]:
        result = play(self.sandbox, playbook, inventory=self.inventory, timeout=600)
        self.plays.append(result)
        return result

    def get(self, *args: str) -> Any:
        return json.loads(self.sandbox.kubectl("get", *args, "-o", "json").stdout)

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.sandbox.kubectl(*args, **kw)

    def plugin_pod(self) -> dict[str, Any] | None:
        listed = self.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=device-plugin")
        return next((p for p in listed["items"] if p["spec"].get("nodeName") == NODE), None)

    def kubelet_log(self) -> str:
        return (self.sandbox.logs_dir / "kubelet.log").read_text(errors="replace")

    def component_pid(self, name: str) -> int:
        state = self.sandbox.state()
        assert state is not None
        return [c.pid for c in state.components if c.name == name][-1]

    def monitor_port(self) -> int:
        state = self.sandbox.state()
        assert state is not None
        return state.ports["real-node-monitor"]


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with real_node_sandbox("vgpu-rn-") as sandbox:
        started = time.monotonic()
        seconds = sandbox.up(
            Spec(nodes=1, gpus_per_node=1, gpu_memory_mib=CARD_MIB, split=SPLIT, real_node=True),
            progress=_log,
        )
        _log(f"vgpu sandbox up --real-node: {seconds:.1f}s (fixture {time.monotonic() - started:.1f}s)")
        yield Node(sandbox)


@pytest.fixture(scope="module")
def prepared(node: Node) -> Node:
    """The playbook run once: the role on the real node, then the chart."""
    started = time.monotonic()
    first = node.play()
    _log(f"ansible-playbook site.yml (first run): rc {first.returncode}, {time.monotonic() - started:.1f}s")
    assert first.returncode == 0, first.stdout[-6000:] + first.stderr[-2000:]
    return node


def _plugin_running(node: Node) -> dict[str, Any] | None:
    pod = node.plugin_pod()
    if not pod:
        return None
    statuses = pod["status"].get("containerStatuses") or []
    return pod if statuses and all(s.get("ready") for s in statuses) else None


def test_the_role_merges_containerds_config_restarts_it_once_and_labels_the_node(prepared: Node) -> None:
    node = prepared
    first = node.plays[0]
    recap = play_recap(first)
    assert recap[NODE]["failed"] == 0 and recap[NODE]["changed"] >= 2, recap
    config = node.lay.containerd_config.read_text()
    # nvidia-ctk (NVIDIA's, built from Go modules) merged its runtime, built beside it, and kept ours.
    assert "runtimes.nvidia]" in config and f'BinaryName = "{realruntime.runtime_binary()}"' in config
    assert f'Root = "{node.lay.runc_root}"' in config and "restrict_oom_score_adj = true" in config
    handler = "GPU node | Restart containerd with gpu_node_containerd_restart_command"
    assert f"RUNNING HANDLER [gpu_node : {handler}]" in first.stdout
    assert lifecycle.restarts(node.sandbox)["containerd"] == 1
    assert node.get("node", NODE)["metadata"]["labels"].get("gpu") == "on"
    _log(f"first run: {NODE} {recap[NODE]}; containerd restarted once; label gpu=on")

    again = node.play()
    assert again.returncode == 0, again.stdout[-4000:]
    recap2 = play_recap(again)
    assert all(counts["changed"] == 0 for counts in recap2.values()), recap2
    assert lifecycle.restarts(node.sandbox)["containerd"] == 1, "containerd restarted without a change"
    _log(f"second run: {recap2}; containerd restarts still 1")


def test_the_charts_device_plugin_pod_runs_from_the_built_image_and_registers_with_the_kubelet(
    prepared: Node,
) -> None:
    node = prepared
    pod = wait_for(
        lambda: _plugin_running(node),
        "the device-plugin pod on the real node to be ready",
        180,
        every=1.0,
        ignore=_FLAKY,
    )
    images = layout.built_images()
    status = pod["status"]["containerStatuses"][0]
    assert status["image"].endswith("vgpu/device-plugin:dev"), status
    assert pod["spec"]["containers"][0]["imagePullPolicy"] == "Never"
    # containerd ran it: the CRI reports a container, and its image is the one imported.
    listed = daemons.crictl(node.lay, "ps", "--name", "device-plugin", "-o", "json")
    running = json.loads(listed.stdout)["containers"]
    assert running and running[0]["state"] == "CONTAINER_RUNNING", listed.stdout[-2000:]
    _log(f"device-plugin pod {pod['metadata']['name']} running from {images['device-plugin']['ref']}")

    def advertised() -> int:
        return int(node.get("node", NODE)["status"]["allocatable"].get("nvidia.com/gpu", "0"))

    assert wait_for(advertised, "the node to advertise nvidia.com/gpu", 60, every=1.0, ignore=_FLAKY) == SPLIT
    log = node.kubelet_log()
    registered = [line for line in log.splitlines() if "registration request from device plugin" in line]
    assert registered and "nvidia.com/gpu" in registered[-1], log[-3000:]
    _log(f"kubelet: {registered[-1].strip()[:220]}")


def _sample_pod(name: str, command: str, resources: dict[str, str] | None) -> dict[str, Any]:
    return sample.sample_pod(name, command, resources, CARD_MIB)


WORKLOAD = (
    "env | grep -E '^(CUDA_|NVIDIA_|LD_PRELOAD)' | sort; "
    "echo preload=$(cat /etc/ld.so.preload); "
    "grep -E ' /etc/(vgpu/limits|ld.so.preload) | /usr/local/vgpu/' /proc/self/mountinfo | cut -d' ' -f5,6; "
    "t_alloc link alloc 256; "
    "echo holding; sleep infinity | t_hold 1024"
)


def _fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+)=(.*)$", text, re.M))


@pytest.fixture(scope="module")
def workload(prepared: Node) -> Iterator[dict[str, Any]]:
    node = prepared
    wait_for(
        lambda: _plugin_running(node), "the device-plugin pod on the real node", 180, every=1.0, ignore=_FLAKY
    )
    manifest = _sample_pod(
        "cuda-3000",
        WORKLOAD,
        {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"},
    )
    node.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    def logs() -> str:
        out = node.kubectl("logs", "-n", "default", "cuda-3000", check=False)
        return out.stdout if "holding" in out.stdout and "held=" in out.stdout else ""

    text = wait_for(logs, "the workload to allocate and hold (kubectl logs)", 180, every=1.0, ignore=_FLAKY)
    pod = node.get("pod", "-n", "default", "cuda-3000")
    yield {"pod": pod, "logs": text}
    node.kubectl("delete", "pod", "-n", "default", "cuda-3000", "--wait=false", check=False)


def test_a_pod_placed_by_the_extender_gets_its_limits_and_the_hook_refuses_past_them(
    prepared: Node, workload: dict[str, Any]
) -> None:
    node, pod, text = prepared, workload["pod"], workload["logs"]
    assert pod["spec"]["nodeName"] == NODE
    assert pod["spec"]["schedulerName"] == "vgpu-scheduler"  # the webhook routed it to the extender
    # The API server's ExtendedResourceToleration let it onto the tainted GPU node unchanged.
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod["spec"]["tolerations"]), pod["spec"][
        "tolerations"
    ]
    annotations = pod["metadata"]["annotations"]
    assert annotations.get("vgpu.openaios.io/phase") == "allocated", annotations
    fields = _fields(text)
    # The contract's env, from the real kubelet's Allocate call.
    assert fields.get("CUDA_DEVICE_MEMORY_LIMIT_0") == "3000m", text
    assert fields.get("CUDA_DEVICE_SM_LIMIT_0") == "30", text
    assert fields.get("NVIDIA_VISIBLE_DEVICES", "").startswith("GPU-"), text
    assert "LD_PRELOAD" not in fields, "the hook must load without LD_PRELOAD"
    # The mounts: the grant, the hook and the preload file, read-only.
    assert fields.get("preload") == "/usr/local/vgpu/libvgpu.so", text
    for path in ("/etc/vgpu/limits", "/etc/ld.so.preload", "/usr/local/vgpu/libvgpu.so"):
        assert re.search(rf"^{re.escape(path)} ro[, ]", text, re.M) or f"{path} ro" in text, (path, text)
    # The refusal: 256 MiB chunks stop under 3000 MiB with CUDA_ERROR_OUT_OF_MEMORY (2).
    chunks, refused = int(fields["chunks"]), int(fields["refused"])
    assert refused == 2 and 8 <= chunks <= 11, text
    assert fields.get("held") == "0", text
    _log(
        f"in the container: CUDA_DEVICE_MEMORY_LIMIT_0={fields['CUDA_DEVICE_MEMORY_LIMIT_0']} "
        f"CUDA_DEVICE_SM_LIMIT_0={fields['CUDA_DEVICE_SM_LIMIT_0']} preload={fields['preload']}; "
        f"t_alloc: chunks={chunks} refused={refused} (256 MiB each)"
    )
    plugin = node.plugin_pod()
    assert plugin is not None
    plugin_log = node.kubectl("logs", "-n", NAMESPACE, plugin["metadata"]["name"]).stdout
    allocate = [line for line in plugin_log.splitlines() if "cuda-3000" in line]
    assert allocate, plugin_log[-3000:]
    _log(f"device plugin: {allocate[-1].strip()[:240]}")

    # The control: the same program in the same image without a GPU request (no Allocate, so no
    # hook) takes the stub's whole card; the refusal above came from the hook.
    control = _sample_pod("cuda-control", "t_alloc link alloc 256", None)
    node.kubectl("apply", "-f", "-", input=json.dumps(control))
    try:

        def done() -> str:
            out = node.kubectl("logs", "-n", "default", "cuda-control", check=False).stdout
            return out if "alive=1" in out else ""

        control_fields = _fields(wait_for(done, "the control pod's output", 120, every=1.0, ignore=_FLAKY))
        assert int(control_fields["chunks"]) == CARD_MIB // 256, control_fields
        _log(f"control without a GPU request: chunks={control_fields['chunks']}")
    finally:
        node.kubectl("delete", "pod", "-n", "default", "cuda-control", "--wait=false", check=False)


def test_vgpu_status_and_the_monitor_show_the_containers_usage(
    prepared: Node, workload: dict[str, Any]
) -> None:
    node, uid = prepared, workload["pod"]["metadata"]["uid"]

    def reported() -> dict[str, Any] | None:
        out = subprocess.run(
            [str(VGPU), "status", f"--kubeconfig={node.sandbox.kubeconfig}", "--node", NODE, "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        for card in json.loads(out.stdout)[0]["cards"]:
            for share in card["shares"]:
                if share["pod"] == "cuda-3000" and share["used_bytes"]:
                    return dict(share)
        return None

    share = wait_for(
        reported,
        "vgpu status to report the container's usage (the Lease, renewed every 10 s)",
        60,
        every=1.0,
        ignore=_FLAKY,
    )
    assert share["memory_mib"] == 3000 and share["cores"] == 30
    assert 1024 * 2**20 <= share["used_bytes"] <= 3000 * 2**20, share
    text = subprocess.run(
        [str(VGPU), "status", f"--kubeconfig={node.sandbox.kubeconfig}", "--node", NODE],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    line = next(x for x in text.splitlines() if "cuda-3000" in x)
    assert "using" in line
    _log(f"vgpu status: {line.strip()}")

    with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port()}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    used = [
        m
        for m in metrics.splitlines()
        if m.startswith("vgpu_container_memory_used_bytes{") and f'pod_uid="{uid}"' in m
    ]
    assert used, metrics[-3000:]
    assert 'pod="cuda-3000"' in used[0] and float(used[0].rsplit(" ", 1)[1]) >= 1024 * 2**20
    _log(f"monitor /metrics: {used[0]}")


def _exec_alloc(node: Node) -> dict[str, str]:
    """t_alloc run by kubectl exec in the running workload container; empty until it answers."""
    argv = ("exec", "-n", "default", "cuda-3000", "--", "t_alloc", "link", "alloc", "256")
    out = node.kubectl(*argv, check=False).stdout
    return _fields(out) if "alive=1" in out else {}


def test_after_a_kubelet_restart_the_plugin_registers_again_and_the_container_keeps_its_limits(
    prepared: Node, workload: dict[str, Any]
) -> None:
    node = prepared
    before = node.kubelet_log().count("registration request from device plugin")
    running = node.get("pod", "-n", "default", "cuda-3000")
    container_id = running["status"]["containerStatuses"][0]["containerID"]
    seconds = lifecycle.restart(node.sandbox, "kubelet")
    _log(f"kubelet restarted in {seconds:.1f}s")

    def registered_again() -> bool:
        return node.kubelet_log().count("registration request from device plugin") > before

    wait_for(
        registered_again, "the device plugin to register with the new kubelet", 90, every=1.0, ignore=_FLAKY
    )
    wait_for(
        lambda: node.get("node", NODE)["status"]["allocatable"].get("nvidia.com/gpu") == str(SPLIT),
        "the node to advertise nvidia.com/gpu again",
        90,
        every=1.0,
        ignore=_FLAKY,
    )
    pod = node.get("pod", "-n", "default", "cuda-3000")
    status = pod["status"]["containerStatuses"][0]
    assert status["containerID"] == container_id and status["restartCount"] == 0, status
    # A new process in the running container still meets the grant: 1024 MiB are held, so fewer
    # 256 MiB chunks fit under 3000 than before. (The new kubelet answers exec once it has
    # synced its pods.)
    fields = wait_for(
        lambda: _exec_alloc(node), "kubectl exec through the new kubelet", 60, every=2, ignore=_FLAKY
    )
    assert int(fields["refused"]) == 2 and int(fields["chunks"]) * 256 + 1024 <= 3000, fields
    _log(f"after the restart, kubectl exec t_alloc: chunks={fields['chunks']} refused={fields['refused']}")


def test_after_a_containerd_restart_the_running_container_keeps_running_and_its_limits(
    prepared: Node, workload: dict[str, Any]
) -> None:
    node = prepared
    before = node.get("pod", "-n", "default", "cuda-3000")["status"]["containerStatuses"][0]
    old_pid = node.component_pid("containerd")
    seconds = lifecycle.restart(node.sandbox, "containerd")
    assert node.component_pid("containerd") != old_pid and not procs.alive(old_pid)
    _log(f"containerd restarted in {seconds:.1f}s (pid {old_pid} -> {node.component_pid('containerd')})")
    # The shims kept the containers; the kubelet finds containerd again on the same socket.
    listed = daemons.crictl(node.lay, "ps", "--name", "cuda", "-o", "json")
    assert any(c["state"] == "CONTAINER_RUNNING" for c in json.loads(listed.stdout)["containers"]), (
        listed.stdout
    )

    fields = wait_for(
        lambda: _exec_alloc(node), "kubectl exec through the new containerd", 60, every=2, ignore=_FLAKY
    )
    assert int(fields["refused"]) == 2 and int(fields["chunks"]) * 256 + 1024 <= 3000, fields
    after = node.get("pod", "-n", "default", "cuda-3000")["status"]["containerStatuses"][0]
    assert after["containerID"] == before["containerID"] and after["restartCount"] == 0, after
    _log(
        f"after the containerd restart, same container: chunks={fields['chunks']} refused={fields['refused']}"
    )


def test_deleting_the_pod_frees_its_room(prepared: Node, workload: dict[str, Any]) -> None:
    node = prepared
    # The whole card's memory fits only once cuda-3000's 3000 MiB are back.
    big = _sample_pod(
        "cuda-whole-card",
        "t_alloc link alloc 256",
        {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(CARD_MIB)},
    )
    node.kubectl("apply", "-f", "-", input=json.dumps(big))
    try:
        time.sleep(5)
        waiting = node.get("pod", "-n", "default", "cuda-whole-card")
        assert not waiting["spec"].get("nodeName"), "placed while cuda-3000 still held its room"
        node.kubectl("delete", "pod", "-n", "default", "cuda-3000", "--wait=true", timeout=120)

        def ran() -> str:
            out = node.kubectl("logs", "-n", "default", "cuda-whole-card", check=False).stdout
            return out if "alive=1" in out else ""

        fields = _fields(
            wait_for(ran, "the whole-card pod to run once the room freed", 120, every=1.0, ignore=_FLAKY)
        )
        assert int(fields["refused"]) == 2 and int(fields["chunks"]) >= (CARD_MIB - 1024) // 256, fields
        _log(f"after deleting cuda-3000, the whole-card pod ran: chunks={fields['chunks']}")
    finally:
        node.kubectl("delete", "pod", "-n", "default", "cuda-whole-card", "--wait=false", check=False)
