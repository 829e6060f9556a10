"""MIG on the DRA path end to end (docs/mig.md#mig-with-dra): ``vgpu dra-plugin --mig dynamic``
over the fake NVML's H100 in MIG mode, against the sandbox's real Kubernetes 1.36 API server (which
validates the pool's shape) and kube-scheduler's own DRA allocator (which counts the partitionable
devices' shared counters).

Claims for two profiles, asked for as examples/dra-mig.yaml asks (the DeviceClass
mig.vgpu.openaios.io and a CEL selector on the profile), are allocated on placements that do not
overlap; a profile with no room left stays Pending; a share of a whole card goes to the card not
in MIG mode, never to a slice. Each MIG claim is prepared over the kubelet's gRPC (the sandbox's
KWOK node has no kubelet, so the test calls what the kubelet calls), which makes its instance in
the fake card; the plugin is killed mid-way with an instance leaked (made, but no claim names it,
as a prepare cut short leaves it) and, started again, reclaims the leak and keeps the claims'
instances; the pods removed and their claims unprepared, the card is empty again and the large
profile that had no room is allocated.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.nodes import node_name

from tests.support import VGPU, short_dir, start, stop, wait_for
from tests.support.dra import resource_claim
from vgpu.core.mig import H100_80GB, Placement
from vgpu.dra.api import dra_pb2, dra_pb2_grpc
from vgpu.dra.migslices import MIG_CLASS, MIG_SELECTOR, SHARED_SELECTOR, device_name
from vgpu.dra.slices import DRIVER
from vgpu.node.fake_nvml import FakeDiscovery

NODE = node_name(0)
REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "native/hook/build/libvgpu.so"
MIG_CARD = "GPU-mig-0"
GPUS = f"""driverVersion: 580.65.06
gpus:
  - uuid: {MIG_CARD}
    model: NVIDIA H100 80GB HBM3
    memoryMiB: 81559
    computeCapability: "9.0"
    mig: {{mode: enabled}}
  - {{uuid: GPU-whole-1, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, computeCapability: "9.0"}}
"""

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Sandbox]:
    with short_dir("vgpu-dramig-") as top:
        sb = Sandbox(top / "sandbox")
        try:
            sb.up(Spec(nodes=1, gpus_per_node=1, product=False))
            if "resource.k8s.io/v1" not in sb.kubectl("api-versions").stdout.split():
                version = sb.api_get("/version")["gitVersion"]
                pytest.skip(f"the control plane ({version}) serves no resource.k8s.io/v1")
            yield sb
        finally:
            sb.down()


class Plugin:
    def __init__(self, sb: Sandbox, top: Path) -> None:
        self.top = top
        self.gpus = top / "gpus.yaml"
        self.gpus.write_text(GPUS)
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
            "--mig=dynamic",
            "--slice-interval=1",
            *([f"--hook-library={HOOK}"] if HOOK.is_file() else []),
        ]
        self.proc = start(self.argv, self.log)

    def card(self) -> dict[Placement, Any]:
        """The MIG card's instances now, by placement (the fake's state file, as the card keeps it)."""
        mig = FakeDiscovery(self.gpus).mig
        assert mig is not None
        return {d.placement: d for d in mig.devices(MIG_CARD)}

    def restart(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # no clean-up at all
        self.proc.wait(timeout=30)
        self.proc = start(self.argv, self.log)

    def _call(self, method: str, claim: dict[str, Any]) -> Any:
        sock = self.top / "plugins/dra.sock"
        wait_for(sock.exists, "the DRA socket", timeout=30)
        meta = claim["metadata"]
        one = dra_pb2.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            stub = dra_pb2_grpc.DRAPluginStub(ch)
            if method == "prepare":
                answer = stub.NodePrepareResources(
                    dra_pb2.NodePrepareResourcesRequest(claims=[one]), timeout=30, wait_for_ready=True
                )
            else:
                answer = stub.NodeUnprepareResources(
                    dra_pb2.NodeUnprepareResourcesRequest(claims=[one]), timeout=30, wait_for_ready=True
                )
        return answer.claims[meta["uid"]]

    def prepare(self, claim: dict[str, Any]) -> Any:
        return self._call("prepare", claim)

    def unprepare(self, claim: dict[str, Any]) -> Any:
        return self._call("unprepare", claim)


@pytest.fixture
def plugin(cluster: Sandbox) -> Iterator[Plugin]:
    with short_dir("vgpu-dramigp-") as top:
        p = Plugin(cluster, top)
        try:
            yield p
        finally:
            stop(p.proc)


def _apply(sb: Sandbox, *objs: dict[str, Any]) -> None:
    sb.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)})
    )


def _classes() -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expr}}]},
        }
        for name, expr in ((DRIVER, SHARED_SELECTOR), (MIG_CLASS, MIG_SELECTOR))
    ]


def _example() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((REPO / "examples/dra-mig.yaml").read_text()) if d]


def _template(profile: str) -> dict[str, Any]:
    """examples/dra-mig.yaml's template, for another profile."""
    t = next(d for d in _example() if d["kind"] == "ResourceClaimTemplate")
    t["metadata"]["name"] = "mig-" + profile.replace(".", "-")
    t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]["expression"] = (
        f'device.attributes["{DRIVER}"].profile == "{profile}"'
    )
    return t


