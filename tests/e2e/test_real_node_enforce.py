"""The node's second line of defence on the real node: a process that bypasses the hook and goes
past its grant is killed from the host within 1 s, the pod gets an Event and the metric counts it;
with ``enforcement.memory: report`` nothing is killed but the crossing is reported; with
``evict`` set for this node alone (``nodeOverrides``) the API server evicts the pod; a neighbour
within its grant is never touched.

The real kubelet, containerd and runc run the sample image's ``t_bypass`` (native/hook/tests),
which loads the stub driver with dlmopen and calls cuMemAlloc_v2 from libcuda's own symbol
table, so the hook that /etc/ld.so.preload loads into it never sees the allocation. The stub
records each process's memory where the chart's device plugin (fake NVML backend, ``processDir``)
reads it back, as NVML gives the real driver's; the plugin maps each PID to its container
through /proc/<pid>/cgroup as the kubelet's cgroupfs driver names it.

Run it alone, under the real node's lock: ``flock /tmp/vgpu-realnode.lock pytest
tests/e2e/test_real_node_enforce.py``. Skipped, with the reason, where no real node can run.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from typing import Any

import pytest
from vgpu_sandbox import binaries
from vgpu_sandbox.realnode import layout, sample

from tests.e2e.test_real_node import NAMESPACE, Node, _log, _plugin_running, node, prepared
from tests.support import wait_for

__all__ = ["node", "prepared"]  # the module's fixtures, shared with test_real_node's

CARD_MIB = 8192
FLAKY = (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError)
AT = r".*\[at monotonic (?P<at>[\d.]+) s\]"  # the plugin's clock at the action, in its log line

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _pod(node: Node, name: str, command: str) -> None:
    manifest = sample.sample_pod(
        name,
        command,
        {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"},
        CARD_MIB,
        stub_procs=node.lay.stub_procs,
    )
    node.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def _logs(node: Node, name: str) -> str:
    return node.kubectl("logs", "-n", "default", name, check=False).stdout


def _crossed_ns(node: Node, name: str) -> int:
    found = re.search(r"^crossed total_mib=\d+ rc=0 mono_ns=(\d+)$", _logs(node, name), re.M)
    return int(found.group(1)) if found else 0


def _plugin_log(node: Node) -> str:
    plugin = node.plugin_pod()
    assert plugin is not None
    return node.kubectl("logs", "-n", NAMESPACE, plugin["metadata"]["name"], check=False).stdout


def _events(node: Node, name: str) -> list[dict[str, Any]]:
    listed = node.get("events", "-n", "default", "--field-selector", f"involvedObject.name={name}")
    return [e for e in listed["items"] if e.get("reason") == "VgpuMemoryOverGrant"]


def _metric(node: Node, action: str, pod: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port()}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("vgpu_memory_enforcement_actions_total{") and f'pod="{pod}"' in line:
            if f'action="{action}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _running(node: Node, name: str) -> bool:
    pod = node.get("pod", "-n", "default", name)
    statuses = pod["status"].get("containerStatuses") or []
    return bool(statuses) and "running" in statuses[0]["state"] and statuses[0]["restartCount"] == 0


def _diagnose(node: Node, *pods: str) -> None:
    """What a failed wait needs: the pods' states, the plugin's log, the stub's process files."""
    for name in pods:
        out = node.kubectl("get", "pod", "-n", "default", name, "-o", "json", check=False).stdout
        _log(f"pod {name}: {out[-1500:]}")
        _log(f"logs {name}: {_logs(node, name)[-800:]}")
    _log(f"plugin log: {_plugin_log(node)[-4000:]}")
    for f in sorted(node.lay.stub_procs.iterdir()):
        _log(f"stub process file {f.name}: {f.read_text()!r}")


@pytest.fixture(scope="module")
def plugin_ready(prepared: Node) -> Node:
    wait_for(lambda: _plugin_running(prepared), "the device-plugin pod", 180, every=1.0, ignore=FLAKY)
    return prepared


