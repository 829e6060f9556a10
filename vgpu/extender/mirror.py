"""The extender's mirror of the cluster: nodes, device plugin Leases and pods, as the watches
deliver them (:mod:`vgpu.extender.sync` lists, then watches, and applies each event here).

Nodes give their inventory annotation, Leases each device plugin's deadline (read by
:func:`vgpu.kube.lease.expires_at`), pods their allocation annotation, which the
:class:`~vgpu.core.ledger.Ledger` commits. The mirror owns the confirmed pods' entries in the
ledger; the :class:`~vgpu.extender.cache.PodCache` owns the assumed ones, and hears from the
mirror when a pod is confirmed (its allocation seen) or gone; the
:class:`~vgpu.extender.nudges.Nudges` hear when room frees. Everything sits behind the one lock of
:class:`vgpu.extender.state.SchedulerState`, which puts these parts together.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vgpu.core import annotations as ann
from vgpu.core.booking import book, finished
from vgpu.core.config import SchedulerConfig
from vgpu.core.errors import AnnotationError
from vgpu.core.gpumode import device_plugin_refusal
from vgpu.core.ledger import Footprint, Usage
from vgpu.core.placement import Placement, Shape, shape
from vgpu.extender.cache import PodCache
from vgpu.extender.nudges import Nudges
from vgpu.kube.lease import expires_at

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass
class NodeEntry:
    inventory: ann.NodeInventory | None = None
    error: str | None = None  # why the inventory is unusable
    raw: str | None = None  # the annotation text it was decoded from
    # why the device-plugin path must leave the node alone (its gpu-mode label: DRA), or None
    mode_refusal: str | None = None

    @property
    def cards(self) -> dict[str, ann.Device] | None:
        """The inventory's cards by UUID; None without a usable inventory."""
        return None if self.inventory is None else {d.uuid: d for d in self.inventory.devices}


