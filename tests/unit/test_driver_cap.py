"""The driver's own memory cap (enforcement.driverCap): per container, on its real cgroup folder,
the calls the node makes to the (fake) NVML, in order: set from the grant when first seen, again
when the grant changes, cleared when its processes end (before the runtime removes the cgroup)
or its grant goes; a cgroup already gone is no error; a driver without the call fails nothing;
``required`` refuses a container no line holds.

The cgroup tree and /proc are folders of the test (as the other monitor tests do): the scan reads
``cgroup.procs``, ``cgroup.events`` and ``/proc/<pid>/mountinfo`` as it reads the host's.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

import pytest
import yaml

from vgpu.core.errors import ConfigError
from vgpu.hookabi.grant import Grant, write_grant
from vgpu.monitor.cgroupscan import CgroupScan
from vgpu.monitor.drivercap import REFUSED_REASON, DriverCap
from vgpu.monitor.hostview import Held, Owner, View
from vgpu.monitor.lines import memory_lines
from vgpu.node.config import parse_node_config
from vgpu.node.fake_memcap import CapCall, FakeCaps, read_log
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.memcap import LIMIT_MAX, CapError, NvmlCaps, _Get, _Set
from vgpu.node.paths import REGION_FILE_NAME, HostPaths

MIB = 1 << 20
UID_A = "0f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
UID_B = "1f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
CID_A, CID_B, CID_PAUSE = "a" * 64, "b" * 64, "c" * 64


class Node:
    """A node's folders: grants, a cgroup v2 tree (systemd driver) and /proc."""

    def __init__(self, tmp: Path, gpus: list[dict[str, object]]) -> None:
        self.paths = HostPaths(tmp / "root")
        self.paths.grants_dir.mkdir(parents=True)
        self.cgroups = tmp / "cgroup"
        self.proc = tmp / "proc"
        self.gpus = tmp / "gpus.yaml"
        self.log = tmp / "caps.jsonl"
        self.gpus.write_text(yaml.safe_dump({"gpus": gpus, "memoryLimitsLog": str(self.log)}))
        self.discovery = FakeDiscovery(self.gpus)
        self.scan = CgroupScan(self.cgroups, self.paths.grants_dir, proc=self.proc)
        dev = os.stat(self.paths.grants_dir).st_dev
        self.device = f"{os.major(dev)}:{os.minor(dev)}"

    def pod_folder(self, uid: str) -> Path:
        under = uid.replace("-", "_")
        return (
            self.cgroups / "kubepods.slice/kubepods-burstable.slice" / f"kubepods-burstable-pod{under}.slice"
        )

    def container(self, uid: str, cid: str, pid: int, grant: str | None) -> Path:
        """A running container: its cgroup folder holding ``pid``, whose mounts name ``grant``."""
        folder = self.pod_folder(uid) / f"cri-containerd-{cid}.scope"
        folder.mkdir(parents=True)
        (folder / "cgroup.procs").write_text(f"{pid}\n")
        (folder / "cgroup.events").write_text("populated 1\nfrozen 0\n")
        (folder / "cgroup.max.depth").write_text("max\n")  # an interface file, as the real folder has
        (self.proc / str(pid)).mkdir(parents=True)
        mounts = "22 1 0:21 / /proc rw - proc proc rw\n"
        if grant is not None:
            mounts += (
                f"40 22 {self.device} /var/lib/vgpu/grants/{grant}.limits /etc/vgpu/limits ro,relatime "
                "- ext4 /dev/sda1 rw\n"
            )
        (self.proc / str(pid) / "mountinfo").write_text(mounts)
        return folder

    def grant(self, name: str, limits: dict[str, int]) -> None:
        write_grant(self.paths.grant(name), Grant(tuple(limits), tuple(v * MIB for v in limits.values())))

    def cap(self, **kw: object) -> DriverCap:
        return DriverCap("n1", self.paths, self.discovery, self.scan, **kw)  # type: ignore[arg-type]

    def calls(self) -> list[tuple[str, str, str, int, int, str]]:
        return [
            (c.op, c.uuid, Path(c.cgroup).name, c.soft, c.hard, c.result) for c in self.discovery.caps.calls
        ]


