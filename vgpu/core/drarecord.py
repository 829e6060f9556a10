"""Where the DRA plugin keeps a prepared claim's record on the node (contract 7, docs/contracts.md).

``<state-dir>/dra/claims/<claim-uid>.json``: written by ``vgpu dra-plugin`` at
NodePrepareResources (``vgpu.dra.prepare``, its fields), removed at NodeUnprepareResources, and
read by the node monitor (``vgpu.plugin.monitor.claims``) to name a claim's folder in its labels.
The writer and the reader stand on different floors, so the place lives here, under both.
"""

from __future__ import annotations

from pathlib import Path

RECORD_VERSION = 1  # a reader refuses another version, naming it
DRA_SUBDIR = "dra"  # the DRA plugin's own folder under --state-dir (its checkpoint, the records)
CLAIMS_SUBDIR = f"{DRA_SUBDIR}/claims"


def dra_dir(state_dir: Path) -> Path:
    return state_dir / DRA_SUBDIR


def claims_dir(state_dir: Path) -> Path:
    """The folder of the records, one ``<claim-uid>.json`` each."""
    return state_dir / CLAIMS_SUBDIR


def record_path(state_dir: Path, claim_uid: str) -> Path:
    return claims_dir(state_dir) / f"{claim_uid}.json"
