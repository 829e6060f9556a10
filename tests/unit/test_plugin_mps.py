"""MPS mode on the node (docs/mps.md): the config key, the inventory, the cards' MPS control daemons
(real processes of the fake control tool), and Allocate's answer on an MPS card."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import short_dir
from vgpu.core.annotations import SHARING_MPS, SHARING_TIMESLICE, ContainerAllocation, DeviceAllocation
from vgpu.core.errors import ConfigError
from vgpu.deviceplugin.answer import PodFailure, container_response
from vgpu.hookabi.grant import Grant, read_grant, write_grant
from vgpu.hookabi.layout import MPS_PIPE_IN_CONTAINER
from vgpu.hookabi.layout import SHARING_MPS as GRANT_MPS
from vgpu.hookabi.layout import SHARING_TIMESLICE as GRANT_TIMESLICE
from vgpu.node.config import NodeConfig, parse_node_config
from vgpu.node.devices import DeviceState
from vgpu.node.discovery import Card
from vgpu.node.mps import PID_FILE, MpsCollector, MpsDaemons, accepts, find_control
from vgpu.node.paths import HostPaths

CARDS = [Card(f"GPU-{c}", i, "H100", 80000) for i, c in enumerate("ab")]
MPS = NodeConfig(sharing_mode="mps")


def fake_control(folder: Path) -> Path:
    """An executable named nvidia-cuda-mps-control that runs the fake (vgpu/node/fake_mps.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "nvidia-cuda-mps-control"
    tool.write_text(f'#!/bin/sh\nexec {sys.executable} -m vgpu.node.fake_mps "$@"\n')
    tool.chmod(0o755)
    return tool


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[MpsDaemons]:
    tool = fake_control(tmp_path / "driver/usr/bin")
    # a short root: <root>/var/lib/vgpu/mps/<uuid>/pipe/control must fit a unix socket path
    with short_dir("vmps-") as short:
        d = MpsDaemons(HostPaths(short / "root"), str(tool), ["GPU-a", "GPU-b"])
        yield d
        d.stop()


def daemon_pid(d: MpsDaemons, uuid: str) -> int:
    return int((d.paths.mps_pipe(uuid) / PID_FILE).read_text())


# -- config and inventory ------------------------------------------------------------------------


def test_sharing_mode_is_read_per_node() -> None:
    text = "sharingMode: timeslice\nnodes:\n  gpu-7: {sharingMode: mps}\n"
    assert parse_node_config(text, "gpu-7", "cfg").sharing_mode == "mps"
    assert parse_node_config(text, "gpu-8", "cfg").sharing_mode == "timeslice"
    assert parse_node_config("", "gpu-8", "cfg").sharing_mode == "timeslice"


def test_a_bad_sharing_mode_names_the_field_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"nodes.gpu-7.sharingMode.*timeslice.*mps.*'spatial'"):
        parse_node_config("nodes:\n  gpu-7: {sharingMode: spatial}\n", "gpu-7", "cfg")


def test_mps_with_mig_on_demand_is_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"sharingMode.*migStrategy: dynamic"):
        parse_node_config("sharingMode: mps\nmigStrategy: dynamic\n", "n", "cfg")
    with pytest.raises(ConfigError, match=r"nodes.n.sharingMode"):
        parse_node_config("migStrategy: dynamic\nnodes:\n  n: {sharingMode: mps}\n", "n", "cfg")


def test_every_card_of_an_mps_node_is_an_mps_card_in_the_inventory() -> None:
    assert {d.sharing for d in DeviceState(CARDS, MPS).inventory().devices} == {SHARING_MPS}
    assert {d.sharing for d in DeviceState(CARDS, NodeConfig()).inventory().devices} == {SHARING_TIMESLICE}


# -- the daemons ---------------------------------------------------------------------------------


def test_each_card_gets_its_daemon_with_its_own_pipe_and_log(daemons: MpsDaemons) -> None:
    assert daemons.ensure() == {"GPU-a": True, "GPU-b": True}
    for uuid in ("GPU-a", "GPU-b"):
        pipe = daemons.paths.mps_pipe(uuid)
        assert accepts(pipe) and daemons.up(uuid)
        assert os.stat(pipe).st_mode & 0o777 == 0o755
        assert (daemons.paths.mps_log(uuid) / "control.log").read_text().count("Startup") == 1
    assert daemon_pid(daemons, "GPU-a") != daemon_pid(daemons, "GPU-b")
    env = daemons.env("GPU-a")
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(daemons.paths.mps_pipe("GPU-a"))
    assert env["PATH"].split(os.pathsep)[0] == str(Path(daemons.control_binary).parent)  # the server's
    daemons.library_dirs = ["/driver-root/usr/lib/x86_64-linux-gnu"]
    assert (
        daemons.env("GPU-a")["LD_LIBRARY_PATH"].split(os.pathsep)[0]
        == "/driver-root/usr/lib/x86_64-linux-gnu"
    )


