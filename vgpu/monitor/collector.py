"""The node monitor: ``/metrics`` with per-card totals and per-container usage and limits.

Per card, from discovery (NVML): memory total and used, utilization, health. Per container,
from the hook's region files (contract 5, docs/contracts.md) under
``<root>/var/lib/vgpu/containers/<pod-uid>_<container>/``:
memory used, limit, budget and spilled per device, SM limit, GPU busy and throttled time,
priority, whether the arbiter (``vgpu.monitor.arbiter``, a thread of the same monitor) tells it
to yield, live processes, and the share of wall time its work kept the card busy over the last
10 s (``vgpu.monitor.timeshare``: samples of ``busy_ns`` from the arbiter's passes and the
scrapes; no series before two samples a second apart). Pod names come from the API server
(the node's pods, looked up at most every ``pod_cache_s``); without it the ``pod_uid`` label
still identifies the pod.

Live resize is not the monitor's: ``vgpu limits set`` changes a running container's limits
through ``vgpu.hookabi.resize.apply_limits``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, make_server
from prometheus_client.registry import Collector

from vgpu.core.annotations import Device
from vgpu.core.errors import KubeError
from vgpu.hookabi.grant import GrantError, as_granted, read_grant
from vgpu.hookabi.layout import FLAG_YIELD
from vgpu.hookabi.region import DeviceState as RegionDevice
from vgpu.hookabi.region import ProcessUsage, Region, RegionError, Snapshot
from vgpu.monitor.arbiter import Arbiter, BadRegions
from vgpu.monitor.claims import claim_labels
from vgpu.monitor.timeshare import TimeShare
from vgpu.node.devices import DeviceState
from vgpu.node.discovery import Card, CardUsage, Discovery
from vgpu.node.paths import REGION_FILE_NAME, HostPaths
from vgpu.node.regions import region_dirs

log = logging.getLogger(__name__)
MIB = 1 << 20

PodLister = Callable[[str], list[dict[str, Any]]]


class CardRow(NamedTuple):
    card: Card
    usage: CardUsage | None  # None: discovery cannot tell now
    offered: Device  # the card as the inventory offers it (scaling and split applied)


class ContainerRow(NamedTuple):
    snap: Snapshot
    differ: bool | None  # the region's copy differs from the grant; None: no grant


class DeviceRow(NamedTuple):
    dev: RegionDevice
    busy_ratio: float | None  # None: no two samples a second apart yet


class ProcessRow(NamedTuple):
    proc: ProcessUsage
    device: int  # the device's index in the container


@dataclass(frozen=True)
class Scope:
    """What one sample of a family stands for, and its labels."""

    name: str
    labels: tuple[str, ...]


CARD = Scope("card", ("node", "uuid", "index", "model"))  # row: CardRow
CONTAINER = Scope("container", ("node", "namespace", "pod", "pod_uid", "container"))  # ContainerRow
DEVICE = Scope("device", ("node", "uuid", "namespace", "pod", "pod_uid", "container"))  # DeviceRow
PROCESS = Scope("process", (*DEVICE.labels, "pid"))  # ProcessRow
NODE = Scope("node", ("node",))  # BadRegions
ARBITER = Scope("arbiter", ("node",))  # ArbiterStats; the families exist only with an arbiter


@dataclass(frozen=True)
class Metric:
    """One exported family, and how to read a sample's value from a row of its scope (None: no sample)."""

    name: str
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily]
    scope: Scope
    help: str
    read: Callable[[Any], float | None]

    def family(self) -> GaugeMetricFamily | CounterMetricFamily:
        return self.kind(self.name, self.help, labels=list(self.scope.labels))


GAUGE, COUNTER = GaugeMetricFamily, CounterMetricFamily


def _usage(read: Callable[[CardUsage], float]) -> Callable[[CardRow], float | None]:
    return lambda row: None if row.usage is None else read(row.usage)


def _spilled(row: ProcessRow) -> float | None:
    spilled = row.proc.spilled_bytes
    return float(spilled[row.device]) if row.device < len(spilled) else None


