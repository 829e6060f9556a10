"""``vgpu dra-plugin``: the DRA driver's node plugin (docs/dra.md#the-node-plugin)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vgpu.core.claimconfig import DRIVER, MPS_CLASS, SHARINGS
from vgpu.dra.node import DRA_SOCKET_NAME, PLUGIN_DIR, REGISTRY_DIR, DraSettings, build
from vgpu.node.flags import add_hook_arguments
from vgpu.node.wiring import serve


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node-name", required=True, help="this node's name (the pool and the slice are named after it)"
    )
    parser.add_argument(
        "--plugin-dir",
        type=Path,
        default=PLUGIN_DIR,
        help=f"where the DRA socket ({DRA_SOCKET_NAME}) is served (default {PLUGIN_DIR})",
    )
    parser.add_argument(
        "--registry-dir",
        type=Path,
        default=REGISTRY_DIR,
        help=f"the kubelet's plugin registration folder (default {REGISTRY_DIR})",
    )
    parser.add_argument(
        "--cdi-dir",
        type=Path,
        default=DraSettings.cdi_dir,
        help=f"where the claims' CDI specs go (default {DraSettings.cdi_dir})",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DraSettings.state_dir,
        help="grants, region folders, hook versions, checkpoint, claim records "
        f"(default {DraSettings.state_dir})",
    )
    parser.add_argument("--config", type=Path, help="the node config YAML the device plugin reads")
    parser.add_argument("--fake-nvml", type=Path, help="GPUS.yaml describing fake cards, instead of NVML")
    parser.add_argument("--kubeconfig", type=Path, help="kubeconfig file; in-cluster config without it")
    add_hook_arguments(
        parser,
        inject_help="plugin: the CDI spec carries the driver's device nodes and libraries (nodes without "
        "NVIDIA's container toolkit); default: the node config's driverInject",
    )
    parser.add_argument(
        "--slice-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often the node's ResourceSlice is checked against its cards (default 10)",
    )
    parser.add_argument(
        "--mig",
        choices=("off", "dynamic"),
        default="off",
        help="dynamic: cards in MIG mode are offered as partitionable devices, one per profile placement, "
        "their instances made at prepare and reclaimed after (docs/mig.md#mig-with-dra); default off",
    )
    parser.add_argument(
        "--sharing-mode",
        choices=SHARINGS,
        default="timeslice",
        help="how the node's whole cards are shared: timeslice (under the hook; DeviceClass "
        f"{DRIVER}) or mps (each card's MPS daemon; DeviceClass {MPS_CLASS}, "
        "docs/dra.md#mps-shares); default timeslice",
    )
    parser.add_argument("--log-level", default=os.environ.get("VGPU_LOG_LEVEL", "INFO"))


def settings(args: argparse.Namespace) -> DraSettings:
    return DraSettings(
        node=args.node_name,
        plugin_dir=args.plugin_dir,
        registry_dir=args.registry_dir,
        cdi_dir=args.cdi_dir,
        state_dir=args.state_dir,
        config=args.config,
        fake_nvml=args.fake_nvml,
        kubeconfig=args.kubeconfig,
        hook_library=args.hook_library,
        driver_inject=args.driver_inject,
        driver_root=args.driver_root,
        driver_host_root=args.driver_host_root,
        slice_interval_s=args.slice_interval,
        mig=args.mig,
        sharing_mode=args.sharing_mode,
    )


def run(args: argparse.Namespace) -> int:
    return serve("dra-plugin", lambda: build(settings(args)), args.log_level)
