"""``enforcement.driverCap: required`` with real processes: on a card whose driver has no cap (the
580 drivers of our GPU machines: the fake NVML without ``driverMemoryLimits``), a container the
driver shows on the card with no hook region is killed, even within its grant; one whose hook
made its region is left alone; with ``auto`` nobody is.

Real parts as in test_enforce_bypass.py: ``t_bypass`` allocates through the stub driver past the
hook, each process in a real cgroup named as the kubelet names a container's, the stub records
its memory where the fake NVML reads it, and the memory enforcer (``report``: it stops nothing)
gives the driver cap its view. Needs root (cgroups); skipped otherwise, saying why.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hook_harness import Built, build, env

from tests.support import wait_for
from tests.support.cgroups import StubNode, granted_container, stub_node
from vgpu.plugin.monitor.cgroupscan import CgroupScan
from vgpu.plugin.monitor.drivercap import DriverCap
from vgpu.plugin.monitor.enforce import Enforcer
from vgpu.plugin.monitor.hostview import HostView
from vgpu.plugin.monitor.lines import memory_lines
from vgpu.plugin.paths import REGION_FILE_NAME

MIB = 1 << 20
CARD = "GPU-3f1c0d6e-0000-4000-8000-00000000ca90"


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


class Node(StubNode):
    def container(self, hooked: bool) -> tuple[str, Path]:
        """A pod's container granted 1000 MiB; ``hooked``: its hook made its region."""
        pod_uid, cgroup = granted_container(self.paths, self.cgroups, "cuda", CARD, 1000 * MIB)
        if hooked:
            folder = self.paths.containers_dir / f"{pod_uid}_cuda"
            folder.mkdir(parents=True)
            (folder / REGION_FILE_NAME).write_bytes(b"")
        return pod_uid, cgroup

    def allocate(self, built: Built, cgroup: Path) -> subprocess.Popen[str]:
        """300 MiB through the stub driver, within the grant, then held."""
        environ = env(built, STUB_CUDA_PROCESS_DIR=str(self.procs), NVIDIA_VISIBLE_DEVICES=CARD)
        child = self.spawn(cgroup, [built.prog("t_bypass"), "200", "300"], environ)
        assert child.stdout is not None
        assert child.stdout.readline().startswith("below")
        return child


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with stub_node(Node, tmp_path, CARD) as made:
        yield made


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_required_kills_the_container_no_line_holds_and_auto_kills_nobody(
    built: Built, node: Node, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    bare_uid, bare_cg = node.container(hooked=False)
    hooked_uid, hooked_cg = node.container(hooked=True)
    view = HostView("n1", node.paths, node.discovery, lambda: [CARD])
    enforcer = Enforcer("n1", view, "report", 256 * MIB, interval_s=0.1)
    cap = DriverCap(
        "n1",
        node.paths,
        node.discovery,
        CgroupScan(node.cgroups, node.paths.grants_dir),
        mode=mode,
        interval_s=0.1,
        view=lambda: enforcer.stats.view,
    )
    enforcer.start()
    cap.start()
    try:
        with caplog.at_level(logging.WARNING):
            bare = node.allocate(built, bare_cg)
            hooked = node.allocate(built, hooked_cg)
            if mode == "required":
                wait_for(lambda: bare.poll() is not None, "the unheld container's process to be killed", 5)
                assert bare.returncode == -9
            time.sleep(1.0)  # more passes: the hooked one stays
        assert hooked.poll() is None
        assert (bare.poll() is None) == (mode == "auto")
        assert cap.stats.refusals == ({"kill": 1} if mode == "required" else {})
        if mode == "required":
            line = next(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
            assert "no hook region" in line and "missing" in line and CARD in line, line
        assert node.discovery.caps.calls == []  # a 580-like driver is never asked to cap
        lines = memory_lines(node.paths, cap, enforcer)
        assert lines[f"{hooked_uid}_cuda"] == ["hook"] and lines[f"{bare_uid}_cuda"] == []
    finally:
        cap.stop()
        enforcer.stop()