# Every family /metrics serves, in the order it serves them (a table: kept out of the formatter).
# fmt: off
METRICS: tuple[Metric, ...] = (
    Metric("vgpu_card_memory_capacity_bytes", GAUGE, CARD,
           "Device memory the card offers to vGPUs (deviceMemoryScaling applied): the scheduler's "
           "series of the same name",
           lambda r: float(r.offered.memory_mib * MIB)),
    Metric("vgpu_card_vgpus_capacity", GAUGE, CARD,
           "vGPUs the card may carry (split): the scheduler's series of the same name",
           lambda r: float(r.offered.split)),
    Metric("vgpu_card_memory_used_bytes", GAUGE, CARD, "Device memory in use on the card",
           _usage(lambda u: float(u.memory_used_mib * MIB))),
    Metric("vgpu_card_utilization_ratio", GAUGE, CARD, "Compute utilization of the card",
           _usage(lambda u: u.utilization_percent / 100.0)),
    Metric("vgpu_card_healthy", GAUGE, CARD, "1 when the card is healthy",
           lambda r: 1.0 if r.card.healthy else 0.0),
    # the old names, kept for one release (docs/monitoring.md, "Renamed metrics")
    Metric("vgpu_card_memory_total_bytes", GAUGE, CARD,
           "DEPRECATED, removed in the next release: use vgpu_card_memory_capacity_bytes. "
           "Device memory of the card as the driver reports it",
           _usage(lambda u: float(u.memory_total_mib * MIB))),
    Metric("vgpu_card_split", GAUGE, CARD,
           "DEPRECATED, removed in the next release: use vgpu_card_vgpus_capacity. "
           "Most vGPUs the card may carry",
           lambda r: float(r.offered.split)),
    Metric("vgpu_container_memory_used_bytes", GAUGE, DEVICE, "Device memory a container's processes hold",
           lambda r: float(r.dev.used_bytes)),
    Metric("vgpu_container_memory_limit_bytes", GAUGE, DEVICE,
           "Device memory limit of a container (0 = none)",
           lambda r: float(r.dev.limit_bytes)),
    Metric("vgpu_container_sm_limit_ratio", GAUGE, DEVICE,
           "Share of the card's SMs a container may use (0 = no cap)",
           lambda r: r.dev.sm_limit / 100.0),
    Metric("vgpu_container_memory_budget_bytes", GAUGE, DEVICE,
           "Device memory a container may hold on the card before it spills to host memory "
           "(0 = the card's free memory)",
           lambda r: float(r.dev.budget_bytes)),
    Metric("vgpu_container_memory_spilled_bytes", GAUGE, DEVICE,
           "Of the container's memory, bytes served from mapped host memory",
           lambda r: float(r.dev.spilled_bytes)),
    Metric("vgpu_container_sm_busy_seconds", COUNTER, DEVICE,
           "GPU time the container's work took on the card",
           lambda r: r.dev.busy_ns / 1e9),
    Metric("vgpu_container_sm_busy_ratio", GAUGE, DEVICE,
           "Share of wall time the container's work kept the card busy, over the last 10 s "
           "(the hook's busy_ns; it measures only launches under a compute limit or a priority flag)",
           lambda r: r.busy_ratio),
    Metric("vgpu_container_sm_throttled_seconds", COUNTER, DEVICE,
           "Time the container's launches waited (SM cap or a higher-priority neighbour)",
           lambda r: r.dev.throttled_ns / 1e9),
    Metric("vgpu_container_yielding", GAUGE, DEVICE,
           "1 while the monitor tells the container to hold launches for a priority-0 neighbour on the card",
           lambda r: 1.0 if r.dev.flags & FLAG_YIELD else 0.0),
    Metric("vgpu_container_processes", GAUGE, CONTAINER, "CUDA processes of the container",
           lambda r: float(len(r.snap.processes))),
    Metric("vgpu_container_priority", GAUGE, CONTAINER, "The container's task priority: 0 high, 1 normal",
           lambda r: float(r.snap.priority)),
    Metric("vgpu_container_region_limits_differ", GAUGE, CONTAINER,
           "1 while the limits copied into the container's region differ from its grant (the container "
           "wrote them; the hook puts them back and holds to the grant)",
           lambda r: None if r.differ is None else float(r.differ)),
    Metric("vgpu_process_memory_spilled_bytes", GAUGE, PROCESS,
           "Bytes one process of the container holds in mapped host memory",
           _spilled),
    Metric("vgpu_monitor_bad_regions", COUNTER, NODE,
           "Region files skipped as unreadable (not a region, another layout version, cut short), "
           "once per file and reason",
           lambda bad: float(bad.total)),
    Metric("vgpu_arbiter_passes", COUNTER, ARBITER, "Passes of the monitor's arbiter",
           lambda stats: float(stats.passes)),
    Metric("vgpu_arbiter_regions", GAUGE, ARBITER, "Region files the arbiter keeps open",
           lambda stats: float(stats.regions)),
    Metric("vgpu_arbiter_pass_seconds", GAUGE, ARBITER, "How long the arbiter's latest pass took",
           lambda stats: stats.last_pass_s),
    Metric("vgpu_arbiter_flag_writes", COUNTER, ARBITER,
           "Flag words the arbiter changed (yield or alone set or cleared)",
           lambda stats: float(stats.flag_writes)),
)
# fmt: on


