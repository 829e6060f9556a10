"""The order in which pods arrived on this node: the order kubelet admits them in.

kubelet learns of its pods from a watch on ``spec.nodeName=<node>``: every pod the scheduler
binds arrives in its own watch event, in the order the Bindings were written, and kubelet
admits pods one at a time in that order (Allocate for each container). Only a batch that
arrives together (kubelet's first list after it starts) is sorted, by creationTimestamp, at
one-second resolution, with ties in no defined order.

The plugin watches the same pods, so it sees the same order: each pod gets the *rank* of the
observation in which the plugin first saw it on the node. Pods first seen together (the
plugin's own first list, a list after its watch broke, or every pod waiting when kubelet
restarts) share a rank, and only their creation time can order them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from vgpu.core.backoff import Backoff
from vgpu.kube.informer import Informer

log = logging.getLogger(__name__)


@runtime_checkable
class PodWatchSource(Protocol):
    """List and watch pods by field selector (vgpu.kube.client.Kube provides both)."""

    def list_pods(self, field_selector: str | None = None) -> tuple[list[dict[str, Any]], str]: ...

    def watch_pods(
        self, resource_version: str, field_selector: str | None = None, timeout_s: int = 300
    ) -> Iterator[tuple[str, dict[str, Any]]]: ...


class Arrivals:
    """Pod UID -> rank of the observation that first saw it; a lower rank arrived earlier."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rank: dict[str, int] = {}
        self._observations = 0
        self.watched = False  # a watch feeds this (so a UID it lacks is worth waiting for)

    def observe(self, uids: Iterable[str]) -> None:
        """One observation: the UIDs not seen before arrived now, together."""
        with self._cond:
            new = [u for u in uids if u not in self._rank]
            if not new:
                return
            self._observations += 1
            for u in new:
                self._rank[u] = self._observations
            self._cond.notify_all()

    def rebatch(self) -> None:
        """kubelet restarted: it lists every pod again and admits those waiting as one batch."""
        with self._cond:
            self._observations += 1
            for u in self._rank:
                self._rank[u] = self._observations
            self._cond.notify_all()

    def forget(self, uids: Iterable[str]) -> None:
        with self._cond:
            for u in uids:
                self._rank.pop(u, None)

    def retain(self, uids: Iterable[str]) -> None:
        keep = set(uids)
        with self._cond:
            for u in [u for u in self._rank if u not in keep]:
                del self._rank[u]

    def rank(self, uid: str) -> int | None:
        with self._cond:
            return self._rank.get(uid)

    def ranks(self, uids: Iterable[str], wait_s: float) -> dict[str, int]:
        """Ranks of ``uids``; UIDs the watch has not delivered yet are waited for up to ``wait_s``.

        Whatever is still unknown then (no watch runs, or it lags) is observed now, as one batch:
        it arrived after everything already ranked.
        """
        wanted = list(uids)
        with self._cond:
            if self.watched and wait_s > 0:
                self._cond.wait_for(lambda: all(u in self._rank for u in wanted), wait_s)
        self.observe(wanted)
        with self._cond:
            return {u: self._rank[u] for u in wanted if u in self._rank}


class ArrivalWatch:
    """Feeds :class:`Arrivals` from a list and watch of the node's pods, relisting when it breaks."""

    def __init__(
        self,
        source: PodWatchSource,
        node: str,
        arrivals: Arrivals,
        timeout_s: int = 300,
        retry_s: float = 1.0,
    ) -> None:
        self.source = source
        self.node = node
        self.arrivals = arrivals
        self.timeout_s = timeout_s
        self.selector = f"spec.nodeName={node}"
        self.informer = Informer(
            f"pods of node {node}",
            lambda: source.list_pods(field_selector=self.selector),
            lambda rv: source.watch_pods(rv, self.selector, self.timeout_s),
            self._on_list,
            self._on_event,
            backoff=Backoff(retry_s, retry_s),  # a fixed delay: the next Allocate needs the ranks
            on_broken=self._on_broken,
            logger=log,
        )

    @property
    def lists(self) -> int:
        """How many times it listed (tests and logs)."""
        return self.informer.lists

    def start(self, first_list_timeout_s: float = 10.0) -> None:
        """Start the watch; returns once the first list is in (or after the timeout)."""
        self.informer.start()
        self.informer.wait_synced(first_list_timeout_s)

    def stop(self) -> None:
        self.informer.stop(timeout_s=None)
        self.arrivals.watched = False

    def _on_list(self, pods: list[dict[str, Any]]) -> None:
        uids = [str((p.get("metadata") or {}).get("uid")) for p in pods]
        self.arrivals.retain(uids)
        self.arrivals.observe(uids)
        self.arrivals.watched = True

    def _on_event(self, kind: str, obj: dict[str, Any]) -> None:
        uid = str((obj.get("metadata") or {}).get("uid"))
        if kind in ("ADDED", "MODIFIED"):
            self.arrivals.observe([uid])
        elif kind == "DELETED":
            self.arrivals.forget([uid])

    def _on_broken(self) -> None:
        self.arrivals.watched = False  # until the next list: a UID it lacks is not worth waiting for