def _pod(name: str, template: str | None = None, claim: str | None = None) -> dict[str, Any]:
    source = {"resourceClaimTemplateName": template} if template else {"resourceClaimName": claim}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "mig", **source}],
            "containers": [{"name": "c", "image": "pause", "resources": {"claims": [{"name": "mig"}]}}],
        },
    }


def _slices(sb: Sandbox) -> list[dict[str, Any]]:
    items = sb.api_get("/apis/resource.k8s.io/v1/resourceslices").get("items", [])
    return [s for s in items if s["spec"].get("nodeName") == NODE and s["spec"]["driver"] == DRIVER]


def _pool(sb: Sandbox, devices: int) -> list[dict[str, Any]]:
    """The node's whole pool, once it offers ``devices`` MIG devices at one generation."""

    def complete() -> list[dict[str, Any]] | None:
        s = _slices(sb)
        gens = {x["spec"]["pool"]["generation"] for x in s}
        offered = sum(len(x["spec"].get("devices") or []) for x in s if "-gpu-" in x["metadata"]["name"])
        ok = len(s) == 3 and len(gens) == 1 and all(x["spec"]["pool"]["resourceSliceCount"] == 3 for x in s)
        return s if ok and offered == devices else None

    return wait_for(complete, f"the pool of {NODE} offering {devices} MIG devices", timeout=60, every=0.5)


def _claim_of(sb: Sandbox, pod: str) -> dict[str, Any] | None:
    items = json.loads(sb.kubectl("get", "resourceclaims", "-n", "default", "-o", "json").stdout)["items"]
    for c in items:
        owners = [o.get("name") for o in c["metadata"].get("ownerReferences") or []]
        if pod in owners or c["metadata"]["name"] == pod:
            return dict(c) if (c.get("status") or {}).get("allocation") else None
    return None


def _unscheduled(sb: Sandbox, pod: str) -> str:
    """Why the scheduler left ``pod`` Pending ("" while it has not said)."""
    got = json.loads(sb.kubectl("get", "pod", "-n", "default", pod, "-o", "json").stdout)
    conds = [c for c in got["status"].get("conditions") or [] if c["type"] == "PodScheduled"]
    return str(conds[0].get("message", "")) if conds and conds[0]["status"] == "False" else ""


def _allocated(sb: Sandbox, pod: str) -> dict[str, Any]:
    claim = _claim_of(sb, pod)
    assert claim is not None, f"{pod}'s claim is not allocated"
    return claim


def _placement(claim: dict[str, Any]) -> tuple[str, Placement]:
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return next(
        (p.name, pl)
        for p in H100_80GB.profiles
        for pl in p.placements
        if device_name(0, p.name, pl.start) == result["device"]
    )


