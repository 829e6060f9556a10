"""HTTP/1.1 to the API server for the two calls made per scheduled pod: the Binding, and watches.

The generated client goes through urllib3 and ``http.client``, which parse every response's
headers with the ``email`` package: on this project's 2-core VM a kept-alive HTTPS Binding POST
cost about 1.1 ms of CPU through urllib3, 0.6 ms through ``http.client`` and 0.2 ms written
straight to the socket (``bench/bench_kube_client.py`` and docs/scheduling.md#speed). In the
extender that CPU is taken under the GIL that kube-scheduler's next ``filter`` call waits for, so
the Binding and the watches (several pod events per scheduled pod) speak HTTP/1.1 here, and every
other call stays on the generated client.

Only what the API server sends is handled: ``Content-Length`` or chunked bodies, keep-alive
unless the server says ``Connection: close``. A request on a kept-alive connection that the server
had already closed (the write fails, or the connection ends before any byte of the answer) is sent
once more on a new connection; a timeout never is, since the server may be working on it.
A kubeconfig with a proxy keeps the generated client for everything (:meth:`Wire.from_configuration`
returns None).
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
RECV_BYTES = 256 * 1024


class WireError(OSError):
    """The connection failed, or the server's answer is not HTTP/1.1 as we read it."""


class _Stale(WireError):
    """A kept-alive connection turned out to be closed before the request reached the server."""


# what writing to a kept-alive connection raises when the server has already closed it
_CLOSED = (BrokenPipeError, ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError)


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    headers: dict[str, str]  # names lower-cased
    body: bytes


