"""The node's second line on the real driver: a process that bypasses the hook and goes past its
grant is killed from the host within 1 s; a neighbour within its grant is never touched; with
``report`` nothing is killed but the crossing is reported.

tests/integration/test_enforce_bypass.py proves the same on the stub driver; here every part is
real: ``t_bypass`` (native/hook/tests) loads the real ``libcuda.so.1`` with dlmopen(LM_ID_NEWLM)
and finds cuMemAlloc_v2 in its ELF symbol table, under libvgpu with a 1000 MiB limit it never
meets; the neighbour (``t_hold``) allocates through the hook, within the limit; the enforcer reads
the driver's per-process memory through NVML (``NvmlDiscovery.processes``) and maps each PID to
its container through a real cgroup named as the kubelet names a container's.

Run as root on the GPU machine: `python3 -m pytest -m gpu tests/gpu/test_enforce_gpu.py -s`.
With VGPU_GPU_OUT set, the crossing-to-kill time is appended to $VGPU_GPU_OUT/enforce.txt.

A real context costs about 500 MiB of device memory that the driver counts in the process's
figure: the neighbour (a context and 200 MiB) stays well within 1000 MiB plus the 256 MiB
tolerance, and so does the bypasser before its crossing (a context and 200 MiB), while after it
(a context and 3000 MiB) it is far past them.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import wait_for
from tests.support.cgroups import granted_container, kubepods_cgroups, reap, reaped_at
from vgpu.monitor.enforce import Enforcer
from vgpu.monitor.hostview import HostView
from vgpu.node.nvml import NvmlDiscovery
from vgpu.node.paths import HostPaths

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "native" / "hook"
BUILD = HOOK / "build"
MIB = 1 << 20
GRANT_MIB = 1000
TOLERANCE = 256 * MIB
BELOW_MIB = 200  # the bypasser's first step: a context and this, within the grant
TARGET_MIB = 3000  # then up to this: far past the grant and the tolerance
NEIGHBOUR_MIB = 200  # through the hook, which charges its context reserve (640 MiB) against the limit


@pytest.fixture(scope="module")
def built() -> Path:
    subprocess.run(["make", "-s", "-C", str(HOOK)], check=True, capture_output=True, timeout=300)
    return BUILD


@pytest.fixture(scope="module")
def nvml() -> Iterator[NvmlDiscovery]:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        pytest.skip("pynvml is not installed: the host view reads the driver through it")
    discovery = NvmlDiscovery()
    try:
        yield discovery
    finally:
        discovery.close()


def _plain_env() -> dict[str, str]:
    drop = ("CUDA_DEVICE_", "CUDA_SM_", "LD_PRELOAD", "STUB_CUDA_", "VGPU_CONTEXT_RESERVE")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


class Node:
    def __init__(self, tmp: Path, cgroups: Path, discovery: NvmlDiscovery, built: Path) -> None:
        self.discovery = discovery
        self.card = discovery.cards()[0].uuid
        self.paths = HostPaths(tmp / "root")
        self.paths.grants_dir.mkdir(parents=True)
        self.tmp = tmp
        self.cgroups = cgroups
        self.built = built
        self.children: list[subprocess.Popen[str]] = []

    def view(self) -> HostView:
        return HostView("n1", self.paths, self.discovery, lambda: [self.card])  # no API server

    def container(self, name: str) -> tuple[str, Path]:
        """A pod with one granted container: its cgroup folder, named as the kubelet names it."""
        return granted_container(self.paths, self.cgroups, name, self.card, GRANT_MIB * MIB)

    def start(self, cgroup: Path, program: str, *args: str) -> subprocess.Popen[str]:
        """``program`` in ``cgroup``, under the hook with the grant's limit in its environment; on
        the real driver (no stub on the library path)."""
        environ = _plain_env() | {
            "LD_PRELOAD": str(self.built / "libvgpu.so"),
            "CUDA_DEVICE_MEMORY_LIMIT": f"{GRANT_MIB}m",
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(self.tmp / f"{cgroup.name}.region"),
            "VGPU_LOG_LEVEL": "warn",
        }
        script = f'echo $$ > {cgroup}/cgroup.procs && exec "$0" "$@"'
        child = subprocess.Popen(
            ["/bin/sh", "-c", script, str(self.built / "tests" / program), *args],
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.children.append(child)
        return child

    def bypass(self, cgroup: Path) -> subprocess.Popen[str]:
        return self.start(cgroup, "t_bypass", str(BELOW_MIB), str(TARGET_MIB))

    def driver_mib(self, pid: int) -> int:
        """What the driver says ``pid`` holds on the card, through the same NVML the view reads."""
        procs = self.discovery.processes(self.card) or []
        return sum(p.memory_bytes for p in procs if p.pid == pid) // MIB


@pytest.fixture
def node(tmp_path: Path, built: Path, nvml: NvmlDiscovery) -> Iterator[Node]:
    with kubepods_cgroups(tmp_path, "vgpu-gpu-test") as cgroups:
        made = Node(tmp_path, cgroups, nvml, built)
        try:
            yield made
        finally:
            reap(made.children, timeout=30)


def _line(child: subprocess.Popen[str], word: str, timeout: float = 60) -> dict[str, str]:
    """The child's next line, which must start with ``word``: its key=value pairs."""
    assert child.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        child.kill()
        raise AssertionError(f"no {word!r} line within {timeout:g} s")
    line = child.stdout.readline()
    if not line.startswith(word):
        child.kill()
        child.wait(timeout=30)
        err = child.stderr.read() if child.stderr else ""
        raise AssertionError(
            f"expected {word!r}, got {line!r} (exit {child.returncode}); stderr: {err[-2000:]}"
        )
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def _seen(node: Node, pid: int) -> None:
    """The driver lists ``pid`` under the PID this process knows it by (not so where NVML gives
    the host's PIDs to a process in another PID namespace: the host view cannot work there)."""
    try:
        wait_for(lambda: node.driver_mib(pid), f"NVML to list PID {pid} on {node.card}", 10, every=0.05)
    except AssertionError:
        listed = [p.pid for p in node.discovery.processes(node.card) or []]
        pytest.skip(
            f"NVML does not list PID {pid} (it lists {listed}): another PID namespace than the driver's?"
        )


