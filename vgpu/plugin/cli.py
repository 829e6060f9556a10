"""``vgpu device-plugin``: the kubelet device plugin, inventory, Lease and monitor of one node."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from vgpu.core.errors import ConfigError, KubeError
from vgpu.plugin.discovery import Discovery
from vgpu.plugin.monitor.arbiter import add_arguments as add_arbiter_arguments
from vgpu.plugin.paths import HookInstall, HostPaths, install_hook

log = logging.getLogger("vgpu.plugin")

DEFAULT_HOOK = "/usr/local/vgpu/libvgpu.so"


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
    parser.add_argument(
        "--hook-library",
        type=Path,
        default=Path(os.environ.get("VGPU_HOOK_LIBRARY", DEFAULT_HOOK)),
        help=f"libvgpu.so to install on the host, versioned by content (default {DEFAULT_HOOK})",
    )
    add_arbiter_arguments(parser)
    parser.add_argument("--log-level", default=os.environ.get("VGPU_LOG_LEVEL", "INFO"))


def open_discovery(args: argparse.Namespace) -> Discovery:
    if args.fake_nvml is not None:
        from vgpu.plugin.fake_nvml import FakeDiscovery

        try:
            return FakeDiscovery(args.fake_nvml)
        except OSError as err:
            raise ConfigError("--fake-nvml", "", f"cannot read {args.fake_nvml} ({err.strerror})") from err
    from vgpu.plugin.nvml import NvmlDiscovery

    return NvmlDiscovery(args.root)


def hook_install(args: argparse.Namespace, paths: HostPaths) -> HookInstall | None:
    if args.hook_library.is_file():
        return install_hook(args.hook_library, paths)
    if args.fake_nvml is not None:
        log.warning(
            "no hook library at %s: containers get their limits in the environment but nothing enforces them "
            "(fine for the sandbox; pass --hook-library on a real node)",
            args.hook_library,
        )
        return None
    raise ConfigError("--hook-library", "", f"{args.hook_library} does not exist; install libvgpu.so there")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from vgpu.plugin.daemon import Daemon

    try:
        daemon = Daemon.from_args(args)
        daemon.start()
    except (ConfigError, KubeError) as err:
        print(f"vgpu device-plugin: {err}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    daemon.stop()
    return 0
