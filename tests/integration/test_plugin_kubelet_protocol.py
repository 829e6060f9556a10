"""The plugin on a real unix socket against a kubelet-protocol peer (the sandbox's kubelet stand-in).

The peer serves Registration, follows ListAndWatch and calls GetPreferredAllocation and Allocate
exactly as kubelet does. Pods come from an in-memory list here; test_plugin_apiserver.py runs
the same path against a real API server.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from vgpu_sandbox.kubelet import Kubelet

from tests.support import FakeKube, bound_pod, poll, short_dir
from vgpu.commands.device_plugin import plugin_monitor
from vgpu.core.annotations import (
    DEVICES_ANNOTATION,
    PHASE_ANNOTATION,
    decode_devices,
)
from vgpu.deviceplugin.daemon import Daemon
from vgpu.node.config import NodeConfig
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.paths import HostPaths

NODE = "node-a"
SPLIT = 3


def gpus_yaml(unhealthy: tuple[int, ...] = ()) -> str:
    return yaml.safe_dump(
        {
            "gpus": [
                {"uuid": f"GPU-{i}", "memoryMiB": 16000, "numa": i // 2, "healthy": i not in unhealthy}
                for i in range(4)
            ]
        }
    )


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short folder instead of pytest's: a unix socket path under it must stay within 107 bytes."""
    with short_dir("vgpu-dp-") as path:
        yield path


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Daemon, Kubelet, FakeKube, Path]]:
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(gpus_yaml())
    api = FakeKube()
    kubelet = Kubelet(NODE, tmp_path, None)
    kubelet.start()
    daemon = Daemon(
        NODE,
        "kube-system",
        HostPaths(tmp_path),
        NodeConfig(split=SPLIT),
        FakeDiscovery(gpus, poll_s=0.05),
        api,  # type: ignore[arg-type]
        None,
        monitor_factory=plugin_monitor(("127.0.0.1", 0)),
    )
    daemon.server.watch_interval_s = 0.1
    daemon.start()
    try:
        yield daemon, kubelet, api, gpus
    finally:
        daemon.stop()
        kubelet.stop()


def advertised(k: Kubelet) -> dict[str, str]:
    plugin = k.plugins.get("nvidia.com/gpu")
    return dict(plugin.devices) if plugin else {}


def test_the_plugin_registers_and_advertises_split_ids_per_card(node: Any) -> None:
    daemon, kubelet, _, _ = node
    assert kubelet.wait_for(lambda k: len(advertised(k)) == 4 * SPLIT, 10)
    plugin = kubelet.plugins["nvidia.com/gpu"]
    assert plugin.socket == daemon.paths.plugin_socket
    assert plugin.options.get_preferred_allocation_available
    assert set(advertised(kubelet)) == {f"GPU-{i}::{n}" for i in range(4) for n in range(SPLIT)}
    assert set(advertised(kubelet).values()) == {"Healthy"}


