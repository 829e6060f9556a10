"""The node monitor's running parts for one node: the arbiter thread, the memory enforcer (the
host's view of every container, ``enforce.py``) and ``/metrics``.

``vgpu monitor`` runs it alone (vgpu/monitor/node.py); ``vgpu device-plugin`` hands it to the device
plugin's ``Daemon``, which runs it beside its own parts (vgpu/commands/device_plugin.py).
"""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client.registry import Collector

from vgpu.monitor.arbiter import DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S, Arbiter
from vgpu.monitor.collector import NodeCollector, PodLister, make_registry, serve_metrics
from vgpu.monitor.compute import ComputeEnforcer
from vgpu.monitor.compute_metrics import ComputeCollector
from vgpu.monitor.enforce import MIB, Enforcer, HostCollector, PodActions
from vgpu.monitor.hostview import HostView
from vgpu.monitor.lines import LinesCollector, build_driver_cap, lease_annotations
from vgpu.node.devices import DeviceState
from vgpu.node.discovery import Discovery, ProcessSource, SmSource
from vgpu.node.paths import HostPaths

log = logging.getLogger(__name__)


class NodeMonitor:
    """The arbiter (``arbiter``: its pass interval and activity window in s; None: none) and the
    collector, served on ``listen`` (HOST, PORT; port 0 picks one, None serves nothing), and the
    memory enforcer as the node config's ``enforcement`` says, where the discovery can list each
    card's processes (``enforce``: False runs none; ``actions``: Events and evictions)."""

    def __init__(
        self,
        node: str,
        state: DeviceState,
        discovery: Discovery,
        paths: HostPaths,
        list_pods: PodLister | None = None,
        listen: tuple[str, int] | None = None,
        arbiter: tuple[float, float] | None = (DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S),
        actions: PodActions | None = None,
        enforce: bool = True,
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
        self.enforcer: Enforcer | None = None
        self.compute: ComputeEnforcer | None = None
        if enforce and isinstance(discovery, ProcessSource) and discovery.lists_processes:
            cfg = state.config
            uuids = lambda: [c.uuid for c in state.cards()]  # noqa: E731 - one line, used twice
            view = HostView(node, paths, discovery, uuids, list_pods)
            self.enforcer = Enforcer(
                node,
                view,
                action=cfg.enforce_memory,
                tolerance_bytes=cfg.memory_tolerance_mib * MIB,
                interval_s=cfg.enforce_interval_ms / 1000,
                actions=actions,
            )
            if isinstance(discovery, SmSource):
                # its own view: the two enforcers' threads never share the view's caches
                compute_view = HostView(node, paths, discovery, uuids, list_pods)
                self.compute = ComputeEnforcer(
                    node,
                    compute_view,
                    discovery,
                    uuids,
                    action=cfg.enforce_compute,
                    interval_s=cfg.enforce_interval_ms / 1000,
                    actions=actions,
                )
        # the third line: the driver's own cap on each container's cgroup (enforcement.driverCap)
        self.driver_cap = build_driver_cap(node, state.config, discovery, paths, self.enforcer, actions)
        self._http: WSGIServer | None = None
        self.port: int | None = None
        self.extra_collectors: list[Collector] = []  # more families on /metrics (MIG on demand's)

    def lease_annotations(self) -> dict[str, str]:
        """What the node's Lease carries for ``vgpu status``: the lines holding each container
        and its media engines' use (contract 2)."""
        return lease_annotations(self.collector.paths, self.driver_cap, self.enforcer)

    def start(self) -> None:
        if self.arbiter is not None:
            self.arbiter.start()
        if self.enforcer is not None:
            self.enforcer.start()
            log.info(
                "memory enforcer: %s past the grant + %d MiB per process, every %.0f ms",
                self.enforcer.action,
                self.enforcer.tolerance // MIB,
                self.enforcer.interval_s * 1000,
            )
        if self.compute is not None:
            self.compute.start()
            log.info("compute gate: on; past it, enforcement.compute is %s", self.compute.action)
        if self.driver_cap is not None:
            self.driver_cap.start()
            log.info(
                "driver cap: %s, on the cgroups under %s", self.driver_cap.mode, self.driver_cap.scan.root
            )
        if self.listen is not None:
            host, port = self.listen
            registry = make_registry(self.collector)
            if self.enforcer is not None:
                registry.register(HostCollector(self.enforcer))
            if self.compute is not None:
                registry.register(ComputeCollector(self.compute))
            registry.register(LinesCollector(self.collector, self.driver_cap, self.enforcer))
            for extra in self.extra_collectors:
                registry.register(extra)
            self._http = serve_metrics(host, port, registry)
            self.port = self._http.server_port
            log.info("node monitor on http://%s:%d/metrics", host, self.port)

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
        if self.enforcer is not None:
            self.enforcer.stop()
        if self.compute is not None:
            self.compute.stop()
        if self.driver_cap is not None:
            self.driver_cap.stop()
        if self.arbiter is not None:
            self.arbiter.stop()
