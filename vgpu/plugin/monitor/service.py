"""The node monitor's running parts for one node: the arbiter thread and ``/metrics``.

``vgpu monitor`` runs it alone; the device plugin's ``Daemon`` runs it beside its own parts.
Both are built from settings by ``vgpu.plugin.node``.
"""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from vgpu.plugin.devices import DeviceState
from vgpu.plugin.discovery import Discovery
from vgpu.plugin.monitor.arbiter import DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S, Arbiter
from vgpu.plugin.monitor.collector import NodeCollector, PodLister, make_registry, serve_metrics
from vgpu.plugin.paths import HostPaths

log = logging.getLogger(__name__)


class NodeMonitor:
    """The arbiter (``arbiter``: its pass interval and activity window in s; None: none) and the
    collector, served on ``listen`` (HOST, PORT; port 0 picks one, None serves nothing)."""

    def __init__(
        self,
        node: str,
        state: DeviceState,
        discovery: Discovery,
        paths: HostPaths,
        list_pods: PodLister | None = None,
        listen: tuple[str, int] | None = None,
        arbiter: tuple[float, float] | None = (DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S),
    ) -> None:
        self.listen = listen
        self.arbiter = (
            Arbiter(
                paths.containers_dir, interval_s=arbiter[0], window_s=arbiter[1], grants_dir=paths.grants_dir
            )
            if arbiter is not None
            else None
        )
        self.collector = NodeCollector(
            node, state, discovery, paths, list_pods=list_pods, arbiter=self.arbiter
        )
        self._http: WSGIServer | None = None
        self.port: int | None = None

    def start(self) -> None:
        if self.arbiter is not None:
            self.arbiter.start()
        if self.listen is not None:
            host, port = self.listen
            self._http = serve_metrics(host, port, make_registry(self.collector))
            self.port = self._http.server_port
            log.info("node monitor on http://%s:%d/metrics", host, self.port)

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
        if self.arbiter is not None:
            self.arbiter.stop()
