"""The committed DRA, DRA health and plugin-registration stubs are what `make proto` produces,
with the kubelet's service names and upstream's field numbers (k8s.io/kubelet/pkg/apis/dra/v1,
dra-health/v1alpha1, pluginregistration/v1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vgpu.dra.api import dra_health_pb2, dra_pb2, registration_pb2

ROOT = Path(__file__).resolve().parents[2]
GENERATED = [
    f"{p}{s}" for p in ("dra_pb2", "registration_pb2", "dra_health_pb2") for s in (".py", ".pyi")
] + [
    "dra_pb2_grpc.py",
    "registration_pb2_grpc.py",
    "dra_health_pb2_grpc.py",
]


def test_regenerating_the_stubs_gives_the_committed_files(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    subprocess.run(
        ["make", "-s", "-f", "vgpu/dra/proto.mk", f"BIN={bin_dir}", f"OUT={tmp_path}"], cwd=ROOT, check=True
    )
    for name in GENERATED:
        fresh = (tmp_path / "vgpu/dra/api" / name).read_text()
        assert fresh == (ROOT / "vgpu/dra/api" / name).read_text(), f"{name} is stale: run `make proto`"


def test_the_services_use_the_kubelets_method_paths() -> None:
    def services(module) -> dict[str, list[str]]:
        return {s.full_name: [m.name for m in s.methods] for s in module.DESCRIPTOR.services_by_name.values()}

    assert services(dra_pb2) == {
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin": ["NodePrepareResources", "NodeUnprepareResources"]
    }
    assert services(registration_pb2) == {
        "pluginregistration.Registration": ["GetInfo", "NotifyRegistrationStatus"]
    }
    # the kubelet dials /v1alpha1.DRAResourceHealth/NodeWatchResources, a server stream
    assert services(dra_health_pb2) == {"v1alpha1.DRAResourceHealth": ["NodeWatchResources"]}
    [method] = dra_health_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods
    assert method.server_streaming and not method.client_streaming


def test_messages_encode_with_upstream_field_numbers() -> None:
    # tag = (field << 3) | wire type 2 (length-delimited) or 0 (varint)
    claim = dra_pb2.Claim(namespace="n", uid="u", name="c")
    assert claim.SerializeToString() == b"\x0a\x01n\x12\x01u\x1a\x01c"
    dev = dra_pb2.Device(request_names=["r"], pool_name="p", device_name="d", cdi_device_ids=["i"])
    assert dev.SerializeToString() == b"\x0a\x01r\x12\x01p\x1a\x01d\x22\x01i"
    answer = dra_pb2.NodePrepareResourceResponse(error="e")
    assert answer.SerializeToString() == b"\x12\x01e"
    assert dra_pb2.NodeUnprepareResourceResponse(error="e").SerializeToString() == b"\x0a\x01e"
    info = registration_pb2.PluginInfo(type="t", name="n", endpoint="e", supported_versions=["v"])
    assert info.SerializeToString() == b"\x0a\x01t\x12\x01n\x1a\x01e\x22\x01v"
    status = registration_pb2.RegistrationStatus(plugin_registered=True, error="x")
    assert status.SerializeToString() == b"\x08\x01\x12\x01x"
    health = dra_health_pb2.DeviceHealth(
        device=dra_health_pb2.DeviceIdentifier(pool_name="p", device_name="d"),
        health=dra_health_pb2.UNHEALTHY,
        last_updated_time=1,
        health_check_timeout_seconds=2,
        message="m",
    )
    assert health.SerializeToString() == b"\x0a\x06\x0a\x01p\x12\x01d\x10\x02\x18\x01\x20\x02\x2a\x01m"
    assert (dra_health_pb2.UNKNOWN, dra_health_pb2.HEALTHY, dra_health_pb2.UNHEALTHY) == (0, 1, 2)