def _record(line: str) -> None:
    print(line)
    out = os.environ.get("VGPU_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with (Path(out) / "enforce.txt").open("a") as f:
            f.write(line + "\n")


def test_a_bypassing_process_past_its_grant_is_killed_within_1s_and_its_neighbour_is_not(node: Node) -> None:
    greedy_uid, greedy_cg = node.container("cuda")
    neighbour_uid, neighbour_cg = node.container("cuda")
    neighbour = node.start(neighbour_cg, "t_hold", str(NEIGHBOUR_MIB))
    assert _line(neighbour, "held")["held"] == "0"
    _seen(node, neighbour.pid)
    enforcer = Enforcer("n1", node.view(), "kill", TOLERANCE, interval_s=0.1)
    enforcer.start()
    try:
        greedy = node.bypass(greedy_cg)
        below = _line(greedy, "below")
        assert below["rc"] == "0", below
        # t_bypass waits 1 s before crossing: the enforcer's passes meanwhile see it within its grant
        neighbour_mib, greedy_below_mib = node.driver_mib(neighbour.pid), node.driver_mib(greedy.pid)
        died = reaped_at(greedy)
        crossed = _line(greedy, "crossed")  # none if it were killed before crossing
        assert crossed["rc"] == "0", (
            "the bypass could not allocate (the hook stopped it, or the card is full)"
        )
        wait_for(lambda: died, "the greedy process to be killed", 5, every=0.005)
        seconds = (died[0] - int(crossed["mono_ns"])) / 1e9
        _record(
            f"real driver: crossing to kill {seconds * 1000:.0f} ms "
            f"(enforcer pass {enforcer.stats.last_pass_s * 1000:.1f} ms, every 100 ms); driver figures: "
            f"neighbour {neighbour_mib} MiB (context + {NEIGHBOUR_MIB}), bypasser before crossing "
            f"{greedy_below_mib} MiB (context + {BELOW_MIB}); "
            f"grant {GRANT_MIB} MiB + {TOLERANCE // MIB} MiB tolerance"
        )
        assert greedy.returncode == -9
        assert seconds < 1.0, f"killed {seconds:.3f} s after crossing"
        time.sleep(1.0)  # more passes: the neighbour, within its grant, is never touched
        assert neighbour.poll() is None
        acted = enforcer.stats.actions or {}
        assert acted == {("kill", "", "", "cuda"): 1}, acted
        view_now = enforcer.stats.view
        assert view_now is not None
        [held] = [h for h in view_now.held if h.owner.pod_uid == neighbour_uid]
        assert held.granted == GRANT_MIB * MIB
        assert NEIGHBOUR_MIB * MIB <= held.total <= GRANT_MIB * MIB + TOLERANCE
        assert all(h.owner.pod_uid != greedy_uid for h in view_now.held)  # its memory went with it
    finally:
        enforcer.stop()


def test_with_report_nothing_is_killed_but_the_crossing_is_reported_once(node: Node) -> None:
    _, greedy_cg = node.container("cuda")
    enforcer = Enforcer("n1", node.view(), "report", TOLERANCE, interval_s=0.1)
    enforcer.start()
    try:
        greedy = node.bypass(greedy_cg)
        assert _line(greedy, "below")["rc"] == "0"
        _seen(node, greedy.pid)
        crossed = _line(greedy, "crossed")
        assert crossed["rc"] == "0"
        reported = wait_for(lambda: enforcer.stats.actions, "the crossing to be reported", 5, every=0.01)
        seconds = (time.clock_gettime_ns(time.CLOCK_MONOTONIC) - int(crossed["mono_ns"])) / 1e9
        _record(f"real driver, report: crossing reported within {seconds * 1000:.0f} ms, nothing killed")
        time.sleep(1.0)
        assert greedy.poll() is None, "report must never kill"
        assert enforcer.stats.actions == {("report", "", "", "cuda"): 1}, reported
    finally:
        enforcer.stop()