class NodeCollector(Collector):
    def __init__(
        self,
        node: str,
        state: DeviceState,
        discovery: Discovery,
        paths: HostPaths,
        list_pods: PodLister | None = None,
        pod_cache_s: float = 10.0,
        arbiter: Arbiter | None = None,
        bad: BadRegions | None = None,
        timeshare: TimeShare | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.node = node
        self.state = state
        self.discovery = discovery
        self.paths = paths
        self.list_pods = list_pods
        self.pod_cache_s = pod_cache_s
        self.arbiter = arbiter
        self.bad = bad if bad is not None else (arbiter.bad if arbiter is not None else BadRegions())
        # with an arbiter, its passes sample busy_ns too (every 25 ms): share its history and clock
        if timeshare is None:
            timeshare = arbiter.timeshare if arbiter is not None else TimeShare()
        self.timeshare = timeshare
        if clock is None:
            clock = arbiter.clock if arbiter is not None else time.monotonic_ns
        self.clock = clock
        self._pods: dict[str, tuple[str, str]] = {}
        self._pods_at = -1e9
        self._lock = threading.Lock()
        self._differ_told: dict[str, str] = {}  # per container folder, the last difference logged

    def _pod_names(self) -> dict[str, tuple[str, str]]:
        if self.list_pods is None:
            return {}
        with self._lock:
            if time.monotonic() - self._pods_at >= self.pod_cache_s:
                try:
                    pods = self.list_pods(self.node)
                    self._pods = {
                        str(p["metadata"].get("uid")): (
                            str(p["metadata"].get("namespace", "")),
                            str(p["metadata"].get("name", "")),
                        )
                        for p in pods
                    }
                except KubeError as err:
                    log.warning("cannot list the pods of %s for metric labels: %s", self.node, err)
                self._pods_at = time.monotonic()
            return self._pods

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())  # collected fresh on every scrape

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Every family of ``METRICS`` (the arbiter's only with an arbiter), filled row by row."""
        metrics = [m for m in METRICS if m.scope is not ARBITER or self.arbiter is not None]
        families = {m.name: m.family() for m in metrics}
        by_scope: dict[Scope, list[Metric]] = {}
        for metric in metrics:
            by_scope.setdefault(metric.scope, []).append(metric)

        def add(scope: Scope, labels: list[str], row: Any) -> None:
            for metric in by_scope.get(scope, ()):
                value = metric.read(row)
                if value is not None:
                    families[metric.name].add_metric(labels, value)

        for card in self.state.cards():
            usage = self.discovery.usage(card.uuid)
            row = CardRow(card, usage, self.state.offered(card))
            add(CARD, [self.node, card.uuid, str(card.index), card.model], row)
        names = self._pod_names() if self.paths.containers_dir.is_dir() else {}
        sampled: list[tuple[str, int, str]] = []
        for folder in self._region_dirs():
            claim = claim_labels(self.paths.vgpu_dir, folder.name)
            if claim is not None:  # a DRA claim's request (docs/dra.md, "Watching DRA containers")
                namespace, pod, pod_uid, container = astuple(claim)
            else:
                pod_uid, _, container = folder.name.partition("_")
                namespace, pod = names.get(pod_uid, ("", ""))
            try:
                # never mapped: a container cutting its file short mid-read must not SIGBUS us
                with Region(folder / REGION_FILE_NAME, mapped=False) as region:
                    snap = region.snapshot()
                read_at = self.clock()
            except RegionError as err:
                self.bad.report(folder / REGION_FILE_NAME, err)
                continue
            snap, differ = self._as_granted(folder, snap)
            add(CONTAINER, [self.node, namespace, pod, pod_uid, container], ContainerRow(snap, differ))
            for dev in snap.devices:
                labels = [self.node, dev.uuid, namespace, pod, pod_uid, container]
                share_key = (folder.name, dev.index, dev.uuid)
                sampled.append(share_key)
                self.timeshare.record(share_key, read_at, dev.busy_ns)
                add(DEVICE, labels, DeviceRow(dev, self.timeshare.ratio(share_key)))
                for proc in snap.processes:
                    add(PROCESS, [*labels, str(proc.pid)], ProcessRow(proc, dev.index))
        self.timeshare.keep_only(sampled)  # containers whose region is gone (or unreadable now)
        add(NODE, [self.node], self.bad)
        if self.arbiter is not None:
            add(ARBITER, [self.node], self.arbiter.stats)
        yield from families.values()

    def _as_granted(self, folder: Path, snap: Snapshot) -> tuple[Snapshot, bool | None]:
        """The limits the container was granted (its region holds only a copy it can write), and
        whether the region's copy differs from them (None: no grant to compare with)."""
        record = self.paths.grant(folder.name)
        try:
            grant = read_grant(record)
        except GrantError as err:
            if record.exists():
                self.bad.report(record, err)
            return snap, None
        snap, differ = as_granted(snap, grant)
        said = "; ".join(differ)
        if differ and self._differ_told.get(folder.name) != said:
            log.warning(
                "container %s wrote limits into its region that differ from its grant (%s); "
                "its hook holds to the grant %s",
                folder.name,
                said,
                record,
            )
        self._differ_told[folder.name] = said
        return snap, bool(differ)

    def _region_dirs(self) -> list[Path]:
        try:
            return region_dirs(self.paths.containers_dir)
        except OSError:
            return []


def make_registry(collector: NodeCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one line per scrape would drown the plugin's own log


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """``/metrics`` on a thread of its own; ``server_port`` tells the port when 0 was asked for."""
    server = make_server(
        host, port, make_wsgi_app(registry), ThreadingWSGIServer, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
