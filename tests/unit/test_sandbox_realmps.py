"""The real node in MPS mode, as `vgpu sandbox up --real-node --sharing-mode mps` sets it up
(tests/e2e/test_real_node_mps.py runs it): the option's rules, the stub driver root with the fake
control tool where the device plugin looks, and the chart values that turn MPS on for that node."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from vgpu_sandbox import realmps
from vgpu_sandbox.cli import register
from vgpu_sandbox.cluster import Spec
from vgpu_sandbox.errors import SandboxError

from vgpu.node.mps import find_control


def test_mps_is_for_the_real_node_on_the_stub_with_the_charts_plugin() -> None:
    Spec(nodes=0, real_node=True, sharing="mps").validate()
    Spec(nodes=1).validate()  # timeslice by default
    for spec in (
        Spec(nodes=1, sharing="mps"),
        Spec(nodes=0, real_node=True, real_gpu=True, sharing="mps"),
        Spec(nodes=0, real_node=True, dra=True, sharing="mps"),
    ):
        with pytest.raises(SandboxError, match="--sharing-mode mps is for the real node"):
            spec.validate()
    with pytest.raises(SandboxError, match="--sharing-mode must be timeslice or mps"):
        Spec(nodes=0, real_node=True, sharing="spatial").validate()


def test_the_flag_reaches_the_spec() -> None:
    parser = argparse.ArgumentParser()
    register(parser)
    assert parser.parse_args(["up", "--sharing-mode", "mps"]).sharing_mode == "mps"
    assert parser.parse_args(["up"]).sharing_mode == "timeslice"
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--sharing-mode", "spatial"])


def test_the_plugin_finds_the_wrapper_in_the_stub_driver_root(tmp_path: Path) -> None:
    node_root = tmp_path / "real-node"
    node_root.mkdir(mode=0o700)
    tool = realmps.write_driver_root(node_root)
    assert find_control(realmps.driver_root(node_root)) == tool  # what the plugin runs
    assert tool.stat().st_mode & 0o777 == 0o755
    assert tool.read_text().splitlines()[-1] == 'exec python3 -m vgpu.node.fake_mps "$@"'
    # the driver root holds nothing but the tool: its folder goes first on the daemon's PATH
    assert [p.relative_to(node_root) for p in sorted(node_root.rglob("*"))] == [
        Path("driver"),
        Path("driver/usr"),
        Path("driver/usr/bin"),
        Path("driver/usr/bin/nvidia-cuda-mps-control"),
    ]
    realmps.write_driver_root(node_root)  # again (a second up in the same folder): no error
    values = realmps.chart_values(node_root, "real-node-0")
    assert values["driver"] == {"root": str(realmps.driver_root(node_root))}
    assert values["devicePlugin"]["nodeOverrides"] == [{"name": "real-node-0", "sharingMode": "mps"}]


def test_down_removes_the_cards_daemon_folders_it_recorded(tmp_path: Path) -> None:
    assert realmps.card_folders(["GPU-a", "GPU-b"]) == ["/var/lib/vgpu/mps/GPU-a", "/var/lib/vgpu/mps/GPU-b"]
    left = tmp_path / "mps" / "GPU-a"
    (left / "pipe").mkdir(parents=True)
    (left / "pipe" / "nvidia-cuda-mps-control.pid").write_text("4242\n")
    realmps.forget([str(left), str(tmp_path / "mps" / "GPU-gone")])  # one never made: no error
    assert not left.exists() and (tmp_path / "mps").is_dir()
