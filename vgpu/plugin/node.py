"""One node's parts built from its settings: what ``vgpu device-plugin`` and ``vgpu monitor`` run.

The two commands (vgpu/plugin/cli.py, vgpu/plugin/monitor/cli.py) only parse their flags into
``NodeSettings`` and hand ``serve`` a builder: ``build_plugin`` (the whole plugin, ``Daemon``)
or ``build_monitor`` (``/metrics`` and the arbiter alone). Every setting is checked before
anything starts, and a bad one stops the command with exit 2 and one line naming the setting
(a ``ConfigError`` or ``KubeError``).

Imports go one way: the commands import this module, this module imports the parts
(``daemon``, ``monitor.service``, ``discovery`` ...), and no part imports a command.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vgpu.core.errors import ConfigError, KubeError
from vgpu.core.service import Service
from vgpu.plugin.config import NodeConfig, load_node_config
from vgpu.plugin.daemon import Daemon
from vgpu.plugin.devices import DeviceState, watch_health
from vgpu.plugin.discovery import Discovery
from vgpu.plugin.monitor.arbiter import DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S
from vgpu.plugin.monitor.collector import PodLister
from vgpu.plugin.monitor.service import NodeMonitor
from vgpu.plugin.paths import HookInstall, HostPaths, install_hook

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


class Startable(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


def open_discovery(settings: NodeSettings) -> Discovery:
    """The fake cards of ``fake_nvml``, else NVML's; ``ConfigError`` naming the setting."""
    if settings.fake_nvml is not None:
        from vgpu.plugin.fake_nvml import FakeDiscovery

        try:
            return FakeDiscovery(settings.fake_nvml)
        except OSError as err:
            raise ConfigError(
                "--fake-nvml", "", f"cannot read {settings.fake_nvml} ({err.strerror})"
            ) from err
    from vgpu.plugin.nvml import NvmlDiscovery

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


def _config(settings: NodeSettings) -> NodeConfig:
    return load_node_config(settings.config, settings.node)


def build_plugin(settings: NodeSettings) -> Daemon:
    """The whole device plugin of the node, every setting checked, nothing started."""
    from vgpu.kube.agent import NodeAgentClient

    config = _config(settings)
    paths = HostPaths(settings.root)
    discovery = open_discovery(settings)
    hook = hook_install(settings, paths)
    client = NodeAgentClient(str(settings.kubeconfig) if settings.kubeconfig else None)
    return Daemon(
        settings.node,
        settings.namespace,
        paths,
        config,
        discovery,
        client,
        hook,
        settings.listen,
        settings.arbiter,
    )


class MonitorNode:
    """``vgpu monitor``'s parts: the node monitor, and the health watch that keeps the cards current."""

    def __init__(self, discovery: Discovery, state: DeviceState, monitor: NodeMonitor) -> None:
        self.discovery = discovery
        self.state = state
        self.monitor = monitor
        self._health = Service("monitor-health", lambda stop: watch_health(discovery, state, stop))

    def start(self) -> None:
        self._health.start()
        self.monitor.start()

    def stop(self) -> None:
        self.monitor.stop()
        self._health.stop()


def build_monitor(settings: NodeSettings) -> MonitorNode:
    """The node monitor alone (``/metrics``, the arbiter), every setting checked, nothing started."""
    config = _config(settings)
    discovery = open_discovery(settings)
    list_pods: PodLister | None = None
    client = None
    if settings.kube:
        from vgpu.kube.agent import NodeAgentClient

        client = NodeAgentClient(str(settings.kubeconfig) if settings.kubeconfig else None)
        list_pods = client.list_node_pods
    state = DeviceState(discovery.cards(), config)
    paths = HostPaths(settings.root)
    monitor = NodeMonitor(
        settings.node,
        state,
        discovery,
        paths,
        list_pods=list_pods,
        listen=settings.listen,
        arbiter=settings.arbiter,
        actions=client,
    )
    return MonitorNode(discovery, state, monitor)


def serve(command: str, build: Callable[[], Startable], log_level: str = "INFO") -> int:
    """Build and start, then run until SIGTERM or SIGINT; 2 with one line on stderr for a bad setting."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