def test_a_card_turning_unhealthy_is_streamed_and_published(node: Any) -> None:
    daemon, kubelet, api, gpus = node
    assert kubelet.wait_for(lambda k: len(advertised(k)) == 4 * SPLIT, 10)
    gpus.write_text(gpus_yaml(unhealthy=(2,)))
    assert kubelet.wait_for(
        lambda k: (
            [i for i, h in advertised(k).items() if h == "Unhealthy"] == [f"GPU-2::{n}" for n in range(SPLIT)]
        ),
        10,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        inv = decode_devices(api.node_annotations(NODE).get(DEVICES_ANNOTATION, '{"version":1,"devices":[]}'))
        if [d.healthy for d in inv.devices] == [True, True, False, True]:
            break
        time.sleep(0.05)
    assert [d.healthy for d in inv.devices] == [True, True, False, True]
    assert len(api.lease_renewals("vgpu-node-a")) >= 1


def test_after_a_kubelet_restart_the_plugin_registers_again(node: Any, tmp_path: Path) -> None:
    daemon, kubelet, _, _ = node
    assert kubelet.wait_for(lambda k: len(advertised(k)) == 4 * SPLIT, 10)
    before = daemon.server.registrations
    kubelet.stop()
    again = Kubelet(NODE, tmp_path, None)
    again.start()  # removes the plugin's socket and recreates kubelet.sock, as kubelet does
    try:
        assert again.wait_for(lambda k: len(advertised(k)) == 4 * SPLIT, 10)
        # devices can arrive before the plugin's Register call has returned and counted itself
        assert poll(lambda: daemon.server.registrations > before, timeout=5, every=0.05)
        assert daemon.server.registrations == before + 1
        assert daemon.paths.plugin_socket.is_socket()
    finally:
        again.stop()


def test_a_kubelet_restart_puts_every_known_pod_in_one_batch_even_if_its_socket_keeps_its_inode(
    node: Any, tmp_path: Path
) -> None:
    # kubelet, restarted, admits the pods still waiting as one batch by creation time, not in
    # the order they were bound; the plugin must order them the same way from then on
    daemon, kubelet, _, _ = node
    assert kubelet.wait_for(lambda k: len(advertised(k)) == 4 * SPLIT, 10)
    daemon.arrivals.observe(["bound-first"])
    daemon.arrivals.observe(["bound-second"])
    assert daemon.arrivals.rank("bound-first") < daemon.arrivals.rank("bound-second")
    before = daemon.server.registrations
    # a new kubelet whose socket got the old inode number: only our removed socket tells
    daemon.paths.plugin_socket.unlink()
    deadline = time.monotonic() + 10
    while daemon.server.registrations == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.server.registrations == before + 1
    assert daemon.arrivals.rank("bound-first") == daemon.arrivals.rank("bound-second")


def test_allocate_over_the_socket_returns_the_scheduled_limits(node: Any) -> None:
    _, kubelet, api, _ = node
    assert kubelet.wait_for(lambda k: len(advertised(k)) == 4 * SPLIT, 10)
    uid = "uid-p"
    api.pods.append(
        bound_pod("p", NODE, {"main": [("GPU-1", 4000, 25)]}, uid=uid, created="2026-01-01T00:00:00Z")
    )
    response = kubelet.allocate_container(uid, "nvidia.com/gpu", 1)
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-1"
    assert response.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4000m"
    assert response.envs["CUDA_DEVICE_SM_LIMIT_0"] == "25"
    assert api.pods[0]["metadata"]["annotations"][PHASE_ANNOTATION] == "allocated"


def test_allocate_with_no_waiting_pod_is_a_clear_grpc_error(node: Any) -> None:
    _, kubelet, _, _ = node
    assert kubelet.wait_for(lambda k: len(advertised(k)) == 4 * SPLIT, 10)
    with pytest.raises(grpc.RpcError) as info:
        kubelet.allocate_container("uid-x", "nvidia.com/gpu", 1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no pod bound to node node-a" in (info.value.details() or "")


def test_the_monitor_serves_per_card_metrics(node: Any) -> None:
    daemon, _, _, _ = node
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{daemon.monitor_port}/metrics", timeout=10).read().decode()
    )
    assert (
        'vgpu_card_memory_total_bytes{index="0",model="Fake GPU",node="node-a",uuid="GPU-0"} 1.6777216e+10'
        in body
    )
    assert 'vgpu_card_healthy{index="3",model="Fake GPU",node="node-a",uuid="GPU-3"} 1.0' in body


def test_a_refusing_kubelet_is_retried_with_backoff_until_it_accepts(tmp_path: Path) -> None:
    from concurrent import futures

    from vgpu.deviceplugin.api import api_pb2, api_pb2_grpc

    class Refusing(api_pb2_grpc.RegistrationServicer):
        def __init__(self) -> None:
            self.calls = 0
            self.accept = False

        def Register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
            self.calls += 1
            if not self.accept:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, "resource already registered")
            return api_pb2.Empty()

    paths = HostPaths(tmp_path)
    paths.kubelet_dir.mkdir(parents=True)
    peer = Refusing()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_RegistrationServicer_to_server(peer, server)
    server.add_insecure_port(f"unix://{paths.kubelet_socket}")
    server.start()
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(gpus_yaml())
    daemon = Daemon(
        NODE,
        "kube-system",
        paths,
        NodeConfig(split=SPLIT),
        FakeDiscovery(gpus),
        FakeKube(),
        None,  # type: ignore[arg-type]
    )
    daemon.server.watch_interval_s = 0.05
    daemon.start()
    try:
        time.sleep(3.2)
        assert 2 <= peer.calls <= 3  # at 0 s, 1 s, 3 s: not once per 50 ms watcher round
        assert daemon.server.registrations == 0
        peer.accept = True
        deadline = time.monotonic() + 10
        while daemon.server.registrations == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.server.registrations == 1
    finally:
        daemon.stop()
        server.stop(0)
