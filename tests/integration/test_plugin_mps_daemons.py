"""The device plugin of a ``sharingMode: mps`` node (docs/mps.md), on real sockets against the
sandbox's kubelet-protocol peer, with the fake MPS control tool as the driver's: each card's daemon
runs before kubelet hears of the card, is restarted when it dies (metrics say so), and a card whose
daemon cannot start is advertised unhealthy until it can."""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from vgpu_sandbox.kubelet import Kubelet

from tests.support import FakeKube, short_dir
from vgpu.commands.device_plugin import plugin_monitor
from vgpu.core.annotations import DEVICES_ANNOTATION, SHARING_MPS, decode_devices
from vgpu.deviceplugin.daemon import Daemon
from vgpu.node.config import NodeConfig
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.mps import PID_FILE, accepts
from vgpu.node.paths import HostPaths

NODE = "node-m"
CARDS = ("GPU-0", "GPU-1")


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    with short_dir("vgpu-mps-") as path:
        yield path


def install_tool(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {sys.executable} -m vgpu.node.fake_mps "$@"\n')
    path.chmod(0o755)


def start(tmp_path: Path, tool: Path) -> tuple[Daemon, Kubelet, FakeKube]:
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(yaml.safe_dump({"gpus": [{"uuid": u, "memoryMiB": 16000} for u in CARDS]}))
    api = FakeKube()
    kubelet = Kubelet(NODE, tmp_path, None)
    kubelet.start()
    daemon = Daemon(
        NODE,
        "kube-system",
        HostPaths(tmp_path),
        NodeConfig(split=2, sharing_mode="mps"),
        FakeDiscovery(gpus, poll_s=0.05),
        api,  # type: ignore[arg-type]
        None,
        monitor_factory=plugin_monitor(("127.0.0.1", 0)),
        mps_control=str(tool),
    )
    daemon.server.watch_interval_s = 0.1
    daemon.start()
    return daemon, kubelet, api


def health(k: Kubelet) -> dict[str, str]:
    plugin = k.plugins.get("nvidia.com/gpu")
    return dict(plugin.devices) if plugin else {}


def metrics(daemon: Daemon) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.monitor_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def test_each_card_has_its_daemon_before_kubelet_hears_of_it_and_a_dead_one_is_restarted(
    tmp_path: Path,
) -> None:
    tool = tmp_path / "driver/usr/bin/nvidia-cuda-mps-control"
    install_tool(tool)
    daemon, kubelet, api = start(tmp_path, tool)
    paths = daemon.paths
    try:
        # started synchronously in start(), before the plugin's socket: up the moment kubelet can see
        assert all(accepts(paths.mps_pipe(u)) for u in CARDS)
        assert kubelet.wait_for(lambda k: set(health(k).values()) == {"Healthy"} and len(health(k)) == 4, 10)
        inventory = decode_devices(api.node_annotations(NODE).get(DEVICES_ANNOTATION))
        assert [d.sharing for d in inventory.devices] == [SHARING_MPS, SHARING_MPS]
        text = metrics(daemon)
        assert 'vgpu_mps_daemon_up{node="node-m",uuid="GPU-0"} 1.0' in text
        pid = int((paths.mps_pipe("GPU-0") / PID_FILE).read_text())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if 'vgpu_mps_daemon_restarts_total{node="node-m",uuid="GPU-0"} 1.0' in metrics(daemon):
                break
            time.sleep(0.2)
        assert 'vgpu_mps_daemon_restarts_total{node="node-m",uuid="GPU-0"} 1.0' in metrics(daemon)
        assert accepts(paths.mps_pipe("GPU-0"))
        assert int((paths.mps_pipe("GPU-0") / PID_FILE).read_text()) != pid
    finally:
        daemon.stop()
        kubelet.stop()
        if daemon.mps is not None:
            daemon.mps.stop()


def test_a_card_whose_daemon_cannot_start_is_unhealthy_until_it_can(tmp_path: Path) -> None:
    tool = tmp_path / "driver/usr/bin/nvidia-cuda-mps-control"  # not there yet
    daemon, kubelet, _ = start(tmp_path, tool)
    try:
        assert kubelet.wait_for(
            lambda k: len(health(k)) == 4 and set(health(k).values()) == {"Unhealthy"}, 10
        )
        assert 'vgpu_mps_daemon_up{node="node-m",uuid="GPU-1"} 0.0' in metrics(daemon)
        install_tool(tool)  # the driver's tool appears (or the fix is made): the next check starts it
        assert kubelet.wait_for(lambda k: set(health(k).values()) == {"Healthy"}, 10)
    finally:
        daemon.stop()
        kubelet.stop()
        if daemon.mps is not None:
            daemon.mps.stop()
