"""Who a DRA claim's region belongs to, for the monitor's labels: the claim's record on the node.

The DRA plugin prepares each claim's request as one folder ``dra_<claim-uid>_<request>`` (its
region, and its grant beside the device plugin's) and writes a record of the claim,
``<state-dir>/dra/claims/<claim-uid>.json``: its namespace and name, and the pods it is
reserved for (``{"namespace": ..., "name": ..., "pods": [{"name": ..., "uid": ...}]}``). A claim
may serve several containers and pods, so its region's series name the claim where a
device-plugin container's name the container: ``container="claim:<claim>/<request>"``, with the
pod only where the claim serves exactly one. A record missing or unreadable leaves the labels to
the folder's name alone; it never fails a scrape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vgpu.core.drarecord import record_path
from vgpu.plugin.monitor.mounts import claim_of


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
    try:
        record = json.loads(record_path(vgpu_dir, uid).read_text())
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict):
        return ClaimLabels("", "", "", f"claim:{uid}/{request}")
    name = str(record.get("name") or uid)
    pods = [p for p in record.get("pods") or [] if isinstance(p, dict)]
    pod, pod_uid = (str(pods[0].get("name", "")), str(pods[0].get("uid", ""))) if len(pods) == 1 else ("", "")
    return ClaimLabels(str(record.get("namespace") or ""), pod, pod_uid, f"claim:{name}/{request}")
