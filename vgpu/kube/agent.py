"""The node's API calls: what a node's device plugin (and the sandbox's kubelet) asks of the API
server, on top of :class:`vgpu.kube.client.Kube`: its pods, its Node's annotations and extended
resources, its Lease."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from vgpu.kube import lease as leases
from vgpu.kube.client import Kube, Obj


class NodeAgentClient(Kube):
    """The API calls of a node's device plugin and of the sandbox kubelet, on top of :class:`Kube`."""

    def list_node_pods(self, node: str) -> list[Obj]:
        """Pods bound to ``node`` (every namespace)."""
        pods, _ = self.list_pods(field_selector=f"spec.nodeName={node}")
        return pods

    def patch_pod_annotations(  # type: ignore[override]
        self, namespace: str, name: str, annotations: Mapping[str, str | None], uid: str | None = None
    ) -> None:
        super().patch_pod_annotations(namespace, name, annotations, uid)

    def node_annotations(self, node: str) -> dict[str, str]:
        node_obj = self._call(f"read node {node}", self.core.read_node, node)
        return dict((node_obj.get("metadata") or {}).get("annotations") or {})

    def node_labels(self, node: str) -> dict[str, str]:
        node_obj = self._call(f"read node {node}", self.core.read_node, node)
        return dict((node_obj.get("metadata") or {}).get("labels") or {})

    def patch_node_annotations(self, node: str, annotations: Mapping[str, str | None]) -> None:
        """Merge-patch a Node's annotations (None removes one)."""
        body = {"metadata": {"annotations": dict(annotations)}}
        self.merge_patch(f"annotate node {node}", self.core.patch_node, node, body=body)

    def patch_node_resources(self, node: str, resource: str, capacity: int, allocatable: int) -> None:
        """Set one extended resource in the Node's status, as kubelet does for device plugins."""
        body = {
            "status": {"capacity": {resource: str(capacity)}, "allocatable": {resource: str(allocatable)}}
        }
        self.merge_patch(f"update the status of node {node}", self.core.patch_node_status, node, body=body)

    def reject_pod(self, namespace: str, name: str, reason: str, message: str) -> None:
        """Mark a pod Failed as kubelet does when it rejects it at admission (the sandbox's kubelet)."""
        body = {"status": {"phase": "Failed", "reason": reason, "message": message}}
        what = f"mark pod {namespace}/{name} Failed"
        self.merge_patch(what, self.core.patch_namespaced_pod_status, name, namespace, body=body)

    def pod_event(self, namespace: str, name: str, uid: str, reason: str, message: str, node: str) -> None:
        """A Warning Event on a pod from the node monitor (``kubectl describe pod`` shows it)."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": namespace,
                "name": name,
                "uid": uid,
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning",
            "source": {"component": "vgpu-monitor", "host": node},
            "reportingComponent": "vgpu-monitor",
            "reportingInstance": node,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        what = f"create an event on pod {namespace}/{name}"
        self._call(what, self.core.create_namespaced_event, namespace, body)

    def evict_pod(self, namespace: str, name: str) -> None:
        """Evict a pod through the Eviction API (its disruption budget holds; a refusal is a KubeError)."""
        meta = {"name": name, "namespace": namespace}
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": meta}
        self._call(
            f"evict pod {namespace}/{name}", self.core.create_namespaced_pod_eviction, name, namespace, body
        )

    def renew_lease(
        self,
        namespace: str,
        name: str,
        holder: str,
        duration_s: int,
        annotations: Mapping[str, str] | None = None,
    ) -> None:
        """Create the Lease, or renew it (see :func:`vgpu.kube.lease.renew`); ``annotations`` are
        set on the Lease with each renewal (the node's usage report)."""
        leases.renew(self, namespace, name, holder, duration_s, annotations)
