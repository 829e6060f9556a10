"""The node's second line: a process that bypasses the hook and goes past its grant is killed
from the host within 1 s, and a neighbour within its grant is never touched.

Real parts throughout: ``t_bypass`` (native/hook/tests) loads the stub driver with dlmopen and
finds cuMemAlloc_v2 in its ELF symbol table, under libvgpu with a 1000 MiB limit that it never
meets; the stub records each process's memory where the fake NVML backend reads it, as the real
driver does for NVML; each process is put into a real cgroup named as the kubelet names a
container's (``.../kubepods/burstable/pod<uid>/<id>``, the cgroupfs driver's form), and the
enforcer (``vgpu.monitor.enforce``) runs on its own thread, reading /proc. Needs root (to
make cgroups); skipped otherwise, saying why.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hook_harness import Built, build, env

from tests.support import wait_for
from tests.support.cgroups import StubNode, granted_container, reaped_at, stub_node
from vgpu.monitor.enforce import Enforcer
from vgpu.monitor.hostview import HostView

MIB = 1 << 20
CARD = "GPU-3f1c0d6e-0000-4000-8000-00000000e2e0"
GRANT_MIB = 1000


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


class Node(StubNode):
    def container(self, name: str) -> tuple[str, Path]:
        """A pod with one granted container: its cgroup folder, named as the kubelet names it."""
        return granted_container(self.paths, self.cgroups, name, CARD, GRANT_MIB * MIB)

    def bypass(self, built: Built, cgroup: Path, below: int, target: int) -> subprocess.Popen[str]:
        """t_bypass in ``cgroup``, under the hook with the grant's limit in its environment."""
        environ = env(
            built,
            STUB_CUDA_PROCESS_DIR=str(self.procs),
            NVIDIA_VISIBLE_DEVICES=CARD,
            CUDA_DEVICE_MEMORY_LIMIT_0=f"{GRANT_MIB}m",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(self.tmp / f"{cgroup.name}.region"),
        )
        return self.spawn(cgroup, [built.prog("t_bypass"), str(below), str(target)], environ)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with stub_node(Node, tmp_path, CARD) as made:
        yield made


def _line(child: subprocess.Popen[str], word: str) -> dict[str, str]:
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.startswith(word), line
    return dict(part.split("=", 1) for part in line.split()[1:])


def test_a_bypassing_process_past_its_grant_is_killed_within_1s_and_its_neighbour_is_not(
    built: Built, node: Node
) -> None:
    greedy_uid, greedy_cg = node.container("cuda")
    neighbour_uid, neighbour_cg = node.container("cuda")
    view = HostView("n1", node.paths, node.discovery, lambda: [CARD])  # no API server: the grants name them
    enforcer = Enforcer("n1", view, "kill", 256 * MIB, interval_s=0.1)
    enforcer.start()
    try:
        neighbour = node.bypass(built, neighbour_cg, 200, 900)  # within its 1000 MiB
        greedy = node.bypass(built, greedy_cg, 512, 3000)  # 3000 past 1000 + 256 tolerated
        assert _line(neighbour, "below")["rc"] == "0" and _line(greedy, "below")["rc"] == "0"
        assert _line(neighbour, "crossed")["rc"] == "0"
        died = reaped_at(greedy)
        crossed = _line(greedy, "crossed")
        assert crossed["rc"] == "0", "the hook stopped the bypass: it did not bypass it"
        wait_for(lambda: died, "the greedy process to be killed", 5, every=0.01)
        seconds = (died[0] - int(crossed["mono_ns"])) / 1e9
        print(
            f"crossing to kill: {seconds * 1000:.0f} ms "
            f"(enforcer pass {enforcer.stats.last_pass_s * 1000:.1f} ms)"
        )
        assert greedy.returncode == -9
        assert seconds < 1.0, f"killed {seconds:.3f} s after crossing"
        time.sleep(0.5)  # more passes: the neighbour, within its grant, is never touched
        assert neighbour.poll() is None
        acted = enforcer.stats.actions or {}
        assert acted == {("kill", "", "", "cuda"): 1}, acted
        view_now = enforcer.stats.view
        assert view_now is not None
        [held] = [h for h in view_now.held if h.owner.pod_uid == neighbour_uid]
        assert held.total == 900 * MIB and held.granted == GRANT_MIB * MIB
        assert all(h.owner.pod_uid != greedy_uid for h in view_now.held)  # its memory went with it
    finally:
        enforcer.stop()


def test_with_report_nothing_is_killed_but_the_crossing_is_reported_once(built: Built, node: Node) -> None:
    _, greedy_cg = node.container("cuda")
    view = HostView("n1", node.paths, node.discovery, lambda: [CARD])
    enforcer = Enforcer("n1", view, "report", 256 * MIB, interval_s=0.1)
    enforcer.start()
    try:
        greedy = node.bypass(built, greedy_cg, 512, 3000)
        _line(greedy, "below")
        _line(greedy, "crossed")
        wait_for(lambda: enforcer.stats.actions, "the crossing to be reported", 5, every=0.05)
        time.sleep(1.0)
        assert greedy.poll() is None, "report must never kill"
        assert enforcer.stats.actions == {("report", "", "", "cuda"): 1}
    finally:
        enforcer.stop()
