"""MPS mode on the real node (docs/mps.md): the real kubelet, containerd and runc, the chart's device
plugin with ``sharingMode: mps`` for this node alone (``nodeOverrides``), and the stub driver.

``vgpu sandbox up --real-node --sharing-mode mps`` gives the plugin a stub driver root whose
``usr/bin/nvidia-cuda-mps-control`` runs the fake daemon of the plugin's image
(vgpu/node/fake_mps.py, vgpu_sandbox.realmps); the plugin starts one per card, its pipe folder
under the host's /var/lib/vgpu/mps. The sample image's programs load the stub driver, which makes a
process whose pipe's control socket accepts at cuInit an MPS client and writes ``mps 1``,
``mps_threads`` and ``mps_pinned`` into its process file, where the plugin's fake NVML reads it.

Shown: a pod annotated ``nvidia.com/vgpu-mode: mps`` lands on the MPS card, its container has the
pipe folder read-only at /var/run/vgpu/mps and a grant saying MPS with that pipe and its limits,
and a process there under the hook is an MPS client with the grant's thread percentage and pinned
limit though its environment unsets them; a process of such a pod that leaves MPS (t_bypass with
T_BYPASS_UNSET_MPS=1) is killed by the node's second line with the Event VgpuLeftMps while the
honest one keeps running; a pod without the annotation never lands on the node's only card, an
MPS one, and stays Pending with the reason.

Run it alone, under the real node's lock: ``flock /tmp/vgpu-realnode.lock pytest
tests/e2e/test_real_node_mps.py``. Skipped, with the reason, where no real node can run.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vgpu_sandbox import realmps
from vgpu_sandbox.cluster import Spec
from vgpu_sandbox.realnode import layout, sample

from tests.e2e.test_real_node import Node, _log, _plugin_running
from tests.support import wait_for
from tests.support.groups import REAL_NODE
from tests.support.sandboxes import real_node_sandbox
from vgpu.core import annotations as ann
from vgpu.hookabi.grant import decode
from vgpu.hookabi.layout import MPS_PIPE_IN_CONTAINER, SHARING_MPS
from vgpu.monitor.enforce import REASON_LEFT_MPS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.xdist_group(REAL_NODE)]

NODE = layout.NAME
CARD_MIB = 8192
SPLIT = 4
MIB = 1 << 20
GRANT_MIB, CORES = 1000, 30
FLAKY = (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError)
MPS_VARS = (
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)
# The honest workload: what its container was given, then t_hold (under the hook, loaded through
# /etc/ld.so.preload) with every MPS variable unset, holding 100 MiB on a FIFO it also writes, so
# that its stdin never ends; it is the container's PID 1.
HONEST = (
    # /var/run is a link to /run in the image: mountinfo names the mount under /run
    "grep -E ' (/var)?/run/vgpu/mps ' /proc/self/mountinfo | cut -d' ' -f5,6; "
    f"echo pipe_files=$(ls {MPS_PIPE_IN_CONTAINER} | sort | tr '\\n' ' '); "
    f"touch {MPS_PIPE_IN_CONTAINER}/probe 2>/dev/null && echo pipe_writable=1 || echo pipe_writable=0; "
    "env | grep -E '^CUDA_MPS_' | sort; "
    "mkfifo /tmp/hold; echo holding; "
    f"exec env {' '.join('-u ' + v for v in MPS_VARS)} t_hold 100 <> /tmp/hold"
)


@pytest.fixture(scope="module")
def mps_node() -> Iterator[Node]:
    """The real node with its one card in MPS mode, the playbook run, the plugin's daemon up."""
    folders: list[str] = []
    with real_node_sandbox("vgpu-rnmps-") as sandbox:
        started = time.monotonic()
        spec = Spec(
            nodes=1,
            gpus_per_node=1,
            gpu_memory_mib=CARD_MIB,
            split=SPLIT,
            real_node=True,
            sharing="mps",
        )
        seconds = sandbox.up(spec, progress=_log)
        _log(f"vgpu sandbox up --real-node --sharing-mode mps: {seconds:.1f}s")
        node = Node(sandbox)
        tool = realmps.control_tool(node.lay.root)
        assert tool.read_text() == realmps.WRAPPER and tool.stat().st_mode & 0o111, tool
        played = node.play()
        assert played.returncode == 0, played.stdout[-6000:] + played.stderr[-2000:]
        wait_for(lambda: _plugin_running(node), "the device-plugin pod", 180, every=1.0, ignore=FLAKY)
        wait_for(
            lambda: _advertised(node) == SPLIT and _mps_cards(node),
            "the node to advertise its MPS card",
            120,
            every=1.0,
            ignore=FLAKY,
        )
        _log(f"up, played and advertised in {time.monotonic() - started:.1f}s")
        record = json.loads(node.lay.record.read_text())
        folders = record["mps_folders"]
        assert [Path(f).name for f in folders] == _mps_cards(node), record
        assert all((Path(f) / "pipe" / "control").is_socket() for f in folders), folders
        yield node
    # down removed the daemons' folders, which the plugin leaves behind
    assert folders and not any(Path(f).exists() for f in folders), folders


