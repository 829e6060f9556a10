"""driverInject: plugin — the driver's device nodes and libraries handed out by Allocate itself.

A fake driver installation (a folder laid out as a driver install lays out a host: versioned
libraries with their soname links, an absolute link among them, nvidia-smi, device nodes) stands
in for the host; the plugin finds it, and the kubelet stand-in's Allocate over the real socket
gets the DeviceSpecs and read-only Mounts a container runtime without NVIDIA's toolkit needs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from vgpu_sandbox.kubelet import Kubelet

from tests.support import FakeKube, bound_pod, short_dir
from tests.support.driver import LIBDIR, VERSION, fake_driver
from vgpu.core.errors import ConfigError
from vgpu.deviceplugin.daemon import Daemon
from vgpu.node.config import NodeConfig, parse_node_config
from vgpu.node.driver import CONTAINER_LIB_DIR, find_driver
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.paths import HostPaths
from vgpu.node.wiring import NodeSettings, driver_files

NODE = "node-d"


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    with short_dir("vgpu-drv-") as path:
        yield path


def test_the_driver_files_are_found_with_their_host_paths(tmp_path: Path) -> None:
    root = fake_driver(tmp_path / "driver")
    found = find_driver(root, "/run/nvidia/driver", root / "dev")
    mounts = {m.container_path: (m.host_path, m.read_only) for m in found.mounts()}
    host = f"/run/nvidia/driver/{LIBDIR}"
    for family in ("libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler"):
        # under its soname and its versioned name, both the real file, read-only
        assert mounts[f"{CONTAINER_LIB_DIR}/{family}.so.1"] == (f"{host}/{family}.so.{VERSION}", True)
        assert mounts[f"{CONTAINER_LIB_DIR}/{family}.so.{VERSION}"] == (f"{host}/{family}.so.{VERSION}", True)
    assert mounts[f"{CONTAINER_LIB_DIR}/libnvidia-gpucomp.so.{VERSION}"][0].endswith(f"gpucomp.so.{VERSION}")
    assert mounts["/usr/bin/nvidia-smi"] == ("/run/nvidia/driver/usr/local/nvidia/bin/nvidia-smi", True)
    assert not [p for p in mounts if "libfoo" in p or p.endswith("libcuda.so")], mounts
    assert found.nvml == root / LIBDIR / f"libnvidia-ml.so.{VERSION}"
    specs = [(d.container_path, d.host_path, d.permissions) for d in found.devices([1])]
    assert specs == [
        ("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", "/dev/nvidia-uvm", "rw"),  # nvidia-uvm-tools is absent: left out
        ("/dev/nvidia1", "/dev/nvidia1", "rw"),
    ]
    with pytest.raises(FileNotFoundError, match="/dev/nvidia7"):
        found.devices([7])


def test_no_driver_under_the_root_stops_the_plugin_naming_the_flag(tmp_path: Path) -> None:
    root = fake_driver(tmp_path / "driver", libcuda=False)
    with pytest.raises(ConfigError, match=r"--driver-root.*no libcuda\.so\.\*"):
        find_driver(root)
    settings = NodeSettings(node=NODE, driver_inject="plugin", driver_root=root, fake_nvml=tmp_path / "g")
    with pytest.raises(ConfigError, match="install the NVIDIA driver"):
        driver_files(settings, NodeConfig(driver_inject="plugin"))
    # The runtime's mode never looks at the driver root: the toolkit brings the driver.
    assert driver_files(settings, NodeConfig(driver_inject="runtime")) is None


def test_the_node_config_names_a_bad_mode() -> None:
    assert parse_node_config("driverInject: plugin", NODE, "f").driver_inject == "plugin"
    assert parse_node_config("", NODE, "f").driver_inject == "runtime"
    assert parse_node_config("nodes: {node-d: {driverInject: plugin}}", NODE, "f").driver_inject == "plugin"
    with pytest.raises(ConfigError, match=r"driverInject.*must be plugin .*cdi .*runtime .*got 'toolkit'"):
        parse_node_config("driverInject: toolkit", NODE, "f")


def _daemon(root: Path, config: NodeConfig, settings: NodeSettings, api: FakeKube) -> Daemon:
    gpus = root / "gpus.yaml"
    gpus.write_text(yaml.safe_dump({"gpus": [{"uuid": f"GPU-{i}", "memoryMiB": 16000} for i in range(2)]}))
    return Daemon(
        NODE,
        "kube-system",
        HostPaths(root),
        config,
        FakeDiscovery(gpus, poll_s=0.05),
        api,  # type: ignore[arg-type]
        None,
        driver=driver_files(settings, config),
    )


@pytest.mark.parametrize("mode", ["plugin", "runtime"])
def test_allocate_hands_out_the_driver_only_in_plugin_mode(tmp_path: Path, mode: str) -> None:
    driver = fake_driver(tmp_path / "driver")
    os.chmod(driver, 0o755)
    api = FakeKube()
    kubelet = Kubelet(NODE, tmp_path, None)
    kubelet.start()
    config = parse_node_config(f"split: 2\ndriverInject: {mode}\n", NODE, "node-config.yaml")
    settings = NodeSettings(
        node=NODE, root=driver, driver_root=driver, driver_host_root="/run/nvidia/driver", fake_nvml=tmp_path
    )
    daemon = _daemon(tmp_path, config, settings, api)
    daemon.start()
    try:
        assert kubelet.wait_for(lambda k: len(k.plugins["nvidia.com/gpu"].devices) == 4, 10)
        api.pods.append(bound_pod("p", NODE, {"main": [("GPU-1", 3000, 30)]}, uid="u1"))
        response = kubelet.allocate_container("u1", "nvidia.com/gpu", 1)
        assert response.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m"
        mounts = {m.container_path: m for m in response.mounts}
        if mode == "runtime":  # the toolkit's job: nothing of the driver in the answer
            driver = [p for p in mounts if "libcuda" in p or p.startswith(("/usr/bin", CONTAINER_LIB_DIR))]
            assert not response.devices and not driver, mounts
            # The card reaches the toolkit by a volume mount it trusts (the environment's list is
            # for the hook and tools: the role sets accept-nvidia-visible-devices-envvar false).
            assert mounts["/var/run/nvidia-container-devices/GPU-1"].host_path == "/dev/null"
            return
        granted = [d.host_path for d in response.devices]
        assert granted == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia1"]
        lib = mounts[f"{CONTAINER_LIB_DIR}/libcuda.so.1"]
        assert lib.read_only and lib.host_path == f"/run/nvidia/driver/{LIBDIR}/libcuda.so.{VERSION}"
        assert mounts["/usr/bin/nvidia-smi"].read_only
        # The grant's mounts are still there beside the driver's.
        assert "/etc/vgpu/limits" in mounts
    finally:
        daemon.stop()
        kubelet.stop()
