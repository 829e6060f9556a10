"""Which lines hold each container's device memory, and its media engines' use: for ``/metrics``
and the node's Lease (``vgpu status``).

The lines (docs/security.md, "Lines of defence"):

- ``hook``: the hook runs in the container (its region file is in the container's folder, made by
  the hook's first process) and refuses allocations past the grant;
- ``driver-cap``: the driver caps the container's cgroup on every card its grant limits
  (``drivercap.py``, ``enforcement.driverCap``);
- ``node``: the node's memory enforcer (``enforce.py``) watches the driver's per-process memory and
  kills or evicts past the grant (not with ``enforcement.memory: report``).

Media engines (NVDEC, NVENC, NVJPG, OFA) per container and card come from the driver's
per-process samples as the memory enforcer's host view last read them (``HostView``: ``Held.codec``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vgpu.core.annotations import CODEC_ANNOTATION, LINES_ANNOTATION
from vgpu.core.errors import ConfigError
from vgpu.hookabi.grant import GRANT_SUFFIX, GrantError, read_grant
from vgpu.monitor.cgroupscan import CgroupScan, unified_root
from vgpu.monitor.claims import claim_labels
from vgpu.monitor.collector import NodeCollector
from vgpu.monitor.drivercap import DriverCap, wanted
from vgpu.monitor.enforce import Enforcer, PodActions
from vgpu.monitor.freezer import cgroup_root
from vgpu.node.config import NodeConfig
from vgpu.node.discovery import Discovery
from vgpu.node.memcap import MemoryCaps
from vgpu.node.paths import REGION_FILE_NAME, HostPaths

log = logging.getLogger(__name__)

LINES = ("hook", "driver-cap", "node")
# the driver's word per engine, and its family on /metrics
ENGINES = (
    ("dec", "vgpu_container_decoder_utilization_ratio", "decoder (NVDEC)"),
    ("enc", "vgpu_container_encoder_utilization_ratio", "encoder (NVENC)"),
    ("jpg", "vgpu_container_jpeg_utilization_ratio", "JPEG decoder (NVJPG)"),
    ("ofa", "vgpu_container_ofa_utilization_ratio", "optical flow (OFA)"),
)


def build_driver_cap(
    node: str,
    cfg: NodeConfig,
    discovery: Discovery,
    paths: HostPaths,
    enforcer: Enforcer | None,
    actions: PodActions | None,
) -> DriverCap | None:
    """The node's driver cap as ``enforcement.driverCap`` says (None: off, or a backend without it);
    raises ConfigError where ``required`` cannot be kept."""
    if cfg.driver_cap == "off":
        return None
    if not isinstance(discovery, MemoryCaps):
        if cfg.driver_cap == "required":
            raise ConfigError(
                "node config",
                "enforcement.driverCap",
                "required, but this node's GPU backend cannot set the cap",
            )
        return None
    if cfg.driver_cap == "required" and enforcer is None:
        raise ConfigError(
            "node config",
            "enforcement.driverCap",
            "required, but refusing a container that no line holds needs the driver's per-process list "
            "(the node's memory enforcer): run the monitor on the real NVML, or give the fake GPU file a "
            "processDir",
        )
    root = unified_root(cgroup_root())
    if root is None:
        log.warning(
            "driver cap: no cgroup v2 hierarchy under %s (no cgroup.controllers); the driver caps cgroup v2 "
            "only, so no container is capped here",
            cgroup_root(),
        )
    return DriverCap(
        node,
        paths,
        discovery,
        CgroupScan(root, paths.grants_dir),
        mode=cfg.driver_cap,
        view=(lambda: enforcer.stats.view) if enforcer is not None else None,
        refuse_with=cfg.enforce_memory,
        actions=actions,
    )


def grant_names(paths: HostPaths) -> list[str]:
    try:
        return sorted(p.name[: -len(GRANT_SUFFIX)] for p in paths.grants_dir.glob(f"*{GRANT_SUFFIX}"))
    except OSError:
        return []


def memory_lines(paths: HostPaths, cap: DriverCap | None, enforcer: Enforcer | None) -> dict[str, list[str]]:
    """Per container (its grant's name) that has started, the lines that hold it now, in ``LINES``
    order. Started: its hook made its region, the driver lists a process of it on a card, or the
    driver cap found its cgroup with a process in it; a container not started yet (or on a
    simulated node, never) holds nothing and is left out."""
    node_line = enforcer is not None and enforcer.action in ("kill", "evict")
    capped = cap.capped_grants() if cap is not None else {}
    view = enforcer.stats.view if enforcer is not None else None
    running = {h.owner.folder for h in view.held} if view is not None else set()
    if cap is not None:
        with cap.lock:
            running |= cap.stats.running
    out: dict[str, list[str]] = {}
    for name in grant_names(paths):
        try:
            grant = read_grant(paths.grant(name))
        except GrantError:
            continue
        limited = set(wanted(grant))
        held = []
        hooked = (paths.containers_dir / name / REGION_FILE_NAME).is_file()
        if not hooked and name not in running:
            continue
        if hooked:
            held.append("hook")
        if limited and limited <= capped.get(name, set()):
            held.append("driver-cap")
        if node_line:
            held.append("node")
        out[name] = held
    return out


def codec_use(enforcer: Enforcer | None) -> dict[str, dict[str, dict[str, int]]]:
    """Per container and card, its media engines' percent in the driver's latest samples."""
    view = enforcer.stats.view if enforcer is not None else None
    out: dict[str, dict[str, dict[str, int]]] = {}
    for held in view.held if view is not None else []:
        if held.codec is None:
            continue
        engines = {key: getattr(held.codec, key) for key, _, _ in ENGINES}
        out.setdefault(held.owner.folder, {})[held.uuid] = {k: v for k, v in engines.items() if v is not None}
    return out


def lease_annotations(paths: HostPaths, cap: DriverCap | None, enforcer: Enforcer | None) -> dict[str, str]:
    def dump(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    return {
        LINES_ANNOTATION: dump(memory_lines(paths, cap, enforcer)),
        CODEC_ANNOTATION: dump(codec_use(enforcer)),
    }


class LinesCollector(Collector):
    """The lines' and media engines' families for ``/metrics`` (docs/monitoring.md)."""

    def __init__(self, collector: NodeCollector, cap: DriverCap | None, enforcer: Enforcer | None) -> None:
        self.collector = collector
        self.cap = cap
        self.enforcer = enforcer

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())

    def _labels(self, grant: str, names: dict[str, tuple[str, str]]) -> list[str]:
        paths = self.collector.paths
        claim = claim_labels(paths.vgpu_dir, grant)
        if claim is not None:
            return [claim.namespace, claim.pod, claim.pod_uid, claim.container]
        pod_uid, _, container = grant.partition("_")
        namespace, pod = names.get(pod_uid, ("", ""))
        return [namespace, pod, pod_uid, container]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        node = self.collector.node
        paths = self.collector.paths
        names = self.collector._pod_names()
        who = ["node", "namespace", "pod", "pod_uid", "container"]
        line = GaugeMetricFamily(
            "vgpu_container_memory_line",
            "1 where the line holds the container's device memory to its grant: hook (the hook's region), "
            "driver-cap (the driver's cgroup cap), node (the memory enforcer kills or evicts)",
            labels=[*who, "line"],
        )
        for grant, held in memory_lines(paths, self.cap, self.enforcer).items():
            labels = [node, *self._labels(grant, names)]
            for name in LINES:
                line.add_metric([*labels, name], 1.0 if name in held else 0.0)
        yield line
        per_card = ["node", "uuid", "namespace", "pod", "pod_uid", "container"]
        engines = {
            key: GaugeMetricFamily(
                name,
                f"Share of the sample period the card's {word} engines worked for the container's "
                "processes, in the driver's latest per-process samples",
                labels=per_card,
            )
            for key, name, word in ENGINES
        }
        for grant, cards in codec_use(self.enforcer).items():
            labels = self._labels(grant, names)
            for uuid, use in cards.items():
                for key, value in use.items():
                    engines[key].add_metric([node, uuid, *labels], value / 100.0)
        yield from engines.values()
        if self.cap is None:
            return
        yield from self._cap_families(node, names)

    def _cap_families(
        self, node: str, names: dict[str, tuple[str, str]]
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        cap = self.cap
        assert cap is not None
        hard = GaugeMetricFamily(
            "vgpu_container_driver_cap_bytes",
            "The hard limit the driver holds the container's cgroup to on the card (enforcement.driverCap)",
            labels=["node", "uuid", "namespace", "pod", "pod_uid", "container"],
        )
        with cap.lock:
            applied = dict(cap.stats.applied)
            grants = dict(cap.stats.grants)
            errors = dict(cap.stats.errors)
            refusals = dict(cap.stats.refusals)
        for (cgroup, uuid), limit in sorted(applied.items()):
            hard.add_metric([node, uuid, *self._labels(grants.get(cgroup, ""), names)], float(limit))
        yield hard
        supported = GaugeMetricFamily(
            "vgpu_card_driver_cap_supported",
            "1 where the driver can cap a cgroup's device memory on the card "
            "(nvmlDeviceSetMemoryLimits_v1, r615+)",
            labels=["node", "uuid"],
        )
        for card in self.collector.state.cards():
            supported.add_metric([node, card.uuid], 1.0 if cap.caps.memory_caps(card.uuid) else 0.0)
        yield supported
        failed = CounterMetricFamily(
            "vgpu_driver_cap_errors",
            "Refusals of the driver to set or clear a container's cap, by NVML's error "
            "(missing, no-permission, ...)",
            labels=["node", "error"],
        )
        for code, count in sorted(errors.items()):
            failed.add_metric([node, code], float(count))
        yield failed
        refused = CounterMetricFamily(
            "vgpu_driver_cap_refusals",
            "Containers refused (killed or evicted) under enforcement.driverCap: required, "
            "no line holding them",
            labels=["node", "action"],
        )
        for action, count in sorted(refusals.items()):
            refused.add_metric([node, action], float(count))
        yield refused
