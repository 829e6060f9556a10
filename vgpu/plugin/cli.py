"""``vgpu device-plugin``: the kubelet device plugin, inventory, Lease and monitor of one node."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vgpu.plugin.config import INJECT_MODES
from vgpu.plugin.monitor.arbiter import add_arguments as add_arbiter_arguments
from vgpu.plugin.monitor.arbiter import settings as arbiter_settings
from vgpu.plugin.monitor.collector import parse_listen
from vgpu.plugin.node import NodeSettings, build_plugin, serve

DEFAULT_HOOK = "/usr/local/vgpu/libvgpu.so"


def add_hook_arguments(parser: argparse.ArgumentParser, inject_help: str) -> None:
    """The hook library's and the driver's flags, alike for ``vgpu device-plugin`` and ``vgpu dra-plugin``."""
    parser.add_argument(
        "--hook-library",
        type=Path,
        default=Path(os.environ.get("VGPU_HOOK_LIBRARY", DEFAULT_HOOK)),
        help=f"libvgpu.so to install on the host, versioned by content (default {DEFAULT_HOOK})",
    )
    parser.add_argument(
        "--driver-inject",
        choices=INJECT_MODES,
        help=inject_help,
    )
    parser.add_argument(
        "--driver-root",
        type=Path,
        default=Path("/"),
        help="where this process sees the host's driver installation (driverInject: plugin; default /)",
    )
    parser.add_argument(
        "--driver-host-root",
        default="/",
        help="the same folder as the host names it, e.g. /run/nvidia/driver (default /)",
    )


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
    parser.add_argument("--monitor-listen", default="0.0.0.0:9394", help="HOST:PORT of /metrics")
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
        listen=parse_listen(args.monitor_listen, "--monitor-listen"),
        arbiter=arbiter_settings(args),
        hook_library=args.hook_library,
        driver_inject=args.driver_inject,
        driver_root=args.driver_root,
        driver_host_root=args.driver_host_root,
        sweep=(args.sweep_interval, args.sweep_min_age),
    )


def run(args: argparse.Namespace) -> int:
    return serve("device-plugin", lambda: build_plugin(settings(args)), args.log_level)
