"""The Kubernetes client seam: the only module that imports the ``kubernetes`` package.

Everything else talks to :class:`Kube`, which speaks plain ``dict`` objects exactly as the API
server serialises them (camelCase keys), never the client's generated models: they are slow to
build for thousands of nodes, and keeping them out keeps the rest of the code free of them.
Errors come out as :class:`vgpu.core.errors.KubeError` (``ConflictError`` for HTTP 409).

Watches and the Binding (the calls made per scheduled pod) speak HTTP/1.1 through
:mod:`vgpu.kube.wire` instead of urllib3, so every watch event costs little more than one
``orjson.loads`` (several pod events of a few kB each per scheduled pod); a stale resource
version ends the watch with :class:`Gone` and the caller lists again.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import orjson
import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from vgpu.core.errors import ConflictError, KubeError
from vgpu.kube.wire import Wire, split_lines

log = logging.getLogger(__name__)

Obj = dict[str, Any]
REQUEST_TIMEOUT_S = 15
# objects as their metadata only (meta.k8s.io/v1 PartialObjectMetadata), for a list and a watch
METADATA_LIST_ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA_ACCEPT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
AUTH_HEADERS_TTL_S = 10.0


class Gone(KubeError):
    """The watch's resource version is too old (HTTP 410): list again."""


def _wrap(what: str, err: Exception) -> KubeError:
    if isinstance(err, ApiException):
        body = err.body
        if body is None and getattr(err, "data", None) is None:
            resp = getattr(err, "http_resp", None) or getattr(err, "response", None)
            body = getattr(resp, "data", None)
        detail = body.decode(errors="replace") if isinstance(body, bytes) else (body or err.reason or "")
        try:
            detail = json.loads(detail).get("message", detail)
        except (ValueError, AttributeError):
            pass
        cls = ConflictError if err.status == 409 else Gone if err.status == 410 else KubeError
        return cls(f"{what}: HTTP {err.status}: {detail}", status=err.status)
    return KubeError(f"{what}: {err}")


def _http_error(what: str, status: int, reason: str, body: bytes) -> KubeError:
    """The error for an HTTP answer of ``status`` >= 400, as :func:`_wrap` makes it for the client's."""
    return _wrap(what, ApiException(status=status, reason=reason, body=body.decode(errors="replace")))


