"""The Kubernetes client seam: the only module that imports the ``kubernetes`` package.

Everything else talks to :class:`Kube`, which speaks plain ``dict`` objects exactly as the API
server serialises them (camelCase keys), never the client's generated models: they are slow to
build for thousands of nodes, and keeping them out keeps the rest of the code free of them.
Errors come out as :class:`vgpu.core.errors.KubeError` (``ConflictError`` for HTTP 409).

Watches and the Binding (the calls made per scheduled pod) speak HTTP/1.1 through
:mod:`vgpu.kube.wire` instead of urllib3, so every watch event costs little more than one
``orjson.loads``; a stale resource version ends the watch with :class:`Gone`. Beside it:
:mod:`~vgpu.kube.replies` (answers, errors, watch events), :mod:`~vgpu.kube.informer` (the
list-then-watch loop) and :mod:`~vgpu.kube.lease` (taking, renewing and reading Leases).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import orjson
import urllib3
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from urllib3.exceptions import HTTPError as Urllib3Error

from vgpu.core.errors import KubeError
from vgpu.kube import replies
from vgpu.kube.lease import now_micro as now_micro
from vgpu.kube.lease import parse_time as parse_time
from vgpu.kube.replies import CALL_ERRORS, http_error, object_of, one_line, wrap
from vgpu.kube.replies import Gone as Gone
from vgpu.kube.wire import Wire, split_lines

log = logging.getLogger(__name__)

Obj = dict[str, Any]
REQUEST_TIMEOUT_S = 15
# objects as their metadata only (meta.k8s.io/v1 PartialObjectMetadata), for a list and a watch
METADATA_LIST_ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA_ACCEPT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
AUTH_HEADERS_TTL_S = 10.0


def impersonation(kubeconfig: str) -> dict[str, str]:
    """The impersonation headers a kubeconfig's current user asks for, as kubectl sends them:
    ``as`` (Impersonate-User) and ``as-user-extra`` (Impersonate-Extra-<key>, the key
    percent-encoded). The Kubernetes client's own loader ignores both. ``as-groups`` is refused:
    each group is a header of the same name, which the client's header maps cannot repeat."""
    try:
        with open(kubeconfig) as f:
            doc = yaml.safe_load(f) or {}
        contexts = {c.get("name"): c.get("context") or {} for c in doc.get("contexts") or []}
        user_name = (contexts.get(doc.get("current-context")) or {}).get("user")
        users = {u.get("name"): u.get("user") or {} for u in doc.get("users") or []}
        user = users.get(user_name) or {}
    except (OSError, yaml.YAMLError, AttributeError, TypeError) as err:
        raise KubeError(f"cannot read the user of {kubeconfig}: {one_line(err)}") from err
    if user.get("as-groups"):
        raise KubeError(
            f"{kubeconfig}: users[{user_name}].as-groups is not supported by vgpu's client (it "
            "impersonates a user and its extra only); drop as-groups and bind the user's own roles"
        )
    headers: dict[str, str] = {}
    if user.get("as"):
        headers["Impersonate-User"] = str(user["as"])
    extra = user.get("as-user-extra") or {}
    if not isinstance(extra, dict):
        raise KubeError(f"{kubeconfig}: users[{user_name}].as-user-extra must map keys to lists of values")
    for key, values in extra.items():
        values = values if isinstance(values, list) else [values]
        if len(values) != 1:
            raise KubeError(f"{kubeconfig}: users[{user_name}].as-user-extra[{key}] must hold one value")
        headers["Impersonate-Extra-" + quote(str(key), safe="")] = str(values[0])
    if extra and "Impersonate-User" not in headers:
        raise KubeError(f"{kubeconfig}: users[{user_name}].as-user-extra needs as (the user to impersonate)")
    return headers


