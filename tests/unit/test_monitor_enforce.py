"""The enforcer's rule and its actions: a container over its grant on a card (by the driver) is
acted on as configured; one within its grant never is."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest

from vgpu.core.errors import ConfigError
from vgpu.hookabi.grant import Grant, write_grant
from vgpu.monitor.cgroup import start_time
from vgpu.monitor.enforce import REASON, Enforcer, HostCollector, decide
from vgpu.monitor.hostview import Held, HostView, Owner, View
from vgpu.node.config import parse_node_config
from vgpu.node.discovery import GpuProcess
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.paths import HostPaths

MIB = 1 << 20
UID_A = "0f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
UID_B = "1f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
CID_A = "a" * 64
CID_B = "b" * 64


def held(folder: str, granted_mib: int, pids: dict[int, int], uuid: str = "GPU-a") -> Held:
    uid, _, name = folder.partition("_")
    return Held(
        Owner(uid, name, "ns", f"pod-{uid[:2]}"),
        uuid,
        granted_mib * MIB,
        {p: m * MIB for p, m in pids.items()},
    )


def test_within_the_grant_plus_the_tolerance_per_process_nothing_is_decided() -> None:
    view = View([held("u1_c", 1000, {10: 1200, 11: 300})], {})
    # 1500 held, 1000 granted + 2 x 256 tolerated
    assert decide(view, 256 * MIB, set(), set()) == []
    assert decide(View([held("u1_c", 1000, {10: 1000})], {}), 0, set(), set()) == []


def test_over_the_grant_the_process_holding_the_most_is_picked() -> None:
    over: set[tuple[str, str]] = set()
    view = View([held("u1_c", 1000, {10: 300, 11: 900}), held("u2_c", 1000, {20: 500})], {})
    [d] = decide(view, 0, set(), over)
    assert (d.pid, d.pid_bytes, d.total, d.allowed) == (11, 900 * MIB, 1200 * MIB, 1000 * MIB)
    assert d.held.owner.folder == "u1_c"


def test_a_killed_process_is_not_counted_again_nor_a_container_without_a_limit() -> None:
    view = View([held("u1_c", 1000, {10: 300, 11: 900}), held("u2_c", 0, {20: 5000})], {})
    assert decide(view, 0, {11}, set()) == []


def test_a_crossing_leaves_the_over_set_once_the_container_is_back_within() -> None:
    over = {("u1_c", "GPU-a"), ("gone_c", "GPU-a")}
    decide(View([held("u1_c", 1000, {10: 1100})], {}), 0, set(), over)
    assert over == {("u1_c", "GPU-a")}
    decide(View([held("u1_c", 1000, {10: 900})], {}), 0, set(), over)
    assert over == set()


class Source:
    def __init__(self) -> None:
        self.procs: dict[str, list[GpuProcess]] = {"GPU-a": [], "GPU-b": []}

    def processes(self, uuid: str) -> list[GpuProcess] | None:
        return self.procs.get(uuid)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []
        self.evicted: list[tuple[str, str]] = []

    def pod_event(self, namespace: str, name: str, uid: str, reason: str, message: str, node: str) -> None:
        self.events.append((namespace, name, uid, reason, message, node))

    def evict_pod(self, namespace: str, name: str) -> None:
        self.evicted.append((namespace, name))


def proc_tree(root: Path, pid: int, cgroup: str) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "cgroup").write_text(cgroup)
    (root / str(pid) / "stat").write_text(f"{pid} (t) S " + " ".join(["0"] * 18) + f" {1000 + pid} 0 0\n")


def pods() -> list[dict[str, object]]:
    return [
        {
            "metadata": {"uid": UID_A, "namespace": "team", "name": "greedy"},
            "status": {"containerStatuses": [{"name": "cuda", "containerID": f"containerd://{CID_A}"}]},
        },
        {
            "metadata": {"uid": UID_B, "namespace": "team", "name": "neighbour"},
            "status": {"containerStatuses": [{"name": "cuda", "containerID": f"containerd://{CID_B}"}]},
        },
    ]


@pytest.fixture
def node(tmp_path: Path) -> tuple[HostPaths, Path, Source]:
    paths = HostPaths(tmp_path / "root")
    paths.grants_dir.mkdir(parents=True)
    for uid in (UID_A, UID_B):
        write_grant(paths.grant(f"{uid}_cuda"), Grant(("GPU-a",), (1000 * MIB,)))
    proc = tmp_path / "proc"
    proc_tree(proc, 101, f"0::/kubepods/burstable/pod{UID_A}/{CID_A}\n")
    proc_tree(proc, 102, f"0::/kubepods/burstable/pod{UID_A}/{CID_A}\n")
    proc_tree(proc, 201, f"0::/kubepods/burstable/pod{UID_B}/{CID_B}\n")
    proc_tree(proc, 301, "0::/system.slice/sshd.service\n")
    return paths, proc, Source()


@pytest.mark.parametrize("action", ["kill", "evict", "report"])
def test_the_action_names_pod_container_pid_held_and_granted_and_spares_the_neighbour(
    node: tuple[HostPaths, Path, Source], action: str, caplog: pytest.LogCaptureFixture
) -> None:
    paths, proc, source = node
    killed: list[tuple[int, int]] = []
    recorder = Recorder()
    view = HostView("n1", paths, source, lambda: ["GPU-a", "GPU-b"], lambda _node: pods(), proc)
    enforcer = Enforcer(
        "n1", view, action, 0, actions=recorder, kill=lambda pid, sig: killed.append((pid, sig))
    )
    source.procs["GPU-a"] = [
        GpuProcess(101, 600 * MIB),
        GpuProcess(102, 300 * MIB),
        GpuProcess(201, 999 * MIB),
        GpuProcess(301, 4000 * MIB),
    ]
    assert enforcer.run_pass() == []  # 900 of 1000, 999 of 1000, the host's 4000 unattributed
    assert enforcer.stats.view is not None and enforcer.stats.view.unattributed["GPU-a"] == 4000 * MIB
    source.procs["GPU-a"][1] = GpuProcess(102, 700 * MIB)  # the greedy pod's second process grows
    with caplog.at_level(logging.WARNING):
        [d] = enforcer.run_pass()
        assert enforcer.run_pass() == []  # killed (not counted again), or acted on once per crossing
    enforcer.drain()
    assert (d.pid, d.total, d.held.owner.pod, d.held.owner.container) == (102, 1300 * MIB, "greedy", "cuda")
    assert killed == ([(102, signal.SIGKILL)] if action == "kill" else [])
    line = next(r.getMessage() for r in caplog.records if "memory over grant" in r.getMessage())
    for word in ("team/greedy", "container cuda", "PID 102", str(1300 * MIB), str(1000 * MIB)):
        assert word in line, line
    [event] = recorder.events
    assert event[:4] == ("team", "greedy", UID_A, REASON) and event[5] == "n1"
    assert recorder.evicted == ([("team", "greedy")] if action == "evict" else [])
    text = "".join(
        f"{m.name} {s.labels} {s.value}\n" for m in HostCollector(enforcer).collect() for s in m.samples
    )
    assert f"'action': '{action}', 'namespace': 'team', 'pod': 'greedy', 'container': 'cuda'}} 1.0" in text
    assert "'pod': 'neighbour'" in text and "vgpu_card_memory_unattributed_bytes" in text


def test_without_the_api_server_a_pods_single_grant_names_the_container(
    node: tuple[HostPaths, Path, Source],
) -> None:
    paths, proc, source = node
    killed: list[int] = []
    view = HostView("n1", paths, source, lambda: ["GPU-a"], None, proc)
    enforcer = Enforcer("n1", view, "kill", 0, kill=lambda pid, sig: killed.append(pid))
    source.procs["GPU-a"] = [GpuProcess(201, 1001 * MIB)]
    [d] = enforcer.run_pass()
    assert killed == [201] and d.held.owner.folder == f"{UID_B}_cuda"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("enforcement: {memory: shoot}", "enforcement.memory"),
        ("enforcement: {memoryToleranceMiB: -1}", "enforcement.memoryToleranceMiB"),
        ("enforcement: {intervalMs: 2000}", "enforcement.intervalMs"),
        ("enforcement: {memroy: kill}", "enforcement.memroy"),
        ("enforcement: kill", "enforcement"),
        ("nodes: {n1: {enforcement: {memory: nope}}}", "nodes.n1.enforcement.memory"),
    ],
)
def test_bad_enforcement_settings_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_node_config(text, "n1", "node.yaml")
    assert err.value.field == field, err.value


def test_enforcement_defaults_and_per_node_settings() -> None:
    cfg = parse_node_config("", "n1", "node.yaml")
    assert (cfg.enforce_memory, cfg.memory_tolerance_mib, cfg.enforce_interval_ms) == ("kill", 256, 100)
    cfg = parse_node_config(
        "enforcement: {memory: evict}\nnodes: {n1: {enforcement: {memory: report, intervalMs: 50}}}",
        "n1",
        "x",
    )
    assert (cfg.enforce_memory, cfg.enforce_interval_ms) == ("report", 50)


def test_the_fake_backend_reads_the_stub_drivers_process_files_by_host_pid(tmp_path: Path) -> None:
    procs = tmp_path / "procs"
    procs.mkdir()
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(
        f"gpus: [{{uuid: GPU-a, memoryMiB: 1000}}, {{uuid: GPU-b, memoryMiB: 1000}}]\nprocessDir: {procs}\n"
    )
    me = os.getpid()
    (procs / f"{me}@{start_time(me)}").write_text(f"GPU-a {300 * MIB}\n1 {5 * MIB}\n")
    (procs / f"{me}@1").write_text(f"GPU-a {700 * MIB}\n")  # this PID, another start: a process gone
    (procs / "junk").write_text("GPU-a 1\n")
    fake = FakeDiscovery(gpus)
    assert fake.processes("GPU-a") == [GpuProcess(me, 300 * MIB)]
    assert fake.processes("GPU-b") == [GpuProcess(me, 5 * MIB)]  # by the card's index
    assert fake.processes("GPU-c") is None


def test_a_bad_process_dir_names_the_field(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text("gpus: [{uuid: GPU-a, memoryMiB: 1000}]\nprocessDir: relative/path\n")
    with pytest.raises(ConfigError) as err:
        FakeDiscovery(gpus)
    assert err.value.field == "processDir"


def test_a_process_gone_between_the_read_and_the_kill_is_not_killed(
    node: tuple[HostPaths, Path, Source],
) -> None:
    paths, proc, source = node
    killed: list[int] = []

    class Racing(HostView):
        def read(self) -> View:
            view = super().read()
            # after the read, the process exits and another one gets its PID
            (proc / "201" / "stat").write_text("201 (other) S " + " ".join(["0"] * 18) + " 99999 0 0\n")
            return view

    source.procs["GPU-a"] = [GpuProcess(201, 2000 * MIB)]
    view = Racing("n1", paths, source, lambda: ["GPU-a"], None, proc)
    enforcer = Enforcer("n1", view, "kill", 0, kill=lambda pid, sig: killed.append(pid))
    [d] = enforcer.run_pass()
    assert d.pid == 201 and killed == []


def test_a_container_whose_cgroup_names_no_pod_is_found_through_the_pods_status(
    node: tuple[HostPaths, Path, Source],
) -> None:
    paths, proc, source = node
    proc_tree(proc, 401, f"8:pids:/k8s.io/{CID_A}\n0::/k8s.io/{CID_A}\n")  # cgroupsPerQOS: false
    killed: list[int] = []
    view = HostView("n1", paths, source, lambda: ["GPU-a"], lambda _node: pods(), proc)
    enforcer = Enforcer("n1", view, "kill", 0, kill=lambda pid, sig: killed.append(pid))
    source.procs["GPU-a"] = [GpuProcess(401, 1500 * MIB)]
    [d] = enforcer.run_pass()
    assert killed == [401] and (d.held.owner.pod, d.held.owner.container) == ("greedy", "cuda")
    # without the API server, such a container cannot be named: its memory is unattributed
    alone = Enforcer("n1", HostView("n1", paths, source, lambda: ["GPU-a"], None, proc), "kill", 0)
    assert alone.run_pass() == [] and alone.stats.view is not None
    assert alone.stats.view.unattributed["GPU-a"] == 1500 * MIB