def test_mig_slices_are_allocated_apart_made_at_prepare_and_reclaimed_across_a_restart(
    cluster: Sandbox, plugin: Plugin
) -> None:
    _apply(cluster, *_classes())
    pool = _pool(cluster, 25)
    counters = next(s for s in pool if "sharedCounters" in s["spec"])
    assert counters["spec"]["sharedCounters"][0]["name"] == "gpu-0-mig", (
        "the API server dropped sharedCounters: turn on the DRAPartitionableDevices feature gate"
    )
    mig_slice = next(s for s in pool if s["metadata"]["name"].endswith("-gpu-0"))
    assert all(d.get("consumesCounters") for d in mig_slice["spec"]["devices"])
    shared = next(s for s in pool if s["metadata"]["name"] == f"{NODE}-{DRIVER}")
    assert [d["name"] for d in shared["spec"]["devices"]] == ["gpu-1"]  # the card used whole

    example = _example()
    _apply(cluster, *[d for d in example if d["kind"] == "ResourceClaimTemplate"], _template("4g.40gb"))
    _apply(
        cluster,
        _pod("mig-a", "mig-3g-40gb"),
        _pod("mig-b", "mig-1g-10gb"),
        _pod("mig-c", "mig-1g-10gb"),
    )
    names = ("mig-a", "mig-b", "mig-c")
    wait_for(lambda: all(_claim_of(cluster, p) for p in names), "three MIG claims allocated", 120, every=0.5)
    claims = {p: _allocated(cluster, p) for p in names}
    got = {p: _placement(c) for p, c in claims.items()}
    assert sorted(n for n, _ in got.values()) == ["1g.10gb", "1g.10gb", "3g.40gb"]
    places = [pl for _, pl in got.values()]
    assert not any(a.overlaps(b) for i, a in enumerate(places) for b in places[i + 1 :]), got
    # no room for a 4g.40gb beside them; a share of a whole card goes to the card not in MIG mode
    share = resource_claim("share", memory="3000Mi", cores="30")
    _apply(cluster, share, _pod("mig-d", "mig-4g-40gb"), _pod("share", claim="share"))
    wait_for(lambda: _claim_of(cluster, "share"), "the share allocated", 120, every=0.5)
    (result,) = _allocated(cluster, "share")["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-1"
    wait_for(lambda: "cannot allocate all claims" in _unscheduled(cluster, "mig-d"), "mig-d refused", 60)
    assert _claim_of(cluster, "mig-d") is None

    # prepared as the kubelet prepares them: each instance made at its allocated placement
    for p, c in claims.items():
        entry = plugin.prepare(c)
        assert entry.error == "", entry.error
        allocated = c["status"]["allocation"]["devices"]["results"][0]["device"]
        assert [d.device_name for d in entry.devices] == [allocated], p
    made = plugin.card()
    assert {(d.profile, pl) for pl, d in made.items()} == set(got.values())
    held = {pl: d.uuid for pl, d in made.items()}
    first = plugin.prepare(claims["mig-a"])

    # killed mid-way, with an instance no claim names (a prepare cut short before its checkpoint)
    mig = FakeDiscovery(plugin.gpus).mig
    assert mig is not None
    free = next(pl for pl in H100_80GB.profile("1g.10gb").placements if not any(pl.overlaps(x) for x in made))
    leaked = mig.create(MIG_CARD, "1g.10gb", free.start)
    plugin.restart()
    wait_for(lambda: free not in plugin.card(), "the leaked instance reclaimed", 60, every=0.5)
    assert {pl: d.uuid for pl, d in plugin.card().items()} == held  # the claims' kept, uuids and all
    assert "reclaimed MIG instances" in plugin.log.read_text() and leaked.uuid not in str(plugin.card())
    assert plugin.prepare(claims["mig-a"]) == first  # the same answer, nothing made again

    # pods removed, claims unprepared: the card empty, and the 4g.40gb that had no room allocated
    cluster.kubectl("delete", "pods", "-n", "default", *names, "--wait=false")
    for c in claims.values():
        assert plugin.unprepare(c).error == ""
    assert plugin.card() == {}
    _pool(cluster, 25)
    wait_for(lambda: _claim_of(cluster, "mig-d"), "the 4g.40gb allocated once the card is free", 120, every=1)
    big = _allocated(cluster, "mig-d")
    assert _placement(big) == ("4g.40gb", Placement(0, 4))
    assert plugin.prepare(big).error == ""
    assert [d.profile for d in plugin.card().values()] == ["4g.40gb"]
    cluster.kubectl("delete", "pods", "-n", "default", "mig-d", "share", "--wait=false")
    assert plugin.unprepare(big).error == ""
    assert plugin.card() == {}
