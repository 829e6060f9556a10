"""What the API server answers, as :class:`vgpu.kube.client.Kube` hands it on: objects as plain
dicts, HTTP errors as :class:`vgpu.core.errors.KubeError` (``ConflictError`` for 409, :class:`Gone`
for 410), and a watch's lines as ``(type, object)`` events.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import orjson
from kubernetes.client.exceptions import ApiException

from vgpu.core.errors import ConflictError, KubeError

Obj = dict[str, Any]


class Gone(KubeError):
    """The watch's resource version is too old (HTTP 410): list again."""


def wrap(what: str, err: Exception) -> KubeError:
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


def http_error(what: str, status: int, reason: str, body: bytes) -> KubeError:
    """The error for an HTTP answer of ``status`` >= 400, as :func:`wrap` makes it for the client's."""
    return wrap(what, ApiException(status=status, reason=reason, body=body.decode(errors="replace")))


def object_of(resp: Any) -> Obj:
    """The JSON object of a reply read unparsed (``_preload_content=False``); the connection goes back."""
    try:
        return decode(resp.data if hasattr(resp, "data") else resp.read())
    finally:
        resp.release_conn()


def decode(data: bytes, what: str = "") -> Obj:
    """The JSON object the API server sent; a KubeError (naming ``what``) for anything else."""
    try:
        doc = orjson.loads(data)
    except ValueError as err:
        raise KubeError(f"{what or 'a call'}: the API server's answer is not JSON: {err}") from err
    if not isinstance(doc, dict):
        raise KubeError(f"unexpected reply from the API server: {str(doc)[:200]}")
    return doc


def events(lines: Iterable[bytes], what: str, closed: threading.Event) -> Iterator[tuple[str, Obj]]:
    """A watch's (type, object) events, one a line; an ERROR event raises (:class:`Gone` for 410);
    ends quietly once ``closed`` is set (the client closed)."""
    for line in lines:
        if closed.is_set():
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
