"""The flags the node's commands share (``vgpu device-plugin``, ``vgpu dra-plugin``, ``vgpu monitor``).

The hook library's and the driver's flags (the two node drivers), and the arbiter's (the device
plugin runs the node monitor's arbiter in its process, ``vgpu monitor`` runs it alone).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vgpu.core.errors import ConfigError
from vgpu.node.config import INJECT_MODES

DEFAULT_HOOK = "/usr/local/vgpu/libvgpu.so"
# The arbiter's pass interval and activity window (vgpu/monitor/arbiter.py).
DEFAULT_MONITOR_LISTEN = "0.0.0.0:9394"  # the node monitor's /metrics (contract 6), either command
DEFAULT_INTERVAL_S = 0.025
DEFAULT_WINDOW_S = 0.1


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


def add_arbiter_arguments(parser: argparse.ArgumentParser) -> None:
    """The arbiter's flags, the same on ``vgpu device-plugin`` and ``vgpu monitor``."""
    parser.add_argument(
        "--arbiter-interval-ms",
        type=float,
        default=DEFAULT_INTERVAL_S * 1000,
        help="how often the arbiter writes the priority flags into the regions (default 25; 0 = no arbiter)",
    )
    parser.add_argument(
        "--activity-window-ms",
        type=float,
        default=DEFAULT_WINDOW_S * 1000,
        help="a container launched within this long ago counts as active on its card (default 100)",
    )


def arbiter_settings(args: argparse.Namespace) -> tuple[float, float] | None:
    """(interval_s, window_s) from the flags, None for no arbiter; raises ConfigError naming the flag."""
    interval = float(getattr(args, "arbiter_interval_ms", DEFAULT_INTERVAL_S * 1000))
    window = float(getattr(args, "activity_window_ms", DEFAULT_WINDOW_S * 1000))
    if not 0 <= interval <= 1000:
        raise ConfigError(
            "--arbiter-interval-ms",
            "",
            f"{interval:g} is out of range: give 1..1000 ms (the hook ignores "
            "flags older than 1 s), or 0 to run no arbiter",
        )
    if not 0 < window <= 10_000:
        raise ConfigError("--activity-window-ms", "", f"{window:g} is out of range: give 1..10000 ms")
    if interval == 0:
        return None
    return interval / 1000, window / 1000