CAPPED = [
    {"uuid": "GPU-a", "memoryMiB": 81559, "driverMemoryLimits": True},
    {"uuid": "GPU-b", "memoryMiB": 81559, "driverMemoryLimits": True},
]
OLD_DRIVER = [{"uuid": "GPU-a", "memoryMiB": 81559}, {"uuid": "GPU-b", "memoryMiB": 81559}]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path, CAPPED)


def test_the_scan_finds_each_vgpu_containers_cgroup_and_grant_and_only_those(node: Node) -> None:
    a = node.container(UID_A, CID_A, 101, f"{UID_A}_cuda")
    node.container(UID_A, CID_PAUSE, 102, None)  # the pod's sandbox: no grant mounted
    # a container whose processes live in a child folder (cgroup v2: none in a folder with children)
    b = node.container(UID_B, CID_B, 201, f"{UID_B}_main")
    (b / "cgroup.procs").write_text("")
    (b / "inner").mkdir()
    (b / "inner" / "cgroup.procs").write_text("201\n")
    # a host's own folders are not walked into (user sessions, services)
    stray = node.cgroups / "user.slice" / "user-0.slice" / f"cri-containerd-{'d' * 64}.scope"
    stray.mkdir(parents=True)
    (stray / "cgroup.procs").write_text("101\n")
    found = node.scan.scan()
    assert [(Path(c.folder), c.grant, c.populated) for c in found] == [
        (a, f"{UID_A}_cuda", True),
        (b, f"{UID_B}_main", True),
    ]


def test_a_container_is_capped_per_card_from_its_grant_once_then_again_when_the_grant_changes(
    node: Node,
) -> None:
    folder = node.container(UID_A, CID_A, 101, f"{UID_A}_cuda")
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1000, "GPU-b": 0})  # no limit on GPU-b: nothing to cap there
    cap = node.cap()
    cap.run_pass()
    cap.run_pass()  # nothing new: no call
    assert node.calls() == [("set", "GPU-a", folder.name, 0, 1000 * MIB, "ok")]
    assert node.discovery.get_memory_limits("GPU-a", str(folder)).hard == 1000 * MIB
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1500, "GPU-b": 0})  # a live resize
    cap.run_pass()
    assert node.calls()[-1] == ("set", "GPU-a", folder.name, 0, 1500 * MIB, "ok")
    assert memory_lines(node.paths, cap, None) == {f"{UID_A}_cuda": ["driver-cap"]}
    # the calls as another process (the sandbox's plugin) wrote them to memoryLimitsLog
    assert read_log(node.log)[0] == CapCall("set", "GPU-a", str(folder), 0, 1000 * MIB, "ok")


def test_the_cap_is_cleared_when_the_containers_processes_end_before_its_cgroup_goes(node: Node) -> None:
    folder = node.container(UID_A, CID_A, 101, f"{UID_A}_cuda")
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1000, "GPU-b": 2000})
    cap = node.cap()
    cap.run_pass()
    (folder / "cgroup.procs").write_text("")
    (folder / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    cap.run_pass()
    for _ in range(2):
        (folder / "cgroup.procs").unlink(missing_ok=True)
        (folder / "cgroup.events").unlink(missing_ok=True)
        (folder / "cgroup.max.depth").unlink(missing_ok=True)
        if folder.exists():
            folder.rmdir()  # the runtime removes it: nothing more is called
        cap.run_pass()
    assert node.calls() == [
        ("set", "GPU-a", folder.name, 0, 1000 * MIB, "ok"),
        ("set", "GPU-b", folder.name, 0, 2000 * MIB, "ok"),
        ("set", "GPU-a", folder.name, 0, LIMIT_MAX, "ok"),
        ("set", "GPU-b", folder.name, 0, LIMIT_MAX, "ok"),
    ]
    assert cap.stats.applied == {} and cap.stats.errors == {}


def test_a_cgroup_already_gone_and_a_grant_removed_are_cleared_without_error(node: Node) -> None:
    gone = node.container(UID_A, CID_A, 101, f"{UID_A}_cuda")
    kept = node.container(UID_B, CID_B, 201, f"{UID_B}_main")
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1000})
    node.grant(f"{UID_B}_main", {"GPU-b": 3000})
    cap = node.cap()
    cap.run_pass()
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()  # removed with its processes still listed: the driver cleared it with the cgroup
    node.paths.grant(f"{UID_B}_main").unlink()  # the pod's grant swept
    cap.run_pass()
    assert node.calls()[2:] == [
        ("set", "GPU-a", gone.name, 0, LIMIT_MAX, "not-found"),
        ("set", "GPU-b", kept.name, 0, LIMIT_MAX, "ok"),
    ]
    assert cap.stats.applied == {} and cap.stats.errors == {}


