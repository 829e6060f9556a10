"""``vgpu dra-plugin``'s parts for one node, built from its flags: every setting checked first.

Discovery (NVML or ``--fake-nvml``), the node config, the hook library and, under
``driverInject: plugin``, the driver's files come from the device plugin's own pieces
(vgpu/node/wiring.py), so a DRA container is held exactly as a device-plugin one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from vgpu.core.claimconfig import SHARINGS
from vgpu.core.errors import ConfigError
from vgpu.core.service import Service
from vgpu.dra.mig import MIG_MODES, MigNode, in_mig_mode, open_mig
from vgpu.dra.prepare import Preparer, StatePaths
from vgpu.dra.publish import SlicePublisher
from vgpu.dra.server import (
    DRA_SOCKET_NAME,
    PLUGIN_DIR,
    REGISTRATION_SOCKET_NAME,
    REGISTRY_DIR,
    DraServer,
    HealthService,
)
from vgpu.node.config import load_node_config
from vgpu.node.discovery import Discovery
from vgpu.node.mps import MpsDaemons
from vgpu.node.wiring import (
    NodeSettings,
    driver_files,
    hook_install,
    mps_control,
    mps_library_dirs,
    open_discovery,
)

log = logging.getLogger(__name__)

# Unix socket paths must fit sockaddr_un (107 bytes and a NUL).
SOCKET_PATH_MAX = 107
MPS_CHECK_S = 2.0  # how often the MPS cards' daemons are checked (and a dead one started again)


@dataclass(frozen=True)
class DraSettings:
    node: str
    plugin_dir: Path = PLUGIN_DIR
    registry_dir: Path = REGISTRY_DIR
    cdi_dir: Path = Path("/var/run/cdi")
    state_dir: Path = StatePaths.state_dir
    config: Path | None = None
    fake_nvml: Path | None = None
    kubeconfig: Path | None = None
    hook_library: Path | None = None
    driver_inject: str | None = None
    driver_root: Path = Path("/")
    driver_host_root: str = "/"
    slice_interval_s: float = 10.0
    mig: str = "off"  # dynamic: cards in MIG mode offered as partitionable devices (docs/mig.md)
    sharing_mode: str = "timeslice"  # mps: every whole card shared through its MPS daemon (docs/dra.md)


class DraPlugin:
    """The publisher of the node's slice and the kubelet's gRPC server, started and stopped together."""

    def __init__(
        self,
        discovery: Discovery,
        publisher: SlicePublisher,
        server: DraServer,
        preparer: Preparer,
        mps: MpsDaemons | None = None,
    ):
        self.discovery = discovery
        self.publisher = publisher
        self.server = server
        self.preparer = preparer
        # --sharing-mode mps: each whole card's MPS control daemon (vgpu/node/mps.py), as the
        # device plugin runs them; Prepare refuses a share whose card's pipe folder is missing
        self.mps = mps
        self._mps_watch = Service.every("dra-mps", MPS_CHECK_S, self._check_mps, logger=log)

    def _check_mps(self) -> None:
        if self.mps is not None:
            self.mps.ensure()

    def start(self) -> None:
        self.preparer.mig_view()  # reclaim the MIG instances no prepared claim holds, first
        if self.mps is not None:  # before kubelet hears of the shares: their pods need the daemons
            self._check_mps()
            self._mps_watch.start()
        self.publisher.start()
        self.server.start()

    def stop(self) -> None:
        self._mps_watch.stop()  # the daemons keep running: their clients' work goes on (docs/mps.md)
        self.server.stop()
        self.publisher.stop()
        self.discovery.close()


def _check_dirs(settings: DraSettings) -> None:
    for flag, folder, name in (
        ("--plugin-dir", settings.plugin_dir, DRA_SOCKET_NAME),
        ("--registry-dir", settings.registry_dir, REGISTRATION_SOCKET_NAME),
    ):
        if not folder.is_absolute():
            raise ConfigError(flag, "", f"{folder} must be an absolute path")
        if len(str(folder / name).encode()) > SOCKET_PATH_MAX:
            raise ConfigError(
                flag, "", f"{folder / name} is longer than a unix socket path may be (107 bytes)"
            )
    for flag, folder in (("--cdi-dir", settings.cdi_dir), ("--state-dir", settings.state_dir)):
        if not folder.is_absolute():
            raise ConfigError(
                flag, "", f"{folder} must be an absolute path (the runtime reads it on the host)"
            )


def build(settings: DraSettings) -> DraPlugin:
    """Every part of the node's DRA plugin, every setting checked, nothing started."""
    from vgpu.kube.resourceapi import ResourceClient

    if not settings.node:
        raise ConfigError(
            "--node-name", "", "must name this node (the Node object; the pool is named after it)"
        )
    _check_dirs(settings)
    if settings.mig not in MIG_MODES:
        raise ConfigError(
            "--mig",
            "",
            f"must be off or dynamic (cards in MIG mode as partitionable devices), got {settings.mig!r}",
        )
    if settings.sharing_mode not in SHARINGS:
        raise ConfigError(
            "--sharing-mode",
            "",
            f"must be timeslice (cards time-sliced under the hook) or mps (each card's MPS daemon), "
            f"got {settings.sharing_mode!r}",
        )
    node_settings = NodeSettings(
        node=settings.node,
        config=settings.config,
        fake_nvml=settings.fake_nvml,
        kubeconfig=settings.kubeconfig,
        hook_library=settings.hook_library,
        driver_inject=settings.driver_inject,
        driver_root=settings.driver_root,
        driver_host_root=settings.driver_host_root,
    )
    config = load_node_config(settings.config, settings.node)
    paths = StatePaths(Path("/"), settings.state_dir)
    driver = driver_files(node_settings, config)
    discovery = open_discovery(node_settings)
    hook = hook_install(node_settings, paths)
    client = ResourceClient(str(settings.kubeconfig) if settings.kubeconfig else None)
    publisher = SlicePublisher(
        settings.node,
        discovery,
        client,
        config.device_memory_scaling,
        settings.slice_interval_s,
        sharing=settings.sharing_mode,
    )
    mig = MigNode(open_mig(discovery)) if settings.mig == "dynamic" else None
    if mig is None:
        publisher.unoffered = frozenset(in_mig_mode(discovery, [c.uuid for c in publisher.cards()]))
    preparer = Preparer(
        settings.node,
        paths,
        settings.cdi_dir,
        config,
        client,
        publisher.cards,
        hook=hook,
        driver=driver,
        mig=mig,
        sharing=settings.sharing_mode,
    )
    if mig is not None:
        publisher.mig = preparer.mig_view
    health = HealthService(settings.node, publisher)
    server = DraServer(
        preparer, settings.plugin_dir, settings.registry_dir, on_registered=publisher.kick, health=health
    )
    mps = None
    if settings.sharing_mode == "mps":
        cards = [c.uuid for c in publisher.cards()]
        # cards in MIG mode are never MPS cards: left out (--mig off) or cut on demand (dynamic)
        parted = publisher.unoffered if mig is None else frozenset(in_mig_mode(discovery, cards))
        whole = [u for u in cards if u not in parted]
        mps = MpsDaemons(paths, mps_control(node_settings, config, sharing_mode="mps"), whole)
        mps.library_dirs = mps_library_dirs(node_settings)
    return DraPlugin(discovery, publisher, server, preparer, mps)
