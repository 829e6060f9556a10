"""The kubelet's side of ``vgpu dra-plugin``: plugin registration and the DRA node service, over gRPC.

Two unix sockets:

- ``<registry-dir>/vgpu.openaios.io-reg.sock``: ``pluginregistration.Registration``. The kubelet's
  plugin watcher finds the socket, calls ``GetInfo`` (type ``DRAPlugin``, the driver's name, the
  DRA socket, and the gRPC services served: ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin``, of which
  the kubelet picks the newest it knows) and reports the outcome with ``NotifyRegistrationStatus``.
- ``<plugin-dir>/dra.sock``: ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` (NodePrepareResources,
  NodeUnprepareResources) and the same methods as ``...dra.v1beta1.DRAPlugin``, whose messages are
  the same on the wire; and ``v1alpha1.DRAResourceHealth`` (NodeWatchResources), which a 1.36
  kubelet calls on the same socket: a stream of every card's health, sent whole when a card's
  health changes and every ``REFRESH_S`` besides; the kubelet shows it in the status of each pod
  whose claim holds the card (``allocatedResourcesStatus``).

A claim that cannot be prepared gets its error in its own entry of the answer (the kubelet shows
it on the pod and calls again); the call itself never fails for one bad claim.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Protocol

import grpc

from vgpu.core.claimconfig import DRIVER
from vgpu.core.errors import KubeError, VgpuError
from vgpu.core.service import Service
from vgpu.dra.api import (
    dra_health_pb2,
    dra_health_pb2_grpc,
    dra_pb2,
    dra_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)
from vgpu.dra.prepare import Preparer
from vgpu.node.discovery import Card

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
# What the plugin tells the kubelet it serves, "<gRPC package's last part>.<service>" as the
# kubelet names them (k8s.io/kubelet/pkg/apis/dra/v1 DRAPluginService, v1beta1 likewise).
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
V1BETA1_SERVICE = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
# The kubelet's folders and the sockets in them (contract 6, docs/contracts.md): the defaults of
# ``--plugin-dir`` and ``--registry-dir``; the chart mounts the same host paths.
PLUGIN_DIR = Path("/var/lib/kubelet/plugins") / DRIVER
REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DRA_SOCKET_NAME = "dra.sock"
REGISTRATION_SOCKET_NAME = f"{DRIVER}-reg.sock"
# The health stream: past TIMEOUT_S without an update the kubelet shows a card Unknown; every card
# is sent again at least every REFRESH_S, and at once when one changes.
TIMEOUT_S = 60
REFRESH_S = 20
MESSAGE_MAX = 1024  # the kubelet cuts longer messages


def registration_socket(registry_dir: Path) -> Path:
    return registry_dir / REGISTRATION_SOCKET_NAME


class DraService(dra_pb2_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    def NodePrepareResources(
        self, request: dra_pb2.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_pb2.NodePrepareResourcesResponse:
        answer = dra_pb2.NodePrepareResourcesResponse()
        for claim in request.claims:
            entry = answer.claims[claim.uid]
            try:
                devices = self.preparer.prepare(claim.namespace, claim.uid, claim.name)
            except Exception as err:  # one claim's failure is its own entry, never the call's
                entry.error = _why(err)
                log.warning(
                    "NodePrepareResources %s/%s (%s): %s", claim.namespace, claim.name, claim.uid, entry.error
                )
                continue
            for d in devices:
                entry.devices.add(
                    request_names=d["requestNames"],
                    pool_name=d["poolName"],
                    device_name=d["deviceName"],
                    cdi_device_ids=d["cdiDeviceIDs"],
                )
        return answer

    def NodeUnprepareResources(
        self, request: dra_pb2.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_pb2.NodeUnprepareResourcesResponse:
        answer = dra_pb2.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            entry = answer.claims[claim.uid]
            try:
                self.preparer.unprepare(claim.uid)
            except Exception as err:
                entry.error = _why(err)
                log.warning(
                    "NodeUnprepareResources %s/%s (%s): %s",
                    claim.namespace,
                    claim.name,
                    claim.uid,
                    entry.error,
                )
        return answer


class HealthSource(Protocol):
    """The node's cards' health (``SlicePublisher``)."""

    def health(self) -> tuple[int, list[tuple[Card, str]]]: ...
    def devices_of(self, card: Card) -> list[str]: ...
    def wait_health(self, version: int, timeout_s: float, done: Callable[[], bool] = ...) -> None: ...
    def wake(self) -> None: ...


class HealthService(dra_health_pb2_grpc.DRAResourceHealthServicer):
    def __init__(self, node: str, source: HealthSource, refresh_s: float = REFRESH_S) -> None:
        self.node = node
        self.source = source
        self.refresh_s = refresh_s
        self.stopping = threading.Event()

    def answer(self, cards: list[tuple[Card, str]]) -> dra_health_pb2.NodeWatchResourcesResponse:
        now = int(time.time())
        out = dra_health_pb2.NodeWatchResourcesResponse()
        for card, reason in cards:
            message = reason if not card.healthy else ""
            if not card.healthy and not message:
                message = "unhealthy"
            for name in self.source.devices_of(card):  # a MIG card: each placement, as the card
                out.devices.add(
                    device=dra_health_pb2.DeviceIdentifier(pool_name=self.node, device_name=name),
                    health=dra_health_pb2.HEALTHY if card.healthy else dra_health_pb2.UNHEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=TIMEOUT_S,
                    message=message[:MESSAGE_MAX],
                )
        return out

    def NodeWatchResources(
        self, request: dra_health_pb2.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[dra_health_pb2.NodeWatchResourcesResponse]:
        ended = threading.Event()

        def end() -> None:
            ended.set()
            self.source.wake()

        context.add_callback(end)
        log.info("the kubelet watches the health of %s's cards", self.node)
        while not (ended.is_set() or self.stopping.is_set()):
            version, cards = self.source.health()
            yield self.answer(cards)
            self.source.wait_health(version, self.refresh_s, lambda: ended.is_set() or self.stopping.is_set())

    def stop(self) -> None:
        self.stopping.set()
        self.source.wake()


def _why(err: Exception) -> str:
    if isinstance(err, VgpuError | KubeError):
        return " ".join(str(err).split())
    if isinstance(err, OSError):
        return f"cannot write the claim's files on the node: {err}"
    log.exception("unexpected error")
    return f"unexpected {type(err).__name__}: {err} (a bug: please report it)"


class RegistrationService(registration_pb2_grpc.RegistrationServicer):
    def __init__(self, endpoint: str, on_registered: Callable[[], None]) -> None:
        self.endpoint = endpoint
        self.on_registered = on_registered
        self.registered = False

    def GetInfo(
        self, request: registration_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> registration_pb2.PluginInfo:
        return registration_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=DRIVER, endpoint=self.endpoint, supported_versions=list(SERVICES)
        )

    def NotifyRegistrationStatus(
        self, request: registration_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> registration_pb2.RegistrationStatusResponse:
        self.registered = request.plugin_registered
        if request.plugin_registered:
            log.info("the kubelet registered %s", DRIVER)
            self.on_registered()
        else:
            log.error("the kubelet refused to register %s: %s", DRIVER, request.error)
        return registration_pb2.RegistrationStatusResponse()


def _v1beta1_handler(service: DraService) -> grpc.GenericRpcHandler:
    """The v1 methods under the v1beta1 service's name: the same messages, field for field."""

    def handler(method: Callable, request_type: type, response_type: type) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            method,
            request_deserializer=request_type.FromString,  # type: ignore[attr-defined]
            response_serializer=response_type.SerializeToString,  # type: ignore[attr-defined]
        )

    return grpc.method_handlers_generic_handler(
        V1BETA1_SERVICE,
        {
            "NodePrepareResources": handler(
                service.NodePrepareResources,
                dra_pb2.NodePrepareResourcesRequest,
                dra_pb2.NodePrepareResourcesResponse,
            ),
            "NodeUnprepareResources": handler(
                service.NodeUnprepareResources,
                dra_pb2.NodeUnprepareResourcesRequest,
                dra_pb2.NodeUnprepareResourcesResponse,
            ),
        },
    )


