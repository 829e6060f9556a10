"""gunicorn's ``gthread`` worker, keeping a busy connection in its thread and reading its plain requests
with a short parser.

Two costs of ``gthread`` sit on kube-scheduler's scheduling path, which sends ``filter`` and then
``bind`` on a kept-alive connection and waits for each answer before it goes on:

- *Hand-offs.* After each answer the connection goes back to the main thread's poller; its next
  request wakes the main thread, which hands it to a pool thread again: two thread hand-offs and
  the main thread's share of the GIL per request. Here the thread that answered waits up to
  :data:`LINGER_S` for the connection's next request and serves it itself; a connection that
  stays quiet goes back to the poller as before. Waiting costs no CPU (the thread sleeps in
  ``poll``), only a pool thread for that long.
- *Parsing.* gunicorn's HTTP/1 parser and response writer are general (chunked bodies, proxies,
  ``Expect``, every limit) and cost more CPU per call than the filter itself. A request on a
  connection already open is first read by :func:`parse_head`, which accepts only the plainest
  form: ``HTTP/1.1``, a Content-Length body of at most :data:`FAST_BODY_MAX`, token header names
  without ``_``, each at most once, no ``Expect``, ``Transfer-Encoding`` or ``Upgrade``, no
  ``Connection`` but ``keep-alive``, no ``%`` in the path, a head of at most :data:`HEAD_MAX`
  bytes. Anything else is put back in front of gunicorn's own parser, unread, and gunicorn
  serves it (and rejects what it rejects) as always. The environ is the one gunicorn builds for
  the same request, less ``gunicorn.socket``, ``wsgi.file_wrapper`` and ``wsgi.early_hints``;
  the access log and the ``pre_request``/``post_request`` hooks are skipped on this path (the
  extender uses none; with an access log configured every request takes gunicorn's path).

Measured with bench/bench_scheduler.py (docs/scheduling.md#speed); tested against plain gthread,
request by request, in tests/integration/test_gunicorn_worker.py.
"""

from __future__ import annotations

import io
import logging
import os
import re
import select
import time
from typing import Any

from gunicorn import SERVER
from gunicorn.http import wsgi
from gunicorn.http.message import TOKEN_RE
from gunicorn.util import hop_headers, http_date
from gunicorn.workers.gthread import ThreadWorker

LINGER_S = 0.01
# gunicorn's heartbeat: the worker sets a file's times (a system call) on every turn of its event
# loop, which on a busy extender is several times per pod; the arbiter only reads it against the
# timeout (120 s, vgpu/extender/server.py), so once a second is as good
NOTIFY_EVERY_S = 1.0
# "0" (or false/no/off) turns the short parser off: every request then goes through gunicorn's
SHORT_PARSER_ENV = "VGPU_EXTENDER_SHORT_PARSER"
HEAD_MAX = 8192  # kube-scheduler's heads are ~200 bytes; gunicorn's own limits apply past this
FAST_BODY_MAX = 4 * 1024 * 1024  # larger bodies stream through gunicorn's reader, as before
READ_SIZE = 65536

log = logging.getLogger(__name__)

_TOKEN = re.compile(rb"[!#$%&'*+\-.^`|~0-9A-Za-z]+")  # RFC 9110 token, less "_" (gunicorn drops those)
_TARGET = re.compile(rb"/[!$&'()*+,\-./0-9:;=@A-Z_a-z~]*(?:\?[!$%&'()*+,\-./0-9:;=?@A-Z_a-z~]*)?")
_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_HOP = {b"connection", b"expect", b"transfer-encoding", b"upgrade", b"te", b"trailer"}
_date = (0, "")


def _http_date() -> str:
    global _date
    now = int(time.time())
    stamp, text = _date
    if stamp != now:
        text = http_date(now)
        _date = (now, text)
    return text


