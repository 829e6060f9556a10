"""Allocate: from kubelet's device IDs to the pod and container they serve (the answer of contract 4,
docs/contracts.md: answer.py).

kubelet's GetPreferredAllocation and Allocate name only device IDs, never the pod. kubelet
admits pods one at a time, in the order they arrived on the node (bind order), and allocates
their containers in order (init containers, then containers). So the container served is the
next one of the pod that is already half served, or else of the pod that arrived first
(:mod:`vgpu.deviceplugin.arrivals`), among those whose next container asks for as many vGPUs as
kubelet passed. The device IDs say nothing about the pod (they are interchangeable to kubelet),
except when they are exactly the IDs this plugin preferred a moment before: then Allocate
serves the container that preference was made for, so the two calls always agree.

When two waiting pods cannot be told apart (they arrived together and were created in the
same second, so kubelet's own order between them is undefined) and would start with different
limits, Allocate refuses rather than risk giving one the other's limits.

Only the choice happens under a lock, in memory; the API server calls (the pod list, the phase
patch) happen outside it, so pods never wait on each other's I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    PHASE_ALLOCATED,
    PHASE_ANNOTATION,
    PHASE_BOUND,
    PHASE_FAILED,
    REASON_ANNOTATION,
    ContainerAllocation,
)
from vgpu.core.errors import KubeError
from vgpu.deviceplugin.answer import PodFailure, container_response
from vgpu.deviceplugin.api import api_pb2
from vgpu.deviceplugin.arrivals import Arrivals
from vgpu.deviceplugin.migdynamic import DynamicMig
from vgpu.deviceplugin.waiting import Waiting, find_waiting, meta_of, pod_ref
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState, card_of, prefer
from vgpu.node.driver import DriverFiles
from vgpu.node.hooklib import HookInstall
from vgpu.node.mps import MpsDaemons
from vgpu.node.paths import HostPaths

log = logging.getLogger(__name__)

DEFAULT_PRIORITY = "1"
# The Event a pod gets when its placement is refused (kubectl describe pod shows it).
PLACEMENT_REFUSED = "VgpuPlacementRefused"


class PodSource(Protocol):
    """The two API server calls Allocate needs (vgpu.kube.client provides them)."""

    def list_node_pods(self, node: str) -> list[dict[str, Any]]:
        """Pods bound to ``node``, as API JSON (camelCase keys)."""
        ...

    def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None]
    ) -> None: ...

    def pod_event(self, namespace: str, name: str, uid: str, reason: str, message: str, node: str) -> None:
        """A Warning Event on the pod."""
        ...


class AllocateError(Exception):
    """Allocate refused; ``code`` is the gRPC status kubelet gets, the message says why and what to do."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        super().__init__(message)


@dataclass(frozen=True)
class Served:
    """What one container got: its pod, its share of the cards, and the answer for kubelet."""

    namespace: str
    pod: str
    pod_uid: str
    container: str
    allocation: ContainerAllocation
    response: api_pb2.ContainerAllocateResponse


class _Ambiguous(Exception):
    """Two or more waiting pods could each be the one kubelet is starting, with different limits."""

    def __init__(self, pods: list[Waiting]) -> None:
        self.pods = pods
        super().__init__(", ".join(f"{w.namespace}/{w.name}" for w in pods))