def _read_or_none(read: Callable[..., Any], kind: str, namespace: str, name: str) -> Obj | None:
    """One namespaced object as a dict, or None when the API server says 404."""
    try:
        resp = read(name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
    except ApiException as err:
        if err.status == 404:
            return None
        raise _wrap(f"read {kind} {namespace}/{name}", err) from err
    return _json(resp)


def _json(resp: Any) -> Obj:
    data = resp.data if hasattr(resp, "data") else resp.read()
    try:
        doc = orjson.loads(data)
    finally:
        resp.release_conn()
    if not isinstance(doc, dict):
        raise KubeError(f"unexpected reply from the API server: {str(doc)[:200]}")
    return doc


def now_micro() -> str:
    """The current time as a Kubernetes MicroTime string."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> dt.datetime | None:
    """Parse a Kubernetes Time or MicroTime string; None when absent or malformed."""
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


class Kube:
    """A small, thread-safe client for what the extender (and the device plugin) need."""

    def __init__(self, kubeconfig: str | None = None, pool_size: int = 32, wire: bool = True) -> None:
        cfg = k8s.Configuration()
        try:
            if kubeconfig:
                k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
            else:
                k8s_config.load_incluster_config(client_configuration=cfg)
        except Exception as err:  # the loaders raise several unrelated types
            where = kubeconfig or "in-cluster service account"
            raise KubeError(f"cannot load Kubernetes credentials from {where}: {err}") from err
        cfg.connection_pool_maxsize = pool_size
        try:
            # the Binding and the watches: see vgpu.kube.wire (None with a proxy: all through urllib3)
            self._wire = Wire.from_configuration(cfg, pool_size) if wire else None
        except (OSError, ValueError) as err:
            raise KubeError(
                f"cannot use the TLS settings of {kubeconfig or 'the service account'}: {err}"
            ) from err
        self.api_client = k8s.ApiClient(cfg)
        # typed Any: we pass plain dicts and read raw responses, which the generated stubs do not describe
        self.core: Any = k8s.CoreV1Api(self.api_client)
        self.coord: Any = k8s.CoordinationV1Api(self.api_client)
        self._closed = threading.Event()
        self._auth: tuple[float, dict[str, str]] | None = None  # (when built, request headers)

    def close(self) -> None:
        self._closed.set()
        if self._wire is not None:
            self._wire.close()
        self.api_client.close()

    # -- pods ---------------------------------------------------------------------------------
    def list_pods(self, field_selector: str | None = None) -> tuple[list[Obj], str]:
        """All pods (every namespace) matching ``field_selector``, and the list's resourceVersion."""
        return self._list(self.core.list_pod_for_all_namespaces, "list pods", field_selector=field_selector)

    def watch_pods(
        self, resource_version: str, field_selector: str | None = None, timeout_s: int = 300
    ) -> Iterator[tuple[str, Obj]]:
        return self._watch(
            "/api/v1/pods",
            self.core.list_pod_for_all_namespaces,
            "watch pods",
            resource_version,
            timeout_s,
            field_selector,
        )

    def get_pod(self, namespace: str, name: str) -> Obj | None:
        return _read_or_none(self.core.read_namespaced_pod, "pod", namespace, name)

    def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], uid: str | None = None
    ) -> Obj:
        """Merge-patch annotations (None removes one); with ``uid``, only that incarnation of the pod."""
        meta: Obj = {"annotations": dict(annotations)}
        if uid is not None:
            meta["uid"] = uid
        try:
            resp = self.core.patch_namespaced_pod(
                name,
                namespace,
                {"metadata": meta},
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        except ApiException as err:
            raise _wrap(f"annotate pod {namespace}/{name}", err) from err
        return _json(resp)

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str] | None = None
    ) -> None:
        """Create the pod's Binding to ``node``; ``annotations`` land on the pod in the same write.

        The API server merges a Binding's annotations into the pod as it sets ``spec.nodeName``,
        in one update: the pod is never bound without them, nor annotated without being bound.
        The UID is sent as kube-scheduler's own binder sends it, but the API server (1.33, tested in
        tests/e2e/test_kube_client.py) does not hold the Binding to it: a pod deleted and re-created
        under the same name between ``filter`` and ``bind`` is bound, as with kube-scheduler alone.
        The reply (a Status object, which the generated client would fail to read back as a
        V1Binding) is not decoded; an HTTP error becomes a :class:`KubeError` as for every call.
        """
        meta: Obj = {"name": name, "namespace": namespace, "uid": uid}
        if annotations:
            meta["annotations"] = dict(annotations)
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        what = f"bind pod {namespace}/{name} to {node}"
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/bindings"
        data = orjson.dumps(body)
        if self._wire is not None:  # one bind per pod: see vgpu.kube.wire
            try:
                reply = self._wire.request("POST", path, self._headers(), data, REQUEST_TIMEOUT_S)
            except OSError as err:
                raise KubeError(f"{what}: {err}") from err
            status, reason, detail = reply.status, reply.reason, reply.body
        else:
            try:
                # the generated method's argument validation and serialisation cost more than the call
                resp = self.api_client.rest_client.pool_manager.request(
                    "POST",
                    self.api_client.configuration.host + path,
                    body=data,
                    headers=self._headers(),
                    timeout=urllib3.Timeout(total=REQUEST_TIMEOUT_S),
                )
            except Urllib3Error as err:
                raise KubeError(f"{what}: {err}") from err
            status, reason, detail = resp.status, resp.reason or "", resp.data
        if status >= 400:
            raise _http_error(what, status, reason, detail)

    def _headers(self) -> dict[str, str]:
        """A JSON request's headers as the client sends them (authentication included).

        Built by the client itself, so a kubeconfig's token, exec plugin or the in-cluster
        service-account token (re-read when it rotates) apply as for every other call; kept for
        ``AUTH_HEADERS_TTL_S`` since building them re-reads the credentials.
        """
        now = time.monotonic()
        cached = self._auth
        if cached is None or now - cached[0] > AUTH_HEADERS_TTL_S:
            headers = dict(self.api_client.default_headers)
            self.api_client.update_params_for_auth(headers, [], ["BearerToken"], "", "POST", None)
            headers["Content-Type"] = headers["Accept"] = "application/json"
            cached = self._auth = (now, headers)
        return cached[1]

    # -- nodes --------------------------------------------------------------------------------
    def _get_headers(self, accept: str) -> dict[str, str]:
        """:meth:`_headers` for a GET answered in ``accept``."""
        headers = {k: v for k, v in self._headers().items() if k != "Content-Type"}
        headers["Accept"] = accept
        return headers

    def list_nodes(self) -> tuple[list[Obj], str]:
        return self._list(self.core.list_node, "list nodes")

    def list_node_metadata(self) -> tuple[list[Obj], str]:
        """Every Node as its metadata only (name, labels, annotations), and the list's resourceVersion.

        What the extender reads of a Node is its inventory annotation: the status (conditions,
        images, addresses), which kubelets rewrite on every status report, is neither sent nor
        decoded. With a proxy in the kubeconfig, whole Nodes (the same metadata, and more).
        """
        wire = self._wire
        if wire is None:
            return self.list_nodes()

        def page(cont: str | None) -> Obj:
            query = {"limit": "500", **({"continue": cont} if cont else {})}
            headers = self._get_headers(METADATA_LIST_ACCEPT)
            try:
                reply = wire.request("GET", f"/api/v1/nodes?{urlencode(query)}", headers, None, 60)
            except OSError as err:
                raise KubeError(f"list nodes: {err}") from err
            if reply.status != 200:
                raise _http_error("list nodes", reply.status, reply.reason, reply.body)
            try:
                doc = orjson.loads(reply.body)
            except ValueError as err:
                raise KubeError(f"list nodes: the API server's answer is not JSON: {err}") from err
            if not isinstance(doc, dict):
                raise KubeError(f"unexpected reply from the API server: {str(doc)[:200]}")
            return doc

        return self._pages(page)

    def watch_node_metadata(self, resource_version: str, timeout_s: int = 300) -> Iterator[tuple[str, Obj]]:
        """Events of Nodes as their metadata only (see :meth:`list_node_metadata`)."""
        return self._watch(
            "/api/v1/nodes",
            self.core.list_node,
            "watch nodes",
            resource_version,
            timeout_s,
            None,
            accept=METADATA_ACCEPT,
        )

    def watch_nodes(self, resource_version: str, timeout_s: int = 300) -> Iterator[tuple[str, Obj]]:
        return self._watch(
            "/api/v1/nodes", self.core.list_node, "watch nodes", resource_version, timeout_s, None
        )

    # -- leases -------------------------------------------------------------------------------
    def list_leases(self, namespace: str) -> tuple[list[Obj], str]:
        return self._list(
            lambda **kw: self.coord.list_namespaced_lease(namespace, **kw), f"list leases in {namespace}"
        )

    def watch_leases(
        self, namespace: str, resource_version: str, timeout_s: int = 300
    ) -> Iterator[tuple[str, Obj]]:
        return self._watch(
            f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace, safe='')}/leases",
            lambda **kw: self.coord.list_namespaced_lease(namespace, **kw),
            f"watch leases in {namespace}",
            resource_version,
            timeout_s,
            None,
        )

    def get_lease(self, namespace: str, name: str) -> Obj | None:
        return _read_or_none(self.coord.read_namespaced_lease, "lease", namespace, name)

    def create_lease(self, namespace: str, lease: Obj) -> Obj:
        try:
            resp = self.coord.create_namespaced_lease(
                namespace, lease, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
            )
        except ApiException as err:
            raise _wrap(f"create lease {namespace}/{lease['metadata']['name']}", err) from err
        return _json(resp)

    def replace_lease(self, namespace: str, lease: Obj) -> Obj:
        """Replace a Lease; its ``metadata.resourceVersion`` makes this a compare-and-swap."""
        name = lease["metadata"]["name"]
        try:
            resp = self.coord.replace_namespaced_lease(
                name, namespace, lease, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
            )
        except ApiException as err:
            raise _wrap(f"replace lease {namespace}/{name}", err) from err
        return _json(resp)

    # -- plumbing -----------------------------------------------------------------------------
    def _list(self, call: Callable[..., Any], what: str, **kw: Any) -> tuple[list[Obj], str]:
        kw = {k: v for k, v in kw.items() if v is not None}

        def page(cont: str | None) -> Obj:
            try:
                resp = call(limit=500, _continue=cont, _preload_content=False, _request_timeout=60, **kw)
            except ApiException as err:
                raise _wrap(what, err) from err
            return _json(resp)

        return self._pages(page)

    @staticmethod
    def _pages(page: Callable[[str | None], Obj]) -> tuple[list[Obj], str]:
        """A list's items over its pages (``page(continue token)``), and its resourceVersion."""
        items: list[Obj] = []
        cont: str | None = None
        rv = ""
        while True:
            doc = page(cont)
            items.extend(doc.get("items") or [])
            meta = doc.get("metadata") or {}
            rv = meta.get("resourceVersion", rv)
            cont = meta.get("continue") or None
            if not cont:
                return items, rv

    def _watch(
        self,
        path: str,
        call: Callable[..., Any],
        what: str,
        resource_version: str,
        timeout_s: int,
        field_selector: str | None,
        accept: str = "application/json",
    ) -> Iterator[tuple[str, Obj]]:
        """Yield (type, object) events; BOOKMARK events carry only the new resourceVersion.

        ``path`` is read through :mod:`vgpu.kube.wire`; ``call`` (the generated list method) only
        when the kubeconfig names a proxy.
        """
        if self._wire is None:
            yield from self._watch_generated(call, what, resource_version, timeout_s, field_selector)
            return
        query = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        if field_selector:
            query["fieldSelector"] = field_selector
        headers = self._get_headers(accept)
        try:
            head, lines = self._wire.stream(f"{path}?{urlencode(query)}", headers, timeout_s + 30)
        except OSError as err:
            if self._closed.is_set():
                return
            raise KubeError(f"{what}: {err}") from err
        if head.status != 200:
            raise _http_error(what, head.status, head.reason, head.body)
        try:
            yield from self._events(lines, what)
        except OSError as err:
            if self._closed.is_set():
                return
            raise KubeError(f"{what}: stream broke: {err}") from err

    def _events(self, lines: Iterable[bytes], what: str) -> Iterator[tuple[str, Obj]]:
        for line in lines:
            if self._closed.is_set():
                return
            if not line.strip():
                continue
            try:
                event = orjson.loads(line)
            except ValueError as err:
                raise KubeError(f"{what}: malformed event: {err}") from err
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                code = obj.get("code")
                msg = f"{what}: {obj.get('message', obj)}"
                raise Gone(msg, status=410) if code == 410 else KubeError(msg, status=code)
            yield kind, obj

    def _watch_generated(
        self,
        call: Callable[..., Any],
        what: str,
        resource_version: str,
        timeout_s: int,
        field_selector: str | None,
    ) -> Iterator[tuple[str, Obj]]:
        kw: dict[str, Any] = {}
        if field_selector:
            kw["field_selector"] = field_selector
        try:
            resp = call(
                watch=True,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_s,
                _preload_content=False,
                _request_timeout=(10, timeout_s + 30),
                **kw,
            )
        except ApiException as err:
            raise _wrap(what, err) from err
        try:
            yield from self._events(split_lines(resp.stream(65536, decode_content=True)), what)
        except (OSError, ValueError, Urllib3Error) as err:
            if self._closed.is_set():
                return
            raise KubeError(f"{what}: stream broke: {err}") from err
        finally:
            resp.release_conn()


