"""The driver's memory cap with real processes. Where the card's (fake) driver caps cgroups
(``driverMemoryLimits``), the node sets the container's cap from its grant when its process
starts (found through its real cgroup and its real mountinfo: the grant bind-mounted at
/etc/vgpu/limits in a mount namespace of its own) and the stub driver refuses the allocation that
would take it past the grant, though the process bypasses the hook; cleared when the process
ends. ``enforcement.driverCap: required`` on a card whose driver has no cap (the 580 drivers of
our GPU machines): a container the driver shows on the card with no hook region is killed, even
within its grant; one whose hook made its region is left alone; with ``auto`` nobody is.

Real parts as in test_enforce_bypass.py: ``t_bypass`` allocates through the stub driver past the
hook, each process in a real cgroup named as the kubelet names a container's, the stub records
its memory where the fake NVML reads it, and the memory enforcer (``report``: it stops nothing)
gives the driver cap its view. Needs root (cgroups); skipped otherwise, saying why.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hook_harness import Built, build, env

from tests.support import wait_for
from tests.support.cgroups import StubNode, granted_container, stub_node
from vgpu.monitor.cgroupscan import CgroupScan
from vgpu.monitor.drivercap import DriverCap
from vgpu.monitor.enforce import Enforcer
from vgpu.monitor.hostview import HostView
from vgpu.monitor.lines import memory_lines
from vgpu.node.fake_memcap import CapCall
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.memcap import LIMIT_MAX
from vgpu.node.paths import REGION_FILE_NAME

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
        assert lines[f"{hooked_uid}_cuda"] == ["hook"]
        # held by none while it runs; once killed it holds nothing and is left out
        assert lines.get(f"{bare_uid}_cuda") == (None if mode == "required" else [])
    finally:
        cap.stop()
        enforcer.stop()


# A container's start as the runtime makes it: a mount namespace of its own with the grant
# bind-mounted at /etc/vgpu/limits (over an overlay of /etc, so the host's is left alone), then
# the process in its cgroup.
START = r"""
set -eu
mkdir "$T/up" "$T/work"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$T/up,workdir=$T/work" /etc
mkdir -p /etc/vgpu && : > /etc/vgpu/limits
mount --bind "$GRANT" /etc/vgpu/limits
echo $$ > "$CG/cgroup.procs"
exec "$@"
"""


def _mount_namespaces() -> str | None:
    """None where this machine lets the test mount a grant as a runtime does; else why not."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    with tempfile.TemporaryDirectory() as t:
        probe = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             f"mkdir {t}/u {t}/w && mount -t overlay overlay "
             f"-o lowerdir=/etc,upperdir={t}/u,workdir={t}/w /etc"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    return (
        None if probe.returncode == 0 else f"no mount namespace with an overlay on /etc here: {probe.stderr}"
    )


@pytest.mark.parametrize("capped", [True, False])
def test_the_drivers_cap_set_from_the_grant_refuses_the_allocation_past_it_and_is_cleared_at_the_end(
    built: Built, node: Node, tmp_path: Path, capped: bool
) -> None:
    why = _mount_namespaces()
    if why is not None:
        pytest.skip(why)
    gpus = tmp_path / "capped.yaml"
    card = {"uuid": CARD, "memoryMiB": 8192, "driverMemoryLimits": capped}
    gpus.write_text(yaml.safe_dump({"gpus": [card], "processDir": str(node.procs)}))
    node.discovery = FakeDiscovery(gpus)
    pod_uid, cgroup = node.container(hooked=False)
    cap = DriverCap(
        "n1", node.paths, node.discovery, CgroupScan(node.cgroups, node.paths.grants_dir), interval_s=0.05
    )
    cap.start()
    root = tempfile.mkdtemp(dir=tmp_path)
    environ = env(built, STUB_CUDA_PROCESS_DIR=str(node.procs), NVIDIA_VISIBLE_DEVICES=CARD)
    environ |= {"T": root, "GRANT": str(node.paths.grant(f"{pod_uid}_cuda")), "CG": str(cgroup)}
    try:
        child = subprocess.Popen(
            [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                START,
                "sh",
                built.prog("t_bypass"),
                "200",
                "3000",
            ],
            env=environ,
            stdout=subprocess.PIPE,
            text=True,
        )
        node.children.append(child)
        assert child.stdout is not None
        assert "rc=0" in child.stdout.readline()  # 200 MiB, within the grant
        crossed = child.stdout.readline()  # a second later: 3000 MiB past the hook
        set_call = CapCall("set", CARD, str(cgroup), 0, 1000 * MIB, "ok")
        if capped:
            assert "rc=2" in crossed, crossed  # CUDA_ERROR_OUT_OF_MEMORY: the driver's cap held
            assert node.discovery.caps.calls == [set_call]
            assert memory_lines(node.paths, cap, None)[f"{pod_uid}_cuda"] == ["driver-cap"]
        else:
            assert "rc=0" in crossed, crossed  # nothing held it: the control
            assert node.discovery.caps.calls == []
        child.kill()
        child.wait()
        if capped:  # its processes ended: cleared before the runtime would remove its cgroup
            clear = CapCall("set", CARD, str(cgroup), 0, LIMIT_MAX, "ok")
            wait_for(lambda: clear in node.discovery.caps.calls, "the cap to be cleared", 5)
            assert node.discovery.caps.calls == [set_call, clear]
            assert not (node.procs / "caps" / cgroup.name).exists()
    finally:
        cap.stop()  # the mounts were the namespace's: gone with its process