class Allocator:
    def __init__(
        self,
        node: str,
        pods: PodSource,
        state: DeviceState,
        paths: HostPaths,
        hook: HookInstall | None,
        arrivals: Arrivals | None = None,
    ) -> None:
        self.node = node
        self.pods = pods
        self.state = state
        self.paths = paths
        self.hook = hook
        self.driver: DriverFiles | None = None  # driverInject: plugin (vgpu/node/driver.py)
        self.dynamic: DynamicMig | None = None  # migStrategy: dynamic (vgpu/deviceplugin/migdynamic.py)
        self.mps: MpsDaemons | None = None  # sharingMode: mps (vgpu/node/mps.py)
        # Fed by a watch of the node's pods (ArrivalWatch); without one, each list is an observation.
        self.arrivals = arrivals or Arrivals()
        self.catch_up_s = 2.0  # how long to wait for the watch to deliver a pod the list shows
        self.tie_wait_s = 3.0  # how long a tie may take to resolve (a pod rejected, deleted) before refusing
        self.preferred_ttl_s = 60.0
        self._lock = threading.Lock()
        self._served: dict[str, set[str]] = {}  # pod uid -> containers already answered
        # pods whose placement was refused, uid -> "<ns>/<name> (why)", told once (core/placementcheck.py)
        self._refused: dict[str, str] = {}
        # IDs GetPreferredAllocation answered -> (pod uid, container, when): Allocate honours it
        self._preferred: dict[frozenset[str], tuple[str, str, float]] = {}

    @property
    def config(self) -> NodeConfig:
        return self.state.config

    # -- finding the pod --------------------------------------------------------------------

    def _waiting(self) -> tuple[list[Waiting], list[str]]:
        try:
            pods = self.pods.list_node_pods(self.node)
        except KubeError as err:
            raise AllocateError(
                grpc.StatusCode.UNAVAILABLE, f"cannot list the pods of node {self.node}: {err}"
            ) from err
        cards = {d.uuid: d for d in self.state.inventory().devices}
        found = find_waiting(pods, self.node, self.config, cards)
        for pod, problems in found.refused:
            self._refuse_placement(pod, problems)
        # a pod refused a moment ago (at GetPreferredAllocation, say) is failed now, and so no
        # longer bound: Allocate's error still names it and why, for kubelet to show on the pod
        just = {str(meta_of(p).get("uid", "")) for p, _ in found.refused}
        uids = [str(meta_of(p).get("uid", "")) for p in pods]
        with self._lock:
            for uid in set(self._refused).difference(uids):
                del self._refused[uid]
            found.malformed += [self._refused[u] for u in uids if u in self._refused and u not in just]
        return found.waiting, found.malformed

    def _refuse_placement(self, pod: Mapping[str, Any], problems: list[str]) -> None:
        """Tell the pod, once, why its placement is refused: phase ``failed`` with the reason, and a
        Warning Event. kubelet's Allocate error says the same and rejects the pod."""
        meta = meta_of(pod)
        uid = str(meta.get("uid", ""))
        namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
        with self._lock:
            if uid in self._refused:
                return
            self._refused[uid] = f"{pod_ref(pod)} ({'; '.join(problems)})"
        reason = (
            f"the node refuses this pod's vGPU placement: it is not what the pod asks for "
            f"({'; '.join(problems)}). Placements are written by the vgpu scheduler alone; delete the "
            f"pod and create it without {ALLOCATION_ANNOTATION}, {PHASE_ANNOTATION} or {REASON_ANNOTATION}"
        )
        log.warning("pod %s/%s: %s", namespace, name, reason)
        try:
            self.pods.patch_pod_annotations(
                namespace, name, {PHASE_ANNOTATION: PHASE_FAILED, REASON_ANNOTATION: reason}
            )
        except KubeError as err:
            log.warning("could not mark pod %s/%s failed: %s", namespace, name, err)
        try:
            self.pods.pod_event(namespace, name, uid, PLACEMENT_REFUSED, reason, self.node)
        except KubeError as err:
            log.warning("could not record an event on pod %s/%s: %s", namespace, name, err)

    def _served_of(self, w: Waiting) -> set[str]:
        """Containers of the pod already answered; call with the lock held.

        Allocate creates each served container's folder, so after a restart of the plugin the
        folders tell which containers of a half-served pod kubelet has already started.
        """
        served = self._served.get(w.uid)
        if served is None:
            served = {n for n in w.order if self.paths.container_dir(w.uid, n).is_dir()}
            self._served[w.uid] = served
        return served

    def _next(self, w: Waiting) -> ContainerAllocation | None:
        """The pod's next container kubelet will start; call with the lock held."""
        served = self._served_of(w)
        nxt = next((n for n in w.order if n not in served), None)
        return None if nxt is None else w.allocation.container(nxt)

    def _remaining(self, w: Waiting) -> tuple[Any, ...]:
        """What the pod's unserved containers would start with; call with the lock held."""
        served = self._served_of(w)
        out = []
        for n in w.order:
            if n in served:
                continue
            c = w.allocation.container(n)
            devices = tuple((d.uuid, d.memory_mib, d.cores, d.mig) for d in c.devices) if c else ()
            out.append((devices, w.priorities.get(n, DEFAULT_PRIORITY)))
        return tuple(out)

    def _prune(self, waiting: list[Waiting]) -> None:
        """Forget pods no longer waiting; call with the lock held (the folders keep the rest)."""
        listed = {w.uid for w in waiting}
        for uid in [u for u in self._served if u not in listed]:
            del self._served[uid]
        now = time.monotonic()
        for key in [k for k, (uid, _, at) in self._preferred.items() if uid not in listed]:
            del self._preferred[key]
        for key in [k for k, (_, _, at) in self._preferred.items() if now - at > self.preferred_ttl_s]:
            del self._preferred[key]

    def _ranks(self, waiting: list[Waiting]) -> dict[str, int]:
        uids = [w.uid for w in waiting]
        if not self.arrivals.watched:
            self.arrivals.retain(uids)  # no watch forgets them: the lists are the observations
        return self.arrivals.ranks(uids, self.catch_up_s)

    def _choose(
        self,
        waiting: list[Waiting],
        ranks: Mapping[str, int],
        count: int,
        ids: Sequence[str] = (),
        offered: Sequence[str] = (),
    ) -> tuple[Waiting, ContainerAllocation]:
        """The pod and container kubelet is starting; call with the lock held.

        Raises LookupError when no waiting pod has a container of ``count`` vGPUs next, and
        _Ambiguous when the pod cannot be told apart from another that would get other limits.
        """
        if ids:
            pref = self._preferred.get(frozenset(ids))
            if pref is not None:
                uid, name, _ = pref
                w = next((w for w in waiting if w.uid == uid), None)
                container = self._next(w) if w is not None else None
                if w is not None and container is not None and container.name == name:
                    return w, container
        candidates: list[tuple[tuple[int, int, str], Waiting, ContainerAllocation]] = []
        some = list(ids or offered)  # IDs of the socket kubelet called: its resource
        resource = self.state.kubelet_resource(card_of(some[0])) if some else None
        for w in waiting:
            container = self._next(w)
            if container is None or len(container.devices) != count:
                continue
            if resource is not None and not self._offered_as(container, resource):
                continue  # another resource's socket serves it (migStrategy: mixed)
            # a half-served pod first (kubelet allocates a pod's containers in one go), then
            # arrival order, then creation time (kubelet's order within a batch)
            in_progress = 0 if self._served_of(w) else 1
            candidates.append(((in_progress, ranks.get(w.uid, 1 << 62), w.created), w, container))
        if not candidates:
            raise LookupError
        candidates.sort(key=lambda c: (c[0], c[1].namespace, c[1].name))
        key, head, container = candidates[0]
        tied = [w for k, w, _ in candidates[1:] if k == key]
        if any(self._remaining(w) != self._remaining(head) for w in tied):
            raise _Ambiguous([head, *tied])
        # Tied pods that would start with the same limits on the same cards: either answer
        # enforces the right limits, so the first one (by name) is served.
        return head, container

    def _offered_as(self, container: ContainerAllocation, resource: str) -> bool:
        """Whether the container's devices are offered as ``resource`` (those of this node)."""
        known = [d.uuid for d in container.devices if self.state.card(d.uuid) is not None]
        return all(self.state.kubelet_resource(u) == resource for u in known)

    def preferred(self, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        """GetPreferredAllocation: IDs on the cards of the container kubelet is about to start.

        The answer is remembered, so that the Allocate that follows with these IDs serves the
        same container even if the node's pods changed in between.
        """
        try:
            waiting, _ = self._waiting()
            ranks = self._ranks(waiting)
        except AllocateError:
            return prefer(list(available), list(must), size)
        with self._lock:
            self._prune(waiting)
            try:
                w, container = self._choose(waiting, ranks, size, (), available[:1])
            except (LookupError, _Ambiguous):
                return prefer(list(available), list(must), size)
            ids = prefer(list(available), list(must), size, wanted=[d.uuid for d in container.devices])
            self._preferred[frozenset(ids)] = (w.uid, container.name, time.monotonic())
        return ids

    def _claim(self, count: int, ids: Sequence[str]) -> tuple[Waiting, ContainerAllocation, bool, int]:
        """Pick the pod and container for these IDs and mark the container served.

        Returns the pod, the container, whether it was the pod's last container and how many
        pods were waiting. A tie is given ``tie_wait_s`` to resolve (kubelet marking the pod it
        rejected Failed, a pod deleted) before it is refused.
        """
        deadline = time.monotonic() + self.tie_wait_s
        while True:
            waiting, malformed = self._waiting()
            ranks = self._ranks(waiting)
            with self._lock:
                self._prune(waiting)
                try:
                    w, container = self._choose(waiting, ranks, count, ids)
                except LookupError:
                    raise _NoPod(len(waiting), malformed) from None
                except _Ambiguous:
                    if time.monotonic() >= deadline:
                        raise
                else:
                    self._preferred.pop(frozenset(ids), None)
                    served = self._served_of(w)
                    served.add(container.name)
                    return w, container, all(n in served for n in w.order), len(waiting)
            time.sleep(0.2)

    def _forget(self, uid: str) -> None:
        with self._lock:
            self._served.pop(uid, None)

    # -- the answer -------------------------------------------------------------------------

    def _response(self, w: Waiting, container: ContainerAllocation) -> api_pb2.ContainerAllocateResponse:
        priority = w.priorities.get(container.name, DEFAULT_PRIORITY)
        made = self.dynamic.provide(w.uid, container) if self.dynamic is not None else None
        if made is None and any(d.mig is not None for d in container.devices):
            raise PodFailure(
                f"container {container.name} is placed as MIG on demand but this node's "
                f"migStrategy is {self.config.mig_strategy}, not dynamic"
            )
        response = container_response(
            self.state,
            self.config,
            self.paths,
            self.hook,
            self.node,
            w.uid,
            container,
            priority,
            self.driver,
            made,
        )
        if self.mps is not None and any(d.uuid in self.mps.uuids for d in container.devices):
            self.mps.hold_grants(only_up=True)  # before its first client: the card's ceilings up to its grant
        return response

    def _mark(self, w: Waiting, phase: str, reason: str | None) -> None:
        try:
            self.pods.patch_pod_annotations(
                w.namespace, w.name, {PHASE_ANNOTATION: phase, REASON_ANNOTATION: reason}
            )
        except KubeError as err:
            log.warning("could not mark pod %s/%s %s: %s", w.namespace, w.name, phase, err)

    def allocate_container(self, ids: Sequence[str]) -> Served:
        """Serve one ContainerAllocateRequest; raises AllocateError with the gRPC status."""
        if not ids:
            raise AllocateError(grpc.StatusCode.INVALID_ARGUMENT, "Allocate named no device IDs")
        unknown = [i for i in ids if self.state.card(card_of(i)) is None]
        if unknown:
            raise AllocateError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"device IDs {', '.join(unknown)} are not devices of this plugin",
            )
        try:
            w, container, last, _ = self._claim(len(ids), ids)
        except _NoPod as err:
            msg = (
                f"no pod bound to node {self.node} is waiting for a container with {len(ids)} vGPU(s) "
                f"({err.waiting} pod(s) in phase {PHASE_BOUND} with a valid {ALLOCATION_ANNOTATION})"
            )
            if err.malformed:
                shown = "; ".join(err.malformed[:5]) + (
                    f"; and {len(err.malformed) - 5} more" if len(err.malformed) > 5 else ""
                )
                msg += "; pods that cannot be served: " + shown
                msg += " (let the vgpu-scheduler place the pod again: delete and recreate it)"
            raise AllocateError(grpc.StatusCode.FAILED_PRECONDITION, msg) from None
        except _Ambiguous as err:
            raise AllocateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot tell which of the pods {err} kubelet is starting: they arrived on node "
                f"{self.node} together and were created in the same second, so kubelet's order between "
                f"them is undefined, and they would start with different vGPU limits. Refusing rather "
                f"than give one pod another's limits: kubelet rejects this pod (UnexpectedAdmissionError); "
                f"a Deployment, Job or StatefulSet replaces it by itself, a bare pod must be recreated",
            ) from None
        try:
            response = self._response(w, container)
        except PodFailure as err:
            self._forget(w.uid)
            self._mark(w, PHASE_FAILED, str(err))
            raise AllocateError(
                grpc.StatusCode.FAILED_PRECONDITION, f"pod {w.namespace}/{w.name}: {err}"
            ) from err
        except OSError as err:  # the host folder: kubelet retries the pod, so it is not marked failed
            with self._lock:
                self._served_of(w).discard(container.name)
            raise AllocateError(
                grpc.StatusCode.INTERNAL,
                f"cannot prepare {self.paths.container_dir(w.uid, container.name)} for pod "
                f"{w.namespace}/{w.name}: {err.strerror}; check that {self.paths.containers_dir} is writable",
            ) from err
        if last:
            self._mark(w, PHASE_ALLOCATED, None)
        log.info("allocated %s/%s container %s: %s", w.namespace, w.name, container.name, dict(response.envs))
        return Served(w.namespace, w.name, w.uid, container.name, container, response)

    def allocate(self, request: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
        responses = [
            self.allocate_container(list(r.devices_ids)).response for r in request.container_requests
        ]
        return api_pb2.AllocateResponse(container_responses=responses)


class _NoPod(Exception):
    def __init__(self, waiting: int, malformed: list[str]) -> None:
        self.waiting = waiting
        self.malformed = malformed
        super().__init__(f"{waiting} waiting")
