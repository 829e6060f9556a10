"""Binding a pod: re-check its node, reserve the plan, write the Binding with the allocation.

``bind`` re-checks the chosen node under the state's lock and reserves the plan in the ledger
before anything is written, so two binds can never be given the same capacity; the reservation is
dropped again if creating the Binding fails. Between filter and bind, the one node filter answered
holds the pod's capacity (:meth:`vgpu.extender.cache.PodCache.assume`), as kube-scheduler assumes a
pod on its node before binding; bind then takes the pod as filter parsed it and the plan filter
assumed, and fits again only when the assumption is gone or the node's inventory changed since.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from vgpu.core import annotations as ann
from vgpu.core.errors import KubeError
from vgpu.core.fit import Plan, Rejection, fit_node
from vgpu.extender.cache import ASSUME_TTL_S, Parsed, PodCache
from vgpu.extender.mirror import Mirror

__all__ = ["ASSUME_TTL_S", "Binder", "KubeAPI"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]


class KubeAPI(Protocol):
    """What binding needs from the API server (satisfied by :class:`vgpu.kube.client.Kube`)."""

    def get_pod(self, namespace: str, name: str) -> Obj | None: ...

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str] | None = None
    ) -> None: ...


class Binder:
    """Binds against ``mirror`` and ``cache``; ``not_ready()`` says why the replica cannot bind now."""

    def __init__(
        self, mirror: Mirror, cache: PodCache, kube: KubeAPI | None, not_ready: Callable[[], str | None]
    ) -> None:
        self.mirror = mirror
        self.cache = cache
        self.kube = kube
        self.not_ready = not_ready

    def bind(self, namespace: str, name: str, uid: str, node: str) -> tuple[str, str]:
        """Bind the pod: ("", "ok"), or (error text for ExtenderBindingResult, "conflict" | "error").

        "conflict" means the node has no room any more (a lost race): kube-scheduler tries again.
        """
        error, kind = self._bind(namespace, name, uid, node)
        return error, ("ok" if not error else kind)

    def _parsed(self, namespace: str, name: str, uid: str) -> Parsed | str:
        """The pod as its filter parsed it, else read from the API server and parsed; or why not."""
        with self.mirror.lock:
            parsed = self.cache.memo(uid)
        if parsed is not None:
            return parsed
        assert self.kube is not None, "bind needs the API server"
        try:
            pod = self.kube.get_pod(namespace, name)
        except KubeError as err:
            return str(err)
        if pod is None or (pod.get("metadata") or {}).get("uid") != uid:
            return f"pod {namespace}/{name} (uid {uid}) no longer exists"
        return self.cache.parse_for_bind(pod, self.mirror.config)

    def _bind(self, namespace: str, name: str, uid: str, node: str) -> tuple[str, str]:
        problem = self.not_ready()
        if problem:
            return problem, "error"
        assert self.kube is not None, "bind needs the API server"
        m, cache = self.mirror, self.cache
        parsed = self._parsed(namespace, name, uid)
        if isinstance(parsed, str):
            return parsed, "error"
        request = parsed.request
        if request is None:
            return str(parsed.error), "error"
        if not request.wants_vgpu:
            return self._create_binding(namespace, name, uid, node), "error"
        # reserve under the lock: the plan filter assumed still holds there, or a fit against the
        # ledger as it is now
        with m.lock:
            problem = m.node_problem(node, m.clock())
            if problem is not None:
                cache.forget(uid)
                return f"node {node} {problem}", "conflict"
            if uid in cache.binding:
                return f"pod {namespace}/{name} is already being bound", "conflict"
            whole = m.nodes[node].inventory
            assert whole is not None
            inventory = whole.offering(request.resource)
            outcome: Plan | Rejection | None = cache.assumed_plan(uid, node, inventory)
            if outcome is None:
                outcome = fit_node(
                    node, inventory, m.ledger.usage(node, excluding=uid), request, m.config.gpu_policy
                )
            if isinstance(outcome, Rejection):
                cache.forget(uid)
                return f"node {node} {outcome.reason}", "conflict"
            cache.begin_bind(uid)  # the bind's own reservation replaces filter's assumption
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
                    cache.confirm(uid)
            return error, "error"
        finally:
            with m.lock:
                cache.end_bind(uid)

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
