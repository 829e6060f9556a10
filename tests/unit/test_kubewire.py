"""vgpu.kube.wire against a scripted HTTP/1.1 server on a real socket (plain TCP and verified TLS).

The API server never sends a malformed answer or closes a kept-alive connection on demand, so
those cases are scripted here; the calls against the real API server are in
tests/e2e/test_kube_client.py.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s
from vgpu_sandbox.pki import CertificateAuthority

from vgpu.kube.wire import Wire, WireError

# a handler reads one request from the connection and answers (or not); False ends the connection
Handler = Callable[[socket.socket, bytes, int], bool]


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        got = conn.recv(65536)
        if not got:
            return b""
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


class Server:
    """Accepts connections; each request is handed to ``handler`` with the connection's number."""

    def __init__(self, handler: Handler, context: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.context = context
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.requests: list[bytes] = []
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        try:
            if self.context is not None:
                conn = self.context.wrap_socket(conn, server_side=True)
            self.open.append(conn)
            while True:
                request = read_request(conn)
                if not request:
                    return
                self.requests.append(request)
                if not self.handler(conn, request, number):
                    return
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.listener.close()
        for c in self.open:
            try:
                c.close()
            except OSError:
                pass


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(handler: Handler, context: ssl.SSLContext | None = None) -> Server:
        servers.append(Server(handler, context))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def answer(status: str, body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def chunked(status: str, pieces: list[bytes]) -> bytes:
    out = f"HTTP/1.1 {status}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    for p in pieces:
        out += f"{len(p):x}\r\n".encode() + p + b"\r\n"
    return out + b"0\r\n\r\n"


def wire_to(server: Server, **kw: object) -> Wire:
    return Wire(f"http://127.0.0.1:{server.port}", None, **kw)  # type: ignore[arg-type]


def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given(serve) -> None:
    server = serve(lambda c, r, n: c.sendall(answer("201 Created", b'{"ok":1}')) or True)
    wire = wire_to(server)
    for i in range(3):
        reply = wire.request("POST", f"/x/{i}", {"Authorization": "Bearer t"}, b'{"a":1}', 5)
        assert (reply.status, reply.reason, reply.body) == (201, "Created", b'{"ok":1}')
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /x/0 HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:%d\r\n" % server.port in first
    assert b"\r\nAuthorization: Bearer t\r\n" in first
    assert b"\r\nContent-Length: 7\r\n" in first and first.endswith(b'\r\n\r\n{"a":1}')


def test_chunked_answer_is_joined(serve) -> None:
    server = serve(lambda c, r, n: c.sendall(chunked("200 OK", [b'{"a":', b"1", b"}"])) or True)
    reply = wire_to(server).request("GET", "/", {}, None, 5)
    assert reply.body == b'{"a":1}'


def test_connection_close_is_not_reused(serve) -> None:
    server = serve(lambda c, r, n: c.sendall(answer("200 OK", b"x", "Connection: close\r\n")) and False)
    wire = wire_to(server)
    assert [wire.request("GET", "/", {}, None, 5).body for _ in range(2)] == [b"x", b"x"]
    assert server.connections == 2


def test_idle_connection_closed_by_server_is_retried_once_on_a_new_one(serve) -> None:
    # the first connection answers once and is then closed by the server, as an idle timeout does
    def handler(conn: socket.socket, request: bytes, number: int) -> bool:
        conn.sendall(answer("201 Created", b"n%d" % number))
        return number != 1

    server = serve(handler)
    wire = wire_to(server)
    assert wire.request("POST", "/a", {}, b"1", 5).body == b"n1"
    time.sleep(0.2)  # the server has closed connection 1 by now
    assert wire.request("POST", "/b", {}, b"2", 5).body == b"n2"
    assert [r.split(b" ")[1] for r in server.requests] == [b"/a", b"/b"]  # /b reached it once


def test_a_fresh_connection_closed_before_answering_is_an_error_not_a_retry(serve) -> None:
    server = serve(lambda c, r, n: False)  # reads the request, closes without a word
    with pytest.raises(WireError, match="closed the connection before answering"):
        wire_to(server).request("POST", "/", {}, b"1", 5)
    assert server.connections == 1


def test_timeout_is_raised_and_never_retried(serve) -> None:
    def silent(conn: socket.socket, request: bytes, number: int) -> bool:
        time.sleep(3)
        return False

    server = serve(silent)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        wire_to(server).request("POST", "/", {}, b"1", 0.3)
    assert time.monotonic() - start < 2
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"SMTP ready\r\n\r\n", "not an HTTP/1.x answer"),
        (b"HTTP/1.1 abc OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n", "out of range"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "in the middle of an answer"),
    ],
)
def test_malformed_answers_raise_wire_error(serve, raw: bytes, message: str) -> None:
    server = serve(lambda c, r, n: c.sendall(raw) and False)
    with pytest.raises(WireError, match=message):
        wire_to(server).request("GET", "/", {}, None, 5)


