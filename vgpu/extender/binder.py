"""Binding a pod: re-check its node, reserve the plan, write the Binding with the allocation.

``bind`` re-checks the chosen node under the mirror's lock and reserves the plan in the ledger
before anything is written, so two binds can never be given the same capacity; the reservation is
dropped again if creating the Binding fails. Between filter and bind, the one node filter answered
holds the pod's capacity (``assume``), as kube-scheduler assumes a pod on its node before binding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from vgpu.core import annotations as ann
from vgpu.core.errors import KubeError, RequestError
from vgpu.core.fit import Plan, Rejection, fit_node
from vgpu.core.requests import PodRequest, parse_pod
from vgpu.extender.mirror import Mirror

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# How long filter's answer for a pod holds its capacity while kube-scheduler has yet to call bind
# (see Mirror.assumed). kube-scheduler binds within milliseconds, or seconds on a saturated
# API server; a pod it never binds (a later plugin turned it down) frees the capacity after this,
# or at once when it is filtered again or deleted.
ASSUME_TTL_S = 30.0


class KubeAPI(Protocol):
    """What binding needs from the API server (satisfied by :class:`vgpu.kube.client.Kube`)."""

    def get_pod(self, namespace: str, name: str) -> Obj | None: ...

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str] | None = None
    ) -> None: ...


class Binder:
    """Holds and binds against ``mirror``; ``not_ready()`` says why the replica cannot bind now."""

    def __init__(self, mirror: Mirror, kube: KubeAPI | None, not_ready: Callable[[], str | None]) -> None:
        self.mirror = mirror
        self.kube = kube
        self.not_ready = not_ready

    # -- filter's hold until bind ----------------------------------------------------------------
    def assume(self, uid: str | None, request: PodRequest, nodes: list[str], now: float) -> None:
        """Hold the pod's capacity on the one node filter answered, until bind.

        Without it, a filter for the next pod, arriving while this pod's bind is still on its way
        (binds are asynchronous), sees the room this pod is about to take; that pod's bind then
        finds no room and kube-scheduler retries it only after its back-off (1 s at least). Only
        for a pod that holds nothing yet and got exactly one node: with more, kube-scheduler picks
        among them and we cannot know which. Caller holds the lock.
        """
        m = self.mirror
        if not uid or len(nodes) != 1 or m.ledger.node_of(uid) is not None:
            return
        node = nodes[0]
        whole = m.nodes[node].inventory
        assert whole is not None
        inventory = whole.offering(request.resource)
        outcome = fit_node(node, inventory, m.ledger.usage(node), request, m.config.gpu_policy)
        if isinstance(outcome, Plan):
            m.ledger.commit(uid, node, outcome.footprint)
            m.assumed[uid] = now + ASSUME_TTL_S

    def lapse(self, now: float) -> None:
        """Free the assumptions bind never came for. Caller holds the lock."""
        assumed = self.mirror.assumed
        while assumed:
            uid, until = next(iter(assumed.items()))
            if until > now:
                return  # in the order made (a pod filtered again goes to the end), so the rest too
            self.drop(uid)
            log.info(
                "pod uid %s: filtered %.0f s ago and not bound; its capacity is free again", uid, ASSUME_TTL_S
            )

    def drop(self, uid: str) -> None:
        """Free what filter held for the pod, if anything. Caller holds the lock."""
        if self.mirror.assumed.pop(uid, None) is not None:
            self.mirror.ledger.release(uid)

    # -- bind --------------------------------------------------------------------------------------
    def bind(self, namespace: str, name: str, uid: str, node: str) -> tuple[str, str]:
        """Bind the pod: ("", "ok"), or (error text for ExtenderBindingResult, "conflict" | "error").

        "conflict" means the node has no room any more (a lost race): kube-scheduler tries again.
        """
        error, kind = self._bind(namespace, name, uid, node)
        return error, ("ok" if not error else kind)

    def _bind(self, namespace: str, name: str, uid: str, node: str) -> tuple[str, str]:
        problem = self.not_ready()
        if problem:
            return problem, "error"
        assert self.kube is not None, "bind needs the API server"
        m = self.mirror
        pod = m.recent_pods.get(uid)
        if pod is None:
            try:
                pod = self.kube.get_pod(namespace, name)
            except KubeError as err:
                return str(err), "error"
            if pod is None or (pod.get("metadata") or {}).get("uid") != uid:
                return f"pod {namespace}/{name} (uid {uid}) no longer exists", "error"
        try:
            request = parse_pod(pod, m.config)
        except RequestError as err:
            return str(err), "error"
        if not request.wants_vgpu:
            return self._create_binding(namespace, name, uid, node), "error"
        # reserve under the lock: re-check against the ledger as it is now
        with m.lock:
            problem = m.node_problem(node, m.clock())
            if problem is not None:
                self.drop(uid)
                return f"node {node} {problem}", "conflict"
            if uid in m.binding:
                return f"pod {namespace}/{name} is already being bound", "conflict"
            whole = m.nodes[node].inventory
            assert whole is not None
            inventory = whole.offering(request.resource)
            outcome = fit_node(
                node, inventory, m.ledger.usage(node, excluding=uid), request, m.config.gpu_policy
            )
            if isinstance(outcome, Rejection):
                self.drop(uid)
                return f"node {node} {outcome.reason}", "conflict"
            m.binding.add(uid)
            m.assumed.pop(uid, None)  # the bind's own reservation replaces filter's
            m.ledger.commit(uid, node, outcome.footprint)
        try:
            annotations = {
                ann.ALLOCATION_ANNOTATION: ann.encode_allocation(outcome.allocation),
                ann.PHASE_ANNOTATION: ann.PHASE_BOUND,
            }
            error = self._create_binding(namespace, name, uid, node, annotations)
            if error:
                self._undo(uid)
            else:
                with m.lock:
                    if m.ledger.node_of(uid) == node:
                        m.committed(uid, annotations[ann.ALLOCATION_ANNOTATION])
            return error, "error"
        finally:
            with m.lock:
                m.binding.discard(uid)

    def _undo(self, uid: str) -> None:
        with self.mirror.lock:
            self.mirror.ledger.release(uid)

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
