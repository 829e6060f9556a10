"""The node monitor: ``/metrics`` with per-card totals and per-container usage and limits.

Per card, from discovery (NVML): memory total and used, utilization, health. Per container,
from the hook's region files (contract 5) under ``<root>/var/lib/vgpu/containers/<pod-uid>_<container>/``:
memory used and limit per device, SM limit, live processes. Pod names come from the API server
(the node's pods, looked up at most every ``pod_cache_s``); without it the ``pod_uid`` label
still identifies the pod.
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
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, make_server
from prometheus_client.registry import Collector

from vgpu.errors import KubeError
from vgpu.plugin.devices import DeviceState
from vgpu.plugin.discovery import Discovery
from vgpu.plugin.paths import REGION_FILE_NAME, HostPaths
from vgpu.region import Region, RegionError

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
    ) -> None:
        self.node = node
        self.state = state
        self.discovery = discovery
        self.paths = paths
        self.list_pods = list_pods
        self.pod_cache_s = pod_cache_s
        self._pods: dict[str, tuple[str, str]] = {}
        self._pods_at = -1e9
        self._lock = threading.Lock()

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

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # collected fresh on every scrape

    def collect(self) -> Iterator[GaugeMetricFamily]:
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
        c_procs = GaugeMetricFamily(
            "vgpu_container_processes",
            "CUDA processes of the container",
            labels=["node", "namespace", "pod", "pod_uid", "container"],
        )
        names = self._pod_names() if self.paths.containers_dir.is_dir() else {}
        for folder in sorted(self._region_dirs()):
            pod_uid, _, container = folder.name.partition("_")
            namespace, pod = names.get(pod_uid, ("", ""))
            try:
                with Region(folder / REGION_FILE_NAME) as region:
                    snap = region.snapshot()
            except RegionError as err:
                log.warning("skipping region %s: %s", folder, err)
                continue
            c_procs.add_metric([self.node, namespace, pod, pod_uid, container], float(len(snap.processes)))
            for dev in snap.devices:
                labels = [self.node, dev.uuid, namespace, pod, pod_uid, container]
                c_used.add_metric(labels, float(dev.used_bytes))
                c_limit.add_metric(labels, float(dev.limit_bytes))
                c_sm.add_metric(labels, dev.sm_limit / 100.0)
        yield from (c_used, c_limit, c_sm, c_procs)

    def _region_dirs(self) -> Iterator[Path]:
        try:
            for folder in self.paths.containers_dir.iterdir():
                if (folder / REGION_FILE_NAME).is_file():
                    yield folder
        except OSError:
            return


def make_registry(collector: NodeCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def parse_listen(text: str, flag: str) -> tuple[str, int]:
    from vgpu.errors import ConfigError

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
