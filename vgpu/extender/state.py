"""The extender's state and the three scheduling verbs, free of HTTP.

One :class:`SchedulerState` per process: the cluster's :class:`~vgpu.extender.mirror.Mirror`
(nodes, Leases, pods and the ledger, fed by :mod:`vgpu.extender.sync`), the placement index
(:mod:`vgpu.core.placement`) and the :class:`~vgpu.extender.binder.Binder`, all behind the
mirror's one lock, and the verbs the Flask views call: ``filter``, ``prioritize``, ``bind``.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

from vgpu.core.config import SchedulerConfig
from vgpu.core.errors import RequestError
from vgpu.core.fit import for_nodes
from vgpu.core.ledger import Ledger
from vgpu.core.placement import Cache, FilterResult, Placement, binpacks
from vgpu.core.policy import node_scores
from vgpu.core.requests import parse_pod
from vgpu.extender.binder import ASSUME_TTL_S, Binder, KubeAPI
from vgpu.extender.mirror import NUDGE_MAX, NUDGE_WINDOW_S, REFUSED_KEPT, Mirror, NodeEntry

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


class SchedulerState(Mirror):
    def __init__(
        self,
        config: SchedulerConfig,
        kube: KubeAPI | None = None,
        clock: Any = time.time,
        filter_keep: int = FILTER_KEEP,
    ) -> None:
        super().__init__(config, clock, Placement(Ledger(), filter_keep))
        self.filter_keep = filter_keep
        self.binder = Binder(self, kube, self._check_ready)
        # per node, for the pod filtered last: (ledger node version, inventory, utilisation with it)
        self._filtered: tuple[str, Cache] = ("", {})
        self.indexed = True  # filter visits nodes in policy order (False: the full scan, for tests)
        self.synced = threading.Event()
        self.leader = threading.Event()

    @property
    def kube(self) -> KubeAPI | None:
        return self.binder.kube

    @kube.setter
    def kube(self, kube: KubeAPI | None) -> None:
        self.binder.kube = kube

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
        binpack = binpacks(request, self.config.node_policy)
        cache: Cache = {}
        problem_now = partial(self.node_problem, now=now)  # called per node: no Python frame of ours
        with self.lock:
            self._filtered = (uid or "", cache)  # prioritize, called next for this pod, reuses it
            self.binder.lapse(now)
            if uid:
                self.recent_pods[uid] = pod
                if len(self.recent_pods) > 4096:
                    self.recent_pods.pop(next(iter(self.recent_pods)))
                self.binder.drop(uid)  # asked again: the last answer for it no longer stands
            if self.indexed and single is not None and (not uid or self.ledger.node_of(uid) is None):
                kept = self.placement.in_policy_order(
                    request, single, node_names, binpack, self.usable.get, problem_now, cache
                )
                if kept is not None:
                    self.binder.assume(uid, request, kept, now)
                    if uid:
                        self.refused.pop(uid, None)
                    return FilterResult(nodes=kept)
            result = self.placement.every_node(
                request, uid, node_names, binpack, self.config.gpu_policy, self.usable.get, problem_now, cache
            )
            self.binder.assume(uid, request, result.nodes, now)
            self.note_refusal(pod, uid, result, now)
            return result

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
        now = self.clock()
        with self.lock:
            cached = self._filtered[1] if uid and self._filtered[0] == uid else {}
            util = self.placement.utilizations(
                request,
                uid,
                node_names,
                self.config.gpu_policy,
                self.usable.get,
                partial(self.node_problem, now=now),
                cached,
            )
        scores = node_scores(util, request.node_policy or self.config.node_policy)
        return {name: scores.get(name, 0) for name in node_names}

    def bind(self, namespace: str, name: str, uid: str, node: str) -> tuple[str, str]:
        """Bind the pod: ("", "ok"), or (error text for ExtenderBindingResult, "conflict" | "error").

        "conflict" means the node has no room any more (a lost race): kube-scheduler tries again.
        """
        return self.binder.bind(namespace, name, uid, node)
