"""Pods filter refused for lack of room, nudged when room frees.

A pod filter refused for lack of room is retried by kube-scheduler on cluster events, among them
the deletion of the pod that frees the room. That event can reach kube-scheduler, and the retry
reach filter, before our own pod watch has delivered it: the retry is refused again and no further
event comes, so kube-scheduler would wait for its next sweep of unschedulable pods (every 30 s,
for pods waiting longer than --pod-max-in-unschedulable-pods-duration). So when the ledger frees
room, pods refused within :data:`NUDGE_WINDOW_S` before are nudged: the Syncer annotates each
(``ann.ROOM_FREED_ANNOTATION``), and a pod's own update makes kube-scheduler retry it. At most
:data:`NUDGE_MAX` per freeing, the most recently refused first; :data:`REFUSED_KEPT` pods tracked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from vgpu.core.placement import FilterResult

NUDGE_WINDOW_S = 5.0
NUDGE_MAX = 100
REFUSED_KEPT = 4096


class Nudges:
    """The refused pods and when room last freed. ``lock`` is the state's (shared) lock."""

    def __init__(self, clock: Callable[[], float], lock: threading.RLock) -> None:
        self._clock = clock
        self._lock = lock
        # uid -> (when, namespace, name), oldest first
        self.refused: dict[str, tuple[float, str, str]] = {}
        self.freed_at = 0.0
        self.room_freed = threading.Event()  # the Syncer waits on it

    def note_refusal(self, pod: dict[str, Any], uid: str | None, result: FilterResult, now: float) -> None:
        """Remember a pod refused for lack of room (some node failed, none fit). Caller holds the lock."""
        if not uid:
            return
        self.refused.pop(uid, None)  # re-inserted last: the dict stays in refusal order
        if result.nodes or not result.failed or result.error:
            return
        meta = pod.get("metadata") or {}
        self.refused[uid] = (now, str(meta.get("namespace") or "default"), str(meta.get("name") or ""))
        while len(self.refused) > REFUSED_KEPT:
            self.refused.pop(next(iter(self.refused)))

    def placed(self, uid: str) -> None:
        """The pod got a node (or left): not refused any more. Caller holds the lock."""
        self.refused.pop(uid, None)

    def freed(self) -> None:
        """The ledger freed room. Caller holds the lock."""
        self.freed_at = self._clock()
        self.room_freed.set()

    def take(self) -> list[tuple[str, str, str]]:
        """(uid, namespace, name) of the pods to nudge since room last freed, most recent first;
        each is forgotten (a new refusal notes it again)."""
        with self._lock:
            since = self.freed_at - NUDGE_WINDOW_S
            out: list[tuple[str, str, str]] = []
            for uid, (when, namespace, name) in reversed(self.refused.items()):
                if when < since or len(out) == NUDGE_MAX:
                    break
                out.append((uid, namespace, name))
            for uid, _, _ in out:
                del self.refused[uid]
            return out
