"""`vgpu status` joins nodes, pods and Leases into who got what on each card."""

from __future__ import annotations

import datetime as dt
import json
import socket
from pathlib import Path

import pytest

from tests.support import bound_pod
from vgpu.commands.cli import main
from vgpu.commands.status import RECORD_ANNOTATION, build_status, render_text
from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    DEVICES_ANNOTATION,
    PHASE_ANNOTATION,
    Allocation,
    ContainerAllocation,
    Device,
    DeviceAllocation,
    NodeInventory,
    encode_allocation,
    encode_devices,
)
from vgpu.core.config import SchedulerConfig
from vgpu.core.ledger import ZERO
from vgpu.extender.state import SchedulerState

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def node(name: str) -> dict:
    inv = NodeInventory(
        (
            Device("GPU-a", 0, "A100", 80000, 100, 10),
            Device("GPU-b", 1, "A100", 80000, 100, 10, healthy=False),
        )
    )
    return {"metadata": {"name": name, "annotations": {DEVICES_ANNOTATION: encode_devices(inv)}}}


def pod(name: str, devices: list[tuple[str, int, int]], phase: str, record: dict | None = None) -> dict:
    alloc = Allocation("n1", (ContainerAllocation("main", tuple(DeviceAllocation(*d) for d in devices)),))
    ann = {ALLOCATION_ANNOTATION: encode_allocation(alloc), PHASE_ANNOTATION: phase}
    if record is not None:
        ann[RECORD_ANNOTATION] = json.dumps(record)
    return {"metadata": {"name": name, "namespace": "ml", "annotations": ann}}


def lease(renew: str) -> dict:
    return {"metadata": {"name": "vgpu-n1"}, "spec": {"renewTime": renew, "leaseDurationSeconds": 40}}


def test_each_card_lists_its_containers_and_totals() -> None:
    record = {"main": {"envs": {"CUDA_DEVICE_MEMORY_LIMIT_0": "3000m", "PATH": "/bin"}}}
    pods = [
        pod("a", [("GPU-a", 3000, 30)], "allocated", record),
        pod("b", [("GPU-a", 5000, 20), ("GPU-b", 1000, 0)], "bound"),
        {"metadata": {"name": "plain", "namespace": "ml"}},
    ]
    [status] = build_status(
        [node("n1"), {"metadata": {"name": "cpu-only"}}], pods, [lease("2026-01-01T11:59:50Z")], NOW
    )
    assert status.lease == "fresh"
    card_a, card_b = status.cards
    assert [(s.pod, s.memory_mib, s.phase) for s in card_a.shares] == [
        ("a", 3000, "allocated"),
        ("b", 5000, "bound"),
    ]
    assert (card_a.memory_used_mib, card_a.cores_used) == (8000, 50)
    assert card_a.shares[0].env == {"CUDA_DEVICE_MEMORY_LIMIT_0": "3000m"}
    text = render_text([status])
    assert "gpu 0 GPU-a A100  mem 8000/80000 MiB  cores 50/100  vgpus 2/10" in text
    assert "gpu 1 GPU-b A100  mem 1000/80000 MiB  cores 0/100  vgpus 1/10  mode hami-core  UNHEALTHY" in text
    assert "env CUDA_DEVICE_MEMORY_LIMIT_0=3000m" in text


def test_each_card_shows_its_mode_as_nvidia_com_vgpu_mode_names_it() -> None:
    inv = NodeInventory(
        (
            Device("GPU-m", 0, "H100", 80000, 100, 10, sharing="mps"),
            Device("GPU-t", 1, "H100", 80000, 100, 10),
        )
    )
    raw = {"metadata": {"name": "n1", "annotations": {DEVICES_ANNOTATION: encode_devices(inv)}}}
    [status] = build_status([raw], [], [lease("2026-01-01T11:59:50Z")], NOW)
    assert [(c.uuid, c.mode) for c in status.cards] == [("GPU-m", "mps"), ("GPU-t", "hami-core")]
    text = render_text([status])
    assert "gpu 0 GPU-m H100  mem 0/80000 MiB  cores 0/100  vgpus 0/10  mode mps\n" in text
    assert "gpu 1 GPU-t H100  mem 0/80000 MiB  cores 0/100  vgpus 0/10  mode hami-core\n" in text


