"""The node's second line on an MPS card (docs/mps.md), with real parts: the card's MPS control
daemon (the fake control tool, started by ``MpsDaemons`` as the plugin starts it), the stub driver
(a process whose pipe's control socket accepts at cuInit is an MPS client and records ``mps 1``
where the fake NVML reads it), processes in real cgroups named as the kubelet names a container's,
and the enforcer on its own thread reading /proc. A process of an MPS container that runs outside
the daemon (it dropped the pipe) is killed; the container's MPS client and a time-sliced neighbour
are not. Needs root (to make cgroups); skipped otherwise, saying why.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hook_harness import Built, build, env

from tests.support import wait_for
from tests.support.cgroups import StubNode, granted_container, reaped_at, stub_node
from vgpu.hookabi.grant import Grant, write_grant
from vgpu.hookabi.layout import MPS_PIPE_IN_CONTAINER, SHARING_MPS
from vgpu.monitor.enforce import REASON_LEFT_MPS, Enforcer
from vgpu.monitor.hostview import HostView
from vgpu.node.mps import MpsDaemons
from vgpu.node.paths import HostPaths

MIB = 1 << 20
CARD = "GPU-3f1c0d6e-0000-4000-8000-00000000e2e1"
GRANT_MIB = 1000


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


class Node(StubNode):
    def hold(self, built: Built, cgroup: Path, mib: int, pipe: Path | None) -> subprocess.Popen[str]:
        """t_hold in ``cgroup`` (no hook: the driver's side alone), an MPS client where ``pipe``."""
        extra = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)} if pipe is not None else {}
        environ = env(built, hook=False, STUB_CUDA_PROCESS_DIR=str(self.procs), **extra)
        script = f'echo $$ > {cgroup}/cgroup.procs && exec "$0" "$@"'
        child = subprocess.Popen(
            ["/bin/sh", "-c", script, built.prog("t_hold"), str(mib)],
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.children.append(child)
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "held=0", line
        return child


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with stub_node(Node, tmp_path, CARD) as made:
        yield made


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[MpsDaemons]:
    tool = tmp_path / "driver/usr/bin/nvidia-cuda-mps-control"
    tool.parent.mkdir(parents=True)
    tool.write_text(f'#!/bin/sh\nexec {sys.executable} -m vgpu.node.fake_mps "$@"\n')
    tool.chmod(0o755)
    # a short root: a unix socket's path is at most 107 bytes
    with tempfile.TemporaryDirectory(prefix="vmps", dir="/tmp") as root:
        made = MpsDaemons(HostPaths(Path(root)), str(tool), [CARD])
        try:
            yield made
        finally:
            made.stop()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def pod_event(self, namespace: str, name: str, uid: str, reason: str, message: str, node: str) -> None:
        self.events.append((reason, message))

    def evict_pod(self, namespace: str, name: str) -> None:
        pass


def test_a_process_that_left_mps_is_killed_and_the_mps_client_and_neighbour_are_not(
    built: Built, node: Node, daemons: MpsDaemons
) -> None:
    assert daemons.ensure() == {CARD: True}
    pipe = daemons.paths.mps_pipe(CARD)
    mps_uid, mps_cg = granted_container(node.paths, node.cgroups, "cuda", CARD, GRANT_MIB * MIB)
    grant = Grant((CARD,), (GRANT_MIB * MIB,), (30,), sharing=SHARING_MPS, mps_pipe=MPS_PIPE_IN_CONTAINER)
    write_grant(node.paths.grant(f"{mps_uid}_cuda"), grant)
    _, neighbour_cg = granted_container(node.paths, node.cgroups, "cuda", CARD, GRANT_MIB * MIB)
    client = node.hold(built, mps_cg, 100, pipe)
    neighbour = node.hold(built, neighbour_cg, 100, None)
    assert [p.mps for p in node.discovery.processes(CARD) or []].count(True) == 1
    recorder = Recorder()
    view = HostView("n1", node.paths, node.discovery, lambda: [CARD], lambda _node: pods(mps_uid))
    enforcer = Enforcer("n1", view, "kill", 256 * MIB, interval_s=0.1, actions=recorder)
    enforcer.start()
    try:
        time.sleep(0.5)  # passes over the client and the neighbour: nothing to do
        assert client.poll() is None and neighbour.poll() is None and not recorder.events
        leaver = node.hold(built, mps_cg, 100, None)  # same container, no pipe: outside MPS
        died = reaped_at(leaver)
        wait_for(lambda: died, "the process outside MPS to be killed", 5, every=0.02)
        assert leaver.returncode == -9
        time.sleep(0.5)
        assert client.poll() is None and neighbour.poll() is None
        enforcer.drain()
        wait_for(lambda: recorder.events, "the Event", 5, every=0.05)
        [(reason, message)] = recorder.events
        assert reason == REASON_LEFT_MPS and "not a client of the card's MPS daemon: it left MPS" in message
        assert f"PID {leaver.pid} " in message and "team/mps-pod" in message
    finally:
        enforcer.stop()


def pods(uid: str) -> list[dict[str, object]]:
    return [{"metadata": {"uid": uid, "namespace": "team", "name": "mps-pod"}, "status": {}}]
