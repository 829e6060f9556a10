"""``vgpu monitor``: the node monitor alone (``/metrics``), for nodes where the plugin runs elsewhere.

The device plugin already serves the same metrics on ``--monitor-listen`` and runs the same
arbiter (priority flags in the regions); this command is for a node where the plugin runs
elsewhere. Run only one arbiter per node: two would write the same words, harmlessly but twice.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from vgpu.core.errors import ConfigError, KubeError
from vgpu.core.service import Service
from vgpu.plugin.monitor.arbiter import add_arguments as add_arbiter_arguments


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", required=True, help="this node's name")
    parser.add_argument(
        "--kubeconfig", type=Path, help="for pod names in labels; in-cluster config without it"
    )
    parser.add_argument("--no-kube", action="store_true", help="do not ask the API server for pod names")
    parser.add_argument("--root", type=Path, default=Path("/"), help="prefix of every host path")
    parser.add_argument("--fake-nvml", type=Path, help="GPUS.yaml describing fake cards, instead of NVML")
    parser.add_argument("--config", type=Path, help="node config YAML (split, scaling...)")
    parser.add_argument("--listen", default="0.0.0.0:9394", help="HOST:PORT of /metrics")
    add_arbiter_arguments(parser)
    parser.add_argument("--log-level", default=os.environ.get("VGPU_LOG_LEVEL", "INFO"))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from vgpu.plugin.cli import open_discovery
    from vgpu.plugin.config import load_node_config
    from vgpu.plugin.devices import DeviceState
    from vgpu.plugin.monitor.arbiter import Arbiter
    from vgpu.plugin.monitor.arbiter import settings as arbiter_settings
    from vgpu.plugin.monitor.collector import NodeCollector, make_registry, parse_listen, serve_metrics
    from vgpu.plugin.paths import HostPaths

    try:
        config = load_node_config(args.config, args.node)
        host, port = parse_listen(args.listen, "--listen")
        arbitration = arbiter_settings(args)
        discovery = open_discovery(args)
        list_pods = None
        if not args.no_kube:
            from vgpu.kube.client import NodeAgentClient

            list_pods = NodeAgentClient(str(args.kubeconfig) if args.kubeconfig else None).list_node_pods
    except (ConfigError, KubeError) as err:
        print(f"vgpu monitor: {err}", file=sys.stderr)
        return 2
    state = DeviceState(discovery.cards(), config)
    paths = HostPaths(args.root)
    arbiter = None
    if arbitration is not None:
        arbiter = Arbiter(
            paths.containers_dir,
            interval_s=arbitration[0],
            window_s=arbitration[1],
            grants_dir=paths.grants_dir,
        )
        arbiter.start()
    collector = NodeCollector(args.node, state, discovery, paths, list_pods=list_pods, arbiter=arbiter)

    def health(stop: threading.Event) -> None:
        while not stop.is_set():
            for event in discovery.wait_health_events(1.0):
                state.set_health(event.uuid, event.healthy)

    health_loop = Service("monitor-health", health).start()
    server = serve_metrics(host, port, make_registry(collector))
    logging.getLogger("vgpu.monitor").info("node monitor on http://%s:%d/metrics", host, server.server_port)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.shutdown()
    health_loop.stop()
    if arbiter is not None:
        arbiter.stop()
    return 0
