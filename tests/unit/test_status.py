"""`vgpu status` joins nodes, pods and Leases into who got what on each card."""

from __future__ import annotations

import datetime as dt
import json

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
    assert "gpu 1 GPU-b A100  mem 1000/80000 MiB  cores 0/100  vgpus 1/10  UNHEALTHY" in text
    assert "env CUDA_DEVICE_MEMORY_LIMIT_0=3000m" in text


def test_an_old_lease_shows_expired_and_a_missing_one_missing() -> None:
    assert build_status([node("n1")], [], [lease("2026-01-01T11:00:00Z")], NOW)[0].lease == "expired"
    assert build_status([node("n1")], [], [], NOW)[0].lease == "missing"


def test_a_share_on_a_card_the_node_lacks_is_shown_apart() -> None:
    [status] = build_status([node("n1")], [pod("x", [("GPU-gone", 10, 0)], "bound")], [], NOW)
    assert [s.pod for s in status.unplaced] == ["x"]
    assert "on a card the node does not list" in render_text([status])


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
    assert "ml/r main  1000 MiB  0%  rejected (UnexpectedAdmissionError: " in render_text([status])


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
    assert "ml/a main  3000 MiB  30%  allocated  using 1664 MiB" in render_text([status])

    for bad in ("{not json", "[1, 2]", '"text"', '{"uid-a_main": [1]}', '{"uid-a_main": {"GPU-a": "5"}}'):
        with_usage["metadata"]["annotations"] = {USAGE_ANNOTATION: bad}
        [status] = build_status([node("n1")], [a], [with_usage], NOW)
        assert status.cards[0].shares[0].used_bytes is None
