"""``vgpu device-plugin``'s flags and their parsing into ``NodeSettings``; the command itself, which
adds the node monitor, is vgpu/commands/device_plugin.py."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vgpu.core.hostport import split_hostport
from vgpu.node.flags import (
    DEFAULT_MONITOR_LISTEN,
    add_arbiter_arguments,
    add_hook_arguments,
    arbiter_settings,
)
from vgpu.node.wiring import NodeSettings


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node", required=True, help="this node's name (the Node object the plugin reports on)"
    )
    parser.add_argument("--kubeconfig", type=Path, help="kubeconfig file; in-cluster config without it")
    parser.add_argument("--namespace", default="kube-system", help="namespace of the node's Lease")
    parser.add_argument(
        "--root", type=Path, default=Path("/"), help="prefix of every host path (tests, sandbox)"
    )
    parser.add_argument("--fake-nvml", type=Path, help="GPUS.yaml describing fake cards, instead of NVML")
    parser.add_argument("--config", type=Path, help="node config YAML (split, deviceMemoryScaling, ...)")
    parser.add_argument("--monitor-listen", default=DEFAULT_MONITOR_LISTEN, help="HOST:PORT of /metrics")
    add_hook_arguments(
        parser,
        inject_help="runtime: NVIDIA's container toolkit gives containers the driver; plugin: Allocate "
        "hands them its device nodes and libraries (nodes without the toolkit); default: the node "
        "config's driverInject",
    )
    parser.add_argument(
        "--sweep-interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how often the folders, grants and hook versions pods gone from the node left are removed (60)",
    )
    parser.add_argument(
        "--sweep-min-age",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="the least time a folder or hook version stays, whatever the pod list says (default 300)",
    )
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
        namespace=args.namespace,
        listen=split_hostport(args.monitor_listen, "--monitor-listen"),
        arbiter=arbiter_settings(args),
        hook_library=args.hook_library,
        driver_inject=args.driver_inject,
        driver_root=args.driver_root,
        driver_host_root=args.driver_host_root,
        sweep=(args.sweep_interval, args.sweep_min_age),
    )
