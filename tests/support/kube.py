"""One API server in memory for the tests: every call the parts make of :class:`vgpu.kube.client.Kube`
through their Protocols (the extender's ``KubeAPI``, the plugin's ``PodSource``, ``NodeAPI`` and
``PodWatchSource``, so the daemon's ``NodeClient``), and a record of what they did."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Mapping
from typing import Any

from vgpu.core.errors import KubeError

Obj = dict[str, Any]


def _merge(target: dict[str, str], patch: Mapping[str, str | None]) -> None:
    """A JSON merge patch of string values, as the API server applies it: None removes the key."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value


class FakeKube:
    """Pods in :attr:`pods` (API JSON, as :func:`tests.support.pods.pod` makes them), node
    annotations by node name, Leases renewed; a watch replays :attr:`events` (a ``KubeError`` put
    there is raised) and expires after ``watch_idle_s`` without one."""

    def __init__(self, pods: list[Obj] | None = None, *, fail_bind: bool = False, watch_idle_s: float = 0.05):
        self.pods: list[Obj] = pods if pods is not None else []
        self.nodes: dict[str, dict[str, str]] = {}  # node -> its annotations
        self.labels: dict[str, dict[str, str]] = {}  # node -> its labels
        self.fail_bind = fail_bind
        self.resource_version = 10
        self.events: queue.Queue[tuple[str, Obj] | KubeError] = queue.Queue()
        self.watch_idle_s = watch_idle_s
        # what the parts did, in order
        self.bound: list[tuple[str, str]] = []  # (pod uid, node)
        self.patches: list[tuple[str, dict[str, str | None]]] = []  # (pod name, patch)
        self.renewals: list[tuple[str, str, Mapping[str, str] | None]] = []  # (lease, holder, annotations)
        self.selectors: list[str | None] = []  # each list_pods' field selector
        self.pod_events: list[tuple[str, str, str]] = []  # (pod name, reason, message)
        self.lists = 0

    def find(self, namespace: str, name: str) -> Obj | None:
        for p in self.pods:
            meta = p["metadata"]
            if meta["name"] == name and meta.get("namespace", "default") == namespace:
                return p
        return None

    # -- the extender (vgpu.extender.state.KubeAPI) --------------------------------------------------

    def get_pod(self, namespace: str, name: str) -> Obj | None:
        return self.find(namespace, name)

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str] | None = None
    ) -> None:
        if self.fail_bind:
            raise KubeError("the API server said no")
        self.bound.append((uid, node))
        p = self.find(namespace, name)
        if p is not None:
            p["spec"]["nodeName"] = node
            _merge(p["metadata"].setdefault("annotations", {}), annotations or {})

    # -- the device plugin (vgpu.deviceplugin.allocate.PodSource, vgpu.deviceplugin.report.NodeAPI) ----

    def list_node_pods(self, node: str) -> list[Obj]:
        return [p for p in self.pods if p.get("spec", {}).get("nodeName") == node]

    def patch_pod_annotations(self, namespace: str, name: str, annotations: Mapping[str, str | None]) -> None:
        self.patches.append((name, dict(annotations)))
        p = self.find(namespace, name)
        if p is not None:
            _merge(p["metadata"].setdefault("annotations", {}), annotations)

    def pod_event(self, namespace: str, name: str, uid: str, reason: str, message: str, node: str) -> None:
        self.pod_events.append((name, reason, message))

    def node_annotations(self, node: str) -> dict[str, str]:
        return dict(self.nodes.get(node, {}))

    def node_labels(self, node: str) -> dict[str, str]:
        return dict(self.labels.get(node, {}))

    def patch_node_annotations(self, node: str, annotations: Mapping[str, str | None]) -> None:
        _merge(self.nodes.setdefault(node, {}), annotations)

    def renew_lease(
        self,
        namespace: str,
        name: str,
        holder: str,
        duration_s: int,
        annotations: Mapping[str, str] | None = None,
    ) -> None:
        self.renewals.append((name, holder, dict(annotations) if annotations is not None else None))

    def lease_renewals(self, name: str) -> list[Mapping[str, str] | None]:
        """The annotations of each renewal of Lease ``name`` (None: renewed without)."""
        return [a for lease, _, a in self.renewals if lease == name]

    # -- the plugin's arrival watch (vgpu.deviceplugin.arrivals.PodWatchSource) ----------------------------

    def list_pods(self, field_selector: str | None = None) -> tuple[list[Obj], str]:
        self.selectors.append(field_selector)
        self.lists += 1
        return list(self.pods), str(self.resource_version)

    def watch_pods(
        self, resource_version: str, field_selector: str | None = None, timeout_s: int = 300
    ) -> Iterator[tuple[str, Obj]]:
        while True:
            try:
                item = self.events.get(timeout=self.watch_idle_s)
            except queue.Empty:
                return  # the watch expired: the caller watches again from its resourceVersion
            if isinstance(item, KubeError):
                raise item
            yield item


def _satisfies_the_protocols() -> None:  # checked by mypy (pyproject's [tool.mypy] packages), never run
    from vgpu.deviceplugin.arrivals import PodWatchSource
    from vgpu.deviceplugin.daemon import NodeClient
    from vgpu.extender.state import KubeAPI

    kube = FakeKube()
    _api: KubeAPI = kube
    _node: NodeClient = kube  # the plugin's PodSource and NodeAPI together
    _watch: PodWatchSource = kube