def test_a_driver_without_the_call_is_asked_nothing_and_reported_as_no_driver_cap(tmp_path: Path) -> None:
    node = Node(tmp_path, OLD_DRIVER)
    node.container(UID_A, CID_A, 101, f"{UID_A}_cuda")
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1000})
    cap = node.cap()
    cap.run_pass()
    assert node.calls() == []
    assert cap.stats.failed == {(f"{UID_A}_cuda", "GPU-a"): "missing"}
    assert memory_lines(node.paths, cap, None) == {f"{UID_A}_cuda": []}
    with pytest.raises(CapError) as err:  # and asked anyway, it answers as a 580 driver does
        node.discovery.set_memory_limits("GPU-a", str(tmp_path), 0, MIB)
    assert err.value.code == "missing"


def test_the_fake_refuses_as_nvml_does_without_root_and_on_a_mig_device(tmp_path: Path) -> None:
    caps = FakeCaps(frozenset({"GPU-a", "MIG-1"}), euid=lambda: 1000)
    with pytest.raises(CapError) as err:
        caps.set_memory_limits("GPU-a", str(tmp_path), 0, MIB)
    assert err.value.code == "no-permission" and "root" in str(err.value)
    with pytest.raises(CapError) as err:
        caps.set_memory_limits("MIG-1", str(tmp_path), 0, MIB)
    assert err.value.code == "not-supported" and not caps.memory_caps("MIG-1")
    root = FakeCaps(frozenset({"GPU-a"}), euid=lambda: 0)
    with pytest.raises(CapError) as err:
        root.set_memory_limits("GPU-a", str(tmp_path), 2 * MIB, MIB)  # soft above hard
    assert err.value.code == "invalid-argument"


def test_an_error_is_counted_once_per_limit_and_the_container_not_reported_capped(node: Node) -> None:
    node.discovery.caps.euid = lambda: 1000  # the monitor not root
    node.container(UID_A, CID_A, 101, f"{UID_A}_cuda")
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1000})
    cap = node.cap()
    cap.run_pass()
    cap.run_pass()  # refused once for this limit: not asked again every pass
    assert cap.stats.errors == {"no-permission": 1}
    assert memory_lines(node.paths, cap, None) == {f"{UID_A}_cuda": []}
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1200})  # a new limit is asked for
    cap.run_pass()
    assert cap.stats.errors == {"no-permission": 2} and len(node.calls()) == 2


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []
        self.evicted: list[tuple[str, str]] = []

    def pod_event(self, namespace: str, name: str, uid: str, reason: str, message: str, node: str) -> None:
        self.events.append((namespace, name, reason, message))

    def evict_pod(self, namespace: str, name: str) -> None:
        self.evicted.append((namespace, name))


def on_card(grant: str, uuid: str, pids: dict[int, int]) -> Held:
    uid, _, name = grant.partition("_")
    return Held(Owner(uid, name, "team", "greedy"), uuid, 1000 * MIB, {p: m * MIB for p, m in pids.items()})


