"""The node's ResourceSlice kept in step with its cards.

``SlicePublisher`` holds the node's current cards (health events from discovery change them;
``health`` and ``wait_health`` give them to the kubelet's health stream, vgpu/dra/server.py)
and makes the API server's slice offer exactly the healthy ones: created when missing, replaced
with the pool's generation one higher when what it offers changed (a card went unhealthy or came
back), left alone otherwise. It checks every ``interval_s`` (the kubelet deletes a node's slices
when it starts and when a plugin stays away) and at once after a health event or a registration.

The slice is not deleted when the plugin stops: a plugin restarting (an upgrade, a crash) must not
make the scheduler see the node's cards vanish while claims run on them. It goes with the Node
(its owner), and the kubelet removes it once the plugin has been gone past its grace period.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vgpu.core.errors import ConflictError, KubeError
from vgpu.core.service import Service
from vgpu.dra.mig import MigView
from vgpu.dra.migslices import fingerprint as mig_fingerprint
from vgpu.dra.migslices import mig_slices
from vgpu.dra.slices import DRIVER, build_slice, device_name, fingerprint, slice_name
from vgpu.kube.resourceapi import ResourceClient
from vgpu.node.discovery import Card, Discovery

log = logging.getLogger(__name__)


def _pool(slice_obj: dict[str, Any]) -> dict[str, Any]:
    pool = (slice_obj.get("spec") or {}).get("pool")
    return pool if isinstance(pool, dict) else {}


class SlicePublisher:
    def __init__(
        self,
        node: str,
        discovery: Discovery,
        client: ResourceClient,
        memory_scaling: float = 1.0,
        interval_s: float = 10.0,
        mig: Callable[[], MigView | None] | None = None,
        sharing: str = "timeslice",
    ) -> None:
        self.node = node
        self.discovery = discovery
        self.client = client
        self.memory_scaling = memory_scaling
        self.interval_s = interval_s
        self.sharing = sharing  # --sharing-mode: every whole card's mode, the devices' attribute
        self.mig = mig  # --mig dynamic: the MIG cards' view (Preparer.mig_view): a pool of slices
        # --mig off: cards in MIG mode, never offered as shares (CUDA cannot use such a card whole)
        self.unoffered: frozenset[str] = frozenset()
        self.driver_version = str(getattr(discovery, "driver_version", "") or "")
        self._lock = threading.Condition()  # notified when a card's health changes (health watchers)
        self._cards = list(discovery.cards())
        self._reasons: dict[str, str] = {}  # card uuid -> why its health last changed
        self._health_version = 0
        self._mig_names: dict[str, list[str]] = {}  # MIG card uuid -> its devices' names (the last view)
        self._kick = threading.Event()
        self._node_uid: str | None = None
        self.generation: int | None = None  # the pool's generation as last written or read
        self.writes = 0  # slices created or replaced (tests)
        self._loop = Service("dra-slices", self._run)
        self._health = Service("dra-health", self._watch_health)

    def cards(self) -> list[Card]:
        with self._lock:
            return list(self._cards)

    def health(self) -> tuple[int, list[tuple[Card, str]]]:
        """(a version that goes up with each health change, each card with why its health last
        changed, "" when it never did)."""
        with self._lock:
            return self._health_version, [(c, self._reasons.get(c.uuid, "")) for c in self._cards]

    def devices_of(self, card: Card) -> list[str]:
        """The pool's devices of ``card``: ``gpu-<index>``, or a MIG card's placements."""
        with self._lock:
            return list(self._mig_names.get(card.uuid) or [device_name(card.index)])

    def wait_health(self, version: int, timeout_s: float, done: Callable[[], bool] = lambda: False) -> None:
        """Until the health changes past ``version``, ``done()`` holds after a ``wake``, or ``timeout_s``."""
        with self._lock:
            self._lock.wait_for(lambda: self._health_version != version or done(), timeout_s)

    def wake(self) -> None:
        """Wake every ``wait_health`` to look at its ``done`` again (a stream that ended)."""
        with self._lock:
            self._lock.notify_all()

    def kick(self) -> None:
        """Check the slice now (after a registration: the kubelet may have wiped it)."""
        self._kick.set()

    def sync(self) -> bool:
        """One check: the slice on the server offers the healthy cards. True when it was written."""
        if self._node_uid is None:
            self._node_uid = self.client.node_uid(self.node)
        if self.mig is not None:
            return self._sync_pool(self.mig())
        name = slice_name(self.node)
        existing = self.client.get_resource_slice(name)
        generation = 1
        if existing is not None:
            generation = int(((existing.get("spec") or {}).get("pool") or {}).get("generation") or 0)
        offered = [c for c in self.cards() if c.uuid not in self.unoffered]
        desired = build_slice(
            self.node,
            offered,
            generation,
            self.driver_version,
            self.memory_scaling,
            self._node_uid,
            self.sharing,
        )
        if (
            existing is not None
            and fingerprint(existing) == fingerprint(desired)
            and _pool(existing).get("resourceSliceCount", 1) == 1  # not left from a pool of several
        ):
            self.generation = generation
            return False
        if existing is None:
            self.client.create_resource_slice(desired)
        else:
            desired["spec"]["pool"]["generation"] = generation + 1
            desired["metadata"]["resourceVersion"] = (existing.get("metadata") or {}).get("resourceVersion")
            if not self._node_uid:  # keep an owner set earlier
                owners = (existing.get("metadata") or {}).get("ownerReferences")
                if owners:
                    desired["metadata"]["ownerReferences"] = copy.deepcopy(owners)
            self.client.replace_resource_slice(desired)
            if _pool(existing).get("resourceSliceCount", 1) != 1:  # MIG turned off: its slices go
                for other in self.client.list_resource_slices(self.node, DRIVER):
                    if (other.get("metadata") or {}).get("name") != name:
                        self.client.delete_resource_slice(str(other["metadata"]["name"]))
        self.generation = desired["spec"]["pool"]["generation"]
        self.writes += 1
        log.info(
            "ResourceSlice %s: %d card(s) at pool generation %d",
            name,
            len(desired["spec"]["devices"]),
            self.generation,
        )
        return True

    def _sync_pool(self, view: MigView | None) -> bool:
        """The pool of several slices (vgpu/dra/migslices.py): the shared cards' slice, the MIG
        cards' counters and devices; all rewritten at one generation higher when one changed."""
        base = slice_name(self.node)
        cards = self.cards()
        owner = (
            [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": self.node,
                    "uid": self._node_uid,
                    "controller": True,
                }
            ]
            if self._node_uid
            else None
        )
        partitioned = view.partitioned if view else frozenset()
        names: dict[str, list[str]] = {}
        for slot in view.slots.values() if view else ():
            names.setdefault(slot.card.uuid, []).append(slot.device)
        with self._lock:
            self._mig_names = names
        shared = build_slice(
            self.node,
            [c for c in cards if c.uuid not in partitioned],
            0,
            self.driver_version,
            self.memory_scaling,
            self._node_uid,
            self.sharing,
        )
        extra = mig_slices(base, self.node, list(view.offered) if view else [], self.driver_version, owner)
        desired = [shared, *extra]
        existing = {
            (s.get("metadata") or {}).get("name"): s
            for s in self.client.list_resource_slices(self.node, DRIVER)
        }
        generations = {int(_pool(s).get("generation") or 0) for s in existing.values()}
        generation = max(generations, default=0)
        same = (
            set(existing) == {d["metadata"]["name"] for d in desired}
            and len(generations) == 1
            and all(_pool(s).get("resourceSliceCount") == len(desired) for s in existing.values())
            and fingerprint(existing[base]) == fingerprint(shared)
            and all(mig_fingerprint(existing[d["metadata"]["name"]]) == mig_fingerprint(d) for d in extra)
        )
        if same:
            self.generation = generation
            return False
        generation += 1
        for d in desired:
            d["spec"]["pool"] = {
                "name": self.node,
                "generation": generation,
                "resourceSliceCount": len(desired),
            }
            old = existing.get(d["metadata"]["name"])
            if old is None:
                self.client.create_resource_slice(d)
                continue
            d["metadata"]["resourceVersion"] = (old.get("metadata") or {}).get("resourceVersion")
            if not self._node_uid and (old.get("metadata") or {}).get("ownerReferences"):
                d["metadata"]["ownerReferences"] = copy.deepcopy(old["metadata"]["ownerReferences"])
            self.client.replace_resource_slice(d)
        for stale in set(existing) - {d["metadata"]["name"] for d in desired}:
            self.client.delete_resource_slice(str(stale))
        self.generation = generation
        self.writes += 1
        log.info(
            "ResourceSlices of %s: %d slice(s), %d MIG device(s), at pool generation %d",
            self.node,
            len(desired),
            sum(len(d["spec"].get("devices") or []) for d in extra),
            generation,
        )
        return True

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.sync()
            except ConflictError:
                continue  # changed under us: read it again at once
            except KubeError as err:
                log.warning("cannot publish the ResourceSlice of %s: %s; retrying", self.node, err)
            self._kick.wait(self.interval_s)
            self._kick.clear()

    def _watch_health(self, stop: threading.Event) -> None:
        while not stop.is_set():
            events = self.discovery.wait_health_events(1.0)
            if not events:
                continue
            with self._lock:
                health = {e.uuid: e.healthy for e in events}
                self._cards = [replace(c, healthy=health.get(c.uuid, c.healthy)) for c in self._cards]
                self._reasons.update({e.uuid: e.reason for e in events})
                self._health_version += 1
                self._lock.notify_all()
            for e in events:
                log.warning("card %s is %s (%s)", e.uuid, "healthy" if e.healthy else "unhealthy", e.reason)
            self.kick()

    def start(self) -> None:
        self._health.start()
        self._loop.start()

    def stop(self) -> None:
        self._loop.stopping.set()
        self._kick.set()  # wakes the loop, which then sees the stop
        self._loop.stop()
        self._health.stop()
