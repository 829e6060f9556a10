"""The node's compute gate's families for ``/metrics`` (docs/monitoring.md): each container's
share of its card by the driver's samples, whether the gate holds or freezes it, the actions
taken, the gate's writes, and which cards the driver gives samples for."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vgpu.monitor.compute import ComputeEnforcer


class ComputeCollector(Collector):
    """The compute gate's families for ``/metrics`` (docs/monitoring.md)."""

    def __init__(self, enforcer: ComputeEnforcer) -> None:
        self.enforcer = enforcer

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        e = self.enforcer
        now = e.clock()
        labels = ["node", "uuid", "namespace", "pod", "pod_uid", "container"]
        share = GaugeMetricFamily(
            "vgpu_container_host_sm_share_ratio",
            "Share of the card's time the container's kernels ran over the last second (driver samples)",
            labels=labels,
        )
        held = GaugeMetricFamily(
            "vgpu_container_compute_held",
            "1 while the node's gate holds the container's launches (its measured share is past its grant)",
            labels=labels,
        )
        throttled = GaugeMetricFamily(
            "vgpu_container_compute_throttled",
            "1 while the container's cgroup is frozen for its compute share (enforcement.compute: throttle)",
            labels=labels,
        )
        with e._lock:
            accounts = list(e.accounts.values())
            counts = dict(e.counts)
            writes = e.gate_writes
            unsampled = set(e.unsampled)
        for a in accounts:
            o = a.owner
            row = [e.node, a.uuid, o.namespace, o.pod, o.pod_uid, o.container]
            share.add_metric(row, a.share(now) / 100.0)
            held.add_metric(row, 1.0 if a.hold_until > now else 0.0)
            throttled.add_metric(row, 1.0 if a.frozen else 0.0)
        acted = CounterMetricFamily(
            "vgpu_compute_enforcement_actions",
            "Actions on containers whose launches escape the compute gate (throttle, evict, kill, report)",
            labels=["node", "action", "namespace", "pod", "container"],
        )
        for (action, namespace, pod, container), count in counts.items():
            acted.add_metric([e.node, action, namespace, pod, container], float(count))
        w = CounterMetricFamily(
            "vgpu_compute_gate_writes", "Changes of a grant's hold_until_ns by the node", labels=["node"]
        )
        w.add_metric([e.node], float(writes))
        sampled = GaugeMetricFamily(
            "vgpu_compute_gate_sampling",
            "1 while the driver gives the card's per-process utilization samples; 0: the node's compute "
            "gate cannot see the card",
            labels=["node", "uuid"],
        )
        for uuid in e.uuids():
            sampled.add_metric([e.node, uuid], 0.0 if uuid in unsampled else 1.0)
        yield from (share, held, throttled, acted, w, sampled)
