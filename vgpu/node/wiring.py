"""What every node command builds alike: its settings, the cards, the hook, the driver's files,
MIG and MPS control, and ``serve`` (start, wait for SIGTERM or SIGINT, stop).

Each command wires its own parts from these (``vgpu device-plugin``: vgpu/commands/device_plugin.py;
``vgpu dra-plugin``: vgpu/dra/node.py; ``vgpu monitor``: vgpu/monitor/node.py). Every setting is
checked before anything starts, and a bad one stops the command with exit 2 and one line naming
the setting (a ``ConfigError`` or ``KubeError``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vgpu.core import logs
from vgpu.core.errors import ConfigError, KubeError
from vgpu.core.mig import MigError
from vgpu.node.config import NodeConfig, load_node_config
from vgpu.node.discovery import Discovery
from vgpu.node.driver import BIN_DIRS, DriverFiles, find_driver
from vgpu.node.flags import DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S
from vgpu.node.hooklib import HookInstall, install_hook
from vgpu.node.mig import MigControl
from vgpu.node.mps import CONTROL_BINARY, find_control
from vgpu.node.paths import HostPaths

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeSettings:
    """What the node's parts are built from (the commands' flags, parsed)."""

    node: str
    root: Path = Path("/")  # prefix of every host path (tests, sandbox)
    config: Path | None = None  # the node config YAML; None: the defaults
    fake_nvml: Path | None = None  # GPUS.yaml describing fake cards, instead of NVML
    kubeconfig: Path | None = None  # None: in-cluster config
    kube: bool = True  # False: never ask the API server (``vgpu monitor --no-kube``)
    namespace: str = "kube-system"  # of the node's Lease
    listen: tuple[str, int] | None = None  # HOST, PORT of /metrics; None: not served
    arbiter: tuple[float, float] | None = (DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S)  # None: no arbiter
    hook_library: Path | None = None  # libvgpu.so to install on the host (the plugin only)
    driver_inject: str | None = None  # plugin | cdi | runtime; None: the node config's driverInject
    driver_root: Path = Path("/")  # where the plugin reads the host's driver files (driverInject: plugin)
    driver_host_root: str = "/"  # the same folder as the host names it (the Mounts' host paths)
    sweep: tuple[float, float] = (60.0, 300.0)  # the plugin's sweep interval and minimum age, seconds


class Startable(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


def open_discovery(settings: NodeSettings) -> Discovery:
    """The fake cards of ``fake_nvml``, else NVML's; ``ConfigError`` naming the setting."""
    if settings.fake_nvml is not None:
        from vgpu.node.fake_nvml import FakeDiscovery

        try:
            return FakeDiscovery(settings.fake_nvml)
        except OSError as err:
            raise ConfigError(
                "--fake-nvml", "", f"cannot read {settings.fake_nvml} ({err.strerror})"
            ) from err
    from vgpu.node.nvml import NvmlDiscovery

    return NvmlDiscovery(settings.root)


def hook_install(settings: NodeSettings, paths: HostPaths) -> HookInstall | None:
    """The hook library installed on the host; None (with a warning) only beside fake cards."""
    library = settings.hook_library
    if library is not None and library.is_file():
        return install_hook(library, paths)
    if settings.fake_nvml is not None:
        log.warning(
            "no hook library at %s: containers get their limits in the environment but nothing enforces them "
            "(fine for the sandbox; pass --hook-library on a real node)",
            library,
        )
        return None
    raise ConfigError("--hook-library", "", f"{library} does not exist; install libvgpu.so there")


def node_config(settings: NodeSettings) -> NodeConfig:
    config = load_node_config(settings.config, settings.node)
    if settings.driver_inject is not None:  # the flag over the node config
        config = dataclasses.replace(config, driver_inject=settings.driver_inject)
    return config


def driver_files(settings: NodeSettings, config: NodeConfig) -> DriverFiles | None:
    """The driver's files to hand out under ``driverInject: plugin`` (None: the runtime's or the
    CDI spec's job). Under ``plugin`` and ``cdi`` the driver's libnvidia-ml is loaded from the
    driver root first, so that NVML finds it where no ld.so cache names it (no runtime gives the
    plugin's own pod the driver then)."""
    if config.driver_inject == "runtime" or (
        config.driver_inject == "cdi" and settings.fake_nvml is not None
    ):
        return None
    found = find_driver(settings.driver_root, settings.driver_host_root, settings.root / "dev")
    if found.nvml is not None and settings.fake_nvml is None:
        try:
            ctypes.CDLL(str(found.nvml), mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise ConfigError("--driver-root", "", f"cannot load {found.nvml} ({err})") from err
    if config.driver_inject != "plugin":
        return None
    log.info(
        "driverInject: plugin: %d library paths and %d tools from %s go to containers with the device nodes",
        len(found.libraries),
        len(found.binaries),
        settings.driver_root,
    )
    return found


def mps_control(settings: NodeSettings, config: NodeConfig, sharing_mode: str | None = None) -> str:
    """``nvidia-cuda-mps-control`` under the driver root (else the bare name, found on PATH or
    failing at start with the fix logged and the cards unhealthy: vgpu/node/mps.py).
    ``sharing_mode``: the DRA plugin's ``--sharing-mode`` (the device plugin's is the config's)."""
    found = find_control(settings.driver_root)
    if found is None and (sharing_mode or config.sharing_mode) == "mps":
        log.warning(
            "sharingMode: mps but no %s under %s (%s): looking on PATH",
            CONTROL_BINARY,
            settings.driver_root,
            ", ".join(BIN_DIRS),
        )
    return str(found) if found is not None else CONTROL_BINARY


def mps_library_dirs(settings: NodeSettings) -> list[str]:
    """The folder of the driver's libraries under the driver root, for the host's MPS tool run in
    the plugin's pod; none where the root is the plugin's own (the runtime gave it the driver)."""
    if settings.driver_root == Path("/") or settings.fake_nvml is not None:
        return []
    try:
        found = find_driver(settings.driver_root, settings.driver_host_root, settings.root / "dev")
    except ConfigError as err:
        log.warning("sharingMode: mps: the driver's libraries are not under the driver root (%s)", err)
        return []
    return [str(found.nvml.parent)] if found.nvml is not None else []


def open_mig(settings: NodeSettings, config: NodeConfig, discovery: Discovery) -> MigControl | None:
    """The cards' MIG state and control: the fake file's, else NVML's. Under ``migStrategy: none``
    it only tells which cards are in MIG mode (so that none is offered whole), and a node where
    it cannot be read gets None instead of an error."""
    if settings.fake_nvml is not None:
        return getattr(discovery, "mig", None)
    from vgpu.node.mig import NvmlMig  # pynvml: loaded only on a node that uses it

    try:
        return NvmlMig()
    except MigError as err:
        if config.mig_strategy == "none":
            log.warning("cannot tell which cards are in MIG mode (%s); every card is offered", err)
            return None
        raise ConfigError("migStrategy", "", str(err)) from err


def serve(command: str, build: Callable[[], Startable], log_level: str = "INFO") -> int:
    """Build and start, then run until SIGTERM or SIGINT; 2 with one line on stderr for a bad setting."""
    logs.configure(log_level)
    try:
        service = build()
        service.start()
    except (ConfigError, KubeError) as err:
        print(f"vgpu {command}: {err}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    service.stop()
    return 0
