"""``vgpu device-plugin``'s parts built from its settings: the ``Daemon``, every setting checked.

The node monitor that runs in the same process is the command's to add
(vgpu/commands/device_plugin.py passes ``monitor``): the device plugin never imports it.
"""

from __future__ import annotations

from vgpu.core.errors import ConfigError
from vgpu.deviceplugin.daemon import Daemon, MonitorFactory
from vgpu.node.paths import HostPaths
from vgpu.node.wiring import (
    NodeSettings,
    driver_files,
    hook_install,
    mps_control,
    mps_library_dirs,
    node_config,
    open_discovery,
    open_mig,
)


def build_plugin(settings: NodeSettings, monitor: MonitorFactory | None = None) -> Daemon:
    """The whole device plugin of the node, every setting checked, nothing started."""
    from vgpu.kube.agent import NodeAgentClient

    config = node_config(settings)
    interval, min_age = settings.sweep
    if not 0 < interval <= 3600:
        raise ConfigError("--sweep-interval", "", f"{interval:g} is out of range: give 0 < SECONDS <= 3600")
    if not 0 <= min_age <= 86400:
        raise ConfigError("--sweep-min-age", "", f"{min_age:g} is out of range: give 0 to 86400 seconds")
    paths = HostPaths(settings.root)
    driver = driver_files(settings, config)
    discovery = open_discovery(settings)
    hook = hook_install(settings, paths)
    control = open_mig(settings, config, discovery)
    client = NodeAgentClient(str(settings.kubeconfig) if settings.kubeconfig else None)
    daemon = Daemon(
        settings.node,
        settings.namespace,
        paths,
        config,
        discovery,
        client,
        hook,
        driver,
        mig=control if config.mig_strategy != "dynamic" else None,
        dynamic_mig=control if config.mig_strategy == "dynamic" else None,
        mps_control=mps_control(settings, config),
        monitor_factory=monitor,
    )
    daemon.sweep_s, daemon.sweep_min_age_s = interval, min_age
    if daemon.mps is not None:
        daemon.mps.library_dirs = mps_library_dirs(settings)
    return daemon