def test_an_old_lease_shows_expired_and_a_missing_one_missing() -> None:
    assert build_status([node("n1")], [], [lease("2026-01-01T11:00:00Z")], NOW)[0].lease == "expired"
    assert build_status([node("n1")], [], [], NOW)[0].lease == "missing"


def test_a_share_on_a_card_the_node_lacks_is_shown_apart() -> None:
    [status] = build_status([node("n1")], [pod("x", [("GPU-gone", 10, 0)], "bound")], [], NOW)
    assert [s.pod for s in status.unplaced] == ["x"]
    assert (
        "  on cards the node does not list:\n    ml/x main  10 MiB  cores uncapped  bound  on GPU-gone\n"
        in render_text([status])
    )


def test_no_vgpu_nodes_says_what_to_check() -> None:
    assert "is the device plugin running" in render_text([])


def test_a_pod_kubelet_rejected_shows_rejected_with_kubelets_reason() -> None:
    rejected = pod("r", [("GPU-a", 1000, 0)], "bound")
    rejected["status"] = {
        "phase": "Failed",
        "reason": "UnexpectedAdmissionError",
        "message": "Allocate failed: cannot tell which of the pods ml/r, ml/s kubelet is starting",
    }
    [status] = build_status([node("n1")], [rejected], [], NOW)
    [share] = status.cards[0].shares
    assert share.phase == "rejected"
    assert share.reason.startswith("UnexpectedAdmissionError: Allocate failed: cannot tell which")
    assert (
        "ml/r main  1000 MiB  cores uncapped  rejected, holds nothing (UnexpectedAdmissionError: "
        in render_text([status])
    )


def test_usage_from_the_nodes_lease_is_shown_per_share_and_a_bad_report_is_ignored() -> None:
    from vgpu.core.annotations import USAGE_ANNOTATION

    a = pod("a", [("GPU-a", 3000, 30)], "allocated")
    a["metadata"]["uid"] = "uid-a"
    b = pod("b", [("GPU-a", 1000, 0), ("GPU-b", 1000, 0)], "allocated")
    b["metadata"]["uid"] = "uid-b"
    report = {"uid-a_main": {"GPU-a": 1744830464}, "uid-b_main": {"GPU-b": 5, "GPU-a": -1}}
    with_usage = lease("2026-01-01T11:59:50Z")
    with_usage["metadata"]["annotations"] = {USAGE_ANNOTATION: json.dumps(report)}
    [status] = build_status([node("n1")], [a, b], [with_usage], NOW)
    card_a, card_b = status.cards
    assert [(s.pod, s.used_bytes) for s in card_a.shares] == [("a", 1744830464), ("b", None)]
    assert [(s.pod, s.used_bytes) for s in card_b.shares] == [("b", 5)]
    assert "ml/a main  3000 MiB  cores 30%  allocated  using 1664 MiB" in render_text([status])

    for bad in ("{not json", "[1, 2]", '"text"', '{"uid-a_main": [1]}', '{"uid-a_main": {"GPU-a": "5"}}'):
        with_usage["metadata"]["annotations"] = {USAGE_ANNOTATION: bad}
        [status] = build_status([node("n1")], [a], [with_usage], NOW)
        assert status.cards[0].shares[0].used_bytes is None


# -- the scheduler's own accounting: what a card holds is what the extender's ledger holds ----------


