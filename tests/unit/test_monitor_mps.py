"""The second line on an MPS card (docs/mps.md): a process of an MPS container that the driver lists
outside the card's MPS daemon left MPS and is acted on; its MPS clients are held to the grant as
any process is; the MPS server belongs to no container."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest

from vgpu.hookabi.grant import Grant, write_grant
from vgpu.hookabi.layout import MPS_PIPE_IN_CONTAINER, SHARING_MPS
from vgpu.monitor.cgroup import start_time
from vgpu.monitor.enforce import REASON, REASON_LEFT_MPS, Enforcer
from vgpu.monitor.hostview import HostView
from vgpu.node.discovery import GpuProcess
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.paths import HostPaths

MIB = 1 << 20
UID_M = "2f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"  # an MPS container
UID_T = "3f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"  # a time-sliced one


class Source:
    def __init__(self) -> None:
        self.procs: list[GpuProcess] = []

    @property
    def lists_processes(self) -> bool:
        return True

    def processes(self, uuid: str) -> list[GpuProcess] | None:
        return list(self.procs) if uuid == "GPU-a" else []


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def pod_event(self, namespace: str, name: str, uid: str, reason: str, message: str, node: str) -> None:
        self.events.append((reason, message))

    def evict_pod(self, namespace: str, name: str) -> None:
        pass


def proc_tree(root: Path, pid: int, uid: str, comm: str = "python", cgroup: str = "") -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "cgroup").write_text(
        f"0::{cgroup or f'/kubepods/burstable/pod{uid}/cri-containerd-{pid:064d}.scope'}\n"
    )
    (root / str(pid) / "stat").write_text(f"{pid} (t) S " + " ".join(["0"] * 18) + f" {1000 + pid} 0 0\n")
    (root / str(pid) / "comm").write_text(comm + "\n")


@pytest.fixture
def node(tmp_path: Path) -> tuple[HostView, Source]:
    paths = HostPaths(tmp_path / "root")
    paths.grants_dir.mkdir(parents=True)
    mps = Grant(("GPU-a",), (1000 * MIB,), (30,), sharing=SHARING_MPS, mps_pipe=MPS_PIPE_IN_CONTAINER)
    write_grant(paths.grant(f"{UID_M}_cuda"), mps)
    write_grant(paths.grant(f"{UID_T}_cuda"), Grant(("GPU-a",), (1000 * MIB,)))
    proc = tmp_path / "proc"
    proc_tree(proc, 101, UID_M)  # an MPS client
    proc_tree(proc, 102, UID_M)  # left MPS
    # the card's MPS server, the node's MPS daemon's child: in the device plugin's cgroup
    proc_tree(proc, 103, "", "nvidia-cuda-mps", "/system.slice/vgpu-device-plugin.service")
    proc_tree(proc, 104, UID_M, "nvidia-cuda-mps")  # a tenant's process named as an MPS server
    proc_tree(proc, 201, UID_T)  # a time-sliced container's process: never an MPS client
    source = Source()
    return HostView("n1", paths, source, lambda: ["GPU-a"], None, proc), source


def pods() -> list[dict[str, object]]:
    return [{"metadata": {"uid": UID_M, "namespace": "team", "name": "mps-pod"}, "status": {}}]


@pytest.mark.parametrize("action", ["kill", "report"])
def test_a_process_of_an_mps_container_outside_mps_is_acted_on_with_the_reason(
    node: tuple[HostView, Source], action: str, caplog: pytest.LogCaptureFixture
) -> None:
    view, source = node
    view.list_pods = lambda _node: pods()
    killed: list[tuple[int, int]] = []
    recorder = Recorder()
    enforcer = Enforcer("n1", view, action, 0, actions=recorder, kill=lambda p, s: killed.append((p, s)))
    source.procs = [
        GpuProcess(101, 300 * MIB, mps=True),
        GpuProcess(103, 500 * MIB),
        GpuProcess(201, 300 * MIB),
    ]
    enforcer.run_pass()
    assert killed == [] and enforcer.stats.view is not None
    assert enforcer.stats.view.unattributed["GPU-a"] == 500 * MIB  # the MPS server: no container's
    source.procs.append(GpuProcess(102, 10 * MIB))
    with caplog.at_level(logging.WARNING):
        enforcer.run_pass()
        enforcer.run_pass()  # killed: spared after; reported: once while it stays outside
    enforcer.drain()
    assert killed == ([(102, signal.SIGKILL)] if action == "kill" else [])
    [(reason, message)] = recorder.events
    assert reason == REASON_LEFT_MPS
    assert "PID 102" in message and "not a client of the card's MPS daemon: it left MPS" in message
    assert "team/mps-pod" in message
    assert any("MPS bypass" in r.getMessage() for r in caplog.records)


def test_a_tenants_process_named_as_the_mps_server_is_still_its_containers(
    node: tuple[HostView, Source],
) -> None:
    """A process's name is its own to set (prctl): one in an MPS container calling itself
    nvidia-cuda-mps is held to the container's grant, and acted on as outside MPS."""
    view, source = node
    killed: list[int] = []
    enforcer = Enforcer("n1", view, "kill", 0, kill=lambda p, s: killed.append(p))
    source.procs = [GpuProcess(101, 300 * MIB, mps=True), GpuProcess(104, 900 * MIB)]
    enforcer.run_pass()
    assert enforcer.stats.view is not None and enforcer.stats.view.unattributed["GPU-a"] == 0
    [held] = enforcer.stats.view.held
    assert held.pids == {101: 300 * MIB, 104: 900 * MIB} and held.left_mps == {104}
    assert 104 in killed


def test_an_mps_client_over_its_grant_is_held_to_it_as_any_process(node: tuple[HostView, Source]) -> None:
    view, source = node
    killed: list[int] = []
    enforcer = Enforcer("n1", view, "kill", 0, kill=lambda p, s: killed.append(p))
    source.procs = [GpuProcess(101, 1200 * MIB, mps=True)]
    [d] = enforcer.run_pass()
    assert killed == [101] and d.total == 1200 * MIB and d.held.granted == 1000 * MIB
    assert REASON != REASON_LEFT_MPS


def test_the_fake_nvml_lists_mps_clients_in_both_lists_as_the_driver_does(tmp_path: Path) -> None:
    procs = tmp_path / "procs"
    procs.mkdir()
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(f"gpus: [{{uuid: GPU-a, memoryMiB: 1000}}]\nprocessDir: {procs}\n")
    me, parent = os.getpid(), os.getppid()
    (procs / f"{me}@{start_time(me)}").write_text(f"0 {300 * MIB}\nmps 1\nmps_threads 30\nmps_pinned {MIB}\n")
    (procs / f"{parent}@{start_time(parent)}").write_text(f"0 {200 * MIB}\n")
    fake = FakeDiscovery(gpus)
    assert fake.mps_processes("GPU-a") == [GpuProcess(me, 300 * MIB, mps=True)]
    by_pid = sorted(fake.compute_processes("GPU-a"), key=lambda p: p.pid)
    assert by_pid == sorted(
        [GpuProcess(me, 300 * MIB, mps=True), GpuProcess(parent, 200 * MIB)], key=lambda p: p.pid
    )