def _listen(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()


class DraServer:
    """Serves both sockets; serves them again when one disappears (a kubelet that cleaned up)."""

    def __init__(
        self,
        preparer: Preparer,
        plugin_dir: Path,
        registry_dir: Path,
        on_registered: Callable[[], None] = lambda: None,
        watch_interval_s: float = 1.0,
        health: HealthService | None = None,
    ) -> None:
        self.dra_socket = plugin_dir / DRA_SOCKET_NAME
        self.reg_socket = registration_socket(registry_dir)
        self.dra = DraService(preparer)
        self.health = health
        self.registration = RegistrationService(str(self.dra_socket), on_registered)
        self.watch_interval_s = watch_interval_s
        self._servers: list[grpc.Server] = []
        self._watcher: Service | None = None

    def _serve(self) -> None:
        self._stop_servers()
        # The DRA socket first: the kubelet calls it as soon as it has read the registration.
        _listen(self.dra_socket)
        dra = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dra-grpc"))
        dra_pb2_grpc.add_DRAPluginServicer_to_server(self.dra, dra)
        dra.add_generic_rpc_handlers((_v1beta1_handler(self.dra),))
        if self.health is not None:
            dra_health_pb2_grpc.add_DRAResourceHealthServicer_to_server(self.health, dra)
        dra.add_insecure_port(f"unix://{self.dra_socket}")
        dra.start()
        _listen(self.reg_socket)
        reg = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="dra-reg"))
        registration_pb2_grpc.add_RegistrationServicer_to_server(self.registration, reg)
        reg.add_insecure_port(f"unix://{self.reg_socket}")
        reg.start()
        self._servers = [reg, dra]
        log.info("serving %s on %s, registration on %s", DRIVER, self.dra_socket, self.reg_socket)

    def _stop_servers(self) -> None:
        for server in self._servers:
            server.stop(grace=1).wait(5)
        self._servers = []

    def check_once(self) -> None:
        if not (os.path.exists(self.dra_socket) and os.path.exists(self.reg_socket)):
            log.warning("a socket of %s is gone; serving again", DRIVER)
            self._serve()

    def start(self) -> None:
        self._serve()
        self._watcher = Service.every("dra-socket-watch", self.watch_interval_s, self.check_once, logger=log)
        self._watcher.start()

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self.health is not None:
            self.health.stop()  # ends the kubelet's stream, which holds a thread of the server
        # The registration socket goes first: the kubelet deregisters the plugin (and, if it does
        # not come back within its grace period, removes the node's slices itself).
        for path in (self.reg_socket, self.dra_socket):
            try:
                path.unlink()
            except OSError:
                pass
        self._stop_servers()
