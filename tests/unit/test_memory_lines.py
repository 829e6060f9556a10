"""What holds each container (hook, driver cap, node) and its media engines' use: from the fake
NVML's per-process files, through the host view, to /metrics, the Lease and ``vgpu status``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry, generate_latest

from tests.unit.test_status import NOW, lease, node, pod
from vgpu.commands.device_plugin import plugin_monitor
from vgpu.commands.status import build_status, render_text
from vgpu.core.annotations import CODEC_ANNOTATION, LINES_ANNOTATION
from vgpu.hookabi.grant import Grant, write_grant
from vgpu.monitor.cgroup import start_time
from vgpu.monitor.collector import NodeCollector
from vgpu.monitor.enforce import Enforcer
from vgpu.monitor.hostview import HostView
from vgpu.monitor.lines import LinesCollector, lease_annotations
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState
from vgpu.node.discovery import Codec, GpuProcess
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.nvml import _mean_codec
from vgpu.node.paths import REGION_FILE_NAME, HostPaths

MIB = 1 << 20
UID_A = "0f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
UID_B = "1f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
CID_A, CID_B = "a" * 64, "b" * 64


def test_the_fake_nvml_gives_a_process_its_codec_samples_from_its_codec_file(tmp_path: Path) -> None:
    procs = tmp_path / "procs"
    procs.mkdir()
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(
        yaml.safe_dump(
            {
                "gpus": [{"uuid": "GPU-a", "memoryMiB": 1000}, {"uuid": "GPU-b", "memoryMiB": 1000}],
                "processDir": str(procs),
            }
        )
    )
    me = f"{os.getpid()}@{start_time(os.getpid())}"
    (procs / me).write_text("GPU-a 1048576\n1 2097152\n")
    (procs / f"{me}.codec").write_text("GPU-a 12 0 30 0\n1 7 3\n")
    fake = FakeDiscovery(gpus)
    assert fake.processes("GPU-a") == [GpuProcess(os.getpid(), MIB, codec=Codec(12, 0, 30, 0))]
    assert fake.processes("GPU-b") == [GpuProcess(os.getpid(), 2 * MIB, codec=Codec(7, 3))]  # by index
    (procs / f"{me}.codec").write_text("GPU-a 12 0 300 0\n")  # no such percent: no sample
    assert fake.processes("GPU-a") == [GpuProcess(os.getpid(), MIB)]


def test_nvmls_samples_average_per_process_and_jpg_ofa_only_where_given() -> None:
    assert _mean_codec([(10, 0, 40, 0), (20, 2, 60, 0)]) == Codec(15, 1, 50, 0)
    assert _mean_codec([(10, 4), (20, 2)]) == Codec(15, 3)
    assert Codec(1, 2, 3, 4) + Codec(1, 1) == Codec(2, 3, None, None)


class Source:
    def __init__(self, procs: list[GpuProcess]) -> None:
        self.procs = procs

    def processes(self, uuid: str) -> list[GpuProcess] | None:
        return self.procs if uuid == "GPU-a" else []


def proc_tree(root: Path, pid: int, cgroup: str) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "cgroup").write_text(cgroup)
    (root / str(pid) / "stat").write_text(f"{pid} (t) S " + " ".join(["0"] * 18) + f" {1000 + pid} 0 0\n")


def pods(_node: str) -> list[dict[str, object]]:
    return [
        {
            "metadata": {"uid": uid, "namespace": "media", "name": name},
            "status": {"containerStatuses": [{"name": "main", "containerID": f"containerd://{cid}"}]},
        }
        for uid, cid, name in ((UID_A, CID_A, "decoder"), (UID_B, CID_B, "plain"))
    ]


def test_a_containers_codec_and_lines_reach_the_metrics_and_the_lease(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path / "root")
    paths.grants_dir.mkdir(parents=True)
    for uid in (UID_A, UID_B):
        write_grant(paths.grant(f"{uid}_main"), Grant(("GPU-a",), (1000 * MIB,)))
    hooked = paths.containers_dir / f"{UID_A}_main"
    hooked.mkdir(parents=True)
    (hooked / REGION_FILE_NAME).write_bytes(b"")  # the hook's first process made it
    proc = tmp_path / "proc"
    proc_tree(proc, 101, f"0::/kubepods/burstable/pod{UID_A}/{CID_A}\n")
    proc_tree(proc, 102, f"0::/kubepods/burstable/pod{UID_A}/{CID_A}\n")
    proc_tree(proc, 201, f"0::/kubepods/burstable/pod{UID_B}/{CID_B}\n")
    source = Source(
        [
            GpuProcess(101, 100 * MIB, 5, Codec(40, 0, 10, 0)),
            GpuProcess(102, 100 * MIB, 5, Codec(25, 0, 5, 0)),
            GpuProcess(201, 100 * MIB, 50),  # no media engine sampled
        ]
    )
    view = HostView("n1", paths, source, lambda: ["GPU-a"], pods, proc)
    enforcer = Enforcer("n1", view, "kill", 0)
    enforcer.run_pass()
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(yaml.safe_dump({"gpus": [{"uuid": "GPU-a", "memoryMiB": 1000}]}))
    fake = FakeDiscovery(gpus)
    collector = NodeCollector("n1", DeviceState(fake.cards(), NodeConfig()), fake, paths, list_pods=pods)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LinesCollector(collector, None, enforcer))
    text = generate_latest(registry).decode()
    a = f'namespace="media",node="n1",pod="decoder",pod_uid="{UID_A}"'
    assert f'vgpu_container_memory_line{{container="main",line="hook",{a}}} 1.0' in text
    assert f'vgpu_container_memory_line{{container="main",line="driver-cap",{a}}} 0.0' in text
    assert f'vgpu_container_memory_line{{container="main",line="node",{a}}} 1.0' in text
    assert f'vgpu_container_decoder_utilization_ratio{{container="main",{a},uuid="GPU-a"}} 0.65' in text
    assert f'vgpu_container_jpeg_utilization_ratio{{container="main",{a},uuid="GPU-a"}} 0.15' in text
    assert 'line="hook",namespace="media",node="n1",pod="plain"' in text
    assert 'pod="plain",pod_uid' not in text.split("vgpu_container_decoder_utilization_ratio")[1]

    annotations = lease_annotations(paths, None, enforcer)
    assert json.loads(annotations[LINES_ANNOTATION]) == {
        f"{UID_A}_main": ["hook", "node"],
        f"{UID_B}_main": ["node"],
    }
    assert json.loads(annotations[CODEC_ANNOTATION]) == {
        f"{UID_A}_main": {"GPU-a": {"dec": 65, "enc": 0, "jpg": 15, "ofa": 0}}
    }
    # enforcement.memory: report holds nothing: the node line is not claimed
    reporting = Enforcer("n1", view, "report", 0)
    reporting.run_pass()
    assert json.loads(lease_annotations(paths, None, reporting)[LINES_ANNOTATION])[f"{UID_B}_main"] == []


def test_vgpu_status_shows_the_lines_and_the_engines_the_lease_reports() -> None:
    a = pod("a", [("GPU-a", 3000, 30)], "allocated")
    a["metadata"]["uid"] = "uid-a"
    b = pod("b", [("GPU-a", 1000, 0)], "allocated")
    b["metadata"]["uid"] = "uid-b"
    reported = lease("2026-01-01T11:59:50Z")
    reported["metadata"]["annotations"] = {
        LINES_ANNOTATION: json.dumps({"uid-a_main": ["hook", "driver-cap", "node"], "uid-b_main": []}),
        CODEC_ANNOTATION: json.dumps({"uid-a_main": {"GPU-a": {"dec": 12, "enc": 0, "jpg": 30}}}),
    }
    [status] = build_status([node("n1")], [a, b], [reported], NOW)
    text = render_text([status])
    assert (
        "ml/a main  3000 MiB  cores 30%  allocated  held by hook+driver-cap+node  dec 12% enc 0% jpg 30%"
        in text
    )
    assert "ml/b main  1000 MiB  cores uncapped  allocated  held by none" in text
    for bad in ("{not json", "[1]", '{"uid-a_main": "hook"}'):
        reported["metadata"]["annotations"] = {LINES_ANNOTATION: bad, CODEC_ANNOTATION: bad}
        [status] = build_status([node("n1")], [a], [reported], NOW)
        assert "held by" not in render_text([status]) and " dec " not in render_text([status])


def test_the_plugins_lease_carries_the_lines_and_engines_of_its_monitor(tmp_path: Path) -> None:
    from tests.support import FakeKube
    from vgpu.deviceplugin.daemon import Daemon

    procs = tmp_path / "procs"
    procs.mkdir()
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(
        yaml.safe_dump(
            {
                "gpus": [{"uuid": "GPU-a", "memoryMiB": 1000, "driverMemoryLimits": True}],
                "processDir": str(procs),
            }
        )
    )
    paths = HostPaths(tmp_path / "root")
    paths.grants_dir.mkdir(parents=True)
    write_grant(paths.grant(f"{UID_A}_main"), Grant(("GPU-a",), (500 * MIB,)))
    write_grant(paths.grant(f"{UID_B}_main"), Grant(("GPU-a",), (500 * MIB,)))  # not started: left out
    (paths.containers_dir / f"{UID_A}_main").mkdir(parents=True)
    (paths.containers_dir / f"{UID_A}_main" / REGION_FILE_NAME).write_bytes(b"")  # its hook started
    api = FakeKube()
    daemon = Daemon(
        "n1",
        "kube-system",
        paths,
        NodeConfig(),
        FakeDiscovery(gpus),
        api,
        None,
        monitor_factory=plugin_monitor(None, None),
    )
    assert daemon.monitor.driver_cap is not None and daemon.monitor.enforcer is not None
    daemon.reporter.renew()
    [(_, _, annotations)] = api.renewals
    assert annotations is not None
    assert json.loads(annotations[LINES_ANNOTATION]) == {f"{UID_A}_main": ["hook", "node"]}
    assert json.loads(annotations[CODEC_ANNOTATION]) == {}


def test_required_without_the_drivers_process_list_stops_the_node_at_start_and_off_builds_nothing(
    tmp_path: Path,
) -> None:
    import pytest

    from vgpu.core.errors import ConfigError
    from vgpu.monitor.service import NodeMonitor

    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(yaml.safe_dump({"gpus": [{"uuid": "GPU-a", "memoryMiB": 1000}]}))  # no processDir
    fake = FakeDiscovery(gpus)
    paths = HostPaths(tmp_path / "root")
    for mode, built in (("off", False), ("auto", True)):
        state = DeviceState(fake.cards(), NodeConfig(driver_cap=mode))
        assert (NodeMonitor("n1", state, fake, paths, arbiter=None).driver_cap is not None) == built
    with pytest.raises(ConfigError) as err:
        NodeMonitor(
            "n1", DeviceState(fake.cards(), NodeConfig(driver_cap="required")), fake, paths, arbiter=None
        )
    assert "enforcement.driverCap" in str(err.value) and "processDir" in str(err.value)
