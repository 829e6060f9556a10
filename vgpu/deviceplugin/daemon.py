"""The parts of one node's plugin wired together: discovery, health, server, reporter, and the
node monitor it is handed.

Built from settings by ``vgpu.deviceplugin.node.build_plugin``; tests build it from parts. The
node monitor (vgpu/monitor/) runs in the same process but is not the device plugin's to import:
``vgpu device-plugin`` (vgpu/commands/device_plugin.py) passes ``monitor_factory``, given the
built ``Daemon``; without one the daemon runs no monitor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.registry import Collector

from vgpu.core.annotations import SHARING_MPS
from vgpu.core.errors import KubeError
from vgpu.core.service import Service
from vgpu.deviceplugin.allocate import Allocator, PodSource
from vgpu.deviceplugin.arrivals import Arrivals, ArrivalWatch, PodWatchSource
from vgpu.deviceplugin.migdynamic import DynamicMig
from vgpu.deviceplugin.migmetrics import MigCollector
from vgpu.deviceplugin.report import NodeAPI, NodeReporter
from vgpu.deviceplugin.server import PluginServer
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState, watch_health
from vgpu.node.discovery import Discovery
from vgpu.node.driver import DriverFiles
from vgpu.node.hooklib import HookInstall, collect
from vgpu.node.mig import MigControl, mig_layout
from vgpu.node.mps import CONTROL_BINARY, MpsCollector, MpsDaemons
from vgpu.node.paths import HostPaths, sweep_container_dirs
from vgpu.node.regions import region_usage

log = logging.getLogger(__name__)


class NodeClient(PodSource, NodeAPI, Protocol):
    """Everything the node side asks of the API server (vgpu.kube.agent.NodeAgentClient)."""


class NodePart(Protocol):
    """What the daemon asks of the node monitor it runs (vgpu.monitor.service.NodeMonitor)."""

    port: int | None  # where /metrics is served once started; None: not served
    extra_collectors: list[Collector]  # the daemon's own families (MIG on demand, MPS) on its /metrics

    def lease_annotations(self) -> dict[str, str]: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class NoMonitor:
    """No node monitor: no /metrics, nothing more on the Lease."""

    def __init__(self) -> None:
        self.port: int | None = None
        self.extra_collectors: list[Collector] = []

    def lease_annotations(self) -> dict[str, str]:
        return {}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


MonitorFactory = Callable[["Daemon"], NodePart]


@dataclass
class Daemon:
    node: str
    namespace: str
    paths: HostPaths
    config: NodeConfig
    discovery: Discovery
    client: NodeClient
    hook: HookInstall | None
    # driverInject: plugin: the driver files Allocate hands out (vgpu/node/driver.py); None: the runtime's
    driver: DriverFiles | None = None
    # the cards' MIG state (vgpu/node/mig.py), read at start under migStrategy single or mixed
    # (the MIG devices offered) and none (the cards in MIG mode, which none cannot offer)
    mig: MigControl | None = None
    # migStrategy: dynamic: the cards' MIG control (vgpu/node/mig.py); None: no MIG on demand
    dynamic_mig: MigControl | None = None
    # sharingMode: mps: the MPS control tool run for each MPS card (vgpu/node/mps.py)
    mps_control: str = CONTROL_BINARY
    # the node monitor run beside the plugin, built from the daemon once its state is (None: none)
    monitor_factory: MonitorFactory | None = None

    def __post_init__(self) -> None:
        cards = self.discovery.cards()
        migs = (
            mig_layout(self.mig, [c.uuid for c in cards])
            if self.mig is not None and self.config.mig_strategy in ("single", "mixed", "none")
            else {}
        )
        self.state = DeviceState(cards, self.config, migs)
        self.arrivals = Arrivals()
        self.allocator = Allocator(self.node, self.client, self.state, self.paths, self.hook, self.arrivals)
        self.allocator.driver = self.driver
        self.dynamic: DynamicMig | None = None
        if self.dynamic_mig is not None:
            self.dynamic = DynamicMig(
                self.node, self.dynamic_mig, self.state.cards(), self.client.list_node_pods, self.state.kick
            )
            self.state.mig_dynamic = self.dynamic.describe
            self.allocator.dynamic = self.dynamic
        self.mps: MpsDaemons | None = None
        mps_cards = [c.uuid for c in self.state.cards() if self.state.offered(c).sharing == SHARING_MPS]
        if mps_cards:
            self.mps = MpsDaemons(self.paths, self.mps_control, mps_cards)
            self.allocator.mps = self.mps
        self.mps_check_s = 2.0
        self._mps_down: set[str] = set()  # cards this plugin reported unhealthy for their daemon
        self.reclaim_s = 5.0  # how often instances no live pod names are reclaimed
        # The order pods arrive on the node is kubelet's admission order: watch it where the
        # client can (vgpu.kube.client can; the tests' in-memory clients cannot, and lists stand in).
        self.arrival_watch = (
            ArrivalWatch(self.client, self.node, self.arrivals)
            if isinstance(self.client, PodWatchSource)
            else None
        )
        # one socket per kubelet resource (migStrategy mixed: one per MIG profile), resourceName first
        self.servers = [
            PluginServer(self.paths, self.state, self.allocator, r) for r in self.state.resources()
        ]
        self.server = self.servers[0]
        containers_dir = self.paths.containers_dir
        self.reporter = NodeReporter(
            self.node,
            self.namespace,
            self.state,
            self.client,
            usage=lambda: region_usage(containers_dir),
            more=lambda: self.monitor.lease_annotations(),
        )
        self.monitor: NodePart = self.monitor_factory(self) if self.monitor_factory else NoMonitor()
        if self.dynamic is not None:
            self.monitor.extra_collectors.append(MigCollector(self.dynamic))
        if self.mps is not None:
            self.monitor.extra_collectors.append(MpsCollector(self.node, self.mps))
        self._stop = threading.Event()  # ends the health and sweep loops
        self._health = Service(
            "dp-health", lambda stop: watch_health(self.discovery, self.state, stop), self._stop
        )
        self._sweeper = Service("dp-sweep", lambda _stop: self._sweep(), self._stop)
        self._reclaimer = Service(
            "dp-mig-reclaim",
            lambda stop: self.dynamic.run(stop, self.reclaim_s) if self.dynamic else None,
            self._stop,
        )
        self._mps_watch = Service.every("dp-mps", self.mps_check_s, self._check_mps, self._stop, log)
        self.sweep_s = 60.0
        self.sweep_min_age_s = 300.0

    @property
    def monitor_port(self) -> int | None:
        """The port ``/metrics`` is served on once started (None: not served)."""
        return self.monitor.port

    def start(self) -> None:
        self.paths.containers_dir.mkdir(parents=True, exist_ok=True)
        self._collect_hooks()  # versions left by earlier plugins that no container uses any more
        if self.arrival_watch is not None:
            self.arrival_watch.start()  # its first list is in before kubelet can call Allocate
        if self.dynamic is not None:  # reconcile before the first Allocate: leftovers reclaimed
            done = self.dynamic.reclaim()
            log.info(
                "MIG on demand: %d instance(s) kept for their pods, %d reclaimed, %d busy",
                done.kept,
                len(done.destroyed),
                len(done.busy),
            )
            self._reclaimer.start()
        if self.mps is not None:  # before kubelet hears of the cards: their pods need the daemons
            self._check_mps()
            self._mps_watch.start()
        self.reporter.start()
        for server in self.servers:
            server.start()
        self._health.start()
        self._sweeper.start()
        self.monitor.start()

    def _check_mps(self) -> None:
        """Start, adopt or restart each MPS card's daemon; a card whose daemon is down is unhealthy
        (its pods would wait at cuInit) until the daemon runs again."""
        if self.mps is None:
            return
        for uuid, up in self.mps.ensure().items():
            if not up:  # every check: a health event may have marked the card healthy meanwhile
                self._mps_down.add(uuid)
                self.state.set_health(uuid, False)
            elif up and uuid in self._mps_down:
                self._mps_down.discard(uuid)
                self.state.set_health(uuid, True)
        self.mps.hold_grants()  # the servers' ceilings follow the grants on each card

    def _sweep(self) -> None:
        """Every ``sweep_s``, remove the region folders, grants and hook records of pods that
        left the node, then the hook versions no container uses any more."""
        while not self._stop.wait(self.sweep_s):
            try:
                live = {str(p["metadata"].get("uid")) for p in self.client.list_node_pods(self.node)}
            except KubeError as err:
                log.warning("not sweeping container folders: cannot list the node's pods (%s)", err)
                continue
            for folder in sweep_container_dirs(self.paths, live, self.sweep_min_age_s, time.time()):
                log.info("removed %s: its pod is gone", folder)
            self._collect_hooks()

    def _collect_hooks(self) -> None:
        keep = self.hook.version if self.hook else None
        try:
            removed = collect(self.paths, keep, self.sweep_min_age_s, time.time())
        except OSError as err:
            log.warning("not removing unused hook versions: %s", err)
            return
        for version in removed:
            log.info("removed hook version %s: no container on the node uses it", version)

    def stop(self) -> None:
        self._stop.set()
        self.monitor.stop()
        for server in self.servers:
            server.stop()
        if self.arrival_watch is not None:
            self.arrival_watch.stop()
        self.reporter.stop()
        self._health.stop()  # joins it: it may be blocked in the discovery's wait, closed next
        self._sweeper.stop(timeout_s=None)
        self._mps_watch.stop()  # the daemons keep running: their clients' work goes on (docs/mps.md)
        if self.dynamic is not None:
            self._reclaimer.stop()
        self.discovery.close()
