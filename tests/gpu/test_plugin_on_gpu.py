"""The whole plugin on real NVML: kubelet sees the real cards and Allocate hands out a real UUID.

Runs with `pytest -m gpu` on a GPU machine; the kubelet peer is the sandbox's stand-in, the
pods are kept in memory (no API server on the GPU machine).
"""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from vgpu_sandbox.kubelet import Kubelet

from tests.support import FakeKube, bound_pod, short_dir
from vgpu.commands.device_plugin import plugin_monitor
from vgpu.core.annotations import PHASE_ANNOTATION
from vgpu.deviceplugin.daemon import Daemon
from vgpu.node.config import NodeConfig
from vgpu.node.hooklib import HookInstall
from vgpu.node.nvml import NvmlDiscovery
from vgpu.node.paths import HostPaths

pytestmark = pytest.mark.gpu


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short folder instead of pytest's: a unix socket path under it must stay within 107 bytes."""
    with short_dir("vgpu-dp-") as path:
        yield path


@contextlib.contextmanager
def plugin_on_real_nvml(
    root: Path, hook: HookInstall | None = None
) -> Iterator[tuple[FakeKube, Kubelet, Daemon]]:
    """The whole plugin on real NVML under ``root``, registered with the kubelet stand-in."""
    api = FakeKube()
    kubelet = Kubelet("gpu-node", root, None)
    kubelet.start()
    daemon = Daemon(
        "gpu-node",
        "kube-system",
        HostPaths(root),
        NodeConfig(split=5),
        NvmlDiscovery(),
        api,
        hook,
        monitor_factory=plugin_monitor(("127.0.0.1", 0)),
    )
    daemon.start()
    try:
        assert kubelet.wait_for(lambda k: len(k.plugins["nvidia.com/gpu"].devices) > 0, 20)
        yield api, kubelet, daemon
    finally:
        daemon.stop()
        kubelet.stop()


def bind_pod(api: FakeKube, uid: str, uuid: str, memory_mib: int, cores: int) -> None:
    """A pod the scheduler bound to one share of card ``uuid``, as the plugin finds it at Allocate."""
    api.pods.append(
        bound_pod(
            "p", "gpu-node", {"main": [(uuid, memory_mib, cores)]}, uid=uid, created="2026-01-01T00:00:00Z"
        )
    )


def test_real_cards_are_advertised_and_allocated(tmp_path: Path) -> None:
    nvml = NvmlDiscovery()
    uuid = nvml.cards()[0].uuid
    count = len(nvml.cards())
    with plugin_on_real_nvml(tmp_path) as (api, kubelet, daemon):
        assert kubelet.wait_for(lambda k: len(k.plugins["nvidia.com/gpu"].devices) == 5 * count, 20)
        assert f"{uuid}::4" in kubelet.plugins["nvidia.com/gpu"].devices
        bind_pod(api, "u1", uuid, 4096, 25)
        response = kubelet.allocate_container("u1", "nvidia.com/gpu", 1)
        assert response.envs["NVIDIA_VISIBLE_DEVICES"] == uuid
        assert response.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"
        assert api.pods[0]["metadata"]["annotations"][PHASE_ANNOTATION] == "allocated"
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{daemon.monitor_port}/metrics", timeout=10)
            .read()
            .decode()
        )
        assert f'uuid="{uuid}"' in body and "vgpu_card_memory_used_bytes" in body