def test_required_kills_a_container_no_line_holds_and_spares_one_the_hook_or_the_cap_holds(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, [{"uuid": "GPU-a", "memoryMiB": 81559, "driverMemoryLimits": True}, OLD_DRIVER[1]])
    node.container(UID_A, CID_A, 101, f"{UID_A}_cuda")
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1000, "GPU-b": 1000})
    node.grant(f"{UID_B}_main", {"GPU-b": 1000})
    hooked = node.paths.containers_dir / f"{UID_B}_main"
    hooked.mkdir(parents=True)
    view = View(
        [
            on_card(f"{UID_A}_cuda", "GPU-a", {101: 600}),  # capped there: held
            on_card(f"{UID_A}_cuda", "GPU-b", {101: 600}),  # a driver without the call, no hook: refused
            on_card(f"{UID_B}_main", "GPU-b", {201: 600}),  # its hook's region: held
        ],
        {},
    )
    (hooked / REGION_FILE_NAME).write_bytes(b"")
    killed: list[tuple[int, int]] = []
    api = Recorder()
    cap = node.cap(mode="required", view=lambda: view, actions=api, kill=lambda p, s: killed.append((p, s)))
    cap.run_pass()
    assert killed == [(101, signal.SIGKILL)]
    assert cap.stats.refusals == {"kill": 1}
    [(ns, pod, reason, message)] = api.events
    assert (ns, pod, reason) == ("team", "greedy", REFUSED_REASON)
    assert "GPU-b" in message and "missing" in message and "driverCap is required" in message
    # auto never refuses
    killed.clear()
    node.cap(mode="auto", view=lambda: view, kill=lambda p, s: killed.append((p, s))).run_pass()
    assert killed == []


def test_a_process_killed_already_is_not_refused_again_while_the_driver_still_lists_it(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, OLD_DRIVER)
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1000})
    view = View([on_card(f"{UID_A}_cuda", "GPU-a", {101: 600})], {})
    gone: set[int] = set()

    def kill(pid: int, _sig: int) -> None:
        if pid in gone:
            raise ProcessLookupError(3, "No such process")
        gone.add(pid)

    api = Recorder()
    cap = node.cap(mode="required", view=lambda: view, actions=api, kill=kill)
    cap.run_pass()
    cap.run_pass()  # the driver's list still names PID 101 for a moment
    assert cap.stats.refusals == {"kill": 1} and len(api.events) == 1


def test_required_evicts_once_where_enforcement_memory_is_evict(tmp_path: Path) -> None:
    node = Node(tmp_path, OLD_DRIVER)
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1000})
    view = View([on_card(f"{UID_A}_cuda", "GPU-a", {101: 600})], {})
    api = Recorder()
    cap = node.cap(mode="required", view=lambda: view, actions=api, refuse_with="evict")
    cap.run_pass()
    cap.run_pass()
    assert api.evicted == [("team", "greedy")] and cap.stats.refusals == {"evict": 1}


def test_required_waits_a_moment_for_a_container_whose_cgroup_is_not_found_yet(node: Node) -> None:
    node.grant(f"{UID_A}_cuda", {"GPU-a": 1000})
    view = View([on_card(f"{UID_A}_cuda", "GPU-a", {101: 600})], {})
    killed: list[int] = []
    cap = node.cap(mode="required", view=lambda: view, kill=lambda p, s: killed.append(p))
    cap.run_pass()
    assert killed == []  # the driver has the call: the next passes may cap it
    cap._first_seen = {k: v - 10 for k, v in cap._first_seen.items()}
    cap.run_pass()
    assert killed == [101]


