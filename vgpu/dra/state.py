"""What the DRA plugin keeps on the node: its checkpoint and one record per prepared claim.

``<state-dir>/dra/checkpoint.json`` holds, per prepared claim UID, the answer given to the kubelet
and the host files made for it, so that a plugin started again answers a repeated
NodePrepareResources exactly as before without writing anything, and removes exactly those files
at NodeUnprepareResources. ``<state-dir>/dra/claims/<claim-uid>.json`` (contract 7,
docs/contracts.md) tells the node monitor which card, memory and cores each claim request holds.
Both are written whole or not at all (a temporary file renamed over the old one).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from vgpu.core.drarecord import dra_dir
from vgpu.dra.cdi import write_json

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1


def _entry_ok(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("devices"), list)
        and all(isinstance(d, dict) for d in entry["devices"])
        and isinstance(entry.get("folders"), list)
        and all(isinstance(f, str) and "/" not in f for f in entry["folders"])
    )


class Checkpoint:
    """The prepared claims by UID; every change is on disk before the call returns."""

    def __init__(self, state_dir: Path) -> None:
        self.path = dra_dir(state_dir) / "checkpoint.json"
        self._lock = threading.Lock()
        self._claims: dict[str, dict[str, Any]] = self._load()

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            return self._set_aside(f"unreadable ({err})")
        if not isinstance(doc, dict) or doc.get("version") != CHECKPOINT_VERSION:
            version = doc.get("version") if isinstance(doc, dict) else None
            return self._set_aside(f"version {version!r}, this plugin reads {CHECKPOINT_VERSION}")
        claims = doc.get("claims")
        if not isinstance(claims, dict) or not all(_entry_ok(v) for v in claims.values()):
            return self._set_aside("claims is not a mapping of claim UIDs to answers and folders")
        return claims

    def _set_aside(self, why: str) -> dict[str, dict[str, Any]]:
        """A checkpoint this plugin cannot read is kept for a person to look at, and the plugin
        starts from none: the kubelet prepares its claims again (the answer is rebuilt from the
        API server) and unprepares by the claim's UID alone."""
        aside = self.path.with_name(f"checkpoint.json.bad-{int(time.time())}")
        log.error("%s is %s: moved to %s; starting with no prepared claims", self.path, why, aside)
        try:
            self.path.rename(aside)
        except OSError as err:
            log.error("cannot move %s aside (%s)", self.path, err)
        return {}

    def _save(self) -> None:
        write_json(self.path, {"version": CHECKPOINT_VERSION, "claims": self._claims}, mode=0o600)

    def get(self, uid: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self._claims.get(uid)
            return None if entry is None else json.loads(json.dumps(entry))

    def uids(self) -> list[str]:
        with self._lock:
            return sorted(self._claims)

    def put(self, uid: str, entry: dict[str, Any]) -> None:
        with self._lock:
            self._claims[uid] = entry
            self._save()

    def remove(self, uid: str) -> None:
        with self._lock:
            if self._claims.pop(uid, None) is not None:
                self._save()
