"""MIG on demand on the node (``migStrategy: dynamic``): instances made at Allocate, reclaimed after.

A card in MIG mode (with a profile table, vgpu/core/mig.py) is the node's to cut: the inventory
lists it with its table and the instances it holds, each with the pod whose allocation names it
(:meth:`DynamicMig.describe`), so the extender chooses a profile and a free placement
(vgpu/core/migfit.py) and writes it in the pod's allocation (``mig: {profile, start}``).

At Allocate (:meth:`DynamicMig.provide`) the node makes exactly that instance, a GPU instance at
the booked placement with its one full compute instance, or finds it already there for this pod
(a plugin restart, a container restart), and hands its MIG device to the container. It refuses,
failing the pod with the reason, when the card has processes outside MIG (a card is never cut
under running work), when another instance or another live pod holds the placement, or when the
grant names a profile or start the card's table does not have.

State lives in the card and in the API server, never in the plugin: which instance is whose is
read from the live pods' allocations each time. :meth:`DynamicMig.reclaim` destroys every
instance on a dynamic card that no live pod (bound here, not Succeeded or Failed) names; one a
process is still on (NVML ``IN_USE``) is left for the next pass. It runs at start (reconcile:
leftovers of a crash reclaimed, instances of running pods kept) and then every ``reclaim_s``.
The instances are listed before the pods, so an instance made by an Allocate (which comes after
its pod's binding) always finds its pod in the list that follows.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    PHASE_ALLOCATED,
    PHASE_ANNOTATION,
    ContainerAllocation,
    DeviceAllocation,
    MigDynamic,
    MigInstance,
    decode_allocation,
)
from vgpu.core.errors import AnnotationError, KubeError
from vgpu.core.mig import MigError, MigTable, Placement
from vgpu.deviceplugin.answer import PodFailure
from vgpu.node.discovery import Card, GpuProcess
from vgpu.node.mig import IN_USE, INSUFFICIENT_RESOURCES, NOT_FOUND, MigControl, MigDevice, MigRefused

log = logging.getLogger(__name__)

TERMINAL = ("Succeeded", "Failed")
Key = tuple[str, str, int]  # (card uuid, profile, start)


@dataclass
class Reclaimed:
    """What one reclaim pass did: instances kept (a live pod names them), destroyed, left busy."""

    kept: int = 0
    destroyed: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)


def named_by(
    pods: Iterable[Mapping[str, Any]], node: str, unreadable: list[str] | None = None
) -> dict[Key, list[tuple[str, bool]]]:
    """The instances the live pods on ``node`` name, by (card, profile, start): each pod's uid and
    whether it is served already (phase ``allocated``: the holder where two name one placement),
    served ones first. A pod whose allocation cannot be read names none and is added to
    ``unreadable`` (``namespace/name``)."""
    named: dict[Key, list[tuple[str, bool]]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if (pod.get("status") or {}).get("phase") in TERMINAL:
            continue
        if (pod.get("spec") or {}).get("nodeName") not in (node, None):
            continue
        annotations = meta.get("annotations") or {}
        raw = annotations.get(ALLOCATION_ANNOTATION)
        if raw is None:
            continue
        try:
            allocation = decode_allocation(raw)
        except AnnotationError:
            if unreadable is not None:
                unreadable.append(f"{meta.get('namespace', '')}/{meta.get('name', '')}")
            continue
        served = annotations.get(PHASE_ANNOTATION) == PHASE_ALLOCATED
        for c in allocation.containers:
            for d in c.devices:
                if d.mig is not None:
                    named.setdefault((d.uuid, d.mig.profile, d.mig.start), []).append(
                        (str(meta.get("uid", "")), served)
                    )
    for holders in named.values():
        holders.sort(key=lambda h: not h[1])
    return named


class DynamicMig:
    """MIG on demand over ``mig`` for the node's cards in MIG mode (see the module)."""

    def __init__(
        self,
        node: str,
        mig: MigControl,
        cards: list[Card],
        list_pods: Callable[[str], list[dict[str, Any]]],
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.node = node
        self.mig = mig
        self.list_pods = list_pods
        self.changed = changed  # the inventory changed: publish it again
        self.tables: dict[str, MigTable] = {}
        for card in cards:
            try:
                mode = mig.mode(card.uuid)
                table = mig.table(card.uuid)
            except (MigRefused, MigError) as err:
                log.info("card %s is not cut on demand: %s", card.uuid, err)
                continue
            if not mode.enabled:
                log.warning(
                    "card %s is not cut on demand: its MIG mode is %s (enable MIG and reset the card)",
                    card.uuid,
                    mode.describe(),
                )
                continue
            self.tables[card.uuid] = table
        self._lock = threading.Lock()  # one change to the cards at a time
        # for /metrics (migmetrics.py): instances made and reclaimed by (card, profile), refusals
        # by kind (busy, taken, invalid), instances the last reclaim pass left busy
        self.made: Counter[tuple[str, str]] = Counter()
        self.reclaimed: Counter[tuple[str, str]] = Counter()
        self.refusals: Counter[str] = Counter()
        self.left_busy = 0
        self._named: dict[Key, list[tuple[str, bool]]] = {}
        self._view: dict[str, MigDynamic] = {}
        self._refresh()

    # -- the inventory ------------------------------------------------------------------------

    def describe(self, uuid: str) -> MigDynamic | None:
        """The card as the inventory lists it; None for a card not cut on demand."""
        return self._view.get(uuid)

    def _refresh(self) -> None:
        view: dict[str, MigDynamic] = {}
        for uuid, table in self.tables.items():
            try:
                gis = self.mig.gpu_instances(uuid)
            except MigRefused as err:
                # never published as empty: what was seen last, else the whole card taken
                log.warning("cannot list the MIG instances of card %s: %s", uuid, err)
                whole = max(table.profiles, key=lambda p: p.memory_slices)
                view[uuid] = self._view.get(uuid) or MigDynamic(
                    table.product, (MigInstance(whole.name, 0, whole.memory_slices),)
                )
                continue
            instances = tuple(
                MigInstance(
                    g.profile,
                    g.placement.start,
                    g.placement.size,
                    next(iter(self._named.get((uuid, g.profile, g.placement.start), [])), ("", False))[0],
                )
                for g in sorted(gis, key=lambda g: g.placement.start)
            )
            view[uuid] = MigDynamic(table.product, instances)
        changed = view != self._view
        self._view = view
        if changed:
            self.changed()

    # -- Allocate -----------------------------------------------------------------------------

    def provide(self, pod_uid: str, container: ContainerAllocation) -> dict[str, MigDevice]:
        """The MIG device of each of the container's vGPUs on a dynamic card (by card uuid),
        made now or found made for this pod; ``PodFailure`` saying why not."""
        wanted = [d for d in container.devices if d.mig is not None]
        if not wanted:
            return {}
        try:
            named = named_by(self.list_pods(self.node), self.node)
        except KubeError as err:
            raise PodFailure(
                f"cannot list the pods of node {self.node} to check the MIG placement: {err}"
            ) from err
        out: dict[str, MigDevice] = {}
        with self._lock:
            self._named = named
            try:
                for d in wanted:
                    out[d.uuid] = self._one(pod_uid, container.name, d, named)
            except MigRefused as err:  # NVML failed past the checks (a card gone, its mode changed)
                self.refusals["invalid"] += 1
                raise PodFailure(f"container {container.name}: MIG on card {d.uuid}: {err}") from err
            except PodFailure as err:
                text = str(err)
                self.refusals[
                    "busy" if "GPU busy" in text else "taken" if "taken" in text else "invalid"
                ] += 1
                raise
            finally:
                self._refresh()
        return out

    def _one(
        self, pod_uid: str, name: str, d: DeviceAllocation, named: Mapping[Key, list[tuple[str, bool]]]
    ) -> MigDevice:
        assert d.mig is not None
        where = f"container {name}'s MIG instance {d.mig.profile} at slice {d.mig.start} on card {d.uuid}"
        table = self.tables.get(d.uuid)
        if table is None:
            raise PodFailure(f"{where}: the card is not cut on demand on node {self.node} (not in MIG mode)")
        try:
            profile = table.profile(d.mig.profile)
        except MigError as err:
            raise PodFailure(f"{where}: {err}") from err
        if d.mig.start not in profile.starts:
            raise PodFailure(f"{where}: {profile.name} starts only at {list(profile.starts)}")
        place = Placement(d.mig.start, profile.memory_slices)
        holder = next((u for u, served in named.get((d.uuid, profile.name, place.start), []) if served), "")
        if holder and holder != pod_uid:
            raise PodFailure(f"{where}: placement taken by pod uid {holder}, served there already")
        gis = self.mig.gpu_instances(d.uuid)
        same = next((g for g in gis if g.profile == profile.name and g.placement == place), None)
        if same is not None:  # made for this pod before (a restart of the plugin or the container)
            found = next((m for m in self.mig.devices(d.uuid) if m.gpu_instance == same.id), None)
            if found is None:
                raise PodFailure(f"{where}: GPU instance {same.id} is there but has no compute instance")
            log.info("pod uid %s: reusing MIG device %s (%s)", pod_uid, found.uuid, where)
            return found
        clash = [g for g in gis if g.placement.overlaps(place)]
        for g in [g for g in clash if (d.uuid, g.profile, g.placement.start) not in named]:
            try:  # a leftover no live pod names (not reclaimed yet): it goes now
                self.mig.destroy(d.uuid, g.id)
                self.reclaimed[(d.uuid, g.profile)] += 1
                clash.remove(g)
                log.info(
                    "reclaimed leftover MIG instance %s at %d on card %s for pod uid %s",
                    g.profile,
                    g.placement.start,
                    d.uuid,
                    pod_uid,
                )
            except MigRefused as err:
                log.info(
                    "leftover MIG instance %s at %d on card %s stays: %s",
                    g.profile,
                    g.placement.start,
                    d.uuid,
                    err,
                )
        if clash:
            held = ", ".join(f"{g.profile} at {g.placement.start}" for g in clash)
            raise PodFailure(
                f"{where}: placement taken by instance(s) {held}, which a live pod holds or a process "
                f"still runs on (a leftover is reclaimed once no process runs on it)"
            )
        busy = self._outside_mig(d.uuid)
        if busy:
            pids = ", ".join(str(p.pid) for p in busy[:5])
            raise PodFailure(
                f"{where}: GPU busy: {len(busy)} process(es) (pid {pids}) run on the card outside MIG; "
                f"MIG on demand never cuts a card with running processes"
            )
        try:
            made = self.mig.create(d.uuid, profile.name, place.start)
        except MigRefused as err:
            what = {IN_USE: "GPU busy", INSUFFICIENT_RESOURCES: "placement taken"}.get(err.code, "refused")
            raise PodFailure(f"{where}: {what}: {err}") from err
        log.info("pod uid %s: made MIG device %s (%s)", pod_uid, made.uuid, where)
        self.made[(d.uuid, profile.name)] += 1
        return made

    def _outside_mig(self, card: str) -> list[GpuProcess]:
        """The card's processes that run on none of its MIG devices (NVML may list a MIG
        device's processes on its parent card too: those are the pods', not in the way)."""
        on_card = self.mig.processes(card) or []
        inside = {p.pid for m in self.mig.devices(card) for p in self.mig.processes(m.uuid) or []}
        return [p for p in on_card if p.pid not in inside]

    # -- reclaim ------------------------------------------------------------------------------

    def reclaim(self) -> Reclaimed:
        """Destroy every instance on a dynamic card that no live pod names (see the module)."""
        done = Reclaimed()
        with self._lock:
            snapshot = {}
            for uuid in self.tables:
                try:
                    snapshot[uuid] = self.mig.gpu_instances(uuid)
                except MigRefused as err:
                    log.warning("not reclaiming on card %s: cannot list its instances (%s)", uuid, err)
            unreadable: list[str] = []
            try:
                named = named_by(self.list_pods(self.node), self.node, unreadable)
            except KubeError as err:
                log.warning("not reclaiming MIG instances: cannot list the node's pods (%s)", err)
                return done
            self._named = named
            if unreadable:  # such a pod may hold any instance: none is destroyed while it is here
                log.warning(
                    "not reclaiming MIG instances: the allocation of pod(s) %s cannot be read (written by "
                    "another version?); they go once those pods do",
                    ", ".join(unreadable[:5]),
                )
                snapshot = {}
            for uuid, gis in snapshot.items():
                for g in gis:
                    what = f"{g.profile} at slice {g.placement.start} on card {uuid} (GPU instance {g.id})"
                    if (uuid, g.profile, g.placement.start) in named:
                        done.kept += 1
                        continue
                    try:
                        self.mig.destroy(uuid, g.id)
                    except MigRefused as err:
                        if err.code == IN_USE:
                            log.info("MIG instance %s has processes on it: reclaimed once they end", what)
                            done.busy.append(what)
                        elif err.code != NOT_FOUND:
                            log.warning("could not reclaim MIG instance %s: %s", what, err)
                            done.busy.append(what)
                        continue
                    log.info("reclaimed MIG instance %s: no live pod holds it", what)
                    done.destroyed.append(what)
                    self.reclaimed[(uuid, g.profile)] += 1
            self.left_busy = len(done.busy)
            self._refresh()
        return done

    def run(self, stop: threading.Event, every_s: float) -> None:
        """Reclaim every ``every_s`` until ``stop`` (a thread's body)."""
        while not stop.wait(every_s):
            try:
                self.reclaim()
            except Exception:  # never let the loop die: the next pass tries again
                log.exception("MIG reclaim pass failed")
