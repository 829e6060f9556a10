"""The node monitor: ``/metrics`` with per-card totals and per-container usage and limits.

Per card, from discovery (NVML): memory total and used, utilization, health. Per container,
from the hook's region files (contract 5) under ``<root>/var/lib/vgpu/containers/<pod-uid>_<container>/``:
memory used, limit, budget and spilled per device, SM limit, GPU busy and throttled time,
priority, whether the arbiter (``vgpu.plugin.monitor.arbiter``, a thread of the same monitor) tells it
to yield, live processes, and the share of wall time its work kept the card busy over the last
10 s (``vgpu.plugin.monitor.timeshare``: samples of ``busy_ns`` from the arbiter's passes and the
scrapes; no series before two samples a second apart). Pod names come from the API server
(the node's pods, looked up at most every ``pod_cache_s``); without it the ``pod_uid`` label
still identifies the pod.

``resize_container`` is the monitor's way to change a running container's limits (live
resize); ``vgpu limits set`` goes through the same ``vgpu.hookabi.resize.apply_limits``. Its errors
name the value at fault in plain words (``LimitError.field``), not a command's flag.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, make_server
from prometheus_client.registry import Collector

from vgpu.core.errors import KubeError
from vgpu.hookabi.grant import GrantError, as_granted, read_grant
from vgpu.hookabi.layout import FLAG_YIELD
from vgpu.hookabi.region import Region, RegionError, Snapshot
from vgpu.hookabi.resize import LimitChange, apply_limits
from vgpu.plugin.devices import DeviceState
from vgpu.plugin.discovery import Discovery
from vgpu.plugin.monitor.arbiter import Arbiter, BadRegions
from vgpu.plugin.monitor.timeshare import TimeShare
from vgpu.plugin.paths import REGION_FILE_NAME, HostPaths

log = logging.getLogger(__name__)
MIB = 1 << 20

PodLister = Callable[[str], list[dict[str, Any]]]


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
        card_labels = ["node", "uuid", "index", "model"]
        total = GaugeMetricFamily(
            "vgpu_card_memory_total_bytes", "Device memory of the card", labels=card_labels
        )
        used = GaugeMetricFamily(
            "vgpu_card_memory_used_bytes", "Device memory in use on the card", labels=card_labels
        )
        util = GaugeMetricFamily(
            "vgpu_card_utilization_ratio", "Compute utilization of the card", labels=card_labels
        )
        healthy = GaugeMetricFamily("vgpu_card_healthy", "1 when the card is healthy", labels=card_labels)
        vgpus = GaugeMetricFamily("vgpu_card_split", "Most vGPUs the card may carry", labels=card_labels)
        for card in self.state.cards():
            labels = [self.node, card.uuid, str(card.index), card.model]
            healthy.add_metric(labels, 1.0 if card.healthy else 0.0)
            vgpus.add_metric(labels, float(self.state.config.split))
            u = self.discovery.usage(card.uuid)
            if u is not None:
                total.add_metric(labels, float(u.memory_total_mib * MIB))
                used.add_metric(labels, float(u.memory_used_mib * MIB))
                util.add_metric(labels, u.utilization_percent / 100.0)
        yield from (total, used, util, healthy, vgpus)

        c_labels = ["node", "uuid", "namespace", "pod", "pod_uid", "container"]
        c_used = GaugeMetricFamily(
            "vgpu_container_memory_used_bytes", "Device memory a container's processes hold", labels=c_labels
        )
        c_limit = GaugeMetricFamily(
            "vgpu_container_memory_limit_bytes",
            "Device memory limit of a container (0 = none)",
            labels=c_labels,
        )
        c_sm = GaugeMetricFamily(
            "vgpu_container_sm_limit_ratio",
            "Share of the card's SMs a container may use (0 = no cap)",
            labels=c_labels,
        )
        c_budget = GaugeMetricFamily(
            "vgpu_container_memory_budget_bytes",
            "Device memory a container may hold on the card before it spills to host memory "
            "(0 = the card's free memory)",
            labels=c_labels,
        )
        c_spilled = GaugeMetricFamily(
            "vgpu_container_memory_spilled_bytes",
            "Of the container's memory, bytes served from mapped host memory",
            labels=c_labels,
        )
        c_busy = CounterMetricFamily(
            "vgpu_container_sm_busy_seconds",
            "GPU time the container's work took on the card",
            labels=c_labels,
        )
        c_busy_ratio = GaugeMetricFamily(
            "vgpu_container_sm_busy_ratio",
            "Share of wall time the container's work kept the card busy, over the last 10 s "
            "(the hook's busy_ns; it measures only launches under a compute limit or a priority flag)",
            labels=c_labels,
        )
        c_throttled = CounterMetricFamily(
            "vgpu_container_sm_throttled_seconds",
            "Time the container's launches waited (SM cap or a higher-priority neighbour)",
            labels=c_labels,
        )
        c_yield = GaugeMetricFamily(
            "vgpu_container_yielding",
            "1 while the monitor tells the container to hold launches for a priority-0 neighbour on the card",
            labels=c_labels,
        )
        p_labels = ["node", "namespace", "pod", "pod_uid", "container"]
        c_procs = GaugeMetricFamily(
            "vgpu_container_processes", "CUDA processes of the container", labels=p_labels
        )
        c_prio = GaugeMetricFamily(
            "vgpu_container_priority", "The container's task priority: 0 high, 1 normal", labels=p_labels
        )
        c_differs = GaugeMetricFamily(
            "vgpu_container_region_limits_differ",
            "1 while the limits copied into the container's region differ from its grant (the container "
            "wrote them; the hook puts them back and holds to the grant)",
            labels=p_labels,
        )
        p_spilled = GaugeMetricFamily(
            "vgpu_process_memory_spilled_bytes",
            "Bytes one process of the container holds in mapped host memory",
            labels=[*c_labels, "pid"],
        )
        names = self._pod_names() if self.paths.containers_dir.is_dir() else {}
        sampled: list[tuple[str, int, str]] = []
        for folder in self._region_dirs():
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
            per_container = [self.node, namespace, pod, pod_uid, container]
            snap = self._as_granted(folder, snap, per_container, c_differs)
            c_procs.add_metric(per_container, float(len(snap.processes)))
            c_prio.add_metric(per_container, float(snap.priority))
            for dev in snap.devices:
                labels = [self.node, dev.uuid, namespace, pod, pod_uid, container]
                c_used.add_metric(labels, float(dev.used_bytes))
                c_limit.add_metric(labels, float(dev.limit_bytes))
                c_sm.add_metric(labels, dev.sm_limit / 100.0)
                c_budget.add_metric(labels, float(dev.budget_bytes))
                c_spilled.add_metric(labels, float(dev.spilled_bytes))
                c_busy.add_metric(labels, dev.busy_ns / 1e9)
                share_key = (folder.name, dev.index, dev.uuid)
                sampled.append(share_key)
                self.timeshare.record(share_key, read_at, dev.busy_ns)
                share = self.timeshare.ratio(share_key)
                if share is not None:
                    c_busy_ratio.add_metric(labels, share)
                c_throttled.add_metric(labels, dev.throttled_ns / 1e9)
                c_yield.add_metric(labels, 1.0 if dev.flags & FLAG_YIELD else 0.0)
                for proc in snap.processes:
                    if dev.index < len(proc.spilled_bytes):
                        p_spilled.add_metric([*labels, str(proc.pid)], float(proc.spilled_bytes[dev.index]))
        self.timeshare.keep_only(sampled)  # containers whose region is gone (or unreadable now)
        yield from (c_used, c_limit, c_sm, c_budget, c_spilled, c_busy, c_busy_ratio, c_throttled, c_yield)
        yield from (c_procs, c_prio, c_differs, p_spilled)
        yield from self._own_metrics()

    def _as_granted(
        self, folder: Path, snap: Snapshot, per_container: list[str], differs: GaugeMetricFamily
    ) -> Snapshot:
        """The limits the container was granted (its region holds only a copy it can write)."""
        record = self.paths.grant(folder.name)
        try:
            grant = read_grant(record)
        except GrantError as err:
            if record.exists():
                self.bad.report(record, err)
            return snap
        snap, differ = as_granted(snap, grant)
        differs.add_metric(per_container, 1.0 if differ else 0.0)
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
        return snap

    def _own_metrics(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        bad = CounterMetricFamily(
            "vgpu_monitor_bad_regions",
            "Region files skipped as unreadable (not a region, another layout version, cut short), "
            "once per file and reason",
            labels=["node"],
        )
        bad.add_metric([self.node], float(self.bad.total))
        yield bad
        if self.arbiter is None:
            return
        stats = self.arbiter.stats
        passes = CounterMetricFamily(
            "vgpu_arbiter_passes", "Passes of the monitor's arbiter", labels=["node"]
        )
        passes.add_metric([self.node], float(stats.passes))
        regions = GaugeMetricFamily(
            "vgpu_arbiter_regions", "Region files the arbiter keeps open", labels=["node"]
        )
        regions.add_metric([self.node], float(stats.regions))
        took = GaugeMetricFamily(
            "vgpu_arbiter_pass_seconds", "How long the arbiter's latest pass took", labels=["node"]
        )
        took.add_metric([self.node], stats.last_pass_s)
        writes = CounterMetricFamily(
            "vgpu_arbiter_flag_writes",
            "Flag words the arbiter changed (yield or alone set or cleared)",
            labels=["node"],
        )
        writes.add_metric([self.node], float(stats.flag_writes))
        yield from (passes, regions, took, writes)

    def _region_dirs(self) -> list[Path]:
        try:
            return region_dirs(self.paths.containers_dir)
        except OSError:
            return []


def region_dirs(containers_dir: Path) -> list[Path]:
    """The containers' folders that hold a region, sorted; none when the folder is not there yet.
    Raises OSError when it cannot be read."""
    try:
        folders = sorted(containers_dir.iterdir())
    except FileNotFoundError:
        return []
    return [folder for folder in folders if (folder / REGION_FILE_NAME).is_file()]


def region_usage(containers_dir: Path) -> dict[str, dict[str, int]]:
    """Device memory each container holds, per card: ``{"<pod-uid>_<container>": {uuid: bytes}}``.

    What the node's Lease carries for ``vgpu status``; unreadable regions are left out (the
    monitor's metrics report them)."""
    usage: dict[str, dict[str, int]] = {}
    for folder in region_dirs(containers_dir):
        try:
            with Region(folder / REGION_FILE_NAME, mapped=False) as region:
                snap = region.snapshot()
        except (RegionError, OSError):
            continue
        usage[folder.name] = {dev.uuid: int(dev.used_bytes) for dev in snap.devices if dev.uuid}
    return usage


def resize_container(
    paths: HostPaths,
    pod_uid: str,
    container: str,
    device: int,
    *,
    memory_bytes: int | None = None,
    sm_percent: int | None = None,
    budget_bytes: int | None = None,
) -> LimitChange:
    """Change one device's limits of a running container; raises LimitError/RegionError, writing nothing."""
    return apply_limits(
        paths.container_dir(pod_uid, container) / REGION_FILE_NAME,
        device,
        memory_bytes=memory_bytes,
        sm_percent=sm_percent,
        budget_bytes=budget_bytes,
    )


def make_registry(collector: NodeCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def parse_listen(text: str, flag: str) -> tuple[str, int]:
    from vgpu.core.errors import ConfigError

    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(flag, "", f"{text!r} is not HOST:PORT (e.g. 0.0.0.0:9394)")
    return host or "0.0.0.0", int(port)


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
