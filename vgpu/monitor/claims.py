"""Who a DRA claim's region belongs to, for the monitor's labels: the claim's record on the node.

The DRA plugin prepares each claim's request as one folder ``dra_<claim-uid>_<request>`` (its
region, and its grant beside the device plugin's) and writes a record of the claim,
``<state-dir>/dra/claims/<claim-uid>.json`` (contract 7, ``vgpu.core.drarecord``): its namespace
and name, and the pods it is reserved for. A claim
may serve several containers and pods, so its region's series name the claim where a
device-plugin container's name the container: ``container="claim:<claim>/<request>"``, with the
pod only where the claim serves exactly one. A record missing, unreadable or of another version
leaves the labels to the folder's name alone; it never fails a scrape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vgpu.core.drarecord import read_record
from vgpu.monitor.mounts import claim_of


@dataclass(frozen=True)
class ClaimLabels:
    namespace: str
    pod: str
    pod_uid: str
    container: str


def claim_labels(vgpu_dir: Path, folder: str) -> ClaimLabels | None:
    """The labels of the DRA folder ``folder`` (None for a device-plugin container's folder)."""
    found = claim_of(folder)
    if found is None:
        return None
    uid, request = found
    record = read_record(vgpu_dir, uid)
    if record is None:
        return ClaimLabels("", "", "", f"claim:{uid}/{request}")
    pod, pod_uid = (record.pods[0].name, record.pods[0].uid) if len(record.pods) == 1 else ("", "")
    return ClaimLabels(record.namespace, pod, pod_uid, f"claim:{record.name or uid}/{request}")
