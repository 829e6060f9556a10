"""The kubelet plumbing: the DevicePlugin gRPC service on a unix socket, Register, re-registering.

Device knowledge lives in :class:`DeviceState`, pod knowledge in :class:`Allocator`; this module
only speaks kubelet's protocol. kubelet removes every plugin socket when it restarts and
recreates its own; the watcher notices either (inode of kubelet.sock changed, our socket gone),
restarts the gRPC server on a fresh socket and registers again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

from vgpu.core.backoff import Backoff
from vgpu.core.service import Service
from vgpu.deviceplugin.allocate import AllocateError, Allocator
from vgpu.deviceplugin.api import api_pb2, api_pb2_grpc
from vgpu.node.devices import DeviceState
from vgpu.node.paths import PLUGIN_SOCKET_NAME, HostPaths

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"


def kubelet_devices(state: DeviceState, resource: str | None = None) -> list[api_pb2.Device]:
    """ListAndWatch's devices of ``resource`` (default: the node config's ``resourceName``), each
    with its card's NUMA node where known."""
    return [
        api_pb2.Device(
            ID=d.ID,
            health=d.health,
            topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=d.numa)]) if d.numa >= 0 else None,
        )
        for d in state.kubelet_devices(resource)
    ]


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    def __init__(
        self, state: DeviceState, allocator: Allocator, stopping: threading.Event, resource: str | None = None
    ) -> None:
        self.state = state
        self.allocator = allocator
        self.stopping = stopping
        self.resource = resource  # the kubelet resource this socket serves; None: resourceName

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        seen = -1
        while not self.stopping.is_set() and context.is_active():
            version = self.state.version
            if version != seen:
                seen = version
                yield api_pb2.ListAndWatchResponse(devices=kubelet_devices(self.state, self.resource))
            self.state.wait_change(seen, 1.0)

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        return api_pb2.PreferredAllocationResponse(
            container_responses=[
                api_pb2.ContainerPreferredAllocationResponse(
                    deviceIDs=self.allocator.preferred(
                        list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size
                    )
                )
                for r in request.container_requests
            ]
        )

    def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocateResponse:
        try:
            return self.allocator.allocate(request)
        except AllocateError as err:
            log.warning("Allocate refused: %s", err)
            context.abort(err.code, str(err))
            raise  # abort raises; this keeps type checkers content

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


def socket_name(resource: str, default: str) -> str:
    """The socket of a resource other than the node's ``resourceName`` (``default``), one each:
    ``vgpu-mig-1g.10gb.sock`` for ``nvidia.com/mig-1g.10gb``."""
    return PLUGIN_SOCKET_NAME if resource == default else f"vgpu-{resource.rsplit('/', 1)[-1]}.sock"


class PluginServer:
    """Serves the plugin socket of one resource and keeps it registered with kubelet."""

    def __init__(
        self,
        paths: HostPaths,
        state: DeviceState,
        allocator: Allocator,
        resource_name: str,
        watch_interval_s: float = 1.0,
    ) -> None:
        self.paths = paths
        self.state = state
        self.allocator = allocator
        self.resource_name = resource_name
        self.endpoint = socket_name(resource_name, state.config.resource_name)
        self.socket = paths.kubelet_dir / self.endpoint
        self.watch_interval_s = watch_interval_s
        self._server: grpc.Server | None = None
        self._streams_stop = threading.Event()
        self._kubelet_inode: int | None = None
        self._registered = False
        self._retry_at = 0.0
        self._backoff = Backoff(1.0, 30.0)  # kubelet answers but refuses: retry after 1, 2, 4 .. 30 s
        self._watcher: Service | None = None
        self.registrations = 0  # how many times Register succeeded (tests and logs)

    # -- serving ----------------------------------------------------------------------------

    def _serve(self) -> None:
        self._stop_server()
        self.paths.kubelet_dir.mkdir(parents=True, exist_ok=True)
        sock = self.socket
        if sock.exists() or sock.is_symlink():
            sock.unlink()
        self._streams_stop = threading.Event()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="dp-grpc"))
        api_pb2_grpc.add_DevicePluginServicer_to_server(
            DevicePluginService(self.state, self.allocator, self._streams_stop, self.resource_name), server
        )
        server.add_insecure_port(f"unix://{sock}")
        server.start()
        self._server = server
        log.info("serving the device plugin on %s", sock)

    def _stop_server(self) -> None:
        if self._server is not None:
            self._streams_stop.set()
            self.state.kick()
            self._server.stop(grace=1).wait(5)
            self._server = None

    def _register(self) -> bool:
        kubelet = self.paths.kubelet_socket
        try:
            with grpc.insecure_channel(f"unix://{kubelet}") as channel:
                api_pb2_grpc.RegistrationStub(channel).Register(
                    api_pb2.RegisterRequest(
                        version=API_VERSION,
                        endpoint=self.endpoint,
                        resource_name=self.resource_name,
                        options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True),
                    ),
                    timeout=5,
                )
        except grpc.RpcError as err:
            log.warning("registering with kubelet at %s failed (%s); retrying", kubelet, err.details())
            return False
        self.registrations += 1
        log.info("registered %s with kubelet at %s", self.resource_name, kubelet)
        return True

    def _kubelet_socket_inode(self) -> int | None:
        try:
            return os.stat(self.paths.kubelet_socket).st_ino
        except OSError:
            return None

    def check_once(self) -> None:
        """One round of the watcher: serve again and re-register when kubelet came back."""
        inode = self._kubelet_socket_inode()
        if inode is None:
            self._registered = False  # kubelet is down; register when its socket is back
            return
        restarted = self._kubelet_inode is not None and inode != self._kubelet_inode
        need_serve = self._server is None or restarted or not self.socket.exists()
        if need_serve:
            if self._server is not None:
                # kubelet restarted: it recreated its socket (the inode may even be reused) and
                # removed ours. It lists its pods anew and admits every waiting one as one batch,
                # by creation time; it calls Allocate only once we registered again, after this.
                log.info("kubelet restarted; serving and registering again")
                self.allocator.arrivals.rebatch()
            self._serve()
        if need_serve or inode != self._kubelet_inode:
            self._retry_at = 0.0  # kubelet is new: try at once
            self._backoff.reset()
        if not self._registered or need_serve or inode != self._kubelet_inode:
            if time.monotonic() >= self._retry_at:
                self._registered = self._register()
                if not self._registered:  # kubelet answers but refuses: back off up to 30 s
                    self._retry_at = time.monotonic() + self._backoff.next()
        self._kubelet_inode = inode

    def start(self) -> None:
        self._serve()
        self.check_once()
        # one round every watch_interval_s (read now: tests shorten it after construction)
        self._watcher = Service.every("dp-kubelet-watch", self.watch_interval_s, self.check_once, logger=log)
        self._watcher.start()

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        self._stop_server()
        try:
            self.socket.unlink()
        except OSError:
            pass
