"""The DRA plugin's record of a prepared claim on the node (contract 7, docs/contracts.md): where
it lives, its fields and version, written and read here alone.

``<state-dir>/dra/claims/<claim-uid>.json``: written by ``vgpu dra-plugin`` at
NodePrepareResources (``vgpu.dra.prepare`` gives the values, :func:`encode_record` the document),
removed at NodeUnprepareResources, and read by the node monitor (``vgpu.monitor.claims``,
through :func:`read_record`) to name a claim's folder in its labels. The writer and the reader
stand on different floors, so the contract lives here, under both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORD_VERSION = 1  # a reader refuses another version (read_record: None)
DRA_SUBDIR = "dra"  # the DRA plugin's own folder under --state-dir (its checkpoint, the records)
CLAIMS_SUBDIR = f"{DRA_SUBDIR}/claims"


def dra_dir(state_dir: Path) -> Path:
    return state_dir / DRA_SUBDIR


def claims_dir(state_dir: Path) -> Path:
    """The folder of the records, one ``<claim-uid>.json`` each."""
    return state_dir / CLAIMS_SUBDIR


def record_path(state_dir: Path, claim_uid: str) -> Path:
    return claims_dir(state_dir) / f"{claim_uid}.json"


def request_entry(
    *,
    request: str,
    device: str,
    uuid: str,
    memory_mib: int,
    cores: int,
    share_id: str,
    priority: int | None,
    sm_policy: str | None,
    grant: Path,
    region_dir: Path,
) -> dict[str, Any]:
    """One allocation result of the claim as the record lists it (``requests[]``)."""
    return {
        "request": request,
        "device": device,
        "uuid": uuid,
        "memoryBytes": memory_mib << 20,
        "cores": cores,
        "shareID": share_id,
        "priority": priority,
        "smPolicy": sm_policy,
        "grant": str(grant),
        "regionDir": str(region_dir),
    }


def encode_record(
    *,
    namespace: str,
    name: str,
    uid: str,
    node: str,
    reserved_for: Iterable[Mapping[str, str]],
    requests: list[dict[str, Any]],
) -> dict[str, Any]:
    """The record's document: ``pods`` are the entries of ``reserved_for`` (the claim's
    ``status.reservedFor``) of resource ``pods``."""
    return {
        "version": RECORD_VERSION,
        "namespace": namespace,
        "name": name,
        "uid": uid,
        "node": node,
        "pods": [{"name": r["name"], "uid": r["uid"]} for r in reserved_for if r["resource"] == "pods"],
        "requests": requests,
    }


@dataclass(frozen=True)
class RecordPod:
    name: str
    uid: str


@dataclass(frozen=True)
class ClaimRecord:
    """What a reader takes from a record: whose claim it is (fields it does not know are passed
    over; a missing field reads as empty)."""

    namespace: str
    name: str
    pods: tuple[RecordPod, ...]


def read_record(state_dir: Path, claim_uid: str) -> ClaimRecord | None:
    """The claim's record, or None where there is none (a claim just unprepared), it cannot be
    read, or it says another version than :data:`RECORD_VERSION`."""
    try:
        doc = json.loads(record_path(state_dir, claim_uid).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("version", RECORD_VERSION) != RECORD_VERSION:
        return None  # a record without a version is read as this one
    pods = tuple(
        RecordPod(str(p.get("name", "")), str(p.get("uid", "")))
        for p in doc.get("pods") or []
        if isinstance(p, dict)
    )
    return ClaimRecord(str(doc.get("namespace") or ""), str(doc.get("name") or ""), pods)