def _rv(obj: Mapping[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


class Mirror:
    def __init__(
        self,
        config: SchedulerConfig,
        clock: Callable[[], float],
        lock: threading.RLock,
        placement: Placement,
        cache: PodCache,
        nudges: Nudges,
    ) -> None:
        self.config = config
        self.clock = clock
        self.lock = lock
        self.placement = placement
        self.ledger = placement.ledger
        self.cache = cache  # told when a pod is confirmed or gone
        self.nudges = nudges  # told when room frees
        self.nodes: dict[str, NodeEntry] = {}
        # node -> (inventory, shape) for the nodes with a usable inventory; its ``get`` is placement's
        # lookup (a dict's own method: called per candidate node, so no Python frame of ours)
        self.usable: dict[str, tuple[ann.NodeInventory, Shape]] = {}
        self.lease_expiry: dict[str, float] = {}  # node -> when its plugin Lease runs out (epoch s)
        self.pod_rv: dict[str, int] = {}  # uid -> newest resourceVersion applied to the ledger
        self._pod_raw: dict[str, str] = {}  # uid -> the allocation annotation last committed
        # pods bound to a node the mirror has no Node for (deleted, or not listed yet at start):
        # node -> {uid: footprint}, out of the ledger, booked there again if the Node comes back
        self.parked: dict[str, dict[str, Footprint]] = {}
        self._parked_on: dict[str, str] = {}  # uid -> its node in ``parked``
        self.inventory_errors = 0

    # -- nodes ---------------------------------------------------------------------------------
    def apply_node(self, node: Obj) -> None:
        meta = node.get("metadata") or {}
        name = meta.get("name")
        if not name:
            return
        raw = (meta.get("annotations") or {}).get(ann.DEVICES_ANNOTATION)
        # One mode per node: a DRA node's cards are booked by DRA, never by this ledger too,
        # whatever inventory an earlier device plugin left on it.
        refusal = device_plugin_refusal(meta.get("labels"))
        with self.lock:
            old = self.nodes.get(name)
            if old is not None and old.raw == raw and old.mode_refusal == refusal:
                return
            if old is None:
                self._unpark_node(name)
            self.placement.node_changed(name)
            self.usable.pop(name, None)
            if refusal is not None:
                self.nodes[name] = NodeEntry(error=refusal, raw=raw, mode_refusal=refusal)
                return
            if raw is None:
                self.nodes[name] = NodeEntry(
                    error=f"had no vGPU inventory (annotation {ann.DEVICES_ANNOTATION} missing)"
                )
                return
            try:
                inventory = ann.decode_devices(raw)
                self.nodes[name] = NodeEntry(inventory=inventory, raw=raw)
                self.usable[name] = (inventory, shape(inventory))
            except AnnotationError as err:
                self.nodes[name] = NodeEntry(error=f"had a malformed inventory, skipped: {err}", raw=raw)
                self.inventory_errors += 1
                log.warning("node %s: %s; skipping it until the annotation is fixed", name, err)
                from vgpu.extender import metrics

                metrics.INVENTORY_ERRORS.labels(name).inc()

    def forget_node(self, name: str) -> None:
        """The Node was deleted: forget it, and take its pods out of the ledger (parked until
        they are deleted, or booked again if the Node comes back)."""
        with self.lock:
            self.nodes.pop(name, None)
            self.usable.pop(name, None)
            self.placement.node_changed(name, gone=True)
            for uid, fp in self.ledger.release_node(name).items():
                self._park(uid, name, fp)

    def replace_nodes(self, nodes: Iterable[Obj]) -> None:
        names = set()
        for n in nodes:
            self.apply_node(n)
            names.add((n.get("metadata") or {}).get("name"))
        with self.lock:
            for name in list(self.nodes):
                if name not in names:
                    self.forget_node(name)

    def _book(self, uid: str, node: str, fp: Footprint) -> None:
        """Commit what pod ``uid`` holds on ``node``, or park it while there is no such Node.
        Caller holds the lock."""
        self._unpark(uid)
        if node in self.nodes:
            self.ledger.commit(uid, node, fp)
        else:
            self.ledger.release(uid)
            self._park(uid, node, fp)

    def _park(self, uid: str, node: str, fp: Footprint) -> None:
        self.parked.setdefault(node, {})[uid] = fp
        self._parked_on[uid] = node

    def _unpark(self, uid: str) -> None:
        node = self._parked_on.pop(uid, None)
        if node is not None:
            pods = self.parked[node]
            del pods[uid]
            if not pods:
                del self.parked[node]

    def _unpark_node(self, name: str) -> None:
        """A Node the mirror did not know: book the pods bound to it. Caller holds the lock."""
        for uid, fp in self.parked.pop(name, {}).items():
            del self._parked_on[uid]
            self.ledger.commit(uid, name, fp)

    # -- device plugin Leases ------------------------------------------------------------------
    def apply_lease(self, lease: Obj, deleted: bool = False) -> None:
        name = (lease.get("metadata") or {}).get("name") or ""
        if not name.startswith(ann.LEASE_PREFIX) or name == self.config.leader_lease:
            return
        node = name[len(ann.LEASE_PREFIX) :]
        with self.lock:
            if deleted:
                self.lease_expiry.pop(node, None)
                return
            ends = expires_at(lease)
            self.lease_expiry[node] = 0.0 if ends is None else ends + self.config.plugin_lease_grace_s

    def replace_leases(self, leases: Iterable[Obj]) -> None:
        with self.lock:
            self.lease_expiry.clear()
        for lease in leases:
            self.apply_lease(lease)

    def node_problem(self, name: str, now: float) -> str | None:
        """Why ``name`` gets nothing new, or None: a predicate like fit's reasons (see
        :class:`vgpu.core.fit.Rejection`). Caller holds the lock."""
        entry = self.nodes.get(name)
        if entry is None:
            return "had no record in the vGPU extender (not yet seen, or deleted)"
        if entry.inventory is None:
            return entry.error or "had no vGPU inventory"
        expiry = self.lease_expiry.get(name)
        if expiry is not None and expiry >= now:
            return None
        lease = f"{self.config.namespace}/{ann.lease_name(name)}"
        if expiry is None:
            return f"had no vGPU device plugin running: Lease {lease} not found"
        return f"had no vGPU device plugin running: Lease {lease} expired"

    # -- pods ----------------------------------------------------------------------------------
    def apply_pod(self, pod: Obj, deleted: bool = False) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid")
        if not uid:
            return
        rv = _rv(pod)
        with self.lock:
            if deleted:
                self.cache.gone(uid)
                self._release(uid)
                self.pod_rv.pop(uid, None)
                self.nudges.placed(uid)
                self._pod_raw.pop(uid, None)
                return
            if rv and rv < self.pod_rv.get(uid, 0):
                return  # older than what the ledger already reflects (e.g. our own bind's patch)
            self.pod_rv[uid] = max(rv, self.pod_rv.get(uid, 0))
            if finished(pod):
                self._pod_raw.pop(uid, None)
                self.cache.gone(uid)
                self.nudges.placed(uid)
                self._release(uid)  # finished pods hold nothing, as for any Kubernetes resource
                return
            raw = (meta.get("annotations") or {}).get(ann.ALLOCATION_ANNOTATION)
            if raw is None:
                # Not (yet) placed, or an event from before our own bind that the watch delivers
                # late: either way nothing to change. Only deletion or finishing frees capacity.
                return
            booked = self._pod_raw.get(uid)
            if booked is not None and (self.ledger.node_of(uid) is not None or uid in self._parked_on):
                if booked != raw:
                    # Placements are the extender's alone (docs/security.md): one changed after the
                    # booking (by anyone: the admission policy should have refused it) is not a new
                    # booking; the ledger keeps what it bound.
                    log.warning(
                        "pod %s/%s: its %s changed after it was booked; keeping the booking",
                        meta.get("namespace"),
                        meta.get("name"),
                        ann.ALLOCATION_ANNOTATION,
                    )
                    self._count_untrusted("changed")
                    self._pod_raw[uid] = raw  # warned once per change
                return  # the same allocation as already committed (most events are status updates)
            try:
                allocation = ann.decode_allocation(raw)
            except AnnotationError as err:
                log.warning(
                    "pod %s/%s: %s; its capacity is not counted", meta.get("namespace"), meta.get("name"), err
                )
                return
            entry = self.nodes.get(allocation.node)
            cards = entry.cards if entry is not None else None
            booking = book(pod, allocation, self.config, cards)
            if booking.problems:
                # one the extender did not book itself (found at a restart, or from a replica
                # before it): the node refuses it, and until the pod fails it counts at no less
                # than the pod asks for (vgpu/core/booking.py)
                log.warning(
                    "pod %s/%s: its placement is not what it asks for (%s); "
                    "booking at least what it asks for",
                    meta.get("namespace"),
                    meta.get("name"),
                    "; ".join(booking.problems),
                )
                self._count_untrusted("mismatch")
            self.cache.confirm(uid)  # an assumption of ours, if any, is this pod's booking now
            self._book(uid, allocation.node, booking.footprint)
            self._pod_raw[uid] = raw

    @staticmethod
    def _count_untrusted(kind: str) -> None:
        from vgpu.extender import metrics

        metrics.UNTRUSTED_PLACEMENTS.labels(kind).inc()

    def replace_pods(self, pods: Iterable[Obj]) -> None:
        """A fresh list: forget pods it no longer has (except binds in flight), apply the rest."""
        pods = list(pods)
        seen = {(p.get("metadata") or {}).get("uid") for p in pods}
        with self.lock:
            for uid in [*self.ledger.pods(), *self._parked_on]:
                if uid not in seen and uid not in self.cache.binding:
                    self.cache.gone(uid)
                    self._release(uid)
                    self.pod_rv.pop(uid, None)
                    self._pod_raw.pop(uid, None)
            for p in pods:
                self.apply_pod(p)

    def committed(self, uid: str, raw: str) -> None:
        """Our own bind wrote allocation ``raw``: the watch's copy of it then costs no second decode.
        Caller holds the lock."""
        self._pod_raw[uid] = raw

    def _release(self, uid: str) -> None:
        """A pod left for good (deleted, finished, gone from a fresh list): free its room and
        note it for the nudge (see NUDGE_WINDOW_S). Caller holds the lock."""
        self._unpark(uid)
        if self.ledger.node_of(uid) is None:
            return
        self.ledger.release(uid)
        self.nudges.freed()

    # -- for the webhook and metrics -------------------------------------------------------------
    def largest_card(self) -> tuple[int, int] | None:
        """(most memory on one card, most usable cards on one node) over known nodes, or None."""
        with self.lock:
            invs = [
                e.inventory for e in self.nodes.values() if e.inventory is not None and e.inventory.devices
            ]
        if not invs:
            return None
        mem = max(d.memory_mib for inv in invs for d in inv.devices)
        cards = max(len(inv.devices) for inv in invs)
        return mem, cards

    def known_cards(self) -> list[ann.Device]:
        """Every card of the nodes with an inventory (the webhook's selection check)."""
        with self.lock:
            return [d for e in self.nodes.values() if e.inventory is not None for d in e.inventory.devices]

    def snapshot(
        self, changed_since: Mapping[str, tuple[int, int, Any]] | None = None
    ) -> list[tuple[str, ann.NodeInventory, Mapping[str, Usage], int]]:
        """(node, inventory, usage per card, ledger node version) for nodes with an inventory.

        With ``changed_since`` (node -> (version, inventory id, ...)), only nodes that changed since.
        """
        out: list[tuple[str, ann.NodeInventory, Mapping[str, Usage], int]] = []
        with self.lock:
            for name, e in self.nodes.items():
                if e.inventory is None:
                    continue
                version = self.ledger.node_version(name)
                seen = changed_since.get(name) if changed_since is not None else None
                if seen is not None and seen[0] == version and seen[1] == id(e.inventory):
                    continue
                out.append((name, e.inventory, dict(self.ledger.usage(name)), version))
        return out

    def inventoried(self) -> set[str]:
        """The nodes with a usable inventory now: those :meth:`snapshot` gives."""
        with self.lock:
            return set(self.usable)

    def skipped(self) -> dict[str, int]:
        now = self.clock()
        with self.lock:
            malformed = sum(
                1
                for e in self.nodes.values()
                if e.inventory is None and e.raw is not None and e.mode_refusal is None
            )
            expired = sum(
                1
                for n, e in self.nodes.items()
                if e.inventory is not None and self.node_problem(n, now) is not None
            )
        return {"malformed_inventory": malformed, "plugin_lease_expired": expired}