def test_a_process_bypassing_the_hook_past_its_grant_is_killed_within_1s_and_its_neighbour_is_not(
    plugin_ready: Node,
) -> None:
    node = plugin_ready
    _pod(node, "neighbour", "exec t_bypass 200 900")  # within its 1000 MiB grant
    _pod(node, "greedy", "exec t_bypass 512 3000")  # past 1000 MiB + 256 tolerated
    try:
        _killed_within_1s(node)
    except AssertionError:
        _diagnose(node, "greedy", "neighbour")
        raise
    finally:
        node.kubectl("delete", "pod", "-n", "default", "greedy", "neighbour", "--wait=false", check=False)


def _acted_within_1s(node: Node, pattern: str, crossed_ns: int, what: str) -> re.Match[str]:
    """The plugin's log line matching ``pattern`` (its ``at`` group: the plugin's clock), which
    must come within 1 s of the container's crossing at ``crossed_ns`` (the same clock)."""
    line = wait_for(
        lambda: re.search(pattern, _plugin_log(node)),
        f"the {what} in the plugin's log",
        30,
        every=1.0,
        ignore=FLAKY,
    )
    seconds = float(line.group("at")) - crossed_ns / 1e9
    _log(f"crossing to {what}: {seconds * 1000:.0f} ms; {line.group(0)[:300]}")
    assert 0 <= seconds < 1.0, f"{what} {seconds:.3f} s after the crossing"
    return line


def _killed_within_1s(node: Node) -> None:
    """greedy crosses its grant, is killed within 1 s, and it is told; its neighbour is not touched."""
    crossed = wait_for(
        lambda: _crossed_ns(node, "greedy"), "greedy to cross its grant", 180, every=1.0, ignore=FLAKY
    )

    def killed() -> dict[str, Any] | None:
        pod = node.get("pod", "-n", "default", "greedy")
        statuses = pod["status"].get("containerStatuses") or []
        return statuses[0]["state"].get("terminated") if statuses else None

    terminated = wait_for(killed, "greedy's container to end", 60, every=0.5, ignore=FLAKY)
    assert terminated["exitCode"] == 137, terminated  # SIGKILL
    line = _acted_within_1s(
        node,
        r"memory over grant: killed PID (?P<pid>\d+): container cuda of default/greedy " + AT,
        crossed,
        "kill",
    )
    for word in ("bytes", "granted 1048576000 bytes"):
        assert word in line.group(0), line.group(0)
    [event] = wait_for(lambda: _events(node, "greedy"), "the Event on the pod", 30, every=1.0, ignore=FLAKY)
    assert event["type"] == "Warning" and f"killed PID {line.group('pid')}" in event["message"], event
    assert wait_for(lambda: _metric(node, "kill", "greedy"), "the metric", 30, every=1.0, ignore=FLAKY) == 1
    # the neighbour within its grant: running, its memory held, never acted on
    assert "crossed total_mib=900 rc=0" in _logs(node, "neighbour")
    time.sleep(1.0)
    assert _running(node, "neighbour") and not _events(node, "neighbour")
    assert _metric(node, "kill", "neighbour") == 0


