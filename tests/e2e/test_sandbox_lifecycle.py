"""`vgpu sandbox` as a person uses it: bad input is refused cleanly and `down` leaves nothing behind.

These start their own small sandboxes (through the real CLI) beside the session one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vgpu_sandbox import procs
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.errors import SandboxError

from tests import support

pytestmark = pytest.mark.e2e


def vgpu(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return support.vgpu(*args, env=env, timeout=timeout)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder short enough for the nodes' unix sockets (pytest's own temp paths are too deep)."""
    with support.short_dir("vgpu-t-") as path:
        yield path


def listening_ports(state: dict) -> list[int]:  # type: ignore[type-arg]
    return [c["port"] for c in state["components"] if c.get("port") and procs.port_open(c["port"])]


def test_a_second_up_while_one_runs_is_refused_and_touches_nothing(sandbox: Sandbox) -> None:
    before = sandbox.running_pids()
    with pytest.raises(SandboxError, match="already running.*vgpu sandbox down"):
        Sandbox(sandbox.state_dir).up(Spec(nodes=1))
    assert sandbox.running_pids() == before
    assert sandbox.status()["healthy"]


def test_up_with_the_apiserver_port_taken_says_so_and_starts_nothing(short_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = vgpu(
            "sandbox", "--dir", str(short_dir / "sb"), "up", "--nodes", "1", "--apiserver-port", str(port)
        )
    assert result.returncode != 0
    assert f"port {port}" in result.stderr and "--apiserver-port" in result.stderr
    assert procs.tagged_pids((short_dir / "sb").resolve()) == []


def test_up_with_a_missing_binary_names_it_and_the_fix(short_dir: Path) -> None:
    empty = short_dir / "bin"
    (empty / "current").mkdir(parents=True)
    result = vgpu(
        "sandbox", "--dir", str(short_dir / "sb"), "up", "--nodes", "1", env={"VGPU_BIN_DIR": str(empty)}
    )
    assert result.returncode != 0
    assert "kube-apiserver" in result.stderr and "make setup" in result.stderr
    assert procs.tagged_pids((short_dir / "sb").resolve()) == []


def test_bad_sizes_are_refused_naming_the_flag(short_dir: Path) -> None:
    result = vgpu("sandbox", "--dir", str(short_dir / "sb"), "up", "--nodes", "0")
    assert result.returncode != 0 and "--nodes" in result.stderr
    result = vgpu("sandbox", "--dir", str(short_dir / "sb"), "up", "--gpu-memory", "12")
    assert result.returncode != 0 and "--gpu-memory" in result.stderr


def test_down_after_a_component_crash_leaves_no_process_and_no_port(short_dir: Path) -> None:
    sb_dir = short_dir / "crash"
    up = vgpu("sandbox", "--dir", str(sb_dir), "up", "--nodes", "2", "--control-plane-only")
    assert up.returncode == 0, up.stderr
    state = json.loads((sb_dir / "state.json").read_text())
    status = vgpu("sandbox", "--dir", str(sb_dir), "status", "--json")
    assert status.returncode == 0, status.stdout
    assert [n["ready"] for n in json.loads(status.stdout)["nodes"]] == [True, True]
    assert json.loads(status.stdout)["state"] == "healthy"
    # every port state.json records is shown, with what listens there
    text = vgpu("sandbox", "--dir", str(sb_dir), "status")
    assert text.returncode == 0 and text.stdout.startswith("sandbox healthy, started ")
    shown = {line.split()[0]: line.split()[1] for line in text.stdout.splitlines() if "://127.0.0.1:" in line}
    assert state["ports"] and {name: url.split(":")[-1].split("/")[0] for name, url in shown.items()} == {
        name: str(port) for name, port in state["ports"].items()
    }

    apiserver = next(c for c in state["components"] if c["name"] == "kube-apiserver")
    os.kill(apiserver["pid"], signal.SIGKILL)
    time.sleep(0.5)
    degraded = vgpu("sandbox", "--dir", str(sb_dir), "status")
    assert degraded.returncode != 0 and "DEAD" in degraded.stdout

    down = vgpu("sandbox", "--dir", str(sb_dir), "down")
    assert down.returncode == 0, down.stderr
    assert procs.tagged_pids(sb_dir.resolve()) == []
    assert listening_ports(state) == []
    # after a clean down: stopped, which is nothing wrong
    stopped = vgpu("sandbox", "--dir", str(sb_dir), "status")
    assert stopped.returncode == 0, stopped.stdout
    assert stopped.stdout.startswith("sandbox stopped at ") and "DEAD" not in stopped.stdout


def test_down_after_up_itself_was_killed_midway_leaves_nothing(short_dir: Path) -> None:
    sb_dir = (short_dir / "killed").resolve()
    up = subprocess.Popen(
        [*support.VGPU, "sandbox", "--dir", str(sb_dir), "up", "--nodes", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(procs.tagged_pids(sb_dir)) < 2:
            time.sleep(0.1)
        assert len(procs.tagged_pids(sb_dir)) >= 2, "up never got as far as starting two components"
    finally:
        up.kill()
        up.wait()
    assert procs.tagged_pids(sb_dir), "the components should outlive the killed `up`"
    down = vgpu("sandbox", "--dir", str(sb_dir), "down")
    assert down.returncode == 0, down.stderr
    assert procs.tagged_pids(sb_dir) == []


def test_a_state_folder_too_deep_for_unix_sockets_is_refused_before_anything_starts(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60)
    result = vgpu("sandbox", "--dir", str(deep), "up", "--nodes", "1")
    assert result.returncode != 0
    assert "too deep" in result.stderr and "--dir" in result.stderr
    assert procs.tagged_pids(deep.resolve()) == []


def test_the_demo_with_a_real_node_refuses_a_running_sandbox_without_one(sandbox: Sandbox) -> None:
    before = sandbox.running_pids()
    result = subprocess.run(
        [sys.executable, "-m", "vgpu_sandbox.demo", "--real-node", "--skip-playbook"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VGPU_SANDBOX_DIR": str(sandbox.state_dir)},
    )
    assert result.returncode == 1, result.stdout
    assert "REAL_NODE=1 needs a sandbox with the real node" in result.stderr
    assert "vgpu sandbox down" in result.stderr
    assert sandbox.running_pids() == before and sandbox.status()["healthy"]  # left as it was


def test_status_of_a_node_the_cluster_lacks_says_so_and_fails(sandbox: Sandbox) -> None:
    result = vgpu("status", f"--kubeconfig={sandbox.kubeconfig}", "--node", "nope")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("vgpu status: no such node: nope (the cluster has ")
    shown = vgpu("status", f"--kubeconfig={sandbox.kubeconfig}", "--node", "vgpu-node-0")
    assert shown.returncode == 0 and shown.stdout.startswith("node vgpu-node-0  lease ")