# =============================================================================================
# Node side (device plugin and the sandbox's kubelet stand-in). Written by the device-plugin
# engineer; everything below builds on Kube and adds only the node calls those parts need.
# =============================================================================================


class NodeAgentClient(Kube):
    """The API calls of a node's device plugin and of the sandbox kubelet."""

    def list_node_pods(self, node: str) -> list[Obj]:
        """Pods bound to ``node`` (every namespace)."""
        pods, _ = self.list_pods(field_selector=f"spec.nodeName={node}")
        return pods

    def patch_pod_annotations(  # type: ignore[override]
        self, namespace: str, name: str, annotations: Mapping[str, str | None], uid: str | None = None
    ) -> None:
        super().patch_pod_annotations(namespace, name, annotations, uid)

    def node_annotations(self, node: str) -> dict[str, str]:
        try:
            resp = self.core.read_node(node, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as err:
            raise _wrap(f"read node {node}", err) from err
        return dict((_json(resp).get("metadata") or {}).get("annotations") or {})

    def patch_node_annotations(self, node: str, annotations: Mapping[str, str | None]) -> None:
        """Merge-patch a Node's annotations (None removes one)."""
        try:
            resp = self.core.patch_node(
                node,
                {"metadata": {"annotations": dict(annotations)}},
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            resp.release_conn()
        except ApiException as err:
            raise _wrap(f"annotate node {node}", err) from err

    def patch_node_resources(self, node: str, resource: str, capacity: int, allocatable: int) -> None:
        """Set one extended resource in the Node's status, as kubelet does for device plugins."""
        body = {
            "status": {"capacity": {resource: str(capacity)}, "allocatable": {resource: str(allocatable)}}
        }
        try:
            resp = self.core.patch_node_status(
                node,
                body,
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            resp.release_conn()
        except ApiException as err:
            raise _wrap(f"update the status of node {node}", err) from err

    def reject_pod(self, namespace: str, name: str, reason: str, message: str) -> None:
        """Mark a pod Failed as kubelet does when it rejects it at admission (the sandbox's kubelet)."""
        body = {"status": {"phase": "Failed", "reason": reason, "message": message}}
        try:
            resp = self.core.patch_namespaced_pod_status(
                name,
                namespace,
                body,
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            resp.release_conn()
        except ApiException as err:
            raise _wrap(f"mark pod {namespace}/{name} Failed", err) from err

    def renew_lease(
        self,
        namespace: str,
        name: str,
        holder: str,
        duration_s: int,
        annotations: Mapping[str, str] | None = None,
    ) -> None:
        """Create the Lease, or renew it; a concurrent writer (409) is retried with a fresh copy.

        ``annotations`` are set on the Lease with each renewal (the node's usage report)."""
        for _ in range(3):
            lease = self.get_lease(namespace, name)
            now = now_micro()
            if lease is None:
                try:
                    self.create_lease(
                        namespace,
                        {
                            "apiVersion": "coordination.k8s.io/v1",
                            "kind": "Lease",
                            "metadata": {
                                "name": name,
                                "namespace": namespace,
                                **({"annotations": dict(annotations)} if annotations else {}),
                            },
                            "spec": {
                                "holderIdentity": holder,
                                "leaseDurationSeconds": duration_s,
                                "acquireTime": now,
                                "renewTime": now,
                            },
                        },
                    )
                    return
                except ConflictError:
                    continue
            spec = lease.setdefault("spec", {})
            spec.update({"holderIdentity": holder, "leaseDurationSeconds": duration_s, "renewTime": now})
            if annotations:
                meta = lease.setdefault("metadata", {})
                meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
            try:
                self.replace_lease(namespace, lease)
                return
            except ConflictError:
                continue
        raise KubeError(f"renew lease {namespace}/{name}: it kept changing under us (3 conflicts)")