class _Reader:
    """Buffered reads from a socket: lines ending in CRLF, exact byte counts, the rest."""

    __slots__ = ("sock", "buf", "received")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.received = 0  # bytes of this answer read from the socket so far

    def _fill(self) -> None:
        try:
            data = self.sock.recv(RECV_BYTES)
        except ConnectionResetError as err:
            if self.received == 0:
                raise _Stale(f"the server reset the connection before answering: {err}") from err
            raise
        if not data:
            if self.received == 0:
                raise _Stale("the server closed the connection before answering")
            raise WireError("the server closed the connection in the middle of an answer")
        self.received += len(data)
        self.buf += data

    def until(self, marker: bytes, limit: int) -> bytes:
        """Bytes up to and without ``marker``, which is consumed too."""
        start = 0
        while True:
            at = self.buf.find(marker, start)
            if at >= 0:
                out = bytes(self.buf[:at])
                del self.buf[: at + len(marker)]
                return out
            if len(self.buf) > limit:
                raise WireError(f"no {marker!r} within {limit} bytes of the answer")
            start = max(0, len(self.buf) - len(marker) + 1)
            self._fill()

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def to_eof(self, limit: int) -> bytes:
        while True:
            if len(self.buf) > limit:
                raise WireError(f"answer larger than {limit} bytes")
            try:
                self._fill()
            except WireError:
                out = bytes(self.buf)
                self.buf.clear()
                return out

    def chunks(self) -> Iterator[bytes]:
        """A chunked body's chunks, as they arrive; ends after the last (empty) chunk."""
        while True:
            line = self.until(b"\r\n", 1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise WireError(f"malformed chunk size {line[:40]!r}") from None
            if size < 0:
                raise WireError(f"malformed chunk size {line[:40]!r}")
            if size == 0:
                while self.until(b"\r\n", MAX_HEADER_BYTES):  # trailers, then the empty line
                    pass
                return
            data = self.exact(size)
            if self.exact(2) != b"\r\n":
                raise WireError("chunk not followed by CRLF")
            yield data


def _head(reader: _Reader) -> tuple[int, str, dict[str, str], bool]:
    """(status, reason, headers, keep-alive) of the answer's head; 1xx answers are skipped."""
    while True:
        raw = reader.until(b"\r\n\r\n", MAX_HEADER_BYTES)
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise WireError(f"not an HTTP/1.x answer: {lines[0][:60]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            raise WireError(f"malformed status line {lines[0][:60]!r}") from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise WireError(f"malformed header line {line[:60]!r}")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        if 100 <= status < 200:
            continue
        reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
        keep = parts[0] == b"HTTP/1.1" and headers.get("connection", "").lower() != "close"
        return status, reason, headers, keep


def _body(reader: _Reader, status: int, headers: Mapping[str, str], keep: bool) -> tuple[bytes, bool]:
    if status in (204, 304):
        return b"", keep
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts, size = [], 0
        for chunk in reader.chunks():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise WireError(f"answer larger than {MAX_BODY_BYTES} bytes")
            parts.append(chunk)
        return b"".join(parts), keep
    length = headers.get("content-length")
    if length is not None:
        try:
            n = int(length)
        except ValueError:
            raise WireError(f"malformed Content-Length {length[:40]!r}") from None
        if not 0 <= n <= MAX_BODY_BYTES:
            raise WireError(f"Content-Length {n} out of range")
        return reader.exact(n), keep
    return reader.to_eof(MAX_BODY_BYTES), False


def split_lines(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The non-empty newline-separated lines of a body that arrives in ``pieces`` (a watch)."""
    pending = bytearray()
    for piece in pieces:
        pending += piece
        start = 0
        while True:
            at = pending.find(b"\n", start)
            if at < 0:
                break
            if at > start:
                yield bytes(pending[start:at])
            start = at + 1
        del pending[:start]
        if len(pending) > MAX_BODY_BYTES:
            raise WireError(f"a line longer than {MAX_BODY_BYTES} bytes")


class Wire:
    """Kept-alive connections to one API server, shared by threads (at most ``pool_size`` idle)."""

    def __init__(
        self,
        url: str,
        context: ssl.SSLContext | None,
        server_hostname: str | None = None,
        pool_size: int = 32,
        connect_timeout_s: float = 10.0,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"API server URL {url!r}: expected http(s)://host[:port][/path]")
        if parts.scheme == "https" and context is None:
            raise ValueError("an https API server needs an SSL context")
        default = 443 if parts.scheme == "https" else 80
        self.host = parts.hostname
        self.port = parts.port or default
        self.prefix = parts.path.rstrip("/")
        self.context = context if parts.scheme == "https" else None
        self.server_hostname = server_hostname or self.host
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if self.port == default else f"{host}:{self.port}"
        self.pool_size = pool_size
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[socket.socket] = []
        self._streams: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_configuration(cls, cfg: Any, pool_size: int = 32) -> Wire | None:
        """From a ``kubernetes.client.Configuration`` as the generated client reads it; None with a proxy."""
        if getattr(cfg, "proxy", None):
            return None
        context: ssl.SSLContext | None = None
        if str(cfg.host).startswith("https"):
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            if cfg.verify_ssl:
                if cfg.ssl_ca_cert or getattr(cfg, "ca_cert_data", None):
                    context.load_verify_locations(
                        cafile=cfg.ssl_ca_cert or None, cadata=getattr(cfg, "ca_cert_data", None) or None
                    )
                else:
                    context.load_default_certs()
                context.check_hostname = cfg.assert_hostname is not False
            else:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if cfg.cert_file:
                context.load_cert_chain(cfg.cert_file, cfg.key_file or None)
        return cls(cfg.host, context, getattr(cfg, "tls_server_name", None), pool_size)

    # -- connections ------------------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        if self._closed:
            raise WireError("client closed")
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=self.server_hostname)
        except BaseException:
            sock.close()
            raise
        return sock

    def _take(self) -> socket.socket | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _give(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.pool_size:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        """Close idle connections, and end running streams (their readers see the stream end)."""
        with self._lock:
            self._closed = True
            socks, self._idle = self._idle, []
            streams = list(self._streams)
        for s in socks:
            s.close()
        for s in streams:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _request_bytes(self, method: str, path: str, headers: Mapping[str, str], body: bytes | None) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("host", "content-length")]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head + body if body else head

    # -- calls ------------------------------------------------------------------------------------
    def request(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes | None, timeout_s: float
    ) -> Response:
        """One request and its whole answer; :class:`WireError` (an ``OSError``) when it fails."""
        data = self._request_bytes(method, path, headers, body)
        reused = self._take()
        sock = reused
        while True:
            if sock is None:
                sock = self._connect()
            try:
                sock.settimeout(timeout_s)
                try:
                    sock.sendall(data)
                except _CLOSED as err:
                    raise _Stale(str(err)) from err
                reader = _Reader(sock)
                status, reason, hdrs, keep = _head(reader)
                body_out, keep = _body(reader, status, hdrs, keep)
            except _Stale:
                sock.close()
                if reused is not None:  # the server had closed it while idle: once more, fresh
                    reused = sock = None
                    continue
                raise
            except BaseException:
                sock.close()
                raise
            if keep and not reader.buf:
                self._give(sock)
            else:
                sock.close()
            return Response(status, reason, hdrs, body_out)

    def stream(
        self, path: str, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[Response, Iterator[bytes]]:
        """A GET whose body is read as it arrives (a watch), on its own connection.

        Returns the answer's head (``body`` empty; the whole body when the status is not 200) and
        an iterator over the body's newline-separated lines. Each read waits up to ``timeout_s``.
        """
        sock = self._connect()
        with self._lock:
            self._streams.add(sock)
        try:
            sock.settimeout(timeout_s)
            sock.sendall(self._request_bytes("GET", path, headers, None))
            reader = _Reader(sock)
            status, reason, hdrs, keep = _head(reader)
            if status != 200:
                body, _ = _body(reader, status, hdrs, False)
                self._forget(sock)
                return Response(status, reason, hdrs, body), iter(())
        except BaseException:
            self._forget(sock)
            raise
        return Response(status, reason, hdrs, b""), self._lines(sock, reader, hdrs)

    def _lines(self, sock: socket.socket, reader: _Reader, headers: Mapping[str, str]) -> Iterator[bytes]:
        try:
            if "chunked" in headers.get("transfer-encoding", "").lower():
                pieces: Iterator[bytes] = reader.chunks()
            else:
                pieces = self._raw(reader)
            yield from split_lines(pieces)
        finally:
            self._forget(sock)

    @staticmethod
    def _raw(reader: _Reader) -> Iterator[bytes]:
        if reader.buf:
            yield bytes(reader.buf)
            reader.buf.clear()
        while True:
            data = reader.sock.recv(RECV_BYTES)
            if not data:
                return
            yield data

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._streams.discard(sock)
        sock.close()
