"""The extender's state and the three scheduling verbs, free of HTTP.

One :class:`SchedulerState` per process holds the ledger, every node's inventory and every
device plugin's Lease deadline, all behind one lock. It is fed by :mod:`vgpu.extender.sync`
(list, then watch) and asked by the Flask views. ``bind`` re-checks the chosen node under the
lock and reserves the plan in the ledger before anything is written, so two binds can never be
given the same capacity; the reservation is dropped again if writing the annotation or creating
the Binding fails.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from vgpu.core import annotations as ann
from vgpu.core.config import BINPACK, SchedulerConfig
from vgpu.core.errors import AnnotationError, KubeError, RequestError
from vgpu.core.fit import (
    CardSummary,
    Plan,
    Rejection,
    card_summary,
    fit_node,
    for_nodes,
    may_fit,
    quick_fits,
    quick_utilization,
    utilization,
)
from vgpu.core.ledger import Ledger, Usage, footprint
from vgpu.core.policy import node_scores
from vgpu.core.requests import ContainerRequest, PodRequest, parse_pod
from vgpu.kube.lease import expires_at

log = logging.getLogger(__name__)

Obj = dict[str, Any]
TERMINAL = ("Succeeded", "Failed")

# filter answers at most this many feasible nodes for a vGPU pod: the best by the pod's node policy.
# kube-scheduler hands filter's answer to prioritize and to its own scoring plugins, so at 1,000
# nodes every pod would otherwise cost two ~400-name round trips and ~400 nodes scored twice; the
# node kube-scheduler finally picks is among the policy's best either way.
FILTER_KEEP = 1

# How long filter's answer for a pod holds its capacity while kube-scheduler has yet to call bind
# (see SchedulerState.assumed). kube-scheduler binds within milliseconds, or seconds on a saturated
# API server; a pod it never binds (a later plugin turned it down) frees the capacity after this,
# or at once when it is filtered again or deleted.
ASSUME_TTL_S = 30.0

# A pod filter refused for lack of room is retried by kube-scheduler on cluster events, among
# them the deletion of the pod that frees the room. That event can reach kube-scheduler, and the
# retry reach filter, before our own pod watch has delivered it: the retry is refused again and
# no further event comes, so kube-scheduler would wait for its next sweep of unschedulable pods
# (every 30 s, for pods waiting longer than --pod-max-in-unschedulable-pods-duration). So when
# the ledger frees room, pods refused within this many seconds before are nudged: the Syncer
# annotates each (ann.ROOM_FREED_ANNOTATION), and a pod's own update makes kube-scheduler retry
# it. At most NUDGE_MAX per freeing, the most recently refused first; REFUSED_KEPT pods tracked.
NUDGE_WINDOW_S = 5.0
NUDGE_MAX = 100
REFUSED_KEPT = 4096


class KubeAPI(Protocol):
    """What the state needs from the API server (satisfied by :class:`vgpu.kube.client.Kube`)."""

    def get_pod(self, namespace: str, name: str) -> Obj | None: ...

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str] | None = None
    ) -> None: ...


@dataclass
class NodeEntry:
    inventory: ann.NodeInventory | None = None
    error: str | None = None  # why the inventory is unusable
    raw: str | None = None  # the annotation text it was decoded from
    # (memory MiB, vGPU slots) over all cards, and the first card's memory: the node policy's terms
    shape: tuple[int, int, int] = (0, 0, 0)


def _shape(inventory: ann.NodeInventory) -> tuple[int, int, int]:
    devices = inventory.devices
    first = devices[0].memory_mib if devices else 0
    return sum(d.memory_mib for d in devices), sum(d.split for d in devices), first


@dataclass
class FilterResult:
    nodes: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    error: str = ""


def _rv(obj: Mapping[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


def _phases(request: PodRequest) -> list[list[str]]:
    return [[c.name for c in phase] for phase in request.phases()]


class SchedulerState:
    def __init__(
        self,
        config: SchedulerConfig,
        kube: KubeAPI | None = None,
        clock: Any = time.time,
        filter_keep: int = FILTER_KEEP,
    ) -> None:
        if filter_keep < 1:
            raise ValueError(f"filter_keep must be at least 1, got {filter_keep}")
        self.config = config
        self.filter_keep = filter_keep
        self.kube = kube
        self.clock = clock
        self.lock = threading.RLock()
        self.ledger = Ledger()
        self.nodes: dict[str, NodeEntry] = {}
        self.lease_expiry: dict[str, float] = {}  # node -> when its plugin Lease runs out (epoch s)
        self.pod_rv: dict[str, int] = {}  # uid -> newest resourceVersion applied to the ledger
        self.binding: set[str] = set()  # uids with a bind in flight
        # uid -> when it lapses: the one node filter answered for the pod, held in the ledger
        # until bind comes, as kube-scheduler assumes a pod on its node before binding it. Without
        # it, a filter for the next pod, arriving while this pod's bind is still on its way (binds
        # are asynchronous), sees the room this pod is about to take; that pod's bind then finds
        # no room and kube-scheduler retries it only after its back-off (1 s at least).
        self.assumed: dict[str, float] = {}
        self.recent_pods: dict[str, Obj] = {}  # uid -> pod as seen in filter (bind has only its name)
        # per node, for the pod filtered last: (ledger node version, inventory, utilisation with it)
        self._filtered: tuple[str, dict[str, tuple[int, Any, float]]] = ("", {})
        self._pod_raw: dict[str, str] = {}  # uid -> the allocation annotation last committed
        # node -> (ledger node version, inventory, what its cards can still take); see _summary
        self._summaries: dict[str, tuple[int, ann.NodeInventory, CardSummary]] = {}
        self.indexed = True  # filter visits nodes in policy order (False: the full scan, for tests)
        # nodes with an inventory, grouped by (capacity shape, committed totals): nodes of one group
        # rank alike under the node policy (see _filter_in_policy_order); regrouped when the ledger
        # or the inventory changes
        self._groups: dict[tuple[tuple[int, int, int], tuple[int, int]], set[str]] = {}
        self._group_of: dict[str, tuple[tuple[int, int, int], tuple[int, int]]] = {}
        self._regroup: set[str] = set()  # nodes whose inventory changed since the last regrouping
        self.synced = threading.Event()
        self.leader = threading.Event()
        self.inventory_errors = 0
        # pods filter refused for lack of room: uid -> (when, namespace, name), oldest first; and
        # when the ledger last freed room (see NUDGE_WINDOW_S), with an event the Syncer waits on
        self.refused: dict[str, tuple[float, str, str]] = {}
        self.freed_at = 0.0
        self.room_freed = threading.Event()

    # -- feeding: nodes ------------------------------------------------------------------------
    def apply_node(self, node: Obj) -> None:
        meta = node.get("metadata") or {}
        name = meta.get("name")
        if not name:
            return
        raw = (meta.get("annotations") or {}).get(ann.DEVICES_ANNOTATION)
        with self.lock:
            old = self.nodes.get(name)
            if old is not None and old.raw == raw:
                return
            self._regroup.add(name)
            if raw is None:
                self.nodes[name] = NodeEntry(
                    error=f"had no vGPU inventory (annotation {ann.DEVICES_ANNOTATION} missing)"
                )
                return
            try:
                inventory = ann.decode_devices(raw)
                self.nodes[name] = NodeEntry(inventory=inventory, raw=raw, shape=_shape(inventory))
            except AnnotationError as err:
                self.nodes[name] = NodeEntry(error=f"had a malformed inventory, skipped: {err}", raw=raw)
                self.inventory_errors += 1
                log.warning("node %s: %s; skipping it until the annotation is fixed", name, err)
                from vgpu.extender import metrics

                metrics.INVENTORY_ERRORS.labels(name).inc()

    def forget_node(self, name: str) -> None:
        with self.lock:
            self.nodes.pop(name, None)
            self._summaries.pop(name, None)
            self._regroup.add(name)

    def replace_nodes(self, nodes: Iterable[Obj]) -> None:
        names = set()
        for n in nodes:
            self.apply_node(n)
            names.add((n.get("metadata") or {}).get("name"))
        with self.lock:
            for name in list(self.nodes):
                if name not in names:
                    del self.nodes[name]
                    self._summaries.pop(name, None)
                    self._regroup.add(name)

    # -- feeding: device plugin Leases ---------------------------------------------------------
    def apply_lease(self, lease: Obj, deleted: bool = False) -> None:
        name = (lease.get("metadata") or {}).get("name") or ""
        if not name.startswith(ann.LEASE_PREFIX) or name == self.config.leader_lease:
            return
        node = name[len(ann.LEASE_PREFIX) :]
        with self.lock:
            if deleted:
                self.lease_expiry.pop(node, None)
                return
            ends = expires_at(lease)  # None (unreadable): counted as run out
            self.lease_expiry[node] = 0.0 if ends is None else ends + self.config.plugin_lease_grace_s

    def replace_leases(self, leases: Iterable[Obj]) -> None:
        with self.lock:
            self.lease_expiry.clear()
        for lease in leases:
            self.apply_lease(lease)

    # -- feeding: pods -------------------------------------------------------------------------
    def apply_pod(self, pod: Obj, deleted: bool = False) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid")
        if not uid:
            return
        rv = _rv(pod)
        with self.lock:
            if deleted:
                self.assumed.pop(uid, None)
                self._release(uid)
                self.pod_rv.pop(uid, None)
                self.recent_pods.pop(uid, None)
                self.refused.pop(uid, None)
                self._pod_raw.pop(uid, None)
                return
            if rv and rv < self.pod_rv.get(uid, 0):
                return  # older than what the ledger already reflects (e.g. our own bind's patch)
            self.pod_rv[uid] = max(rv, self.pod_rv.get(uid, 0))
            if (pod.get("status") or {}).get("phase") in TERMINAL:
                self._pod_raw.pop(uid, None)
                self.assumed.pop(uid, None)
                self.refused.pop(uid, None)
                self._release(uid)  # finished pods hold nothing, as for any Kubernetes resource
                return
            raw = (meta.get("annotations") or {}).get(ann.ALLOCATION_ANNOTATION)
            if raw is None:
                # Not (yet) placed, or an event from before our own bind that the watch delivers
                # late: either way nothing to change. Only deletion or finishing frees capacity.
                return
            if self._pod_raw.get(uid) == raw and self.ledger.node_of(uid) is not None:
                return  # the same allocation as already committed (most events are status updates)
            try:
                allocation = ann.decode_allocation(raw)
            except AnnotationError as err:
                log.warning(
                    "pod %s/%s: %s; its capacity is not counted", meta.get("namespace"), meta.get("name"), err
                )
                return
            try:
                phases: list[list[str]] | None = _phases(parse_pod(pod, self.config))
            except RequestError:
                phases = None  # count every container at once: never less than the truth
            self.assumed.pop(uid, None)
            self.ledger.commit(uid, allocation.node, footprint(allocation, phases))
            self._pod_raw[uid] = raw

    def replace_pods(self, pods: Iterable[Obj]) -> None:
        """A fresh list: forget pods it no longer has (except binds in flight), apply the rest."""
        pods = list(pods)
        seen = {(p.get("metadata") or {}).get("uid") for p in pods}
        with self.lock:
            for uid in list(self.ledger.pods()):
                if uid not in seen and uid not in self.binding:
                    self.assumed.pop(uid, None)
                    self._release(uid)
                    self.pod_rv.pop(uid, None)
                    self._pod_raw.pop(uid, None)
            for p in pods:
                self.apply_pod(p)

    def _release(self, uid: str) -> None:
        """A pod left for good (deleted, finished, gone from a fresh list): free its room and
        note it for the nudge (see NUDGE_WINDOW_S). Caller holds the lock."""
        if self.ledger.node_of(uid) is None:
            return
        self.ledger.release(uid)
        self.freed_at = self.clock()
        self.room_freed.set()

    def _note_refusal(self, pod: Obj, uid: str | None, result: FilterResult, now: float) -> None:
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

    def take_nudges(self) -> list[tuple[str, str, str]]:
        """(uid, namespace, name) of the pods to nudge since room last freed, most recent first;
        each is forgotten (a new refusal notes it again)."""
        with self.lock:
            since = self.freed_at - NUDGE_WINDOW_S
            out: list[tuple[str, str, str]] = []
            for uid, (when, namespace, name) in reversed(self.refused.items()):
                if when < since or len(out) == NUDGE_MAX:
                    break
                out.append((uid, namespace, name))
            for uid, _, _ in out:
                del self.refused[uid]
            return out

    # -- asking ----------------------------------------------------------------------------------
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

    def _check_ready(self) -> str | None:
        if not self.synced.is_set():
            return "vGPU extender is still loading cluster state; retry"
        if not self.leader.is_set():
            return "this vGPU extender replica is on standby (not the Lease holder); retry"
        return None

    def filter(self, pod: Obj, node_names: list[str]) -> FilterResult:
        problem = self._check_ready()
        if problem:
            return FilterResult(error=problem)
        try:
            request = parse_pod(pod, self.config)
        except RequestError as err:  # an impossible pod (admission was bypassed): fits nowhere
            return FilterResult(unresolvable=dict.fromkeys(node_names, for_nodes(f"were not tried: {err}")))
        uid = (pod.get("metadata") or {}).get("uid")
        if not request.wants_vgpu:
            return FilterResult(nodes=list(node_names))
        now = self.clock()
        single = request.single_container  # the usual pod: a quick exact check, no plan built
        cache: dict[str, tuple[int, Any, float]] = {}
        with self.lock:
            self._filtered = (uid or "", cache)  # prioritize, called next for this pod, reuses it
            self._lapse_assumed(now)
            if uid:
                self.recent_pods[uid] = pod
                if len(self.recent_pods) > 4096:
                    self.recent_pods.pop(next(iter(self.recent_pods)))
                self._drop_assumed(uid)  # asked again: the last answer for it no longer stands
            if self.indexed and single is not None and (not uid or self.ledger.node_of(uid) is None):
                kept = self._filter_in_policy_order(request, single, node_names, now, cache)
                if kept is not None:
                    self._assume(uid, request, kept, now)
                    if uid:
                        self.refused.pop(uid, None)
                    return FilterResult(nodes=kept)
            result = self._filter_every_node(request, uid, node_names, now, cache)
            self._assume(uid, request, result.nodes, now)
            self._note_refusal(pod, uid, result, now)
            return result

    def _assume(self, uid: str | None, request: PodRequest, nodes: list[str], now: float) -> None:
        """Hold the pod's capacity on the one node filter answered, until bind (see ``assumed``).

        Only for a pod that holds nothing yet and got exactly one node: with more, kube-scheduler
        picks among them and we cannot know which. Caller holds the lock.
        """
        if not uid or len(nodes) != 1 or self.ledger.node_of(uid) is not None:
            return
        node = nodes[0]
        inventory = self.nodes[node].inventory
        assert inventory is not None
        outcome = fit_node(node, inventory, self.ledger.usage(node), request, self.config.gpu_policy)
        if isinstance(outcome, Plan):
            self.ledger.commit(uid, node, outcome.footprint)
            self.assumed[uid] = now + ASSUME_TTL_S

    def _lapse_assumed(self, now: float) -> None:
        """Free the assumptions bind never came for. Caller holds the lock."""
        while self.assumed:
            uid, until = next(iter(self.assumed.items()))
            if until > now:
                return  # in the order made (a pod filtered again goes to the end), so the rest too
            self._drop_assumed(uid)
            log.info(
                "pod uid %s: filtered %.0f s ago and not bound; its capacity is free again", uid, ASSUME_TTL_S
            )

    def _filter_every_node(
        self,
        request: PodRequest,
        uid: str | None,
        node_names: list[str],
        now: float,
        cache: dict[str, tuple[int, Any, float]],
    ) -> FilterResult:
        """Fit the pod on every node (with each one's reason), then keep the best. Caller holds the lock."""
        result = FilterResult()
        single = request.single_container
        for name in node_names:
            problem = self.node_problem(name, now)
            if problem is not None:
                result.unresolvable[name] = for_nodes(problem)
                continue
            entry = self.nodes[name]
            assert entry.inventory is not None
            usage = self.ledger.usage(name, excluding=uid)
            if single is not None and quick_fits(entry.inventory, usage, single, request.selection):
                result.nodes.append(name)
                util = quick_utilization(entry.inventory, usage, single)
                cache[name] = (self.ledger.node_version(name), entry.inventory, util)
                continue
            outcome = fit_node(name, entry.inventory, usage, request, self.config.gpu_policy, decide=False)
            if isinstance(outcome, Plan):
                result.nodes.append(name)
                util = utilization(entry.inventory, usage, outcome.footprint)
                cache[name] = (self.ledger.node_version(name), entry.inventory, util)
            elif outcome.unresolvable:
                result.unresolvable[name] = for_nodes(outcome.reason)
            else:
                result.failed[name] = for_nodes(outcome.reason)
        if len(result.nodes) > self.filter_keep:
            result.nodes = self._best(result.nodes, request, cache)
        return result

    def _filter_in_policy_order(
        self,
        request: PodRequest,
        c: ContainerRequest,
        node_names: list[str],
        now: float,
        cache: dict[str, tuple[int, Any, float]],
    ) -> list[str] | None:
        """The nodes :meth:`_filter_every_node` keeps, found by fitting only the best candidates.

        For a pod whose vGPUs are all in one container ``c`` and that holds nothing yet. A node's
        utilisation with the pod on it depends only on its capacity shape and the ledger's totals
        for it (the same integers and arithmetic as ``quick_utilization``, so the same floats), so
        it is worked out once per group of nodes alike in both, not per node. Groups are visited
        best first by the node policy; within equal utilisation, nodes in the order given; the
        first ``filter_keep`` that fit are the answer: exactly the full scan's choice. A node is
        turned away by its :class:`CardSummary` when that shows it cannot take ``c``, before any
        card is looked at. None when fewer than ``filter_keep`` nodes fit: then the full scan
        runs, for every node's reason. Caller holds the lock.
        """
        self._refresh_groups()
        binpack = (request.node_policy or self.config.node_policy) == BINPACK
        count, percent = c.count, c.memory_percent or 0
        ranked: dict[float, list[set[str]]] = {}
        for ((total_mem, total_slots, first), (used_mem, used_slots)), members in self._groups.items():
            if not total_mem or not total_slots:
                util = 1.0
            else:
                mem = c.memory_mib if c.memory_mib is not None else first * percent // 100
                util = ((used_mem + mem * count) / total_mem + (used_slots + count) / total_slots) / 2
            ranked.setdefault(util, []).append(members)
        position: dict[str, int] | None = None
        kept: list[tuple[int, str]] = []
        for util in sorted(ranked, reverse=binpack):
            groups = ranked[util]
            members = groups[0] if len(groups) == 1 else set().union(*groups)
            candidates: Iterable[tuple[int, str]]
            if len(members) * 4 >= len(node_names):
                # a large group (on an idle cluster, every node): walk the names in order, stopping
                # at the first that fits, rather than sorting where each member was asked
                candidates = ((i, n) for i, n in enumerate(node_names) if n in members)
            else:
                if position is None:
                    position = dict(zip(node_names, range(len(node_names)), strict=True))
                found = position.keys() & members
                candidates = ((i, node_names[i]) for i in sorted(map(position.__getitem__, found)))
            for i, name in candidates:
                if name in cache:
                    continue  # named twice in the request: kept once
                if self.node_problem(name, now) is not None:
                    continue
                inventory = self.nodes[name].inventory
                assert inventory is not None
                version = self.ledger.node_version(name)
                usage = self.ledger.usage(name)
                if not may_fit(self._summary(name, inventory, version, usage), c):
                    continue
                if not quick_fits(inventory, usage, c, request.selection):
                    continue
                kept.append((i, name))
                cache[name] = (version, inventory, util)
                if len(kept) == self.filter_keep:
                    kept.sort()
                    return [name for _, name in kept]
        return None

    def _refresh_groups(self) -> None:
        """Move the nodes whose totals or inventory changed to their group. Caller holds the lock."""
        changed = self.ledger.take_changed()
        if self._regroup:
            changed |= self._regroup
            self._regroup = set()
        for name in changed:
            old = self._group_of.pop(name, None)
            if old is not None:
                members = self._groups[old]
                members.discard(name)
                if not members:
                    del self._groups[old]
            entry = self.nodes.get(name)
            if entry is None or entry.inventory is None:
                continue
            key = (entry.shape, self.ledger.totals(name))
            self._groups.setdefault(key, set()).add(name)
            self._group_of[name] = key

    def _summary(
        self, name: str, inventory: ann.NodeInventory, version: int, usage: Mapping[str, Usage]
    ) -> CardSummary:
        """The node's :class:`CardSummary`, recomputed only when its ledger entry or inventory changed."""
        hit = self._summaries.get(name)
        if hit is not None and hit[0] == version and hit[1] is inventory:
            return hit[2]
        summary = card_summary(inventory, usage)
        self._summaries[name] = (version, inventory, summary)
        return summary

    def _best(
        self, feasible: list[str], request: PodRequest, cache: dict[str, tuple[int, Any, float]]
    ) -> list[str]:
        """The ``filter_keep`` best of ``feasible`` by the pod's node policy, in their given order.

        ``cache`` holds each feasible node's utilisation with the pod on it (filter fills it, and
        prioritize reuses it). Ties keep kube-scheduler's order (it rotates where it starts), so
        equal nodes share the load.
        """
        sign = -1.0 if (request.node_policy or self.config.node_policy) == BINPACK else 1.0
        order = {name: i for i, name in enumerate(feasible)}
        keep = heapq.nsmallest(self.filter_keep, feasible, key=lambda n: (sign * cache[n][2], order[n]))
        keep.sort(key=order.__getitem__)
        return keep

    def prioritize(self, pod: Obj, node_names: list[str]) -> dict[str, int]:
        problem = self._check_ready()
        if problem:
            raise NotReady(problem)
        try:
            request = parse_pod(pod, self.config)
        except RequestError:
            return dict.fromkeys(node_names, 0)
        uid = (pod.get("metadata") or {}).get("uid")
        if not request.wants_vgpu:
            return dict.fromkeys(node_names, 0)
        util: dict[str, float] = {}
        now = self.clock()
        with self.lock:
            cached = self._filtered[1] if uid and self._filtered[0] == uid else {}
            for name in node_names:
                entry = self.nodes.get(name)
                if entry is None or entry.inventory is None or self.node_problem(name, now):
                    continue
                hit = cached.get(name)
                if hit is not None and hit[0] == self.ledger.node_version(name) and hit[1] is entry.inventory:
                    util[name] = hit[2]
                    continue
                usage = self.ledger.usage(name, excluding=uid)
                if request.single_container is not None:
                    util[name] = quick_utilization(entry.inventory, usage, request.single_container)
                    continue
                outcome = fit_node(
                    name, entry.inventory, usage, request, self.config.gpu_policy, decide=False
                )
                if isinstance(outcome, Plan):
                    util[name] = utilization(entry.inventory, usage, outcome.footprint)
        scores = node_scores(util, request.node_policy or self.config.node_policy)
        return {name: scores.get(name, 0) for name in node_names}

    def bind(self, namespace: str, name: str, uid: str, node: str) -> tuple[str, str]:
        """Bind the pod: ("", "ok"), or (error text for ExtenderBindingResult, "conflict" | "error").

        "conflict" means the node has no room any more (a lost race): kube-scheduler tries again.
        """
        error, kind = self._bind(namespace, name, uid, node)
        return error, ("ok" if not error else kind)

    def _bind(self, namespace: str, name: str, uid: str, node: str) -> tuple[str, str]:
        problem = self._check_ready()
        if problem:
            return problem, "error"
        assert self.kube is not None, "bind needs the API server"
        pod = self.recent_pods.get(uid)
        if pod is None:
            try:
                pod = self.kube.get_pod(namespace, name)
            except KubeError as err:
                return str(err), "error"
            if pod is None or (pod.get("metadata") or {}).get("uid") != uid:
                return f"pod {namespace}/{name} (uid {uid}) no longer exists", "error"
        try:
            request = parse_pod(pod, self.config)
        except RequestError as err:
            return str(err), "error"
        if not request.wants_vgpu:
            return self._create_binding(namespace, name, uid, node), "error"
        # reserve under the lock: re-check against the ledger as it is now
        with self.lock:
            problem = self.node_problem(node, self.clock())
            if problem is not None:
                self._drop_assumed(uid)
                return f"node {node} {problem}", "conflict"
            if uid in self.binding:
                return f"pod {namespace}/{name} is already being bound", "conflict"
            inventory = self.nodes[node].inventory
            assert inventory is not None
            outcome = fit_node(
                node, inventory, self.ledger.usage(node, excluding=uid), request, self.config.gpu_policy
            )
            if isinstance(outcome, Rejection):
                self._drop_assumed(uid)
                return f"node {node} {outcome.reason}", "conflict"
            self.binding.add(uid)
            self.assumed.pop(uid, None)  # the bind's own reservation replaces filter's
            self.ledger.commit(uid, node, outcome.footprint)
        try:
            annotations = {
                ann.ALLOCATION_ANNOTATION: ann.encode_allocation(outcome.allocation),
                ann.PHASE_ANNOTATION: ann.PHASE_BOUND,
            }
            error = self._create_binding(namespace, name, uid, node, annotations)
            if error:
                self._undo(uid)
            else:
                with self.lock:
                    if self.ledger.node_of(uid) == node:
                        # what the watch will deliver: the bound pod then costs no second decode
                        self._pod_raw[uid] = annotations[ann.ALLOCATION_ANNOTATION]
            return error, "error"
        finally:
            with self.lock:
                self.binding.discard(uid)

    def _drop_assumed(self, uid: str) -> None:
        """Free what filter held for the pod, if anything. Caller holds the lock."""
        if self.assumed.pop(uid, None) is not None:
            self.ledger.release(uid)

    def _undo(self, uid: str) -> None:
        with self.lock:
            self.ledger.release(uid)

    def _create_binding(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str] | None = None
    ) -> str:
        """Bind (with the allocation, in the same write); "" on success, else why not."""
        assert self.kube is not None
        try:
            self.kube.bind_pod(namespace, name, uid, node, annotations)
        except KubeError as err:
            # did it take after all (a timeout, or a retry after our own earlier success)?
            try:
                pod = self.kube.get_pod(namespace, name)
            except KubeError:
                pod = None
            if pod is not None and (pod.get("metadata") or {}).get("uid") == uid:
                got = (pod.get("metadata") or {}).get("annotations") or {}
                same = all(got.get(k) == v for k, v in (annotations or {}).items())
                if (pod.get("spec") or {}).get("nodeName") == node and same:
                    return ""
            return str(err)
        return ""

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
        self, changed_since: Mapping[str, tuple[int, int]] | None = None
    ) -> list[tuple[str, ann.NodeInventory, Mapping[str, Usage], int]]:
        """(node, inventory, usage per card, ledger node version) for nodes with an inventory.

        With ``changed_since`` (node -> (version, inventory id)), only nodes that changed since.
        """
        out: list[tuple[str, ann.NodeInventory, Mapping[str, Usage], int]] = []
        with self.lock:
            for name, e in self.nodes.items():
                if e.inventory is None:
                    continue
                version = self.ledger.node_version(name)
                if changed_since is not None and changed_since.get(name) == (version, id(e.inventory)):
                    continue
                out.append((name, e.inventory, dict(self.ledger.usage(name)), version))
        return out

    def skipped(self) -> dict[str, int]:
        now = self.clock()
        with self.lock:
            malformed = sum(1 for e in self.nodes.values() if e.inventory is None and e.raw is not None)
            expired = sum(
                1
                for n, e in self.nodes.items()
                if e.inventory is not None and self.node_problem(n, now) is not None
            )
        return {"malformed_inventory": malformed, "plugin_lease_expired": expired}


class NotReady(Exception):
    """The replica cannot answer now (loading, or on standby)."""