def test_each_cards_totals_are_the_extenders_ledger_for_the_same_pods() -> None:
    """An init container of 10000 MiB before an app container of 5000 MiB holds 10000 MiB on the
    card (the larger phase, as the scheduler books it), not 15000 MiB and 2 vGPUs; a finished
    pod holds nothing, whether it succeeded or kubelet refused it."""
    inventory = node("n1")
    with_init = bound_pod(
        "with-init",
        "n1",
        {"prep": [("GPU-a", 10000, 0)], "main": [("GPU-a", 5000, 0)]},
        init=["prep"],
        uid="u1",
    )
    running = bound_pod("running", "n1", {"main": [("GPU-a", 3000, 30)]}, uid="u2")
    done = bound_pod("done", "n1", {"main": [("GPU-a", 7000, 0)]}, uid="u3")
    done["status"] = {"phase": "Succeeded"}
    refused = bound_pod("refused", "n1", {"main": [("GPU-b", 7000, 0)]}, uid="u4")
    refused["status"] = {"phase": "Failed", "reason": "UnexpectedAdmissionError"}
    pods = [with_init, running, done, refused]

    [status] = build_status([inventory], pods, [], NOW)

    extender = SchedulerState(SchedulerConfig(), clock=lambda: 0.0)
    extender.apply_node(inventory)
    for p in pods:
        extender.apply_pod(p)
    booked = extender.ledger.usage("n1")
    assert booked  # the ledger holds something to compare with
    for card in status.cards:
        u = booked.get(card.uuid, ZERO)
        assert (card.memory_used_mib, card.cores_used, card.vgpus_used) == (u.memory_mib, u.cores, u.count)
    text = render_text([status], finished_too=True)
    assert "gpu 0 GPU-a A100  mem 13000/80000 MiB  cores 30/100  vgpus 2/10" in text
    assert "gpu 1 GPU-b A100  mem 0/80000 MiB  cores 0/100  vgpus 0/10" in text
    assert "default/with-init prep (init)  10000 MiB  cores uncapped  bound" in text
    assert "default/with-init main  5000 MiB  cores uncapped  bound" in text
    assert "default/done main  7000 MiB  cores uncapped  succeeded, holds nothing" in text
    assert (
        "default/refused main  7000 MiB  cores uncapped  rejected, holds nothing (UnexpectedAdmissionError)"
        in text
    )
    # by default a succeeded pod is counted, not listed; a failed one is listed with why
    short = render_text([status])
    assert "default/done" not in short
    assert "(1 succeeded pod(s) not shown: they hold nothing; --all lists them)" in short
    assert "default/refused main  7000 MiB  cores uncapped  rejected, holds nothing" in short


def test_an_uncapped_share_reads_uncapped_and_a_capped_one_its_percent() -> None:
    pods = [pod("free", [("GPU-a", 1000, 0)], "allocated"), pod("capped", [("GPU-a", 1000, 25)], "allocated")]
    text = render_text(build_status([node("n1")], pods, [], NOW))
    assert "ml/free main  1000 MiB  cores uncapped  allocated" in text
    assert "ml/capped main  1000 MiB  cores 25%  allocated" in text
    assert " 0% " not in text


def test_a_pod_spec_of_the_wrong_shape_is_counted_as_every_container_at_once_and_never_raises() -> None:
    odd = bound_pod("odd", "n1", {"main": [("GPU-a", 1000, 0)]}, uid="u-odd")
    odd["spec"]["initContainers"] = 5
    [status] = build_status([node("n1")], [odd], [], NOW)
    assert status.cards[0].memory_used_mib == 1000 and status.cards[0].shares[0].pod == "odd"


# -- a node deleted while pods are still bound to it -------------------------------------------------


def test_pods_bound_to_a_node_that_no_longer_exists_are_shown_under_it_holding_nothing() -> None:
    orphan = bound_pod("orphan", "gone-1", {"main": [("GPU-z", 2000, 0)]}, uid="u-o")
    on_cpu_node = bound_pod("elsewhere", "cpu-only", {"main": [("GPU-y", 1000, 0)]}, uid="u-c")
    nodes = [node("n1"), {"metadata": {"name": "cpu-only"}}]
    shown = build_status(nodes, [orphan, on_cpu_node], [], NOW)
    assert [(n.name, n.gone) for n in shown] == [("gone-1", True), ("n1", False)]
    text = render_text(shown)
    assert text.startswith(
        "node gone-1  GONE: no such Node, yet 1 pod(s) are still bound to it; they hold nothing in the "
        "scheduler (the pod garbage collector deletes them; kubectl delete pod does it now)\n"
        "    default/orphan main  2000 MiB  cores uncapped  bound  on GPU-z\n"
    )