def _upgrade(node: Node, *values: str) -> None:
    """``helm upgrade --reuse-values`` with ``values`` (``key=value``), then wait until the new
    device-plugin pod has replaced the old one and registered with the kubelet."""
    before = node.plugin_pod()
    assert before is not None
    registered = node.kubelet_log().count("registration request from device plugin")
    sets = [arg for value in values for arg in ("--set", value)]
    upgraded = subprocess.run(
        [
            str(node.sandbox.bin("helm")),
            "upgrade",
            "vgpu",
            str(binaries.repo_root() / "charts" / "vgpu"),
            "-n",
            NAMESPACE,
            "--reuse-values",
            *sets,
            f"--kubeconfig={node.sandbox.kubeconfig}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert upgraded.returncode == 0, upgraded.stderr[-2000:]

    def new_plugin() -> dict[str, Any] | None:
        pod = _plugin_running(node)
        return pod if pod and pod["metadata"]["uid"] != before["metadata"]["uid"] else None

    wait_for(new_plugin, f"the device-plugin pod with {' '.join(values)}", 240, every=1.0, ignore=FLAKY)
    # the kubelet admits a GPU pod only once the new plugin has registered and listed its devices
    wait_for(
        lambda: (
            node.kubelet_log().count("registration request from device plugin") > registered
            and node.get("node", layout.NAME)["status"]["allocatable"].get("nvidia.com/gpu") == "4"
        ),
        "the new plugin to register with the kubelet",
        120,
        every=1.0,
        ignore=FLAKY,
    )


def test_with_report_the_crossing_is_reported_and_nothing_is_killed(plugin_ready: Node) -> None:
    node = plugin_ready
    _upgrade(node, "devicePlugin.enforcement.memory=report")
    _pod(node, "greedy-report", "exec t_bypass 512 3000")
    try:
        wait_for(lambda: _crossed_ns(node, "greedy-report"), "the crossing", 180, every=1.0, ignore=FLAKY)
        reported = wait_for(
            lambda: [
                x for x in _plugin_log(node).splitlines() if "reported only" in x and "greedy-report" in x
            ],
            "the report in the plugin's log",
            30,
            every=1.0,
            ignore=FLAKY,
        )
        _log(f"report: {reported[0][:300]}")
        assert wait_for(lambda: _events(node, "greedy-report"), "the Event", 30, every=1.0, ignore=FLAKY)
        assert _metric(node, "report", "greedy-report") == 1
        time.sleep(2.0)
        assert _running(node, "greedy-report"), "report must never kill"
    except AssertionError:
        _diagnose(node, "greedy-report")
        raise
    finally:
        node.kubectl("delete", "pod", "-n", "default", "greedy-report", "--wait=false", check=False)


def test_evict_set_for_this_node_alone_evicts_the_pod_through_the_api_server(plugin_ready: Node) -> None:
    """Cluster-wide ``report``, ``evict`` for this node by ``nodeOverrides``: the chart gives the
    plugin the eviction right, the real API server evicts the pod (policy/v1 Eviction) and the
    kubelet stops it; once per crossing, while the pod terminates."""
    node = plugin_ready
    _upgrade(
        node,
        "devicePlugin.enforcement.memory=report",
        f"devicePlugin.nodeOverrides[0].name={layout.NAME}",
        "devicePlugin.nodeOverrides[0].enforcement.memory=evict",
    )
    _pod(node, "greedy-evict", "exec t_bypass 512 3000")
    try:
        crossed = wait_for(
            lambda: _crossed_ns(node, "greedy-evict"), "the crossing", 180, every=1.0, ignore=FLAKY
        )
        _acted_within_1s(
            node,
            "memory over grant: evicting the pod: container cuda of default/greedy-evict " + AT,
            crossed,
            "eviction",
        )

        def gone() -> bool:
            listed = node.get("pods", "-n", "default", "--field-selector", "metadata.name=greedy-evict")
            return not listed["items"] or "deletionTimestamp" in listed["items"][0]["metadata"]

        wait_for(gone, "the API server to evict the pod", 30, every=0.5, ignore=FLAKY)
        [event] = wait_for(
            lambda: _events(node, "greedy-evict"), "the Event on the pod", 30, every=1.0, ignore=FLAKY
        )
        assert event["type"] == "Warning" and event["message"].startswith("evicting the pod"), event
        assert "could not evict" not in event["message"], event
        time.sleep(1.0)  # more passes see it over while it terminates: still one action
        assert _metric(node, "evict", "greedy-evict") == 1
        assert _metric(node, "kill", "greedy-evict") == 0
    except AssertionError:
        _diagnose(node, "greedy-evict")
        raise
    finally:
        node.kubectl("delete", "pod", "-n", "default", "greedy-evict", "--wait=false", check=False)