class Kube:
    """A small, thread-safe client for what the extender (and the device plugin) need."""

    def __init__(self, kubeconfig: str | None = None, pool_size: int = 32, wire: bool = True) -> None:
        cfg = k8s.Configuration()
        if kubeconfig and not os.path.isfile(kubeconfig):
            raise KubeError(f"cannot load Kubernetes credentials from {kubeconfig}: no such file")
        try:
            if kubeconfig:
                k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
            else:
                k8s_config.load_incluster_config(client_configuration=cfg)
        except Exception as err:  # the loaders raise several unrelated types
            where = kubeconfig or "in-cluster service account"
            raise KubeError(f"cannot load Kubernetes credentials from {where}: {one_line(err)}") from err
        cfg.connection_pool_maxsize = pool_size
        self.server: str = cfg.host  # the API server's URL, named in errors
        impersonate = impersonation(kubeconfig) if kubeconfig else {}
        try:
            # the Binding and the watches: see vgpu.kube.wire (None with a proxy: all through urllib3)
            self._wire = Wire.from_configuration(cfg, pool_size) if wire else None
        except (OSError, ValueError) as err:
            raise KubeError(
                f"cannot use the TLS settings of {kubeconfig or 'the service account'}: {one_line(err)}"
            ) from err
        self.api_client = k8s.ApiClient(cfg)
        for header, value in impersonate.items():
            self.api_client.set_default_header(header, value)
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
        return self._read_or_none(
            f"read pod {namespace}/{name}", self.core.read_namespaced_pod, name, namespace
        )

    def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], uid: str | None = None
    ) -> Obj:
        """Merge-patch annotations (None removes one); with ``uid``, only that incarnation of the pod."""
        meta: Obj = {"annotations": dict(annotations)}
        if uid is not None:
            meta["uid"] = uid
        return self.merge_patch(
            f"annotate pod {namespace}/{name}",
            self.core.patch_namespaced_pod,
            name,
            namespace,
            body={"metadata": meta},
        )

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str] | None = None
    ) -> None:
        """Create the pod's Binding to ``node``; ``annotations`` land on the pod in the same write.

        The API server merges a Binding's annotations into the pod as it sets ``spec.nodeName``,
        in one update: the pod is never bound without them, nor annotated without being bound.
        The UID is sent as kube-scheduler's own binder sends it, but the API server (1.33 and 1.36,
        tested in tests/e2e/test_kube_client.py) does not hold the Binding to it: a pod deleted and re-created
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
        self._request("POST", path, self._headers(), orjson.dumps(body), REQUEST_TIMEOUT_S, what)

    def get(self, path: str) -> Any:
        """GET an API path no other call covers (the sandbox, tests): its JSON, or its text
        when it is not JSON (``/readyz`` answers ``ok``); HTTP errors as KubeError (404 too)."""
        body = self._request(
            "GET", path, self._get_headers("application/json"), None, REQUEST_TIMEOUT_S, f"GET {path}"
        )
        try:
            return orjson.loads(body)
        except ValueError:
            return body.decode(errors="replace")

    def _request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        data: bytes | None,
        timeout_s: float,
        what: str,
    ) -> bytes:
        """One request past the generated client (its argument checks and serialisation cost more
        than the call): through :mod:`vgpu.kube.wire`, or urllib3 with a proxy; the answer's body."""
        if self._wire is not None:
            try:
                reply = self._wire.request(method, path, headers, data, timeout_s)
            except OSError as err:
                raise wrap(what, err, self.server) from err
            status, reason, body = reply.status, reply.reason, reply.body
        else:
            try:
                resp = self.api_client.rest_client.pool_manager.request(
                    method,
                    self.api_client.configuration.host + path,
                    body=data,
                    headers=dict(headers),
                    timeout=urllib3.Timeout(total=timeout_s),
                )
            except Urllib3Error as err:
                raise wrap(what, err, self.server) from err
            status, reason, body = resp.status, resp.reason or "", resp.data
        if status >= 400:
            raise http_error(what, status, reason, body)
        return bytes(body)

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
        if self._wire is None:
            return self.list_nodes()

        def page(cont: str | None) -> Obj:
            query = {"limit": "500", **({"continue": cont} if cont else {})}
            headers = self._get_headers(METADATA_LIST_ACCEPT)
            body = self._request("GET", f"/api/v1/nodes?{urlencode(query)}", headers, None, 60, "list nodes")
            return replies.decode(body, "list nodes")

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
        return self._read_or_none(
            f"read lease {namespace}/{name}", self.coord.read_namespaced_lease, name, namespace
        )

    def create_lease(self, namespace: str, lease: Obj) -> Obj:
        what = f"create lease {namespace}/{lease['metadata']['name']}"
        return self._call(what, self.coord.create_namespaced_lease, namespace, lease)

    def replace_lease(self, namespace: str, lease: Obj) -> Obj:
        """Replace a Lease; its ``metadata.resourceVersion`` makes this a compare-and-swap."""
        name = lease["metadata"]["name"]
        return self._call(
            f"replace lease {namespace}/{name}", self.coord.replace_namespaced_lease, name, namespace, lease
        )

    # -- plumbing -----------------------------------------------------------------------------
    def _call(self, what: str, call: Callable[..., Any], *args: Any, **kw: Any) -> Obj:
        """One generated method's call, its answer read as a plain dict; errors as KubeError."""
        try:
            resp = call(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S, **kw)
        except CALL_ERRORS as err:
            raise wrap(what, err, self.server) from err
        return object_of(resp)

    def _read_or_none(self, what: str, read: Callable[..., Any], *names: str) -> Obj | None:
        """One object as a dict, or None when the API server says 404."""
        try:
            return self._call(what, read, *names)
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    def merge_patch(self, what: str, call: Callable[..., Any], *names: str, body: Obj) -> Obj:
        """A JSON merge patch (``None`` removes a key) through the generated ``patch_*`` method
        ``call``, given the object's ``names`` (name, then namespace); returns the object as it is now."""
        return self._call(what, call, *names, body, _content_type="application/merge-patch+json")

    def _list(self, call: Callable[..., Any], what: str, **kw: Any) -> tuple[list[Obj], str]:
        kw = {k: v for k, v in kw.items() if v is not None}

        def page(cont: str | None) -> Obj:
            try:
                resp = call(limit=500, _continue=cont, _preload_content=False, _request_timeout=60, **kw)
            except CALL_ERRORS as err:
                raise wrap(what, err, self.server) from err
            return object_of(resp)

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
            raise wrap(what, err, self.server) from err
        if head.status != 200:
            raise http_error(what, head.status, head.reason, head.body)
        try:
            yield from replies.events(lines, what, self._closed)
        except OSError as err:
            if self._closed.is_set():
                return
            raise KubeError(f"{what}: stream broke: {err}") from err

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
        except CALL_ERRORS as err:
            raise wrap(what, err, self.server) from err
        try:
            yield from replies.events(
                split_lines(resp.stream(65536, decode_content=True)), what, self._closed
            )
        except (OSError, ValueError, Urllib3Error) as err:
            if self._closed.is_set():
                return
            raise KubeError(f"{what}: stream broke: {err}") from err
        finally:
            resp.release_conn()
