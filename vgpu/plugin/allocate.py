"""Allocate: from kubelet's device IDs to the pod and container they serve, and contract 4's answer.

kubelet's Allocate names only device IDs, never the pod. The pod is found among the pods bound
to this node whose phase is ``bound``: kubelet admits pods one at a time, oldest first, and
their containers in order (init containers, then containers), so the answer is the oldest bound
pod whose next unserved container asks for as many vGPUs as kubelet passed, preferring one
whose cards are those of the IDs. Only that choice happens under a lock, in memory; the API
server calls (the pod list, the phase patch) happen outside it, so pods never wait on each
other's I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from vgpu.annotations import (
    ALLOCATION_ANNOTATION,
    PHASE_ALLOCATED,
    PHASE_ANNOTATION,
    PHASE_BOUND,
    PHASE_FAILED,
    REASON_ANNOTATION,
    Allocation,
    ContainerAllocation,
    decode_allocation,
)
from vgpu.errors import AnnotationError, KubeError
from vgpu.plugin.api import api_pb2
from vgpu.plugin.config import NodeConfig
from vgpu.plugin.devices import DeviceState, card_of
from vgpu.plugin.paths import CONTAINER_HOOK_PATH, REGION_FILE_NAME, HookInstall, HostPaths

log = logging.getLogger(__name__)

PRIORITY_RESOURCE = "nvidia.com/priority"
DEFAULT_PRIORITY = "1"


class PodSource(Protocol):
    """The two API server calls Allocate needs (vgpu.kube provides them)."""

    def list_node_pods(self, node: str) -> list[dict[str, Any]]:
        """Pods bound to ``node``, as API JSON (camelCase keys)."""
        ...

    def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None]
    ) -> None: ...


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


@dataclass(frozen=True)
class _Waiting:
    namespace: str
    name: str
    uid: str
    created: str
    allocation: Allocation
    order: tuple[str, ...]  # containers with vGPUs, in the order kubelet starts them
    priorities: Mapping[str, str]


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = pod.get("metadata") or {}
    return meta if isinstance(meta, Mapping) else {}


def _pod_ref(pod: Mapping[str, Any]) -> str:
    m = _meta(pod)
    return f"{m.get('namespace', '?')}/{m.get('name', '?')}"


def _kubelet_order(pod: Mapping[str, Any], allocation: Allocation) -> tuple[str, ...]:
    spec = pod.get("spec") or {}
    names = [c.get("name") for c in (spec.get("initContainers") or [])] + [
        c.get("name") for c in (spec.get("containers") or [])
    ]
    wanted = {c.name for c in allocation.containers if c.devices}
    ordered = [n for n in names if n in wanted]
    # Containers the annotation names but the spec does not are an error the caller reports.
    return tuple(ordered + [c.name for c in allocation.containers if c.devices and c.name not in ordered])


def _priorities(pod: Mapping[str, Any]) -> dict[str, str]:
    spec = pod.get("spec") or {}
    out: dict[str, str] = {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        limits = ((c.get("resources") or {}).get("limits")) or {}
        out[str(c.get("name"))] = str(limits.get(PRIORITY_RESOURCE, DEFAULT_PRIORITY))
    return out


class Allocator:
    def __init__(
        self,
        node: str,
        pods: PodSource,
        state: DeviceState,
        paths: HostPaths,
        hook: HookInstall | None,
    ) -> None:
        self.node = node
        self.pods = pods
        self.state = state
        self.paths = paths
        self.hook = hook
        self._lock = threading.Lock()
        self._served: dict[str, set[str]] = {}  # pod uid -> containers already answered

    @property
    def config(self) -> NodeConfig:
        return self.state.config

    # -- finding the pod --------------------------------------------------------------------

    def _waiting(self) -> tuple[list[_Waiting], list[str]]:
        try:
            pods = self.pods.list_node_pods(self.node)
        except KubeError as err:
            raise AllocateError(
                grpc.StatusCode.UNAVAILABLE, f"cannot list the pods of node {self.node}: {err}"
            ) from err
        waiting: list[_Waiting] = []
        malformed: list[str] = []
        for pod in pods:
            meta = _meta(pod)
            annotations = meta.get("annotations") or {}
            if meta.get("deletionTimestamp"):
                continue
            if PHASE_ANNOTATION not in annotations and ALLOCATION_ANNOTATION not in annotations:
                if self._asks_for_devices(pod):
                    malformed.append(
                        f"{_pod_ref(pod)} (asks for {self.config.resource_name} but has no "
                        f"{ALLOCATION_ANNOTATION}: it was not placed by the vgpu scheduler; "
                        "check its schedulerName and the admission webhook)"
                    )
                continue
            if annotations.get(PHASE_ANNOTATION) != PHASE_BOUND:
                continue
            try:
                allocation = decode_allocation(annotations.get(ALLOCATION_ANNOTATION))
            except AnnotationError as err:
                malformed.append(f"{_pod_ref(pod)} ({err})")
                continue
            if allocation.node != self.node:
                malformed.append(
                    f"{_pod_ref(pod)} ({ALLOCATION_ANNOTATION}: node: names {allocation.node!r}, "
                    f"but the pod runs on {self.node!r})"
                )
                continue
            waiting.append(
                _Waiting(
                    namespace=str(meta.get("namespace", "")),
                    name=str(meta.get("name", "")),
                    uid=str(meta.get("uid", "")),
                    created=str(meta.get("creationTimestamp", "")),
                    allocation=allocation,
                    order=_kubelet_order(pod, allocation),
                    priorities=_priorities(pod),
                )
            )
        waiting.sort(key=lambda w: (w.created, w.namespace, w.name))
        return waiting, malformed

    def _asks_for_devices(self, pod: Mapping[str, Any]) -> bool:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return False
        spec = pod.get("spec") or {}
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            if self.config.resource_name in (((c.get("resources") or {}).get("limits")) or {}):
                return True
        return False

    def _served_of(self, w: _Waiting) -> set[str]:
        """Containers of the pod already answered; call with the lock held.

        Allocate creates each served container's folder, so after a restart of the plugin the
        folders tell which containers of a half-served pod kubelet has already started.
        """
        served = self._served.get(w.uid)
        if served is None:
            served = {n for n in w.order if self.paths.container_dir(w.uid, n).is_dir()}
            self._served[w.uid] = served
        return served

    def _next(self, w: _Waiting) -> ContainerAllocation | None:
        """The pod's next container kubelet will start; call with the lock held."""
        served = self._served_of(w)
        nxt = next((n for n in w.order if n not in served), None)
        return None if nxt is None else w.allocation.container(nxt)

    def _prune(self, waiting: list[_Waiting]) -> None:
        """Forget pods no longer waiting; call with the lock held (the folders keep the rest)."""
        listed = {w.uid for w in waiting}
        for uid in [u for u in self._served if u not in listed]:
            del self._served[uid]

    def preferred_cards(self, count: int) -> list[str]:
        """The cards of the container kubelet is about to start, for GetPreferredAllocation."""
        try:
            waiting, _ = self._waiting()
        except AllocateError:
            return []
        with self._lock:
            for w in waiting:
                container = self._next(w)
                if container is not None and len(container.devices) == count:
                    return [d.uuid for d in container.devices]
        return []

    def _claim(
        self, waiting: list[_Waiting], ids: Sequence[str]
    ) -> tuple[_Waiting, ContainerAllocation, bool]:
        """Pick the pod and container for these IDs and mark the container served.

        Returns the pod, the container and whether it was the pod's last container.
        """
        cards = sorted(card_of(i) for i in ids)
        with self._lock:
            self._prune(waiting)
            by_count: tuple[_Waiting, ContainerAllocation] | None = None
            chosen: tuple[_Waiting, ContainerAllocation] | None = None
            for w in waiting:
                container = self._next(w)
                if container is None or len(container.devices) != len(ids):
                    continue
                if sorted(d.uuid for d in container.devices) == cards:
                    chosen = (w, container)
                    break
                if by_count is None:
                    by_count = (w, container)
            chosen = chosen or by_count
            if chosen is None:
                raise LookupError
            w, container = chosen
            served = self._served_of(w)
            served.add(container.name)
            return w, container, all(n in served for n in w.order)

    def _forget(self, uid: str) -> None:
        with self._lock:
            self._served.pop(uid, None)

    # -- the answer -------------------------------------------------------------------------

    def _response(self, w: _Waiting, container: ContainerAllocation) -> api_pb2.ContainerAllocateResponse:
        for d in container.devices:
            card = self.state.card(d.uuid)
            if card is None:
                raise _PodFailure(f"card {d.uuid} of container {container.name} is not on node {self.node}")
            if not card.healthy:
                raise _PodFailure(f"card {d.uuid} of container {container.name} is unhealthy")
        inside = self.paths.container_dir_inside(w.uid, container.name)
        host_dir = self.paths.container_dir(w.uid, container.name)
        host_dir.mkdir(parents=True, exist_ok=True)
        host_dir.chmod(0o777)  # the container's processes, whatever their user, create the region here
        envs = {
            "NVIDIA_VISIBLE_DEVICES": ",".join(d.uuid for d in container.devices),
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"{inside}/{REGION_FILE_NAME}",
            "CUDA_TASK_PRIORITY": w.priorities.get(container.name, DEFAULT_PRIORITY),
        }
        for i, d in enumerate(container.devices):
            envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{d.memory_mib}m"
            envs[f"CUDA_DEVICE_SM_LIMIT_{i}"] = str(min(d.cores, 100))
        if self.config.oversubscribe:
            envs["CUDA_OVERSUBSCRIBE"] = "true"
        mounts = [api_pb2.Mount(container_path=inside, host_path=str(host_dir), read_only=False)]
        if self.hook is not None:
            mounts += [
                api_pb2.Mount(
                    container_path=CONTAINER_HOOK_PATH, host_path=str(self.hook.library), read_only=True
                ),
                api_pb2.Mount(
                    container_path="/etc/ld.so.preload", host_path=str(self.hook.preload), read_only=True
                ),
            ]
        return api_pb2.ContainerAllocateResponse(envs=envs, mounts=mounts)

    def _mark(self, w: _Waiting, phase: str, reason: str | None) -> None:
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
        waiting, malformed = self._waiting()
        try:
            w, container, last = self._claim(waiting, ids)
        except LookupError:
            msg = (
                f"no pod bound to node {self.node} is waiting for a container with {len(ids)} vGPU(s) "
                f"({len(waiting)} pod(s) in phase {PHASE_BOUND} with a valid {ALLOCATION_ANNOTATION})"
            )
            if malformed:
                shown = "; ".join(malformed[:5]) + (
                    f"; and {len(malformed) - 5} more" if len(malformed) > 5 else ""
                )
                msg += "; pods that cannot be served: " + shown
                msg += " (let the vgpu-scheduler place the pod again: delete and recreate it)"
            raise AllocateError(grpc.StatusCode.FAILED_PRECONDITION, msg) from None
        try:
            response = self._response(w, container)
        except _PodFailure as err:
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


class _PodFailure(Exception):
    """The pod cannot be served on this node; it is marked failed with this reason."""
