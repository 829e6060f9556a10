"""Keeping :class:`SchedulerState` current: list then watch pods, nodes and Leases; hold the Lease.

Each kind has its own :class:`vgpu.kube.informer.Informer`: list (replacing what the state
knew), then watch from the list's resourceVersion; a stale version (HTTP 410) or a broken stream
means list again, after a short backoff on errors. The state reports ready once every kind has
been listed once.

Only one replica serves at a time: the one holding the Lease ``config.leader_lease`` in
``config.namespace``. On taking it over, the replica lists pods again before serving, so
it sees every allocation the previous holder wrote. A holder that cannot renew within the
Lease's duration stops serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

from vgpu.core import annotations as ann
from vgpu.core.errors import KubeError
from vgpu.core.service import Service
from vgpu.extender.state import SchedulerState
from vgpu.kube import lease as leases
from vgpu.kube.client import Kube, now_micro
from vgpu.kube.informer import Informer

log = logging.getLogger(__name__)
Obj = dict[str, Any]


class Syncer:
    def __init__(self, state: SchedulerState, kube: Kube, identity: str) -> None:
        self.state = state
        self.kube = kube
        self.identity = identity
        self.stop = threading.Event()  # ends every loop below
        cfg = state.config
        self._pod_selector = f"spec.schedulerName={cfg.scheduler_name}"

        informer = partial(Informer, stop=self.stop, on_synced=self._on_synced, logger=log)
        self.informers = [
            informer("pods", self._list_pods, self._watch_pods, state.replace_pods, self._on_pod),
            informer(
                "nodes",
                self.kube.list_node_metadata,  # the inventory annotation is all it reads
                self.kube.watch_node_metadata,
                state.replace_nodes,
                self._on_node,
            ),
            informer(
                "leases",
                lambda: self.kube.list_leases(cfg.namespace),
                lambda rv: self.kube.watch_leases(cfg.namespace, rv),
                state.replace_leases,
                self._on_lease,
            ),
        ]
        self._services = [
            Service("vgpu-sync-leader", lambda _stop: self._lead(), self.stop),
            Service.every("vgpu-sync-metrics", 5.0, self._refresh_metrics, self.stop, log),
            Service("vgpu-sync-nudge", lambda _stop: self._nudge(), self.stop),
        ]
        self._seen: dict[str, tuple[int, int, tuple[str, ...]]] = {}  # the gauges' (see refresh_gauges)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        for informer in self.informers:
            informer.start()
        for service in self._services:
            service.start()

    def close(self) -> None:
        self.stop.set()
        if self.state.leader.is_set():
            self._release()
        self.kube.close()

    # -- list + watch ------------------------------------------------------------------------------
    def _list_pods(self) -> tuple[list[Obj], str]:
        return self.kube.list_pods(field_selector=self._pod_selector)

    def _watch_pods(self, rv: str) -> Iterator[tuple[str, Obj]]:
        return self.kube.watch_pods(rv, field_selector=self._pod_selector)

    def _on_pod(self, kind: str, obj: Obj) -> None:
        self.state.apply_pod(obj, deleted=kind == "DELETED")

    def _on_node(self, kind: str, obj: Obj) -> None:
        if kind == "DELETED":
            self.state.forget_node((obj.get("metadata") or {}).get("name", ""))
        else:
            self.state.apply_node(obj)

    def _on_lease(self, kind: str, obj: Obj) -> None:
        self.state.apply_lease(obj, deleted=kind == "DELETED")

    def _on_synced(self) -> None:
        """One informer listed for the first time: the state is loaded once all three have."""
        if all(i.synced.is_set() for i in self.informers) and not self.state.synced.is_set():
            log.info("cluster state loaded: %d pods hold vGPUs", len(self.state.ledger.pods()))
            self.state.synced.set()

    # -- the active-replica Lease ----------------------------------------------------------------
    def _lead(self) -> None:
        cfg = self.state.config
        period = max(1.0, cfg.lease_duration_s / 3)
        while not self.stop.is_set():
            held = False
            try:
                held = self._try_acquire()
            except KubeError as err:
                log.warning("extender Lease: %s", err)
            if held:
                if not self.state.leader.is_set():
                    self._take_over()
            elif self.state.leader.is_set():  # never serve without a confirmed Lease
                log.warning("lost the extender Lease %s/%s; standing by", cfg.namespace, cfg.leader_lease)
                self.state.leader.clear()
            self.stop.wait(period if held else min(period, 2.0))

    def _take_over(self) -> None:
        # wait for the first full load, then list pods again: the last holder may have bound more
        while not self.state.synced.wait(1.0):
            if self.stop.is_set():
                return
        try:
            pods, _ = self._list_pods()
            self.state.replace_pods(pods)
        except KubeError as err:
            log.warning("relist before serving failed: %s; serving from the watch", err)
        log.info("holding the extender Lease as %s: serving", self.identity)
        self.state.leader.set()

    def _try_acquire(self) -> bool:
        cfg = self.state.config
        return leases.acquire(self.kube, cfg.namespace, cfg.leader_lease, self.identity, cfg.lease_duration_s)

    def _release(self) -> None:
        cfg = self.state.config
        try:
            leases.release(self.kube, cfg.namespace, cfg.leader_lease, self.identity)
        except KubeError as err:
            log.warning("could not release the extender Lease: %s", err)
        self.state.leader.clear()

    # -- retries after room frees ----------------------------------------------------------------------
    def _nudge(self) -> None:
        """Annotate the pods refused just before room freed, so kube-scheduler retries them now
        rather than at its next sweep (see vgpu.extender.state.NUDGE_WINDOW_S)."""
        while not self.stop.is_set():
            if not self.state.room_freed.wait(1.0):
                continue
            self.state.room_freed.clear()
            if not self.state.leader.is_set():
                continue  # a standby replica refused nothing; the active one nudges
            for uid, namespace, name in self.state.take_nudges():
                try:
                    self.kube.patch_pod_annotations(
                        namespace, name, {ann.ROOM_FREED_ANNOTATION: now_micro()}, uid=uid
                    )
                except KubeError as err:  # gone, or re-created under its name: nothing to retry
                    log.info("could not nudge pod %s/%s for a retry: %s", namespace, name, err)

    # -- gauges --------------------------------------------------------------------------------------
    def _refresh_metrics(self) -> None:
        from vgpu.extender import metrics as m

        refresh_gauges(self.state, m, self._seen)


def refresh_gauges(
    state: SchedulerState, m: Any, seen: dict[str, tuple[int, int, tuple[str, ...]]] | None = None
) -> None:
    """Set the per-card and per-node gauges from the state as it is now.

    ``seen`` (node -> (ledger node version, inventory id, the card UUIDs) last written) skips nodes
    that did not change: at 1,000 nodes of 8 cards, rewriting every gauge each time cost more CPU
    than the verbs. It also says which series to remove: those of a node no longer there with an
    inventory (the Node deleted, its inventory unusable) and of a card its inventory dropped.
    """
    from vgpu.core.ledger import ZERO
    from vgpu.core.selection import card_kind

    m.LEADER.set(1 if state.leader.is_set() else 0)
    for reason, n in state.skipped().items():
        m.NODES_SKIPPED.labels(reason).set(n)
    written = seen if seen is not None else {}
    for node, inv, usage, version in state.snapshot(changed_since=seen):
        total = used = 0
        for d in inv.devices:
            u = usage.get(d.uuid, ZERO)
            m.CARD_MEMORY_CAPACITY.labels(node, d.uuid).set(d.memory_mib * m.MiB)
            m.CARD_MEMORY_ALLOCATED.labels(node, d.uuid).set(u.memory_mib * m.MiB)
            m.CARD_CORES_ALLOCATED.labels(node, d.uuid).set(u.cores / 100)
            m.CARD_VGPUS_CAPACITY.labels(node, d.uuid).set(d.split)
            m.CARD_VGPUS_ALLOCATED.labels(node, d.uuid).set(u.count)
            m.set_card_mode(node, d.uuid, card_kind(d))
            total += d.memory_mib
            used += u.memory_mib
        m.NODE_MEMORY_CAPACITY.labels(node).set(total * m.MiB)
        m.NODE_MEMORY_ALLOCATED.labels(node).set(used * m.MiB)
        cards = tuple(d.uuid for d in inv.devices)
        dropped = set(written.get(node, (0, 0, ()))[2]) - set(cards)
        for uuid in dropped:
            m.forget_card(node, uuid)
        written[node] = (version, id(inv), cards)
    for node in set(written) - state.inventoried():
        for uuid in written.pop(node)[2]:
            m.forget_card(node, uuid)
        m.forget_node(node)
