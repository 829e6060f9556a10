"""MIG on demand's families for the node's ``/metrics`` (docs/monitoring.md): the instances each
card holds (held by a pod, or a leftover waiting to be reclaimed), those made and reclaimed, the
refusals at Allocate by kind, and the instances the last reclaim pass found busy."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vgpu.deviceplugin.migdynamic import DynamicMig


class MigCollector(Collector):
    def __init__(self, dynamic: DynamicMig) -> None:
        self.dynamic = dynamic

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        d = self.dynamic
        node = d.node
        instances = GaugeMetricFamily(
            "vgpu_mig_instances",
            "MIG instances a card cut on demand holds now: held (a live pod's) or leftover (to reclaim)",
            labels=["node", "uuid", "profile", "state"],
        )
        held: dict[tuple[str, str, str], int] = {}
        for uuid in sorted(d.tables):
            view = d.describe(uuid)
            for i in view.instances if view else ():
                key = (uuid, i.profile, "held" if i.pod else "leftover")
                held[key] = held.get(key, 0) + 1
        for (uuid, profile, state), n in sorted(held.items()):
            instances.add_metric([node, uuid, profile, state], float(n))
        made = CounterMetricFamily(
            "vgpu_mig_instances_made",
            "MIG instances made on demand at Allocate",
            labels=["node", "uuid", "profile"],
        )
        for (uuid, profile), n in sorted(d.made.items()):
            made.add_metric([node, uuid, profile], float(n))
        reclaimed = CounterMetricFamily(
            "vgpu_mig_instances_reclaimed",
            "MIG instances destroyed because no live pod held them",
            labels=["node", "uuid", "profile"],
        )
        for (uuid, profile), n in sorted(d.reclaimed.items()):
            reclaimed.add_metric([node, uuid, profile], float(n))
        refused = CounterMetricFamily(
            "vgpu_mig_allocate_refusals",
            "Allocates refused for MIG on demand: busy (processes outside MIG), taken, invalid",
            labels=["node", "kind"],
        )
        for kind, n in sorted(d.refusals.items()):
            refused.add_metric([node, kind], float(n))
        busy = GaugeMetricFamily(
            "vgpu_mig_reclaim_busy",
            "MIG instances no pod holds that the last reclaim pass left because processes are on them",
            labels=["node"],
        )
        busy.add_metric([node], float(d.left_busy))
        yield from (instances, made, reclaimed, refused, busy)
