"""What the API server answers, as :class:`vgpu.kube.client.Kube` hands it on: objects as plain
dicts, HTTP errors as :class:`vgpu.core.errors.KubeError` (``ConflictError`` for 409, :class:`Gone`
for 410), and a watch's lines as ``(type, object)`` events.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import orjson
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from vgpu.core.errors import ConflictError, KubeError
from vgpu.kube.wire import WireError

Obj = dict[str, Any]


class Gone(KubeError):
    """The watch's resource version is too old (HTTP 410): list again."""


# what a call through the generated client raises: an HTTP answer, or none (urllib3's own errors)
CALL_ERRORS = (ApiException, Urllib3Error)


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def _transport_reason(err: BaseException) -> str:
    """Why no HTTP answer came, in a few words: ``connection refused``, ``timed out``, ...

    urllib3 wraps the socket's error (MaxRetryError -> NewConnectionError -> ConnectionRefusedError);
    the innermost one names the cause.
    """
    seen: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in seen and len(seen) < 10:
        seen.append(cur)
        reason = getattr(cur, "reason", None)
        cur = reason if isinstance(reason, BaseException) else None
        cur = cur or seen[-1].__cause__ or seen[-1].__context__
    for e in reversed(seen):
        if isinstance(e, ssl.SSLCertVerificationError):
            return (
                f"TLS: {e.verify_message or 'certificate verify failed'}: does the kubeconfig's CA match it?"
            )
        if isinstance(e, ssl.SSLError):
            return f"TLS: {e.reason or one_line(e)}"
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if isinstance(e, socket.gaierror):
            return f"its name does not resolve: {e.strerror or one_line(e)}"
        if isinstance(e, TimeoutError | socket.timeout):
            return "timed out"
        if isinstance(e, ConnectionResetError):
            return "connection reset"
        if isinstance(e, OSError) and e.strerror:
            lower = e.strerror[:1].isupper() and e.strerror[1:2].islower()
            return e.strerror.lower() if lower else e.strerror
    names = {"ConnectTimeoutError": "timed out", "ReadTimeoutError": "timed out", "SSLError": "TLS failed"}
    for e in reversed(seen):
        if type(e).__name__ in names:
            return names[type(e).__name__]
    return one_line(err)[:200]


def unreachable(server: str, err: BaseException) -> str:
    """The one line for an API server that gave no HTTP answer."""
    return f"cannot reach the API server at {server} ({_transport_reason(err)})"


def wrap(what: str, err: Exception, server: str = "") -> KubeError:
    """The one-line KubeError for a failed call to the API server at ``server``: its HTTP answer
    (``ConflictError`` for 409, :class:`Gone` for 410), or why no answer came (``unreachable``)."""
    if isinstance(err, WireError) and not isinstance(err.__cause__ or err.__context__, OSError):
        return KubeError(f"{what}: the API server at {server or '?'}: {one_line(err)}")
    if isinstance(err, Urllib3Error | OSError) and not isinstance(err, ApiException):
        return KubeError(f"{what}: {unreachable(server or '?', err)}", unreachable=True)
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
        detail = one_line(detail)
        detail = detail if len(detail) <= 300 else detail[:300] + "..."
        return cls(f"{what}: HTTP {err.status}: {detail}", status=err.status)
    return KubeError(f"{what}: {one_line(err)}")


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