def parse_head(head: bytes) -> tuple[str, str, dict[str, str], int] | None:
    """(method, request target, headers as WSGI environ keys, content length) of a plain request head.

    ``head`` is everything before the blank line. None when the request is anything but plain
    (see the module docstring): gunicorn's parser is then the one to read it.
    """
    if len(head) > HEAD_MAX:
        return None
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1":
        return None
    method, target = parts[0], parts[1]
    if method != b"POST" or not _TARGET.fullmatch(target):
        return None
    environ: dict[str, str] = {}
    length: int | None = None
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name) or not _VALUE.fullmatch(value):
            return None  # also a folded line (starts with a space) and a space before the colon
        low = name.lower()
        text = value.strip(b" \t").decode("latin-1")
        if low in _HOP and not (low == b"connection" and text.lower() == "keep-alive"):
            return None  # (keep-alive is HTTP/1.1's default: Python's clients still send it)
        if low == b"content-length":
            if length is not None or not text.isascii() or not text.isdigit():
                return None
            length = int(text)
            key = "CONTENT_LENGTH"
        elif low == b"content-type":
            key = "CONTENT_TYPE"
        else:
            key = "HTTP_" + name.decode("ascii").upper().replace("-", "_")
        if key in environ:
            return None  # repeated: gunicorn joins or refuses them
        environ[key] = text
    if length is None or length > FAST_BODY_MAX:
        return None
    return method.decode("ascii"), target.decode("ascii"), environ, length


def _readable_within(conn: Any, timeout_s: float) -> bool:
    """Whether the next request's bytes are there already (buffered) or arrive within timeout_s."""
    unreader = getattr(conn.parser, "unreader", None)
    buf = getattr(unreader, "buf", None)
    if buf is not None and buf.getvalue():
        return True
    pending = getattr(conn.sock, "pending", None)  # TLS records decrypted but not yet read
    if pending is not None and pending():
        return True
    try:
        poller = select.poll()
        poller.register(conn.sock.fileno(), select.POLLIN)
        return bool(poller.poll(timeout_s * 1000))
    except (OSError, ValueError):  # closed under us: gthread's own path deals with it
        return False


class _Fallback(Exception):
    """The request is not plain: gunicorn's parser reads it (from the bytes given back)."""


