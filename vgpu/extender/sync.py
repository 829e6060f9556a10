"""Keeping :class:`SchedulerState` current: list then watch pods, nodes and Leases; hold the Lease.

Each kind has its own thread: list (replacing what the state knew), then watch from the list's
resourceVersion; a stale version (HTTP 410) or a broken stream means list again, after a short
backoff on errors. The state reports ready once every kind has been listed once.

Only one replica serves at a time: the one holding the Lease ``config.leader_lease`` in
``config.namespace``. On taking it over, the replica lists pods again before serving, so
it sees every allocation the previous holder wrote. A holder that cannot renew within the
Lease's duration stops serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from vgpu.core import annotations as ann
from vgpu.core.errors import ConflictError, KubeError
from vgpu.extender.state import SchedulerState
from vgpu.kube.client import Gone, Kube, now_micro, parse_time

log = logging.getLogger(__name__)
Obj = dict[str, Any]


class Syncer:
    def __init__(self, state: SchedulerState, kube: Kube, identity: str) -> None:
        self.state = state
        self.kube = kube
        self.identity = identity
        self.stop = threading.Event()
        self._listed: set[str] = set()
        self._threads: list[threading.Thread] = []
        cfg = state.config
        self._pod_selector = f"spec.schedulerName={cfg.scheduler_name}"

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.state.config
        loops: list[tuple[str, Callable[[], None]]] = [
            ("pods", lambda: self._loop("pods", self._list_pods, self._watch_pods, self._on_pod)),
            (
                "nodes",
                lambda: self._loop("nodes", self._list_nodes, self.kube.watch_node_metadata, self._on_node),
            ),
            (
                "leases",
                lambda: self._loop(
                    "leases",
                    self._list_leases,
                    lambda rv: self.kube.watch_leases(cfg.namespace, rv),
                    self._on_lease,
                ),
            ),
            ("leader", self._lead),
            ("metrics", self._metrics),
            ("nudge", self._nudge),
        ]
        for name, target in loops:
            t = threading.Thread(target=target, name=f"vgpu-sync-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        self.stop.set()
        if self.state.leader.is_set():
            self._release()
        self.kube.close()

    # -- list + watch ------------------------------------------------------------------------------
    def _list_pods(self) -> str:
        pods, rv = self.kube.list_pods(field_selector=self._pod_selector)
        self.state.replace_pods(pods)
        return rv

    def _watch_pods(self, rv: str) -> Iterator[tuple[str, Obj]]:
        return self.kube.watch_pods(rv, field_selector=self._pod_selector)

    def _list_nodes(self) -> str:
        nodes, rv = self.kube.list_node_metadata()  # the inventory annotation is all it reads
        self.state.replace_nodes(nodes)
        return rv

    def _list_leases(self) -> str:
        leases, rv = self.kube.list_leases(self.state.config.namespace)
        self.state.replace_leases(leases)
        return rv

    def _on_pod(self, kind: str, obj: Obj) -> None:
        self.state.apply_pod(obj, deleted=kind == "DELETED")

    def _on_node(self, kind: str, obj: Obj) -> None:
        if kind == "DELETED":
            self.state.forget_node((obj.get("metadata") or {}).get("name", ""))
        else:
            self.state.apply_node(obj)

    def _on_lease(self, kind: str, obj: Obj) -> None:
        self.state.apply_lease(obj, deleted=kind == "DELETED")

    def _loop(
        self,
        kind: str,
        lister: Callable[[], str],
        watcher: Callable[[str], Iterator[tuple[str, Obj]]],
        apply: Callable[[str, Obj], None],
    ) -> None:
        backoff = 0.5
        rv: str | None = None
        while not self.stop.is_set():
            try:
                if rv is None:
                    rv = lister()
                    self._listed.add(kind)
                    if self._listed >= {"pods", "nodes", "leases"} and not self.state.synced.is_set():
                        log.info("cluster state loaded: %d pods hold vGPUs", len(self.state.ledger.pods()))
                        self.state.synced.set()
                for event, obj in watcher(rv):
                    if self.stop.is_set():
                        return
                    new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                    if event != "BOOKMARK":
                        apply(event, obj)
                    if new_rv:
                        rv = new_rv
                backoff = 0.5
            except Gone:
                rv = None
            except KubeError as err:
                log.warning("%s: %s; listing again in %.1fs", kind, err, backoff)
                rv = None
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception:  # never let a bad event kill the loop
                log.exception("%s: unexpected error; listing again", kind)
                rv = None
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

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
            self._list_pods()
        except KubeError as err:
            log.warning("relist before serving failed: %s; serving from the watch", err)
        log.info("holding the extender Lease as %s: serving", self.identity)
        self.state.leader.set()

    def _try_acquire(self) -> bool:
        cfg = self.state.config
        lease = self.kube.get_lease(cfg.namespace, cfg.leader_lease)
        spec_new = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": cfg.lease_duration_s,
            "renewTime": now_micro(),
        }
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": cfg.leader_lease, "namespace": cfg.namespace},
                "spec": {**spec_new, "acquireTime": now_micro(), "leaseTransitions": 0},
            }
            try:
                self.kube.create_lease(cfg.namespace, body)
                return True
            except ConflictError:
                return False
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        renewed = parse_time(spec.get("renewTime"))
        duration = spec.get("leaseDurationSeconds") or cfg.lease_duration_s
        expired = renewed is None or renewed.timestamp() + duration < time.time()
        if holder and holder != self.identity and not expired:
            return False
        new_spec = {**spec, **spec_new}
        if holder != self.identity:
            new_spec["acquireTime"] = now_micro()
            new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        lease["spec"] = new_spec
        try:
            self.kube.replace_lease(cfg.namespace, lease)
            return True
        except ConflictError:
            return False

    def _release(self) -> None:
        cfg = self.state.config
        try:
            lease = self.kube.get_lease(cfg.namespace, cfg.leader_lease)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                self.kube.replace_lease(cfg.namespace, lease)
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
    def _metrics(self) -> None:
        from vgpu.extender import metrics as m

        seen: dict[str, tuple[int, int]] = {}
        while not self.stop.wait(5.0):
            try:
                refresh_gauges(self.state, m, seen)
            except Exception:
                log.exception("refreshing metrics failed")


def refresh_gauges(state: SchedulerState, m: Any, seen: dict[str, tuple[int, int]] | None = None) -> None:
    """Set the per-card and per-node gauges from the state as it is now.

    ``seen`` (node -> (ledger node version, inventory id) last written) skips nodes that did not
    change: at 1,000 nodes of 8 cards, rewriting every gauge each time cost more CPU than the verbs.
    """
    from vgpu.core.ledger import ZERO

    m.LEADER.set(1 if state.leader.is_set() else 0)
    for reason, n in state.skipped().items():
        m.NODES_SKIPPED.labels(reason).set(n)
    for node, inv, usage, version in state.snapshot(changed_since=seen):
        total = used = 0
        for d in inv.devices:
            u = usage.get(d.uuid, ZERO)
            m.CARD_MEMORY_CAPACITY.labels(node, d.uuid).set(d.memory_mib * m.MiB)
            m.CARD_MEMORY_ALLOCATED.labels(node, d.uuid).set(u.memory_mib * m.MiB)
            m.CARD_CORES_ALLOCATED.labels(node, d.uuid).set(u.cores / 100)
            m.CARD_VGPUS_CAPACITY.labels(node, d.uuid).set(d.split)
            m.CARD_VGPUS_ALLOCATED.labels(node, d.uuid).set(u.count)
            total += d.memory_mib
            used += u.memory_mib
        m.NODE_MEMORY_CAPACITY.labels(node).set(total * m.MiB)
        m.NODE_MEMORY_ALLOCATED.labels(node).set(used * m.MiB)
        if seen is not None:
            seen[node] = (version, id(inv))