def test_a_live_daemon_is_adopted_not_started_again(daemons: MpsDaemons, tmp_path: Path) -> None:
    daemons.ensure()
    pid = daemon_pid(daemons, "GPU-a")
    again = MpsDaemons(daemons.paths, daemons.control_binary, ["GPU-a"])  # the plugin restarted
    assert again.ensure() == {"GPU-a": True}
    assert daemon_pid(daemons, "GPU-a") == pid and again.restarts["GPU-a"] == 0
    assert (daemons.paths.mps_log("GPU-a") / "control.log").read_text().count("Startup") == 1


def test_a_dead_daemon_is_restarted_and_counted(daemons: MpsDaemons) -> None:
    daemons.ensure()
    pid = daemon_pid(daemons, "GPU-a")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while accepts(daemons.paths.mps_pipe("GPU-a")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemons.ensure()["GPU-a"]
    assert daemon_pid(daemons, "GPU-a") != pid
    assert daemons.restarts == {"GPU-a": 1, "GPU-b": 0}
    text = "\n".join(
        f"{s.name} {s.labels['uuid']} {s.value}"
        for m in MpsCollector("n", daemons).collect()
        for s in m.samples
    )
    assert "vgpu_mps_daemon_restarts_total GPU-a 1.0" in text
    assert "vgpu_mps_daemon_up GPU-b 1.0" in text


def test_stop_quits_each_daemon(daemons: MpsDaemons) -> None:
    daemons.ensure()
    daemons.stop()
    assert not accepts(daemons.paths.mps_pipe("GPU-a")) and not daemons.up("GPU-a")
    assert not (daemons.paths.mps_pipe("GPU-a") / PID_FILE).exists()


def test_a_daemon_that_cannot_start_is_down_with_the_reason(tmp_path: Path) -> None:
    with short_dir("vmps-") as short:
        d = MpsDaemons(HostPaths(short), str(tmp_path / "missing/nvidia-cuda-mps-control"), ["GPU-a"])
        assert d.ensure() == {"GPU-a": False}
        assert "cannot run" in d.errors["GPU-a"]


def test_a_pipe_too_long_for_a_unix_socket_is_refused_with_the_fix(tmp_path: Path) -> None:
    tool = fake_control(tmp_path / "driver/usr/bin")
    d = MpsDaemons(HostPaths(tmp_path / ("r" * 80)), str(tool), ["GPU-a"])
    assert d.ensure() == {"GPU-a": False}
    assert "longer than a unix socket path may be" in d.errors["GPU-a"] and "--root" in d.errors["GPU-a"]


def test_the_fake_answers_the_control_commands_from_stdin(daemons: MpsDaemons) -> None:
    daemons.ensure()

    def ask(command: str) -> str:
        done = subprocess.run(
            [daemons.control_binary], input=command, env=daemons.env("GPU-a"), capture_output=True, text=True
        )
        return done.stdout.strip()

    assert ask("get_default_active_thread_percentage\n") == "100.0"
    assert ask("set_default_active_thread_percentage 40\n") == "40.0"
    assert ask("get_default_active_thread_percentage\n") == "40.0"
    assert ask("get_server_list\n") == ""
    ask("quit\n")
    deadline = time.monotonic() + 5
    while accepts(daemons.paths.mps_pipe("GPU-a")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not accepts(daemons.paths.mps_pipe("GPU-a"))


def test_the_control_tool_is_found_where_the_driver_tools_are(tmp_path: Path) -> None:
    assert find_control(tmp_path) is None
    tool = fake_control(tmp_path / "usr/local/nvidia/bin")
    assert find_control(tmp_path) == tool


# -- Allocate on an MPS card ---------------------------------------------------------------------


@pytest.mark.parametrize("inject", ["plugin", "cdi", "runtime"])
def test_an_mps_card_gives_the_grant_the_pipe_and_the_variables(tmp_path: Path, inject: str) -> None:
    config = NodeConfig(sharing_mode="mps", driver_inject=inject)
    paths = HostPaths(tmp_path)
    container = ContainerAllocation("main", (DeviceAllocation("GPU-a", 3000, 30),))
    answer = container_response(DeviceState(CARDS, config), config, paths, None, "n", "uid1", container, "1")
    pipe = [m for m in answer.mounts if m.container_path == MPS_PIPE_IN_CONTAINER]
    assert len(pipe) == 1 and pipe[0].read_only and pipe[0].host_path == str(paths.mps_pipe("GPU-a"))
    assert answer.envs["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPE_IN_CONTAINER
    assert answer.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert answer.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    grant = read_grant(paths.grant("uid1_main"))
    assert grant.sharing == GRANT_MPS and grant.mps_pipe == MPS_PIPE_IN_CONTAINER
    assert grant.sm_limits == (30,) and grant.limits == (3000 << 20,)


def test_no_cores_asked_sets_no_thread_cap(tmp_path: Path) -> None:
    container = ContainerAllocation("main", (DeviceAllocation("GPU-a", 3000, 0),))
    answer = container_response(
        DeviceState(CARDS, MPS), MPS, HostPaths(tmp_path), None, "n", "u", container, "1"
    )
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in answer.envs
    assert read_grant(HostPaths(tmp_path).grant("u_main")).sm_limits == (0,)


def test_a_time_sliced_card_gets_no_mps(tmp_path: Path) -> None:
    config = NodeConfig()
    container = ContainerAllocation("main", (DeviceAllocation("GPU-a", 3000, 30),))
    answer = container_response(
        DeviceState(CARDS, config), config, HostPaths(tmp_path), None, "n", "u", container, "1"
    )
    assert not any(m.container_path == MPS_PIPE_IN_CONTAINER for m in answer.mounts)
    assert not any(k.startswith("CUDA_MPS_") for k in answer.envs)
    grant = read_grant(HostPaths(tmp_path).grant("u_main"))
    assert grant.sharing == GRANT_TIMESLICE and grant.mps_pipe == ""


def test_an_mps_container_on_two_cards_fails_with_the_fix(tmp_path: Path) -> None:
    container = ContainerAllocation(
        "main", (DeviceAllocation("GPU-a", 1000, 10), DeviceAllocation("GPU-b", 1000, 10))
    )
    with pytest.raises(PodFailure, match=r"one card.*nvidia.com/vgpu-mode: mps"):
        container_response(DeviceState(CARDS, MPS), MPS, HostPaths(tmp_path), None, "n", "u", container, "1")


def test_a_failing_daemon_is_down_with_what_it_said(tmp_path: Path) -> None:
    tool = tmp_path / "bin/nvidia-cuda-mps-control"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho 'An instance of this daemon is already running' >&2\nexit 1\n")
    tool.chmod(0o755)
    with short_dir("vmps-") as short:
        d = MpsDaemons(HostPaths(short), str(tool), ["GPU-a"])
        assert d.ensure() == {"GPU-a": False} and not d.up("GPU-a")
        assert "exited 1: An instance of this daemon is already running" in d.errors["GPU-a"]


# -- the servers' ceilings ----------------------------------------------------------------------


def _mps_grant(d: MpsDaemons, name: str, uuid: str, threads: int, mib: int, sharing: int = GRANT_MPS) -> None:
    write_grant(
        d.paths.grant(name),
        Grant(
            (uuid,),
            (mib << 20,),
            sm_limits=(threads,),
            sharing=sharing,
            mps_pipe=MPS_PIPE_IN_CONTAINER if sharing == GRANT_MPS else "",
        ),
    )


def test_each_cards_server_ceilings_follow_the_largest_mps_grant_on_it(daemons: MpsDaemons) -> None:
    """A client that never loads the hook (a static binary) gets the server's defaults: the
    largest grant on the card, never more, never below a live grant."""
    daemons.ensure()
    _mps_grant(daemons, "p1_main", "GPU-a", 30, 1000)
    _mps_grant(daemons, "p2_main", "GPU-a", 70, 2000)
    _mps_grant(daemons, "p3_main", "GPU-b", 0, 500)  # no thread cap asked: 100 %
    _mps_grant(daemons, "p4_main", "GPU-b", 90, 9000, sharing=0)  # time-sliced: not this card's
    daemons.hold_grants()
    assert daemons.ask("GPU-a", "get_default_active_thread_percentage") == "70.0"
    assert daemons.ask("GPU-a", "get_default_device_pinned_mem_limit 0") == "2000M"
    assert daemons.ask("GPU-b", "get_default_active_thread_percentage") == "100.0"
    assert daemons.ask("GPU-b", "get_default_device_pinned_mem_limit 0") == "500M"
    daemons.paths.grant("p2_main").unlink()  # the 70 % container left and was swept
    daemons.hold_grants()
    assert daemons.ask("GPU-a", "get_default_active_thread_percentage") == "30.0"
    assert daemons.ask("GPU-a", "get_default_device_pinned_mem_limit 0") == "1000M"


def test_at_allocate_the_ceilings_only_rise(daemons: MpsDaemons) -> None:
    """Allocate raises a card's ceilings to a new grant before its first client connects, and
    never lowers them there (a container may still be starting under the old ones)."""
    daemons.ensure()
    _mps_grant(daemons, "p1_main", "GPU-a", 60, 4000)
    daemons.hold_grants()
    daemons.paths.grant("p1_main").unlink()
    _mps_grant(daemons, "p2_main", "GPU-a", 80, 1000)
    daemons.hold_grants(only_up=True)
    assert daemons.ask("GPU-a", "get_default_active_thread_percentage") == "80.0"
    assert daemons.ask("GPU-a", "get_default_device_pinned_mem_limit 0") == "4000M"
    assert daemons.ceilings["GPU-a"] == (80, 4000)


def test_a_restarted_daemon_gets_its_ceilings_again(daemons: MpsDaemons) -> None:
    daemons.ensure()
    _mps_grant(daemons, "p1_main", "GPU-a", 40, 1500)
    daemons.hold_grants()
    os.kill(daemon_pid(daemons, "GPU-a"), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while accepts(daemons.paths.mps_pipe("GPU-a")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemons.ensure()["GPU-a"]
    daemons.hold_grants()
    assert daemons.ask("GPU-a", "get_default_active_thread_percentage") == "40.0"
    assert daemons.ask("GPU-a", "get_default_device_pinned_mem_limit 0") == "1500M"
