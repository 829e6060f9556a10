"""The extender's state and the three scheduling verbs, free of HTTP.

One :class:`SchedulerState` per process puts together, behind one lock, parts that each own their
fields: the :class:`~vgpu.extender.mirror.Mirror` (nodes, Leases, bound pods, fed by
:mod:`vgpu.extender.sync`), the :class:`~vgpu.extender.cache.PodCache` (pods between filter and
bind: assumed, parsed once, fitted once), the :class:`~vgpu.extender.nudges.Nudges` (pods refused
for lack of room), the placement index (:mod:`vgpu.core.placement`) over the shared
:class:`~vgpu.core.ledger.Ledger`, and the :class:`~vgpu.extender.binder.Binder`; and it answers
the verbs the HTTP handlers (:mod:`vgpu.extender.verbs`) call: ``filter``, ``prioritize``, ``bind``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from vgpu.core import annotations as ann
from vgpu.core.config import SchedulerConfig
from vgpu.core.fit import Plan, fit_node, for_nodes
from vgpu.core.ledger import Footprint, Ledger, Usage
from vgpu.core.placement import Cache, FilterResult, Placement, binpacks
from vgpu.core.policy import node_scores
from vgpu.core.requests import PodRequest
from vgpu.extender.binder import Binder, KubeAPI
from vgpu.extender.cache import ASSUME_TTL_S, PodCache
from vgpu.extender.mirror import Mirror, NodeEntry
from vgpu.extender.nudges import NUDGE_MAX, NUDGE_WINDOW_S, REFUSED_KEPT, Nudges

__all__ = [
    "ASSUME_TTL_S",
    "FILTER_KEEP",
    "NUDGE_MAX",
    "NUDGE_WINDOW_S",
    "REFUSED_KEPT",
    "FilterResult",
    "KubeAPI",
    "NodeEntry",
    "NotReady",
    "SchedulerState",
]

Obj = dict[str, Any]

# filter answers at most this many feasible nodes for a vGPU pod: the best by the pod's node policy.
# kube-scheduler hands filter's answer to prioritize and to its own scoring plugins, so at 1,000
# nodes every pod would otherwise cost two ~400-name round trips and ~400 nodes scored twice; the
# node kube-scheduler finally picks is among the policy's best either way.
FILTER_KEEP = 1


class NotReady(Exception):
    """The replica cannot answer now (loading, or on standby)."""


class SchedulerState:
    def __init__(
        self,
        config: SchedulerConfig,
        kube: KubeAPI | None = None,
        clock: Callable[[], float] = time.time,
        filter_keep: int = FILTER_KEEP,
    ) -> None:
        self.config = config
        self.clock = clock  # read through self.now by every part, so a test may set it later
        self.lock = threading.RLock()
        self.filter_keep = filter_keep
        ledger = Ledger()
        self.ledger = ledger
        self.placement = Placement(ledger, filter_keep)
        self.cache = PodCache(ledger)
        self.nudges = Nudges(self.now, self.lock)
        self.mirror = Mirror(config, self.now, self.lock, self.placement, self.cache, self.nudges)
        self.binder = Binder(self.mirror, self.cache, kube, self._check_ready)
        # per node, for the pod filtered last: (ledger node version, inventory, utilisation with it)
        self._filtered: tuple[str, Cache] = ("", {})
        self.indexed = True  # filter visits nodes in policy order (False: the full scan, for tests)
        self.synced = threading.Event()
        self.leader = threading.Event()

    def now(self) -> float:
        return self.clock()

    @property
    def kube(self) -> KubeAPI | None:
        return self.binder.kube

    @kube.setter
    def kube(self, kube: KubeAPI | None) -> None:
        self.binder.kube = kube

    # -- the parts' fields, read by the syncer, the metrics and the tests -------------------------
    @property
    def nodes(self) -> dict[str, NodeEntry]:
        return self.mirror.nodes

    @property
    def usable(self) -> dict[str, tuple[ann.NodeInventory, Any]]:
        return self.mirror.usable

    @property
    def lease_expiry(self) -> dict[str, float]:
        return self.mirror.lease_expiry

    @property
    def parked(self) -> dict[str, dict[str, Footprint]]:
        return self.mirror.parked

    @property
    def inventory_errors(self) -> int:
        return self.mirror.inventory_errors

    @property
    def assumed(self) -> dict[str, float]:
        return self.cache.assumed

    @property
    def binding(self) -> set[str]:
        return self.cache.binding

    @property
    def room_freed(self) -> threading.Event:
        return self.nudges.room_freed

    def take_nudges(self) -> list[tuple[str, str, str]]:
        return self.nudges.take()

    # -- what the watches deliver (vgpu.extender.sync) ---------------------------------------------
    def apply_node(self, node: Obj) -> None:
        self.mirror.apply_node(node)

    def forget_node(self, name: str) -> None:
        self.mirror.forget_node(name)

    def replace_nodes(self, nodes: Iterable[Obj]) -> None:
        self.mirror.replace_nodes(nodes)

    def apply_lease(self, lease: Obj, deleted: bool = False) -> None:
        self.mirror.apply_lease(lease, deleted)

    def replace_leases(self, leases: Iterable[Obj]) -> None:
        self.mirror.replace_leases(leases)

    def apply_pod(self, pod: Obj, deleted: bool = False) -> None:
        self.mirror.apply_pod(pod, deleted)

    def replace_pods(self, pods: Iterable[Obj]) -> None:
        self.mirror.replace_pods(pods)

    def node_problem(self, name: str, now: float) -> str | None:
        return self.mirror.node_problem(name, now)

    # -- for the webhook and metrics ---------------------------------------------------------------
    def largest_card(self) -> tuple[int, int] | None:
        return self.mirror.largest_card()

    def known_cards(self) -> list[ann.Device]:
        return self.mirror.known_cards()

    def snapshot(
        self, changed_since: Mapping[str, tuple[int, int, Any]] | None = None
    ) -> list[tuple[str, ann.NodeInventory, Mapping[str, Usage], int]]:
        return self.mirror.snapshot(changed_since)

    def inventoried(self) -> set[str]:
        return self.mirror.inventoried()

    def skipped(self) -> dict[str, int]:
        return self.mirror.skipped()

    # -- the verbs -----------------------------------------------------------------------------------
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
        uid = (pod.get("metadata") or {}).get("uid")
        now = self.clock()
        cache: Cache = {}
        problem_now = partial(self.mirror.node_problem, now=now)  # per node: no Python frame of ours
        m, pods = self.mirror, self.cache
        with self.lock:
            parsed = pods.parsed(pod, self.config)
            request = parsed.request
            if request is None:  # an impossible pod (admission was bypassed): fits nowhere
                return FilterResult(
                    unresolvable=dict.fromkeys(node_names, for_nodes(f"were not tried: {parsed.error}"))
                )
            if not request.wants_vgpu:
                return FilterResult(nodes=list(node_names))
            single = request.single_container  # the usual pod: a quick exact check, no plan built
            binpack = binpacks(request, self.config.node_policy)
            self._filtered = (uid or "", cache)  # prioritize, called next for this pod, reuses it
            pods.expire(now)
            if uid:
                pods.forget(uid)  # asked again: the last answer for it no longer stands
            if self.indexed and single is not None and (not uid or self.ledger.node_of(uid) is None):
                plans: dict[str, Plan] = {}
                kept = self.placement.in_policy_order(
                    request, single, node_names, binpack, m.usable.get, problem_now, cache,
                    plans if uid else None, self.config.gpu_policy,
                )  # fmt: skip
                if kept is not None:
                    self._assume(uid, request, kept, now, plans)
                    if uid:
                        self.nudges.placed(uid)
                    return FilterResult(nodes=kept)
            result = self.placement.every_node(
                request, uid, node_names, binpack, self.config.gpu_policy, m.usable.get, problem_now, cache
            )
            self._assume(uid, request, result.nodes, now, {})
            self.nudges.note_refusal(pod, uid, result, now)
            return result

    def _assume(
        self, uid: str | None, request: PodRequest, nodes: list[str], now: float, plans: Mapping[str, Plan]
    ) -> None:
        """Hold the pod's capacity on the one node filter answered, until bind.

        Without it, a filter for the next pod, arriving while this pod's bind is still on its way
        (binds are asynchronous), sees the room this pod is about to take; that pod's bind then
        finds no room and kube-scheduler retries it only after its back-off (1 s at least). Only
        for a pod that holds nothing yet and got exactly one node: with more, kube-scheduler picks
        among them and we cannot know which. The plan is the one filter fitted (``plans``), else
        fitted here. Caller holds the lock.
        """
        if not uid or len(nodes) != 1 or self.ledger.node_of(uid) is not None:
            return
        node = nodes[0]
        whole = self.mirror.nodes[node].inventory
        assert whole is not None
        inventory = whole.offering(request.resource)
        plan = plans.get(node)
        if plan is None:
            outcome = fit_node(node, inventory, self.ledger.usage(node), request, self.config.gpu_policy)
            if not isinstance(outcome, Plan):
                return
            plan = outcome
        self.cache.assume(uid, node, inventory, plan, now + ASSUME_TTL_S)

    def prioritize(self, pod: Obj, node_names: list[str]) -> dict[str, int]:
        problem = self._check_ready()
        if problem:
            raise NotReady(problem)
        uid = (pod.get("metadata") or {}).get("uid")
        now = self.clock()
        with self.lock:
            request = self.cache.parsed(pod, self.config).request
            if request is None or not request.wants_vgpu:
                return dict.fromkeys(node_names, 0)
            cached = self._filtered[1] if uid and self._filtered[0] == uid else {}
            util = self.placement.utilizations(
                request,
                uid,
                node_names,
                self.config.gpu_policy,
                self.mirror.usable.get,
                partial(self.mirror.node_problem, now=now),
                cached,
            )
            policy = request.node_policy or self.config.node_policy
        scores = node_scores(util, policy)
        return {name: scores.get(name, 0) for name in node_names}

    def bind(self, namespace: str, name: str, uid: str, node: str) -> tuple[str, str]:
        """Bind the pod: ("", "ok"), or (error text for ExtenderBindingResult, "conflict" | "error").

        "conflict" means the node has no room any more (a lost race): kube-scheduler tries again.
        """
        return self.binder.bind(namespace, name, uid, node)