def test_status_of_one_node_leaves_out_the_pods_of_others(
    fake_kube: type[FakeKube],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    others = bound_pod("other", "cpu-1", {"main": [("GPU-q", 1000, 0)]}, uid="u-q")
    gone = bound_pod("orphan", "gone-1", {"main": [("GPU-z", 2000, 0)]}, uid="u-o")
    mine = bound_pod("mine", "n1", {"main": [("GPU-a", 1000, 0)]}, uid="u-m")
    monkeypatch.setattr(FakeKube, "pods", [others, gone, mine])
    assert main(["status", f"--kubeconfig={tmp_path / 'kc'}", "--node", "n1"]) == 0
    out = capsys.readouterr().out
    assert "default/mine main" in out and "gone-1" not in out and "other" not in out
    assert main(["status", f"--kubeconfig={tmp_path / 'kc'}"]) == 0
    assert "node gone-1  GONE: no such Node" in capsys.readouterr().out


class FakeKube:
    """What `vgpu status` reads, from lists given here instead of an API server."""

    nodes: list[dict] = []
    pods: list[dict] = []

    def __init__(self, kubeconfig: str | None) -> None:
        self.kubeconfig = kubeconfig

    def list_nodes(self) -> tuple[list[dict], str]:
        return self.nodes, "1"

    def list_pods(self) -> tuple[list[dict], str]:
        return self.pods, "1"

    def list_leases(self, namespace: str) -> tuple[list[dict], str]:
        return [], "1"

    def get(self, path: str) -> dict:
        from vgpu.core.errors import KubeError

        # a cluster before 1.34: resource.k8s.io/v1 is not served
        raise KubeError(f"GET {path}: 404 Not Found", status=404)


@pytest.fixture
def fake_kube(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> type[FakeKube]:
    from vgpu.kube import client

    plain = {"metadata": {"name": "cpu-1"}}
    monkeypatch.setattr(FakeKube, "nodes", [node("n1"), plain])
    monkeypatch.setattr(client, "Kube", FakeKube)
    (tmp_path / "kc").write_text("")
    return FakeKube


@pytest.mark.parametrize(
    ("wanted", "message"),
    [
        ("nope", "vgpu status: no such node: nope (the cluster has 2: cpu-1, n1)"),
        ("cpu-1", "vgpu status: node cpu-1 is not a vGPU node: it carries no " + DEVICES_ANNOTATION),
    ],
)
def test_a_node_that_is_not_there_or_has_no_gpus_is_said_and_exits_1(
    fake_kube: type[FakeKube], tmp_path: Path, capsys: pytest.CaptureFixture[str], wanted: str, message: str
) -> None:
    assert main(["status", f"--kubeconfig={tmp_path / 'kc'}", "--node", "n1", "--node", wanted]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(message) and out.err.count("\n") == 1
    assert main(["status", f"--kubeconfig={tmp_path / 'kc'}", "--node", "n1"]) == 0
    assert capsys.readouterr().out.startswith("node n1  lease missing")


def test_an_unreachable_api_server_is_one_line_with_what_to_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "kc").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    monkeypatch.setenv("VGPU_SANDBOX_DIR", str(tmp_path))  # whose kubeconfig status reads by default
    (tmp_path / "kubeconfig").write_text((tmp_path / "kc").read_text())
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"vgpu status: list nodes: cannot reach the API server at https://127.0.0.1:{port} "
        "(connection refused): is the sandbox up? "
        f"(vgpu sandbox up; its kubeconfig is {tmp_path / 'kubeconfig'}), or give --kubeconfig\n"
    )
    assert main(["status", f"--kubeconfig={tmp_path / 'kc'}"]) == 1
    assert capsys.readouterr().err.endswith(
        f"(connection refused): is the cluster up, and is {tmp_path / 'kc'} its kubeconfig?\n"
    )


# -- DRA nodes: cards from the ResourceSlices, shares from the allocated claims --------------------

GIB = 1 << 30


def dra_slice(node: str, cards: list[tuple[int, str, int]]) -> dict:
    """A slice as vgpu dra-plugin publishes it (the API server's quantities as it returns them)."""
    devices = [
        {
            "name": f"gpu-{i}",
            "attributes": {
                "uuid": {"string": uuid},
                "productName": {"string": "NVIDIA H200"},
                "index": {"int": i},
            },
            "capacity": {"memory": {"value": f"{gib}Gi"}, "cores": {"value": "100"}},
            "allowMultipleAllocations": True,
        }
        for i, uuid, gib in cards
    ]
    spec = {"driver": "vgpu.openaios.io", "nodeName": node, "pool": {"name": node}, "devices": devices}
    return {"metadata": {"name": f"{node}-vgpu.openaios.io"}, "spec": spec}


def dra_claim(name: str, node: str, device: str, consumed: dict | None, pods: list[str]) -> dict:
    result = {"request": "gpu", "driver": "vgpu.openaios.io", "pool": node, "device": device}
    if consumed is not None:
        result["consumedCapacity"] = consumed
    reserved = [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods]
    status = {"allocation": {"devices": {"results": [result]}}, "reservedFor": reserved}
    return {"metadata": {"name": name, "namespace": "ml"}, "status": status}


def test_dra_nodes_show_their_slices_cards_and_each_claims_share() -> None:
    stale = node("d1")  # an inventory an earlier device plugin left on a node now in DRA mode
    stale["metadata"]["labels"] = {"openaios.io/gpu-mode": "dra"}
    slices = [
        dra_slice("d1", [(0, "GPU-x", 140), (1, "GPU-y", 140)]),
        {"spec": {"driver": "other.example.com", "nodeName": "d1", "devices": []}},
    ]
    claims = [
        dra_claim("small", "d1", "gpu-0", {"memory": "3000Mi", "cores": "30"}, ["notebook"]),
        dra_claim("two", "d1", "gpu-0", {"memory": "1Gi", "cores": "20"}, ["a", "b"]),
        dra_claim("whole", "d1", "gpu-1", None, []),  # 1.34: no consumedCapacity, the whole card
        dra_claim("elsewhere", "gone", "gpu-0", None, ["x"]),
    ]
    [status] = build_status([stale], [], [], NOW, slices=slices, claims=claims)
    assert (status.name, status.mode, status.lease) == ("d1", "dra", "")
    x, y = status.cards
    assert (x.uuid, x.memory_mib, x.cores) == ("GPU-x", 140 * 1024, 100)
    assert [(s.claim, s.pod, s.memory_mib, s.cores, s.phase) for s in x.shares] == [
        ("small/gpu", "notebook", 3000, 30, "reserved"),
        ("two/gpu", "a,b", 1024, 20, "reserved"),
    ]
    assert (x.memory_used_mib, x.cores_used) == (4024, 50)
    assert [(s.claim, s.memory_mib, s.cores, s.phase) for s in y.shares] == [
        ("whole/gpu", 140 * 1024, 100, "allocated")
    ]
    text = render_text([status])
    assert text.startswith("node d1  mode dra (ResourceSlice)\n")
    assert "  gpu 0 GPU-x NVIDIA H200  mem 4024/143360 MiB  cores 50/100  claims 2" in text
    assert "    ml/notebook claim small/gpu  3000 MiB  cores 30%  reserved" in text
    assert "    ml/- claim whole/gpu  143360 MiB  cores 100%  allocated" in text


def test_a_dra_cards_mode_is_its_shares_attribute_sharing_timeslice_where_absent() -> None:
    slices = [dra_slice("d1", [(0, "GPU-x", 140), (1, "GPU-y", 140)])]
    slices[0]["spec"]["devices"][1]["attributes"]["sharing"] = {"string": "mps"}
    [status] = build_status([], [], [], NOW, slices=slices, claims=[])
    assert [c.mode for c in status.cards] == ["timeslice", "mps"]
    assert "  gpu 1 GPU-y NVIDIA H200  mem 0/143360 MiB  cores 0/100  claims 0  mode mps\n" in render_text(
        [status]
    )


def test_status_reads_the_dra_objects_and_a_dra_node_may_be_named(
    fake_kube: type[FakeKube],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dra_node = {"metadata": {"name": "d1", "labels": {"openaios.io/gpu-mode": "dra"}}}
    monkeypatch.setattr(FakeKube, "nodes", [node("n1"), dra_node])
    served = {
        "/apis/resource.k8s.io/v1/resourceslices": {"items": [dra_slice("d1", [(0, "GPU-x", 80)])]},
        "/apis/resource.k8s.io/v1/resourceclaims": {
            "items": [dra_claim("c", "d1", "gpu-0", {"memory": "2Gi", "cores": "10"}, ["p"])]
        },
    }
    monkeypatch.setattr(FakeKube, "get", lambda self, path: served[path])
    assert main(["status", f"--kubeconfig={tmp_path / 'kc'}", "--node", "d1", "-o", "json"]) == 0
    [doc] = json.loads(capsys.readouterr().out)
    assert doc["mode"] == "dra" and doc["cards"][0]["shares"][0]["claim"] == "c/gpu"
    assert doc["cards"][0]["memoryUsedMiB"] == 2048
    assert main(["status", f"--kubeconfig={tmp_path / 'kc'}", "--node", "n1"]) == 0
    assert "d1" not in capsys.readouterr().out  # only the nodes asked for


def test_a_mig_card_on_the_dra_path_is_shown_once_with_each_claims_slice() -> None:
    from vgpu.core.mig import H100_80GB
    from vgpu.dra.migslices import device, mig_slices, slots
    from vgpu.node.discovery import Card

    card = Card(uuid="GPU-m", index=0, model="NVIDIA H100 80GB HBM3", memory_mib=81559)
    pool = mig_slices("d2-vgpu.openaios.io", "d2", [(card, slots(card, H100_80GB))])
    assert device(slots(card, H100_80GB)[0])["attributes"]["type"] == {"string": "mig"}
    claims = [
        dra_claim("big", "d2", "gpu-0-mig-3g-40gb-0", None, ["trainer"]),
        dra_claim("small", "d2", "gpu-0-mig-1g-10gb-6", None, []),
    ]
    [status] = build_status([], [], [], NOW, slices=[dra_slice("d2", []), *pool], claims=claims)
    [m] = status.cards
    assert (m.uuid, m.model, m.memory_mib) == ("GPU-m", "NVIDIA H100 80GB HBM3 (MIG)", 81152)
    assert [(s.claim, s.memory_mib, s.cores) for s in m.shares] == [
        ("big/gpu", 40448, 42),
        ("small/gpu", 9984, 14),
    ]


def test_a_share_made_as_a_mig_instance_on_demand_names_it() -> None:
    from vgpu.core.annotations import MigDynamic, MigGrant, MigInstance

    dyn = MigDynamic("H100 80GB", (MigInstance("3g.40gb", 4, 4, "uid-m"),))
    inv = NodeInventory((Device("GPU-m", 0, "NVIDIA H100 80GB HBM3", 81559, 100, 7, mig_dynamic=dyn),))
    n = {"metadata": {"name": "n1", "annotations": {DEVICES_ANNOTATION: encode_devices(inv)}}}
    alloc = Allocation(
        "n1", (ContainerAllocation("main", (DeviceAllocation("GPU-m", 30000, 0, MigGrant("3g.40gb", 4)),)),)
    )
    p = {
        "metadata": {
            "name": "m",
            "namespace": "ml",
            "uid": "uid-m",
            "annotations": {ALLOCATION_ANNOTATION: encode_allocation(alloc), PHASE_ANNOTATION: "allocated"},
        }
    }
    [status] = build_status([n], [p], [lease("2026-01-01T11:59:50Z")], NOW)
    assert status.cards[0].shares[0].mig == "3g.40gb at slice 4"
    assert "ml/m main  30000 MiB  cores uncapped  allocated  MIG 3g.40gb at slice 4" in render_text([status])
