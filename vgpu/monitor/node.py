"""``vgpu monitor``'s parts built from its settings: the node monitor alone, and the health watch
that keeps the cards current (the device plugin runs the same ``NodeMonitor`` in its process:
vgpu/commands/device_plugin.py)."""

from __future__ import annotations

from vgpu.core.service import Service
from vgpu.monitor.collector import PodLister
from vgpu.monitor.service import NodeMonitor
from vgpu.node.devices import DeviceState, watch_health
from vgpu.node.discovery import Discovery
from vgpu.node.mig import mig_layout
from vgpu.node.paths import HostPaths
from vgpu.node.wiring import NodeSettings, node_config, open_discovery, open_mig


class MonitorNode:
    """``vgpu monitor``'s parts: the node monitor, and the health watch that keeps the cards current."""

    def __init__(self, discovery: Discovery, state: DeviceState, monitor: NodeMonitor) -> None:
        self.discovery = discovery
        self.state = state
        self.monitor = monitor
        self._health = Service("monitor-health", lambda stop: watch_health(discovery, state, stop))

    def start(self) -> None:
        self._health.start()
        self.monitor.start()

    def stop(self) -> None:
        self.monitor.stop()
        self._health.stop()


def build_monitor(settings: NodeSettings) -> MonitorNode:
    """The node monitor alone (``/metrics``, the arbiter), every setting checked, nothing started."""
    config = node_config(settings)
    discovery = open_discovery(settings)
    list_pods: PodLister | None = None
    client = None
    if settings.kube:
        from vgpu.kube.agent import NodeAgentClient

        client = NodeAgentClient(str(settings.kubeconfig) if settings.kubeconfig else None)
        list_pods = client.list_node_pods
    cards = discovery.cards()
    # the MIG devices offered under single or mixed, watched per device; no other strategy needs them here
    mig = open_mig(settings, config, discovery) if config.mig_strategy in ("single", "mixed") else None
    state = DeviceState(cards, config, mig_layout(mig, [c.uuid for c in cards]) if mig is not None else None)
    paths = HostPaths(settings.root)
    monitor = NodeMonitor(
        settings.node,
        state,
        discovery,
        paths,
        list_pods=list_pods,
        listen=settings.listen,
        arbiter=settings.arbiter,
        actions=client,
    )
    return MonitorNode(discovery, state, monitor)