def short_parser_enabled() -> bool:
    return os.environ.get(SHORT_PARSER_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class LingeringThreadWorker(ThreadWorker):  # type: ignore[misc]
    linger_s = LINGER_S
    fast_path = short_parser_enabled()
    _base_environ: dict[str, Any] | None = None
    _notified = float("-inf")

    def notify(self) -> None:
        """Tell the arbiter the worker lives, at most every :data:`NOTIFY_EVERY_S`."""
        now = time.monotonic()
        if now - self._notified >= NOTIFY_EVERY_S:
            self._notified = now
            super().notify()

    def handle(self, conn: Any) -> Any:
        keep = self._serve_one(conn)
        while (
            keep is True
            and self.alive
            and not getattr(conn, "is_http2", False)
            and _readable_within(conn, self.linger_s)
        ):
            keep = self._serve_one(conn)
        return keep

    def _serve_one(self, conn: Any) -> Any:
        if not self._fast_ok(conn):
            return super().handle(conn)
        unreader = conn.parser.unreader
        data = unreader.buf.getvalue()
        unreader.buf = io.BytesIO()
        try:
            return self._serve_plain(conn, data)
        except _Fallback as back:
            unreader.unread(back.args[0])
            return self.fallback(conn)

    def fallback(self, conn: Any) -> Any:
        """gunicorn's own path for one request (a seam for the tests to count)."""
        return super().handle(conn)

    def _fast_ok(self, conn: Any) -> bool:
        """Whether gunicorn would keep the connection open after this request, and its state is as
        this worker knows it (gunicorn's path sets a connection up, so it takes the first request)."""
        return (
            self.fast_path
            and self.alive
            and getattr(conn, "initialized", False)
            and not getattr(conn, "is_http2", True)
            and isinstance(getattr(getattr(conn.parser, "unreader", None), "buf", None), io.BytesIO)
            and isinstance(conn.server, tuple)  # not a unix socket (SERVER_NAME comes from Host there)
            and bool(self.cfg.keepalive)
            and not self.cfg.accesslog
            and len(self.keepalived_conns) < self.max_keepalived
            and self.nr + 1 < self.max_requests
        )

    def _serve_plain(self, conn: Any, data: bytes) -> bool:
        sock = conn.sock
        sock.setblocking(True)
        try:
            while (end := data.find(b"\r\n\r\n")) < 0:
                if len(data) > HEAD_MAX:
                    raise _Fallback(data)
                chunk = sock.recv(READ_SIZE)
                if not chunk:
                    if data:
                        raise _Fallback(data)  # gunicorn reports the half request as it does
                    return False  # the client closed between requests
                data += chunk
        except OSError:
            raise _Fallback(data) from None  # gunicorn's path meets the error and deals with it
        parsed = parse_head(data[:end])
        if parsed is None:
            raise _Fallback(data)
        method, target, headers, length = parsed
        got = bytearray(data[end + 4 :])
        try:
            while len(got) < length:
                chunk = sock.recv(max(READ_SIZE, length - len(got)))
                if not chunk:
                    return False  # the client went away mid-body
                got += chunk
        except OSError:
            return False
        if len(got) > length:
            conn.parser.unreader.unread(bytes(got[length:]))  # a pipelined request: served next
            del got[length:]
        body = bytes(got)
        environ = self._environ(conn, method, target)
        environ.update(headers)
        environ["wsgi.input"] = io.BytesIO(body)
        self.nr += 1
        return self._respond(conn, environ)

    def _environ(self, conn: Any, method: str, target: str) -> dict[str, Any]:
        """What gunicorn's ``wsgi.create`` puts in the environ for a plain request over TCP."""
        base = self._base_environ
        if base is None:
            base = self._base_environ = wsgi.base_environ(self.cfg)
            base["wsgi.multithread"] = True
            base["wsgi.url_scheme"] = "https" if self.cfg.is_ssl else "http"
            base["SCRIPT_NAME"] = ""
            base["SERVER_PROTOCOL"] = "HTTP/1.1"
            base.pop("wsgi.file_wrapper", None)  # its writer is gunicorn's Response, not used here
        environ = dict(base)
        path, _, query = target.partition("?")
        environ["REQUEST_METHOD"] = method
        environ["RAW_URI"] = target
        environ["PATH_INFO"] = path
        environ["QUERY_STRING"] = query
        environ["SERVER_NAME"], environ["SERVER_PORT"] = str(conn.server[0]), str(conn.server[1])
        environ["gunicorn.socket"] = conn.sock  # as gunicorn's: the TLS peer (vgpu.extender.app)
        client = conn.client
        if isinstance(client, tuple):
            environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = str(client[0]), str(client[1])
        else:
            environ["REMOTE_ADDR"] = client.decode() if isinstance(client, bytes) else str(client)
        return environ

    def _respond(self, conn: Any, environ: dict[str, Any]) -> bool:
        started: list[Any] = []
        written: list[bytes] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            if exc_info is not None and started:
                raise exc_info[1].with_traceback(exc_info[2])
            started[:] = [status, headers]
            return written.append

        try:
            result = self.wsgi(environ, start_response)
            try:
                chunks = [bytes(c) for c in result]
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            if not started:
                raise RuntimeError("the application returned without calling start_response")
            body = b"".join([*written, *chunks])
            head = _response_head(started[0], started[1], len(body))
        except Exception as err:  # as gunicorn: the client gets a 500, the log the traceback
            self.handle_error(None, conn.sock, conn.client, err)
            return False
        try:
            conn.sock.sendall(head + body)
        except OSError:
            return False  # the client went away: nothing to tell it
        return True


def _response_head(status: str, headers: list[tuple[str, str]], length: int) -> bytes:
    """The status line and headers, as gunicorn's Response writes them for a kept-alive connection.

    Server, Date and Connection first, then the app's headers less hop-by-hop ones and its own
    Server and Date (gunicorn drops those too, and keeps the connection open whatever the app's
    ``Connection`` says); Content-Length last when the app left it out (gunicorn would use chunked
    coding there: the body is all here, so its length is known).
    """
    code = status[:3]
    if not code.isdigit() or status[3:4] != " " or not wsgi.HEADER_VALUE_RE.fullmatch(status):
        raise ValueError(f"invalid status line from the application: {status!r}")
    lines = []
    has_length = False
    for name, value in headers:
        if not TOKEN_RE.fullmatch(name) or not wsgi.HEADER_VALUE_RE.fullmatch(value):
            raise ValueError(f"invalid response header from the application: {name!r}")
        low = name.lower()
        if low in hop_headers:  # gunicorn writes its own Server, Date and Connection
            continue
        if low == "content-length":
            has_length = True
        lines.append(name + ": " + value.strip(" \t"))
    if not has_length and code[0] != "1" and code not in ("204", "304"):
        lines.append(f"Content-Length: {length}")
    first = ["HTTP/1.1 " + status, "Server: " + SERVER, "Date: " + _http_date(), "Connection: keep-alive"]
    return "\r\n".join([*first, *lines, "", ""]).encode("latin-1")
