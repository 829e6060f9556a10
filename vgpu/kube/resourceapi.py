"""The DRA calls of a node's plugin: ResourceClaims read, the node's ResourceSlice written.

``resource.k8s.io/v1`` (Kubernetes 1.34 and later), as plain dicts like every call of
:class:`vgpu.kube.client.Kube`. Errors are :class:`vgpu.core.errors.KubeError`
(``ConflictError`` when the slice changed since it was read).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import orjson

from vgpu.core.errors import ConflictError, KubeError
from vgpu.kube.client import REQUEST_TIMEOUT_S, Kube, Obj

RESOURCE_API = "/apis/resource.k8s.io/v1"


def _q(name: str) -> str:
    return quote(name, safe="")


class ResourceClient(Kube):
    """What ``vgpu dra-plugin`` asks of the API server."""

    def _json(self, method: str, path: str, what: str, body: Any = None) -> Obj:
        data = None if body is None else orjson.dumps(body)
        headers = self._headers() if data is not None else self._get_headers("application/json")
        reply = self._request(method, path, headers, data, REQUEST_TIMEOUT_S, what)
        try:
            doc = orjson.loads(reply) if reply else {}
        except ValueError as err:
            raise KubeError(f"{what}: the API server answered something that is not JSON") from err
        return doc if isinstance(doc, dict) else {}

    def _or_none(self, path: str, what: str) -> Obj | None:
        try:
            return self._json("GET", path, what)
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    def get_resource_claim(self, namespace: str, name: str) -> Obj | None:
        """The claim, None when it does not exist."""
        path = f"{RESOURCE_API}/namespaces/{_q(namespace)}/resourceclaims/{_q(name)}"
        return self._or_none(path, f"read ResourceClaim {namespace}/{name}")

    def get_resource_slice(self, name: str) -> Obj | None:
        return self._or_none(f"{RESOURCE_API}/resourceslices/{_q(name)}", f"read ResourceSlice {name}")

    def list_resource_slices(self, node: str, driver: str) -> list[Obj]:
        """The slices of ``driver`` on ``node`` (a pool of several slices: MIG, docs/mig.md)."""
        selector = quote(f"spec.nodeName={node},spec.driver={driver}", safe="")
        doc = self._json(
            "GET", f"{RESOURCE_API}/resourceslices?fieldSelector={selector}", f"list ResourceSlices of {node}"
        )
        items = doc.get("items")
        return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []

    def create_resource_slice(self, slice_obj: Obj) -> Obj:
        name = slice_obj["metadata"]["name"]
        return self._json("POST", f"{RESOURCE_API}/resourceslices", f"create ResourceSlice {name}", slice_obj)

    def replace_resource_slice(self, slice_obj: Obj) -> Obj:
        """PUT with the read ``metadata.resourceVersion``: ``ConflictError`` if it changed since."""
        name = slice_obj["metadata"]["name"]
        what = f"update ResourceSlice {name}"
        try:
            return self._json("PUT", f"{RESOURCE_API}/resourceslices/{_q(name)}", what, slice_obj)
        except KubeError as err:
            if err.status == 409 and not isinstance(err, ConflictError):
                raise ConflictError(str(err), status=409) from err
            raise

    def delete_resource_slice(self, name: str) -> None:
        try:
            self._json("DELETE", f"{RESOURCE_API}/resourceslices/{_q(name)}", f"delete ResourceSlice {name}")
        except KubeError as err:
            if err.status != 404:
                raise

    def node_uid(self, node: str) -> str | None:
        """The Node's UID (the slice's owner), None when the Node does not exist."""
        obj = self._or_none(f"/api/v1/nodes/{_q(node)}", f"read node {node}")
        return None if obj is None else (obj.get("metadata") or {}).get("uid")