def test_driver_cap_config_and_its_errors() -> None:
    assert parse_node_config("", "n", "c.yaml").driver_cap == "auto"
    assert parse_node_config("enforcement: {driverCap: required}", "n", "c.yaml").driver_cap == "required"
    assert (
        parse_node_config("enforcement: {driverCap: off}", "n", "c.yaml").driver_cap == "off"
    )  # YAML's false
    with pytest.raises(ConfigError) as err:
        parse_node_config("enforcement: {driverCap: strict}", "n", "c.yaml")
    assert "enforcement.driverCap" in str(err.value) and "required" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_node_config("nodes: {n: {enforcement: {driverCap: 1}}}", "n", "c.yaml")
    assert "nodes.n.enforcement.driverCap" in str(err.value)


def test_the_fake_gpu_files_cap_keys_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(
        yaml.safe_dump({"gpus": [{"uuid": "GPU-a", "memoryMiB": 1, "driverMemoryLimits": "yes"}]})
    )
    with pytest.raises(ConfigError, match=r"gpus\[0\]\.driverMemoryLimits"):
        FakeDiscovery(path)
    path.write_text(yaml.safe_dump({"gpus": [{"uuid": "GPU-a", "memoryMiB": 1}], "memoryLimitsLog": "caps"}))
    with pytest.raises(ConfigError, match="memoryLimitsLog"):
        FakeDiscovery(path)


class NvmlFailure(Exception):
    def __init__(self, value: int) -> None:
        self.value = value


class OldNvml:
    """pynvml as loaded on a driver before r615: the symbol is not there."""

    NVMLError = NvmlFailure

    @staticmethod
    def _nvmlGetFunctionPointer(name: str) -> object:
        raise NvmlFailure(13)  # NVML_ERROR_FUNCTION_NOT_FOUND


SEEN: list[tuple[bytes, int, int]] = []


@ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_Set))
def _set_limits(handle: int, limits: object) -> int:
    got = limits.contents  # type: ignore[attr-defined]
    SEEN.append((got.nameSpace, got.softLimit, got.hardLimit))
    return 4  # NVML_ERROR_NO_PERMISSION


class NewNvml(OldNvml):
    @staticmethod
    def _nvmlGetFunctionPointer(name: str) -> object:
        return _set_limits


def test_the_nvml_structs_are_nvml_h_s_and_a_580_driver_reads_as_missing() -> None:
    assert (ctypes.sizeof(_Set), ctypes.sizeof(_Get)) == (24, 32)
    caps = NvmlCaps(OldNvml, {"GPU-a": 1234}, mig=frozenset({"MIG-x"}))
    assert not caps.memory_caps("GPU-a") and not caps.memory_caps("MIG-x")
    with pytest.raises(CapError) as err:
        caps.set_memory_limits("GPU-a", "/sys/fs/cgroup/x", 0, MIB)
    assert err.value.code == "missing" and "r615" in str(err.value)

    new = NvmlCaps(NewNvml, {"GPU-a": 1234})
    assert new.memory_caps("GPU-a")
    with pytest.raises(CapError) as err:  # the struct reaches the driver's function as nvml.h lays it out
        new.set_memory_limits("GPU-a", "/sys/fs/cgroup/x", 0, 5 * MIB)
    assert SEEN == [(b"/sys/fs/cgroup/x", 0, 5 * MIB)]
    assert err.value.code == "no-permission" and "root" in str(err.value)


def test_only_a_cgroup_v2_hierarchy_is_walked(tmp_path: Path) -> None:
    from vgpu.monitor.cgroupscan import unified_root

    v1 = tmp_path / "v1"
    (v1 / "cpu" / "kubepods").mkdir(parents=True)
    (v1 / "cpu" / "cpu.shares").write_text("1024\n")
    assert unified_root(v1) is None
    assert CgroupScan(None, tmp_path).scan() == []
    (v1 / "unified").mkdir()
    (v1 / "unified" / "cgroup.controllers").write_text("cpu memory\n")
    assert unified_root(v1) == v1 / "unified"  # a hybrid host
    chart = tmp_path / "host"  # the chart mounts only the kubelet's part
    (chart / "kubepods.slice").mkdir(parents=True)
    (chart / "kubepods.slice" / "cgroup.controllers").write_text("cpu memory\n")
    assert unified_root(chart) == chart
