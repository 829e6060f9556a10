"""``vgpu dra-plugin`` against a real Kubernetes 1.36 API server (resource.k8s.io/v1 with
consumable capacity): the node's ResourceSlice published and following the cards' health, a
ResourceClaim allocated in the API server prepared over the kubelet's gRPC, a claim of another
node refused naming the field, the same answer after the plugin is killed and started again
(nothing written twice), the slice left in place by a stop.

Its own sandbox control plane (Kubernetes 1.36, `make setup`); skipped, saying so, where the
control plane serves no ``resource.k8s.io/v1``. The claim's ``status.allocation`` is written here as
the scheduler writes it, so that the test needs neither a scheduler nor a node agent; the real
node's test (tests/e2e/test_dra_real_node.py) lets kube-scheduler allocate.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.nodes import node_name

from tests.support import VGPU, short_dir, start, stop, wait_for
from tests.support.dra import allocation_result, resource_claim
from vgpu.dra import cdi
from vgpu.dra.api import dra_pb2, dra_pb2_grpc
from vgpu.kube.resourceapi import ResourceClient

NODE = node_name(0)
HOOK = Path(__file__).resolve().parents[2] / "native/hook/build/libvgpu.so"

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Sandbox]:
    with short_dir("vgpu-dra136-") as top:
        sb = Sandbox(top / "sandbox")
        try:
            sb.up(Spec(nodes=1, gpus_per_node=1, product=False))
            if "resource.k8s.io/v1" not in sb.kubectl("api-versions").stdout.split():
                version = sb.api_get("/version")["gitVersion"]
                pytest.skip(f"the control plane ({version}) serves no resource.k8s.io/v1")
            yield sb
        finally:
            sb.down()


GPUS = """driverVersion: 570.124.06
gpus:
  - {uuid: GPU-dra-0, model: NVIDIA H200, memoryMiB: 143771, computeCapability: "9.0", healthy: true}
  - {uuid: GPU-dra-1, model: NVIDIA H200, memoryMiB: 143771, computeCapability: "9.0", healthy: %s}
"""


class Plugin:
    def __init__(self, sb: Sandbox, top: Path) -> None:
        self.top = top
        self.gpus = top / "gpus.yaml"
        self.gpus.write_text(GPUS % "true")
        self.log = top / "plugin.log"
        self.argv = [
            *VGPU,
            "dra-plugin",
            f"--node-name={NODE}",
            f"--plugin-dir={top / 'plugins'}",
            f"--registry-dir={top / 'registry'}",
            f"--cdi-dir={top / 'cdi'}",
            f"--state-dir={top / 'state'}",
            f"--fake-nvml={self.gpus}",
            f"--kubeconfig={sb.kubeconfig}",
            f"--hook-library={HOOK}",
            "--slice-interval=1",
        ]
        self.proc = start(self.argv, self.log)

    def restart(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=30)
        self.proc = start(self.argv, self.log)

    def prepare(self, name: str, uid: str) -> dra_pb2.NodePrepareResourceResponse:
        sock = self.top / "plugins/dra.sock"
        wait_for(sock.exists, "the DRA socket", timeout=30)
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            answer = dra_pb2_grpc.DRAPluginStub(ch).NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(
                    claims=[dra_pb2.Claim(namespace="default", name=name, uid=uid)]
                ),
                timeout=30,
                wait_for_ready=True,
            )
        return answer.claims[uid]


@pytest.fixture
def plugin(cluster: Sandbox) -> Iterator[Plugin]:
    with short_dir("vgpu-dra-") as top:
        p = Plugin(cluster, top)
        try:
            yield p
        finally:
            stop(p.proc)


def _client(sb: Sandbox) -> ResourceClient:
    return ResourceClient(str(sb.kubeconfig))


def _claim(sb: Sandbox, name: str, pool: str = NODE, memory: str = "3000Mi", cores: str = "30") -> str:
    """A claim as a user writes it, then allocated as kube-scheduler allocates it; its UID."""
    claim = resource_claim(name, memory=memory, cores=cores)
    made = json.loads(sb.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(claim)).stdout)
    status: dict[str, Any] = {
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        allocation_result(
                            pool, memory, cores, share_id="7f8e6d5c-4b3a-4291-8877-665544332211"
                        )
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pool]}]}
                    ]
                },
            }
        }
    }
    sb.kubectl(
        "patch", "resourceclaim", name, "-n", "default", "--subresource=status", "--type=merge",
        "-p", json.dumps(status),
    )  # fmt: skip
    return str(made["metadata"]["uid"])


def _slice(sb: Sandbox) -> dict[str, Any] | None:
    return _client(sb).get_resource_slice(f"{NODE}-vgpu.openaios.io")


def test_the_slice_follows_the_cards_and_outlives_a_stop(cluster: Sandbox, plugin: Plugin) -> None:
    s = wait_for(lambda: _slice(cluster), "the node's ResourceSlice", timeout=60)
    assert s["spec"]["pool"]["name"] == NODE and s["spec"]["nodeName"] == NODE
    assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    gpu0 = s["spec"]["devices"][0]
    assert gpu0["allowMultipleAllocations"] is True
    assert gpu0["attributes"]["driverVersion"] == {"version": "570.124.6"}
    assert gpu0["capacity"]["cores"]["value"] == "100"
    node_uid = _client(cluster).node_uid(NODE)
    assert s["metadata"]["ownerReferences"][0]["uid"] == node_uid
    generation = s["spec"]["pool"]["generation"]
    plugin.gpus.write_text(GPUS % "false")  # the second card goes unhealthy: it leaves the slice
    s = wait_for(
        lambda: (x := _slice(cluster)) and len(x["spec"]["devices"]) == 1 and x, "gpu-1 gone", timeout=30
    )
    assert s["spec"]["pool"]["generation"] == generation + 1
    plugin.proc.send_signal(signal.SIGTERM)
    assert plugin.proc.wait(timeout=30) == 0
    assert _slice(cluster) is not None  # a restarting plugin must not take the cards from running claims


def test_a_claim_is_prepared_once_across_a_kill_and_another_nodes_claim_is_refused(
    cluster: Sandbox, plugin: Plugin
) -> None:
    uid = _claim(cluster, "share-a")
    entry = plugin.prepare("share-a", uid)
    assert entry.error == ""
    assert [list(d.cdi_device_ids) for d in entry.devices] == [[f"vgpu.openaios.io/claim={uid}-gpu"]]
    spec_file = cdi.spec_path(plugin.top / "cdi", uid)
    env = json.loads(spec_file.read_text())["devices"][0]["containerEdits"]["env"]
    assert "CUDA_DEVICE_MEMORY_LIMIT_0=3000m" in env and "CUDA_DEVICE_SM_LIMIT_0=30" in env
    record = json.loads((plugin.top / f"state/dra/claims/{uid}.json").read_text())
    assert record["requests"][0]["memoryBytes"] == 3000 << 20 and record["requests"][0]["cores"] == 30
    stamp = spec_file.stat().st_ino, spec_file.stat().st_mtime_ns
    plugin.restart(signal.SIGKILL)  # killed: no clean-up at all
    again = plugin.prepare("share-a", uid)
    assert again == entry
    assert (spec_file.stat().st_ino, spec_file.stat().st_mtime_ns) == stamp
    assert plugin.log.read_text().count(f"prepared ResourceClaim default/share-a ({uid})") == 1
    far = _claim(cluster, "far", pool="vgpu-node-elsewhere")
    refused = plugin.prepare("far", far)
    assert "results[0].pool" in refused.error and "another node" in refused.error
    assert not cdi.spec_path(plugin.top / "cdi", far).exists()
