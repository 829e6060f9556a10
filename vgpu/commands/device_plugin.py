"""``vgpu device-plugin``: the kubelet device plugin, inventory, Lease and node monitor of one node.

The one place the device plugin (vgpu/deviceplugin/) and the node monitor (vgpu/monitor/) meet:
the two stand side by side on the node floor (vgpu/node/) and never import each other, and this
command runs the monitor in the plugin's process (its ``/metrics`` on ``--monitor-listen``, its
arbiter, its Lease annotations on the plugin's Lease). ``vgpu monitor`` runs the monitor alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from vgpu.deviceplugin.cli import register, settings
from vgpu.deviceplugin.daemon import Daemon
from vgpu.deviceplugin.node import build_plugin
from vgpu.monitor.enforce import PodActions
from vgpu.monitor.service import NodeMonitor
from vgpu.node.flags import DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S
from vgpu.node.wiring import serve

__all__ = ["plugin_monitor", "register", "run"]


def plugin_monitor(
    listen: tuple[str, int] | None,
    arbiter: tuple[float, float] | None = (DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S),
) -> Callable[[Daemon], NodeMonitor]:
    """The node monitor of a device plugin's ``Daemon``: its cards (``DeviceState``), discovery,
    host paths and API client; ``/metrics`` on ``listen`` (None: not served), the arbiter's pass
    interval and activity window (None: no arbiter)."""

    def build(daemon: Daemon) -> NodeMonitor:
        client = daemon.client
        return NodeMonitor(
            daemon.node,
            daemon.state,
            daemon.discovery,
            daemon.paths,
            list_pods=client.list_node_pods,
            listen=listen,
            arbiter=arbiter,
            actions=client if isinstance(client, PodActions) else None,
        )

    return build


def run(args: argparse.Namespace) -> int:
    def build() -> Daemon:
        node = settings(args)
        return build_plugin(node, monitor=plugin_monitor(node.listen, node.arbiter))

    return serve("device-plugin", build, args.log_level)
