"""`vgpu device-plugin` checks every setting before it starts anything, and says which field is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

GPUS = "gpus:\n  - {uuid: GPU-a, memoryMiB: 1000}\n"


def start(tmp_path: Path, *extra: str, gpus: str | None = GPUS) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "vgpu.commands.cli",
        "device-plugin",
        "--node=n1",
        f"--kubeconfig={tmp_path / 'no-such-kubeconfig'}",
        f"--root={tmp_path / 'root'}",
        "--monitor-listen=127.0.0.1:0",
        *extra,
    ]
    if gpus is not None:
        (tmp_path / "gpus.yaml").write_text(gpus)
        argv.append(f"--fake-nvml={tmp_path / 'gpus.yaml'}")
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def nothing_started(tmp_path: Path) -> bool:
    return not (tmp_path / "root/var/lib/kubelet/device-plugins/vgpu.sock").exists()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("split: 0\n", "split: must be an integer from 1 to 100"),
        ("deviceMemoryScaling: 2\n", "deviceMemoryScaling: 2.0 promises more memory"),
        ("nodes:\n  n1: {deviceCoreScaling: -1}\n", "nodes.n1.deviceCoreScaling: must be a number above 0"),
        ("spilt: 3\n", "spilt: unknown key"),
    ],
)
def test_a_bad_node_config_stops_the_plugin_naming_the_field(
    tmp_path: Path, config: str, message: str
) -> None:
    (tmp_path / "cfg.yaml").write_text(config)
    result = start(tmp_path, f"--config={tmp_path / 'cfg.yaml'}")
    assert result.returncode == 2
    assert f"cfg.yaml: {message}" in result.stderr
    assert "Traceback" not in result.stderr
    assert nothing_started(tmp_path)


def test_a_bad_fake_gpu_file_stops_the_plugin_naming_the_field(tmp_path: Path) -> None:
    result = start(tmp_path, gpus="gpus:\n  - {uuid: GPU-a, memoryMiB: lots}\n")
    assert result.returncode == 2
    assert "gpus.yaml: gpus[0].memoryMiB: must be an integer >= 1" in result.stderr
    assert nothing_started(tmp_path)


def test_a_bad_listen_address_is_refused(tmp_path: Path) -> None:
    result = start(tmp_path, "--monitor-listen=9394")
    assert result.returncode == 2
    assert "--monitor-listen" in result.stderr and "HOST:PORT" in result.stderr


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--sweep-interval=0", "--sweep-interval: 0 is out of range: give 0 < SECONDS <= 3600"),
        ("--sweep-min-age=-1", "--sweep-min-age: -1 is out of range: give 0 to 86400 seconds"),
    ],
)
def test_a_bad_sweep_timing_stops_the_plugin_naming_the_flag(tmp_path: Path, flag: str, message: str) -> None:
    result = start(tmp_path, flag)
    assert result.returncode == 2
    assert f"vgpu device-plugin: {message}" in result.stderr
    assert "Traceback" not in result.stderr
    assert nothing_started(tmp_path) and not (tmp_path / "root/var/lib/vgpu/lib").exists()


def test_unreachable_credentials_stop_the_plugin_before_it_serves(tmp_path: Path) -> None:
    result = start(tmp_path)  # the kubeconfig does not exist
    assert result.returncode == 2
    assert "cannot load Kubernetes credentials" in result.stderr
    assert nothing_started(tmp_path)


def test_without_nvml_the_plugin_says_to_use_a_gpu_node_or_the_fake(tmp_path: Path) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine; this test covers machines without it")
    except pynvml.NVMLError:
        pass
    result = start(tmp_path, gpus=None)
    assert result.returncode == 2
    assert "cannot initialise NVML" in result.stderr and "--fake-nvml" in result.stderr


def test_vgpu_monitor_serves_a_nodes_metrics_and_stops_on_sigterm(tmp_path: Path) -> None:
    import re
    import signal
    import urllib.request

    (tmp_path / "gpus.yaml").write_text("gpus:\n  - {uuid: GPU-a, memoryMiB: 1000, memoryUsedMiB: 10}\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vgpu.commands.cli",
            "monitor",
            "--node=n1",
            "--no-kube",
            f"--root={tmp_path}",
            f"--fake-nvml={tmp_path / 'gpus.yaml'}",
            "--listen=127.0.0.1:0",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        port = None
        for line in proc.stderr:
            found = re.search(r"node monitor on http://127\.0\.0\.1:(\d+)/metrics", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert (
            'vgpu_card_memory_used_bytes{index="0",model="Fake GPU",node="n1",uuid="GPU-a"} 1.048576e+07'
            in body
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
