"""The parts of one node's plugin wired together: discovery, health, server, reporter, monitor."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from vgpu.core.errors import KubeError
from vgpu.core.service import Service
from vgpu.plugin.allocate import Allocator, PodSource
from vgpu.plugin.arrivals import Arrivals, ArrivalWatch, PodWatchSource
from vgpu.plugin.config import NodeConfig, load_node_config
from vgpu.plugin.devices import DeviceState
from vgpu.plugin.discovery import Discovery
from vgpu.plugin.monitor.arbiter import DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S, Arbiter
from vgpu.plugin.monitor.arbiter import settings as arbiter_settings
from vgpu.plugin.monitor.collector import (
    NodeCollector,
    make_registry,
    parse_listen,
    region_usage,
    serve_metrics,
)
from vgpu.plugin.paths import HookInstall, HostPaths, sweep_container_dirs
from vgpu.plugin.report import NodeAPI, NodeReporter
from vgpu.plugin.server import PluginServer

log = logging.getLogger(__name__)


class NodeClient(PodSource, NodeAPI, Protocol):
    """Everything the node side asks of the API server (vgpu.kube.client.NodeAgentClient)."""


@dataclass
class Daemon:
    node: str
    namespace: str
    paths: HostPaths
    config: NodeConfig
    discovery: Discovery
    client: NodeClient
    hook: HookInstall | None
    monitor_listen: tuple[str, int] | None = None
    # The arbiter's pass interval and activity window (vgpu.plugin.monitor.arbiter); None: no arbiter.
    arbiter: tuple[float, float] | None = (DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S)

    def __post_init__(self) -> None:
        self.state = DeviceState(self.discovery.cards(), self.config)
        self.arrivals = Arrivals()
        self.allocator = Allocator(self.node, self.client, self.state, self.paths, self.hook, self.arrivals)
        # The order pods arrive on the node is kubelet's admission order: watch it where the
        # client can (vgpu.kube.client can; the tests' in-memory clients cannot, and lists stand in).
        self.arrival_watch = (
            ArrivalWatch(self.client, self.node, self.arrivals)
            if isinstance(self.client, PodWatchSource)
            else None
        )
        self.server = PluginServer(self.paths, self.state, self.allocator, self.config.resource_name)
        containers_dir = self.paths.containers_dir
        self.reporter = NodeReporter(
            self.node, self.namespace, self.state, self.client, usage=lambda: region_usage(containers_dir)
        )
        self.arbiter_thread = (
            Arbiter(
                self.paths.containers_dir,
                interval_s=self.arbiter[0],
                window_s=self.arbiter[1],
                grants_dir=self.paths.grants_dir,
            )
            if self.arbiter is not None
            else None
        )
        self.collector = NodeCollector(
            self.node,
            self.state,
            self.discovery,
            self.paths,
            list_pods=self.client.list_node_pods,
            arbiter=self.arbiter_thread,
        )
        self._stop = threading.Event()  # ends the health and sweep loops
        self._health = Service("dp-health", lambda _stop: self._watch_health(), self._stop)
        self._sweeper = Service("dp-sweep", lambda _stop: self._sweep(), self._stop)
        self._http: WSGIServer | None = None
        self.monitor_port: int | None = None
        self.sweep_s = 60.0
        self.sweep_min_age_s = 300.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Daemon:
        """Validate every setting first: a bad one stops the plugin before anything starts."""
        from vgpu.kube.client import NodeAgentClient
        from vgpu.plugin.cli import hook_install, open_discovery

        config = load_node_config(args.config, args.node)
        listen = parse_listen(args.monitor_listen, "--monitor-listen")
        arbiter = arbiter_settings(args)
        paths = HostPaths(args.root)
        discovery = open_discovery(args)
        hook = hook_install(args, paths)
        client = NodeAgentClient(str(args.kubeconfig) if args.kubeconfig else None)
        return cls(args.node, args.namespace, paths, config, discovery, client, hook, listen, arbiter)

    def start(self) -> None:
        self.paths.containers_dir.mkdir(parents=True, exist_ok=True)
        if self.arrival_watch is not None:
            self.arrival_watch.start()  # its first list is in before kubelet can call Allocate
        self.reporter.start()
        self.server.start()
        self._health.start()
        self._sweeper.start()
        if self.arbiter_thread is not None:
            self.arbiter_thread.start()
        if self.monitor_listen is not None:
            host, port = self.monitor_listen
            self._http = serve_metrics(host, port, make_registry(self.collector))
            self.monitor_port = self._http.server_port
            log.info("node monitor on http://%s:%d/metrics", host, self.monitor_port)

    def _watch_health(self) -> None:
        while not self._stop.is_set():
            for event in self.discovery.wait_health_events(1.0):
                if self.state.set_health(event.uuid, event.healthy):
                    log.warning(
                        "card %s is now %s: %s",
                        event.uuid,
                        "healthy" if event.healthy else "unhealthy",
                        event.reason,
                    )

    def _sweep(self) -> None:
        """Every ``sweep_s``, remove the region folders of pods that left the node."""
        while not self._stop.wait(self.sweep_s):
            try:
                live = {str(p["metadata"].get("uid")) for p in self.client.list_node_pods(self.node)}
            except KubeError as err:
                log.warning("not sweeping container folders: cannot list the node's pods (%s)", err)
                continue
            for folder in sweep_container_dirs(self.paths, live, self.sweep_min_age_s, time.time()):
                log.info("removed %s: its pod is gone", folder)

    def stop(self) -> None:
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()
        self.server.stop()
        if self.arrival_watch is not None:
            self.arrival_watch.stop()
        self.reporter.stop()
        if self.arbiter_thread is not None:
            self.arbiter_thread.stop()
        self._health.stop()  # joins it: it may be blocked in the discovery's wait, closed next
        self._sweeper.stop(timeout_s=None)
        self.discovery.close()
