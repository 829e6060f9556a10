"""A kubelet stand-in for the sandbox's simulated nodes: the device-plugin half of kubelet.

    python -m vgpu_sandbox.kubelet --node NAME --kubeconfig PATH --root DIR

It serves kubelet's Registration service on ``DIR/var/lib/kubelet/device-plugins/kubelet.sock``
(removing other sockets there at start, as kubelet does), follows each registered plugin's
ListAndWatch stream and mirrors the devices into the Node's ``status.capacity`` (all devices)
and ``status.allocatable`` (the healthy ones). For pods bound to its node it plays kubelet's
admission, in kubelet's order: it lists and then watches the node's pods, admits the pods of
its first list as one batch sorted by creationTimestamp (ties in random order, as kubelet's
unstable sort leaves them), and every later pod as its watch event arrives (bind order). Per
container (init containers, then containers) that asks for the resource, it picks free device
IDs (GetPreferredAllocation when offered), calls ``Allocate`` over the real socket, and records
what the container would start with: the env and mounts in the pod annotation
``sandbox.vgpu.openaios.io/containers`` and in ``DIR/var/lib/kubelet/vgpu-sandbox/<pod-uid>.json``.
A refusal lands in ``sandbox.vgpu.openaios.io/admission-error`` and, as kubelet does, the pod
is marked ``Failed`` with reason ``UnexpectedAdmissionError``. KWOK starts such a pod only once
its record is written without an error (:func:`vgpu_sandbox.nodes.pod_stages`), as a kubelet
starts no container before Allocate answered.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from vgpu.core import logs
from vgpu.core.backoff import Backoff
from vgpu.core.errors import KubeError
from vgpu.core.service import Service
from vgpu.deviceplugin.api import api_pb2, api_pb2_grpc
from vgpu.kube.informer import Informer
from vgpu_sandbox.nodes import ERROR_ANNOTATION, RECORD_ANNOTATION

log = logging.getLogger("vgpu_sandbox.kubelet")

__all__ = ["ERROR_ANNOTATION", "RECORD_ANNOTATION", "Kubelet"]
REJECT_REASON = "UnexpectedAdmissionError"  # what kubelet sets when a device plugin refuses Allocate


class KubeletAPI(Protocol):
    def list_node_pods(self, node: str) -> list[dict[str, Any]]: ...

    def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None]
    ) -> None: ...

    def patch_node_resources(self, node: str, resource: str, capacity: int, allocatable: int) -> None: ...

    def list_pods(self, field_selector: str | None = None) -> tuple[list[dict[str, Any]], str]: ...

    def watch_pods(
        self, resource_version: str, field_selector: str | None = None, timeout_s: int = 300
    ) -> Iterator[tuple[str, dict[str, Any]]]: ...

    def reject_pod(self, namespace: str, name: str, reason: str, message: str) -> None: ...


@dataclass
class PluginEndpoint:
    """A registered plugin as kubelet sees it."""

    resource: str
    socket: Path
    options: api_pb2.DevicePluginOptions
    channel: grpc.Channel
    stub: api_pb2_grpc.DevicePluginStub
    devices: dict[str, str] = field(default_factory=dict)  # id -> health
    updates: int = 0
    connected: bool = True


class _Registration(api_pb2_grpc.RegistrationServicer):
    def __init__(self, kubelet: Kubelet) -> None:
        self.kubelet = kubelet

    def Register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        if request.version != "v1beta1":
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"unsupported device plugin API version {request.version}"
            )
        self.kubelet.add_plugin(request)
        return api_pb2.Empty()


class Kubelet:
    """The Registration server and the plugin client side; ``admit_pending`` plays pod admission."""

    def __init__(self, node: str, root: Path, api: KubeletAPI | None) -> None:
        self.node = node
        self.root = Path(root)
        self.api = api
        self.dir = self.root / "var/lib/kubelet/device-plugins"
        self.socket = self.dir / "kubelet.sock"
        self.records_dir = self.root / "var/lib/kubelet/vgpu-sandbox"
        self.plugins: dict[str, PluginEndpoint] = {}
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._in_use: dict[str, dict[str, list[str]]] = {}  # pod uid -> resource -> device ids
        self._admitted: set[str] = set()

    # -- the Registration service ---------------------------------------------------------

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for entry in self.dir.iterdir():  # kubelet removes every plugin socket when it starts
            if entry.is_socket() or entry.name == "kubelet.sock":
                entry.unlink()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubelet"))
        api_pb2_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        log.info("kubelet stand-in for %s listening on %s", self.node, self.socket)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for p in self.plugins.values():
                p.channel.close()
            self._changed.notify_all()
        if self._server is not None:
            self._server.stop(grace=0).wait(5)
        try:
            self.socket.unlink()
        except OSError:
            pass

    def add_plugin(self, request: api_pb2.RegisterRequest) -> None:
        sock = self.dir / request.endpoint
        channel = grpc.insecure_channel(f"unix://{sock}")
        stub = api_pb2_grpc.DevicePluginStub(channel)
        endpoint = PluginEndpoint(request.resource_name, sock, request.options, channel, stub)
        with self._lock:
            old = self.plugins.get(request.resource_name)
            self.plugins[request.resource_name] = endpoint
        if old is not None:
            old.channel.close()
        log.info("plugin for %s registered on %s", request.resource_name, sock)
        threading.Thread(target=self._follow, args=(endpoint,), name="kubelet-law", daemon=True).start()

    def _follow(self, endpoint: PluginEndpoint) -> None:
        try:
            for response in endpoint.stub.ListAndWatch(api_pb2.Empty()):
                with self._lock:
                    endpoint.devices = {d.ID: d.health for d in response.devices}
                    endpoint.updates += 1
                    self._changed.notify_all()
                self._mirror(endpoint)
        except grpc.RpcError as err:
            log.info("ListAndWatch of %s ended: %s", endpoint.resource, err.code())
        with self._lock:
            endpoint.connected = False
            if self.plugins.get(endpoint.resource) is endpoint:
                endpoint.devices = {}
                self._changed.notify_all()
        if not self._stop.is_set():
            self._mirror(endpoint)

    def _mirror(self, endpoint: PluginEndpoint) -> None:
        if self.api is None:
            return
        with self._lock:
            if self.plugins.get(endpoint.resource) is not endpoint:
                return
            capacity = len(endpoint.devices)
            healthy = sum(1 for h in endpoint.devices.values() if h == "Healthy")
        try:
            self.api.patch_node_resources(self.node, endpoint.resource, capacity, healthy)
        except KubeError as err:
            log.warning("cannot update the capacity of node %s: %s", self.node, err)

    def wait_for(self, predicate: Any, timeout_s: float) -> bool:
        """Wait until ``predicate(self)`` holds (tests use it to follow the stream)."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout_s)

    # -- admission: Allocate as kubelet calls it --------------------------------------------

    def _free(self, resource: str) -> list[str]:
        endpoint = self.plugins[resource]
        used = {i for per in self._in_use.values() for i in per.get(resource, [])}
        return [i for i, h in endpoint.devices.items() if h == "Healthy" and i not in used]

    def allocate_container(
        self, pod_uid: str, resource: str, count: int
    ) -> api_pb2.ContainerAllocateResponse:
        """Pick ``count`` free devices for a container, call Allocate; raises RpcError or LookupError."""
        with self._lock:
            endpoint = self.plugins.get(resource)
            if endpoint is None or not endpoint.connected:
                raise LookupError(f"no device plugin registered for {resource}")
            free = self._free(resource)
            if len(free) < count:
                raise LookupError(f"{resource}: {count} requested, {len(free)} free")
        ids = free[:count]
        if endpoint.options.get_preferred_allocation_available:
            pref = endpoint.stub.GetPreferredAllocation(
                api_pb2.PreferredAllocationRequest(
                    container_requests=[
                        api_pb2.ContainerPreferredAllocationRequest(
                            available_deviceIDs=free, allocation_size=count
                        )
                    ]
                ),
                timeout=10,
            )
            picked = list(pref.container_responses[0].deviceIDs)
            if len(picked) == count and set(picked) <= set(free):
                ids = picked
        with self._lock:
            self._in_use.setdefault(pod_uid, {}).setdefault(resource, []).extend(ids)
        response = endpoint.stub.Allocate(
            api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]),
            timeout=30,
        )
        return response.container_responses[0]

    def release(self, pod_uid: str) -> None:
        with self._lock:
            self._in_use.pop(pod_uid, None)

    def admit(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        """Allocate every container of a pod in kubelet's order; returns the record it wrote."""
        meta = pod["metadata"]
        uid = str(meta["uid"])
        spec = pod.get("spec") or {}
        record: dict[str, Any] = {}
        error: str | None = None
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            limits = ((c.get("resources") or {}).get("limits")) or {}
            for resource, value in limits.items():
                if resource not in self.plugins:
                    continue
                try:
                    response = self.allocate_container(uid, resource, int(value))
                except grpc.RpcError as err:
                    error = f"Allocate failed for container {c['name']}: {err.code().name}: {err.details()}"
                except LookupError as err:
                    error = f"container {c['name']}: {err}"
                else:
                    record[c["name"]] = {
                        "envs": dict(sorted(response.envs.items())),
                        "mounts": [
                            {
                                "containerPath": m.container_path,
                                "hostPath": m.host_path,
                                "readOnly": m.read_only,
                            }
                            for m in response.mounts
                        ],
                    }
                if error:
                    break
            if error:
                break
        self.records_dir.mkdir(parents=True, exist_ok=True)
        doc = {
            "namespace": meta.get("namespace"),
            "pod": meta.get("name"),
            "containers": record,
            "error": error,
        }
        (self.records_dir / f"{uid}.json").write_text(json.dumps(doc, indent=2, sort_keys=True))
        if error:
            log.warning("pod %s/%s not admitted: %s", meta.get("namespace"), meta.get("name"), error)
            self.release(uid)
        if self.api is not None:
            try:
                self.api.patch_pod_annotations(
                    str(meta.get("namespace")),
                    str(meta.get("name")),
                    {
                        RECORD_ANNOTATION: json.dumps(record, sort_keys=True, separators=(",", ":")),
                        ERROR_ANNOTATION: error,
                    },
                )
            except KubeError as err:
                log.warning(
                    "cannot record the admission of %s/%s: %s", meta.get("namespace"), meta.get("name"), err
                )
        return doc

    def _reject(self, pod: Mapping[str, Any], error: str) -> None:
        """Mark the pod Failed as kubelet does when admission fails (it never retries it); KWOK
        never started it, since its record carries the error."""
        if self.api is None:
            return
        meta = pod["metadata"]
        ns, name = str(meta.get("namespace")), str(meta.get("name"))
        try:
            self.api.reject_pod(ns, name, REJECT_REASON, error)
        except KubeError as err:
            log.warning("cannot mark pod %s/%s Failed: %s", ns, name, err)

    def admit_batch(self, pods: Iterable[Mapping[str, Any]]) -> int:
        """Admit the new pods among ``pods`` as kubelet admits one batch: by creationTimestamp.

        kubelet's sort is unstable, and a batch comes out of a map: pods created in the same
        second go in no defined order, so here in a random one.
        """
        batch = [p for p in pods if self._admissible(p)]
        random.shuffle(batch)
        batch.sort(key=lambda p: str(p["metadata"].get("creationTimestamp") or ""))
        admitted = 0
        for pod in batch:
            uid = str(pod["metadata"]["uid"])
            if uid in self._admitted:
                continue
            self._admitted.add(uid)
            if not self._wants_devices(pod):
                continue
            doc = self.admit(pod)
            if doc["error"]:
                self._reject(pod, str(doc["error"]))
            admitted += 1
        return admitted

    def _admissible(self, pod: Mapping[str, Any]) -> bool:
        meta = pod["metadata"]
        phase = (pod.get("status") or {}).get("phase")
        return not meta.get("deletionTimestamp") and phase not in ("Succeeded", "Failed")

    def _forget_gone(self, present: set[str]) -> None:
        with self._lock:
            for uid in [u for u in self._in_use if u not in present]:
                del self._in_use[uid]
        self._admitted &= present

    def admit_pending(self) -> int:
        """One list: admit the new pods bound here as one batch, release the devices of gone ones.

        This is what kubelet does with its first list when it starts.
        """
        assert self.api is not None
        pods, _ = self.api.list_pods(field_selector=f"spec.nodeName={self.node}")
        admitted = self.admit_batch(pods)
        self._forget_gone({str(p["metadata"]["uid"]) for p in pods if self._admissible(p)})
        return admitted

    def _wants_devices(self, pod: Mapping[str, Any]) -> bool:
        spec = pod.get("spec") or {}
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            limits = ((c.get("resources") or {}).get("limits")) or {}
            if any(r in self.plugins for r in limits):
                return True
        return False

    def run(self, interval_s: float = 0.5) -> None:
        """List the node's pods (one batch), then admit each pod as its watch event arrives.

        A broken watch (or a 410 Gone) lists again (after ``interval_s`` on errors); pods new in
        that list are again one batch, as for kubelet. Admission starts once a plugin registered.
        """
        api = self.api
        assert api is not None
        selector = f"spec.nodeName={self.node}"
        with self._lock:
            while not self.plugins and not self._stop.is_set():
                self._changed.wait(interval_s)
        Informer(
            f"pods of {self.node}",
            lambda: api.list_pods(field_selector=selector),
            lambda rv: api.watch_pods(rv, selector, 60),  # one that simply expired goes on from rv
            self._on_list,
            self._on_event,
            backoff=Backoff(interval_s, interval_s),
            stop=self._stop,
            logger=log,
        ).run()

    def _on_list(self, pods: list[dict[str, Any]]) -> None:
        self.admit_batch(pods)
        self._forget_gone({str(p["metadata"]["uid"]) for p in pods if self._admissible(p)})

    def _on_event(self, kind: str, pod: dict[str, Any]) -> None:
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if kind in ("ADDED", "MODIFIED") and uid:
            if self._admissible(pod):
                self.admit_batch([pod])
            else:
                self.release(uid)
        elif kind == "DELETED" and uid:
            self.release(uid)
            self._admitted.discard(uid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vgpu_sandbox.kubelet", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--node", required=True)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument(
        "--interval", type=float, default=0.5, help="seconds before listing again when the pod watch breaks"
    )
    args = parser.parse_args(argv)
    logs.configure(os.environ.get("VGPU_LOG_LEVEL", "INFO"))
    from vgpu.kube.agent import NodeAgentClient

    client = NodeAgentClient(str(args.kubeconfig))
    kubelet = Kubelet(args.node, args.root, client)
    kubelet.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: kubelet._stop.set())
    # admission blocks in a pod watch; it runs aside so a signal stops the process at once
    Service("kubelet-admit", lambda _stop: kubelet.run(args.interval), kubelet._stop).start()
    while not kubelet._stop.wait(1.0):
        pass
    kubelet.stop()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