def _advertised(node: Node) -> int:
    return int(node.get("node", NODE)["status"]["allocatable"].get("nvidia.com/gpu", "0"))


def _mps_cards(node: Node) -> list[str]:
    annotations = node.get("node", NODE)["metadata"].get("annotations", {})
    inventory = ann.decode_devices(annotations.get(ann.DEVICES_ANNOTATION))
    return [d.uuid for d in inventory.devices if d.sharing == ann.SHARING_MPS]


def _pod(node: Node, name: str, command: str, mode: str | None, env: dict[str, str] | None = None) -> None:
    manifest = sample.sample_pod(
        name,
        command,
        {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(GRANT_MIB), "nvidia.com/gpucores": str(CORES)},
        CARD_MIB,
        stub_procs=node.lay.stub_procs,
    )
    if mode is not None:
        manifest["metadata"]["annotations"] = {ann.HAMI_VGPU_MODE_ANNOTATION: mode}
    for key, value in (env or {}).items():
        manifest["spec"]["containers"][0]["env"].append({"name": key, "value": value})
    node.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def _fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+)=(.*)$", text, re.M))


def _logs(node: Node, name: str) -> str:
    return node.kubectl("logs", "-n", "default", name, check=False).stdout


def _exec(node: Node, name: str, script: str) -> str:
    done = node.kubectl("exec", "-n", "default", name, "--", "sh", "-c", script, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _plugin_log(node: Node) -> str:
    plugin = node.plugin_pod()
    assert plugin is not None
    return node.kubectl("logs", "-n", "kube-system", plugin["metadata"]["name"], check=False).stdout


def _diagnose(node: Node, *pods: str) -> None:
    for name in pods:
        out = node.kubectl("get", "pod", "-n", "default", name, "-o", "json", check=False).stdout
        _log(f"pod {name}: {out[-1500:]}")
        _log(f"logs {name}: {_logs(node, name)[-800:]}")
    _log(f"plugin log: {_plugin_log(node)[-4000:]}")
    for f in sorted(node.lay.stub_procs.iterdir()):
        if f.is_file():
            _log(f"stub process file {f.name}: {f.read_text()!r}")


def _running(node: Node, name: str) -> bool:
    pod = node.get("pod", "-n", "default", name)
    statuses = pod["status"].get("containerStatuses") or []
    return bool(statuses) and "running" in statuses[0]["state"] and statuses[0]["restartCount"] == 0


def _events(node: Node, name: str, reason: str) -> list[dict[str, Any]]:
    listed = node.get("events", "-n", "default", "--field-selector", f"involvedObject.name={name}")
    return [e for e in listed["items"] if e.get("reason") == reason]


def _metric(node: Node, name: str, uuid: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port()}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and f'uuid="{uuid}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture(scope="module")
def honest(mps_node: Node) -> Iterator[str]:
    """The MPS pod's container holding its memory as an MPS client; its logs."""
    node = mps_node
    _pod(node, "mps-honest", HONEST, "mps")
    try:

        def held() -> str:
            out = _logs(node, "mps-honest")
            return out if "held=0" in out else ""

        yield wait_for(held, "the MPS pod to hold its memory", 180, every=1.0, ignore=FLAKY)
    except AssertionError:
        _diagnose(node, "mps-honest")
        raise
    finally:
        node.kubectl("delete", "pod", "-n", "default", "mps-honest", "--wait=false", check=False)


def test_an_mps_pod_lands_on_the_mps_card_and_its_process_is_a_client_with_the_grants_limits(
    mps_node: Node, honest: str
) -> None:
    node = mps_node
    [card] = _mps_cards(node)
    assert _metric(node, "vgpu_mps_daemon_up", card) == 1.0
    pod = node.get("pod", "-n", "default", "mps-honest")
    assert pod["spec"]["nodeName"] == NODE
    allocation = ann.decode_allocation(pod["metadata"]["annotations"][ann.ALLOCATION_ANNOTATION])
    placed = allocation.container("cuda")
    assert placed is not None and [d.uuid for d in placed.devices] == [card], allocation
    # the pipe folder, read-only, and the variables set as a convenience
    assert re.search(r"^(/var)?/run/vgpu/mps ro[, ]", honest, re.M), honest
    assert "pipe_writable=0" in honest and "control" in _fields(honest)["pipe_files"].split(), honest
    given = {k: v for k, v in _fields(honest).items() if k.startswith("CUDA_MPS_")}
    assert given == {
        "CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE_IN_CONTAINER,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(CORES),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={GRANT_MIB}M",
    }, honest
    # the grant, read inside the container where the hook reads it
    grant = decode(base64.b64decode(_exec(node, "mps-honest", "base64 -w0 /etc/vgpu/limits")))
    assert (grant.sharing, grant.mps_pipe) == (SHARING_MPS, MPS_PIPE_IN_CONTAINER), grant
    assert (grant.uuids, grant.limits, grant.sm_limits) == ((card,), (GRANT_MIB * MIB,), (CORES,)), grant
    # t_hold (PID 1) ran with no MPS variable, yet the stub saw an MPS client with the grant's
    # limits: the hook set them from the grant before the driver's cuInit
    environ = _exec(node, "mps-honest", "tr '\\0' '\\n' < /proc/1/environ")
    assert "held=0" in honest and not any(v + "=" in environ for v in MPS_VARS), environ
    seen = _exec(node, "mps-honest", 'cat "$STUB_CUDA_PROCESS_DIR/1@$(cut -d" " -f22 /proc/1/stat)"')
    fields = dict(line.split(" ", 1) for line in seen.splitlines())
    assert fields.get("mps") == "1", seen
    assert int(fields["mps_threads"]) == CORES and int(fields["mps_pinned"]) == GRANT_MIB * MIB, seen
    assert int(fields[card]) == 100 * MIB, seen
    _log(f"MPS client on {card}: {fields}; grant sharing={grant.sharing} pipe={grant.mps_pipe}")


def test_a_process_that_leaves_mps_is_killed_and_the_honest_client_keeps_running(
    mps_node: Node, honest: str
) -> None:
    node = mps_node
    _pod(node, "mps-leaver", "exec t_bypass 100 200", "mps", {"T_BYPASS_UNSET_MPS": "1"})
    try:

        def ended() -> dict[str, Any] | None:
            pod = node.get("pod", "-n", "default", "mps-leaver")
            statuses = pod["status"].get("containerStatuses") or []
            return statuses[0]["state"].get("terminated") if statuses else None

        terminated = wait_for(ended, "the process outside MPS to be killed", 180, every=0.5, ignore=FLAKY)
        assert terminated["exitCode"] == 137, terminated  # SIGKILL
        assert "below total_mib=100" in _logs(node, "mps-leaver")
        [event] = wait_for(
            lambda: _events(node, "mps-leaver", REASON_LEFT_MPS), "the Event", 30, every=1.0, ignore=FLAKY
        )
        assert event["type"] == "Warning" and "it left MPS" in event["message"], event
        assert "killed PID" in event["message"], event
        _log(f"left MPS: {event['message'][:300]}")
        time.sleep(2.0)  # more passes of the enforcer: the client is still not acted on
        assert _running(node, "mps-honest")
        assert not _events(node, "mps-honest", REASON_LEFT_MPS)
    except AssertionError:
        _diagnose(node, "mps-leaver", "mps-honest")
        raise
    finally:
        node.kubectl("delete", "pod", "-n", "default", "mps-leaver", "--wait=false", check=False)


def test_a_pod_without_the_annotation_never_lands_on_the_mps_card(mps_node: Node) -> None:
    node = mps_node
    _pod(node, "not-mps", "exec t_hold 100", None)
    try:

        def unschedulable() -> str:
            pod = node.get("pod", "-n", "default", "not-mps")
            assert not pod["spec"].get("nodeName"), pod["spec"]
            for c in pod["status"].get("conditions") or []:
                if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message"):
                    return str(c["message"])
            return ""

        message = wait_for(unschedulable, "the pod's unschedulable reason", 60, every=1.0, ignore=FLAKY)
        assert "shared through MPS (mps)" in message and ann.HAMI_VGPU_MODE_ANNOTATION in message, message
        time.sleep(5.0)  # and it stays so
        pod = node.get("pod", "-n", "default", "not-mps")
        assert not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending", pod["status"]
        _log(f"not-mps stays Pending: {message[:300]}")
    finally:
        node.kubectl("delete", "pod", "-n", "default", "not-mps", "--wait=false", check=False)
