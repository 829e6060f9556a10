"""Contract 7 in one home (vgpu/core/drarecord.py): the record the DRA plugin writes is the one the
node monitor reads, a record of another version is refused, and a missing or broken one reads as
none (the monitor then names the claim's folder alone)."""

from __future__ import annotations

import json
from pathlib import Path

from vgpu.core.drarecord import (
    RECORD_VERSION,
    ClaimRecord,
    RecordPod,
    claims_dir,
    encode_record,
    read_record,
    record_path,
    request_entry,
)
from vgpu.dra.cdi import write_json
from vgpu.monitor.claims import ClaimLabels, claim_labels

UID = "7d0e4c51-93a4-4f0e-b1d6-2c3e4f5a6b7c"


def _write(state: Path, reserved_for: list[dict[str, str]]) -> None:
    entry = request_entry(
        request="gpu",
        device="gpu-0",
        uuid="GPU-a",
        memory_mib=3000,
        cores=30,
        share_id="",
        priority=1,
        sm_policy="cap",
        grant=state / "grants" / f"dra_{UID}_gpu.limits",
        region_dir=state / "containers" / f"dra_{UID}_gpu",
    )
    doc = encode_record(
        namespace="ml", name="trainer-gpu", uid=UID, node="n1", reserved_for=reserved_for, requests=[entry]
    )
    write_json(record_path(state, UID), doc)  # as the plugin writes it: whole, renamed into place


def test_the_plugins_record_is_what_the_monitor_reads(tmp_path: Path) -> None:
    reserved = [
        {"resource": "pods", "name": "trainer", "uid": "uid-9"},
        {"resource": "jobs", "name": "not-a-pod", "uid": "uid-0"},
    ]
    _write(tmp_path, reserved)
    assert record_path(tmp_path, UID) == tmp_path / "dra" / "claims" / f"{UID}.json"
    assert record_path(tmp_path, UID).parent == claims_dir(tmp_path)
    doc = json.loads(record_path(tmp_path, UID).read_text())
    assert doc["version"] == RECORD_VERSION == 1
    assert doc["requests"][0]["memoryBytes"] == 3000 << 20 and doc["requests"][0]["grant"].endswith(".limits")
    assert read_record(tmp_path, UID) == ClaimRecord("ml", "trainer-gpu", (RecordPod("trainer", "uid-9"),))
    assert claim_labels(tmp_path, f"dra_{UID}_gpu") == ClaimLabels(
        "ml", "trainer", "uid-9", "claim:trainer-gpu/gpu"
    )


def test_a_record_of_another_version_missing_or_broken_reads_as_none(tmp_path: Path) -> None:
    assert read_record(tmp_path, UID) is None  # a claim just unprepared
    _write(tmp_path, [])
    path = record_path(tmp_path, UID)
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "version": 2}))
    assert read_record(tmp_path, UID) is None
    assert claim_labels(tmp_path, f"dra_{UID}_gpu") == ClaimLabels("", "", "", f"claim:{UID}/gpu")
    path.write_text("{not json")
    assert read_record(tmp_path, UID) is None
    path.write_text("[]")
    assert read_record(tmp_path, UID) is None