def test_answer_without_length_is_read_to_the_end_and_the_connection_dropped(serve) -> None:
    server = serve(lambda c, r, n: c.sendall(b"HTTP/1.0 200 OK\r\n\r\nall of it") and False)
    wire = wire_to(server)
    assert wire.request("GET", "/", {}, None, 5).body == b"all of it"
    assert wire.request("GET", "/", {}, None, 5).body == b"all of it"
    assert server.connections == 2


def test_stream_yields_lines_across_chunk_boundaries(serve) -> None:
    pieces = [b'{"type":"ADDED"}\n{"ty', b'pe":"MODIFIED"}\n', b'{"type":"DELETED"}\n\n']
    server = serve(lambda c, r, n: c.sendall(chunked("200 OK", pieces)) and False)
    head, lines = wire_to(server).stream("/w?watch=true", {"Accept": "application/json"}, 5)
    assert head.status == 200
    assert list(lines) == [b'{"type":"ADDED"}', b'{"type":"MODIFIED"}', b'{"type":"DELETED"}']
    assert server.requests[0].startswith(b"GET /w?watch=true HTTP/1.1\r\n")


def test_stream_error_status_carries_the_body(serve) -> None:
    server = serve(lambda c, r, n: c.sendall(answer("410 Gone", b'{"message":"too old"}')) or True)
    head, lines = wire_to(server).stream("/w", {}, 5)
    assert (head.status, head.body, list(lines)) == (410, b'{"message":"too old"}', [])


def test_close_ends_a_running_stream(serve) -> None:
    def handler(conn: socket.socket, request: bytes, number: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nline\n\r\n")
        time.sleep(30)
        return False

    server = serve(handler)
    wire = wire_to(server)
    _, lines = wire.stream("/w", {}, 60)
    assert next(lines) == b"line"
    threading.Timer(0.3, wire.close).start()
    start = time.monotonic()
    with pytest.raises(OSError):
        next(lines)
    assert time.monotonic() - start < 5


def _tls(tmp_path: Path) -> tuple[CertificateAuthority, ssl.SSLContext]:
    ca = CertificateAuthority(tmp_path / "pki")
    pair = ca.issue("apiserver", ["127.0.0.1"])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pair.cert, pair.key)
    return ca, ctx


def test_tls_from_configuration_verifies_the_server(serve, tmp_path: Path) -> None:
    ca, server_ctx = _tls(tmp_path)
    server = serve(lambda c, r, n: c.sendall(answer("200 OK", b"tls")) or True, server_ctx)
    cfg = k8s.Configuration()
    cfg.host = f"https://127.0.0.1:{server.port}"
    cfg.ssl_ca_cert = str(ca.cert_path)
    wire = Wire.from_configuration(cfg)
    assert wire is not None and wire.request("GET", "/", {}, None, 5).body == b"tls"

    other = CertificateAuthority(tmp_path / "other")
    cfg.ssl_ca_cert = str(other.cert_path)
    wrong = Wire.from_configuration(cfg)
    assert wrong is not None
    with pytest.raises(ssl.SSLCertVerificationError):
        wrong.request("GET", "/", {}, None, 5)


def test_a_proxy_keeps_the_generated_client() -> None:
    cfg = k8s.Configuration()
    cfg.host = "https://10.0.0.1:6443"
    cfg.proxy = "http://proxy:3128"
    assert Wire.from_configuration(cfg) is None


def test_bad_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="expected http"):
        Wire("ftp://x", None)
    with pytest.raises(ValueError, match="needs an SSL context"):
        Wire("https://x", None)
