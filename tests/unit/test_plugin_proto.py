"""The committed kubelet stubs are what `make proto` produces, and speak kubelet's wire format."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vgpu.deviceplugin.api import api_pb2, api_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")


def test_regenerating_the_stubs_gives_the_committed_files(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    subprocess.run(
        ["make", "-s", "-f", "vgpu/deviceplugin/proto.mk", f"BIN={bin_dir}", f"OUT={tmp_path}"],
        cwd=ROOT,
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "vgpu/deviceplugin/api" / name).read_text()
        committed = (ROOT / "vgpu/deviceplugin/api" / name).read_text()
        assert fresh == committed, f"{name} is stale: run `make proto` and commit the result"


def test_the_services_use_kubelets_method_paths() -> None:
    services = {
        s.full_name: [m.name for m in s.methods] for s in api_pb2.DESCRIPTOR.services_by_name.values()
    }
    assert services == {
        "v1beta1.Registration": ["Register"],
        "v1beta1.DevicePlugin": [
            "GetDevicePluginOptions",
            "ListAndWatch",
            "GetPreferredAllocation",
            "Allocate",
            "PreStartContainer",
        ],
    }
    assert hasattr(api_pb2_grpc, "add_DevicePluginServicer_to_server")


def test_messages_encode_with_upstream_field_numbers() -> None:
    # Bytes worked out by hand from upstream's field numbers: tag = (field << 3) | wire type.
    req = api_pb2.RegisterRequest(version="v1beta1", endpoint="e", resource_name="r")
    assert req.SerializeToString() == b"\x0a\x07v1beta1\x12\x01e\x1a\x01r"
    dev = api_pb2.Device(
        ID="a", health="Healthy", topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=1)])
    )
    assert dev.SerializeToString() == b"\x0a\x01a\x12\x07Healthy\x1a\x04\x0a\x02\x08\x01"
    pref = api_pb2.ContainerPreferredAllocationRequest(
        available_deviceIDs=["x"], must_include_deviceIDs=["y"], allocation_size=2
    )
    assert pref.SerializeToString() == b"\x0a\x01x\x12\x01y\x18\x02"
    mount = api_pb2.Mount(container_path="c", host_path="h", read_only=True)
    assert mount.SerializeToString() == b"\x0a\x01c\x12\x01h\x18\x01"
    resp = api_pb2.ContainerAllocateResponse(cdi_devices=[api_pb2.CDIDevice(name="n")])
    assert resp.SerializeToString() == b"\x2a\x03\x0a\x01n"
