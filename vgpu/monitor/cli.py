"""``vgpu monitor``: the node monitor alone (``/metrics``), for nodes where the plugin runs elsewhere.

The device plugin already serves the same metrics on ``--monitor-listen`` and runs the same
arbiter (priority flags in the regions); this command is for a node where the plugin runs
elsewhere. Run only one arbiter per node: two would write the same words, harmlessly but twice.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vgpu.core.hostport import split_hostport
from vgpu.monitor.node import build_monitor
from vgpu.node.flags import DEFAULT_MONITOR_LISTEN, add_arbiter_arguments, arbiter_settings
from vgpu.node.wiring import NodeSettings, serve


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", required=True, help="this node's name")
    parser.add_argument(
        "--kubeconfig", type=Path, help="for pod names in labels; in-cluster config without it"
    )
    parser.add_argument("--no-kube", action="store_true", help="do not ask the API server for pod names")
    parser.add_argument("--root", type=Path, default=Path("/"), help="prefix of every host path")
    parser.add_argument("--fake-nvml", type=Path, help="GPUS.yaml describing fake cards, instead of NVML")
    parser.add_argument("--config", type=Path, help="node config YAML (split, scaling...)")
    parser.add_argument("--listen", default=DEFAULT_MONITOR_LISTEN, help="HOST:PORT of /metrics")
    add_arbiter_arguments(parser)
    parser.add_argument("--log-level", default=os.environ.get("VGPU_LOG_LEVEL", "INFO"))


def settings(args: argparse.Namespace) -> NodeSettings:
    """The flags as the node's settings; ``ConfigError`` naming the flag at fault."""
    return NodeSettings(
        node=args.node,
        root=args.root,
        config=args.config,
        fake_nvml=args.fake_nvml,
        kubeconfig=args.kubeconfig,
        kube=not args.no_kube,
        listen=split_hostport(args.listen, "--listen"),
        arbiter=arbiter_settings(args),
    )


def run(args: argparse.Namespace) -> int:
    return serve("monitor", lambda: build_monitor(settings(args)), args.log_level)
