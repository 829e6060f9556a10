"""LingeringThreadWorker under real gunicorn: a connection's next request within the linger is
served by the thread that answered the last one, without going back through the main thread's
poller; later requests, pipelined requests, TLS, a client that goes away and a stop all behave
as gthread does.

The workers count their hand-offs to the thread pool (``enqueue_req``: one per accepted
connection, and in plain gthread one more per request on a kept-alive connection); the app
answers with the serving thread's id, its path and that count. A subclass with a long linger
(2 s) makes the outcome deterministic on a loaded machine; the production linger is 10 ms.
"""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vgpu.sandbox.pki import CertificateAuthority
from vgpu.sandbox.procs import free_port

APP = textwrap.dedent(
    """
    import threading
    from gunicorn.workers.gthread import ThreadWorker
    from vgpu.extender.worker import LingeringThreadWorker

    HANDOFFS = [0]

    class Counting:
        def enqueue_req(self, conn):
            HANDOFFS[0] += 1
            super().enqueue_req(conn)

    class Long(Counting, LingeringThreadWorker):
        linger_s = 2.0

    class Short(Counting, LingeringThreadWorker):
        linger_s = 0.2

    class Plain(Counting, ThreadWorker):
        pass

    def app(environ, start_response):
        if environ.get("CONTENT_LENGTH"):
            environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
        body = f"{threading.get_ident()} {environ['PATH_INFO']} {HANDOFFS[0]}".encode()
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]
    """
)


@dataclass
class Server:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    tls: ssl.SSLContext | None = None

    def connect(self) -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        if self.tls is None:
            return raw
        return self.tls.wrap_socket(raw, server_hostname="127.0.0.1")


def start(tmp: Path, worker: str, *, tls: bool = False, threads: int = 4) -> Server:
    (tmp / "lingerapp.py").write_text(APP)
    port = free_port()
    log = tmp / f"gunicorn-{port}.log"
    argv = [
        sys.executable, "-m", "gunicorn", f"--worker-class=lingerapp.{worker}", f"--threads={threads}",
        "--workers=1", f"--bind=127.0.0.1:{port}", "--keep-alive=30", "--graceful-timeout=5",
        f"--chdir={tmp}", "lingerapp:app",
    ]  # fmt: skip
    context = None
    if tls:
        ca = CertificateAuthority(tmp / "pki")
        pair = ca.issue("server", ["127.0.0.1"])
        argv[-1:-1] = [f"--certfile={pair.cert}", f"--keyfile={pair.key}"]
        context = ssl.create_default_context(cafile=str(ca.cert_path))
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    server = Server(port, proc, log, context)
    deadline = time.monotonic() + 30
    while True:
        try:
            with server.connect():
                return server
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gunicorn did not start:\n" + log.read_text()) from None
            time.sleep(0.1)


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def request(path: str, body: bytes = b"x") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def read_answer(sock: socket.socket) -> tuple[int, str, int]:
    """One HTTP/1.1 answer with a Content-Length: (thread id, path, hand-offs so far)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before an answer")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    fields = dict(h.split(b":", 1) for h in head.split(b"\r\n")[1:])
    length = int(next(v for k, v in fields.items() if k.lower() == b"content-length"))
    while len(rest) < length:
        rest += sock.recv(65536)
    assert len(rest) == length, "more bytes than one answer (pipelined answers are read one at a time)"
    ident, path, handoffs = rest.decode().split(" ")
    return int(ident), path, int(handoffs)


@pytest.fixture
def long_linger(tmp_path: Path) -> Iterator[Server]:
    server = start(tmp_path, "Long")
    yield server
    stop(server)


def back_to_back(server: Server, count: int) -> tuple[set[int], int]:
    """``count`` requests in a row on one connection: (the threads that served them, hand-offs to
    the pool after the first request's)."""
    with server.connect() as sock:
        threads = set()
        counts = []
        for k in range(count):
            sock.sendall(request(f"/r{k}"))
            ident, path, handoffs = read_answer(sock)
            assert path == f"/r{k}"
            threads.add(ident)
            counts.append(handoffs)
    return threads, counts[-1] - counts[0]


def test_back_to_back_requests_stay_on_the_thread_that_served_the_first(long_linger: Server) -> None:
    threads, handoffs = back_to_back(long_linger, 20)
    assert len(threads) == 1, threads
    assert handoffs == 0  # none of the 19 follow-ups went back through the poller


def test_plain_gthread_hands_every_kept_alive_request_to_the_pool(tmp_path: Path) -> None:
    """The baseline the worker improves on (and proof that the count above can fail)."""
    server = start(tmp_path, "Plain")
    try:
        assert back_to_back(server, 20)[1] == 19
    finally:
        stop(server)


def test_pipelined_requests_are_each_answered_in_order(long_linger: Server) -> None:
    with long_linger.connect() as sock:
        sock.sendall(request("/a") + request("/b") + request("/c"))
        buf = b""
        answers: list[str] = []
        while len(answers) < 3:
            buf += sock.recv(65536)
            while b"\r\n\r\n" in buf:
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(rest) < length:
                    break
                answers.append(rest[:length].decode().split(" ")[1])  # the path
                buf = rest[length:]
    assert answers == ["/a", "/b", "/c"]


def test_other_connections_are_served_while_threads_linger(tmp_path: Path) -> None:
    server = start(tmp_path, "Long", threads=2)
    try:
        idle = [server.connect() for _ in range(2)]
        for k, sock in enumerate(idle):  # each leaves a thread lingering on its connection
            sock.sendall(request(f"/idle{k}"))
            read_answer(sock)
        with server.connect() as third:
            third.sendall(request("/third"))
            assert read_answer(third)[1] == "/third"  # once a linger ran out (2 s at most)
        for sock in idle:
            sock.close()
    finally:
        stop(server)


def test_a_connection_quiet_past_the_linger_is_still_served(tmp_path: Path) -> None:
    server = start(tmp_path, "Short")
    try:
        with server.connect() as sock:
            sock.sendall(request("/first"))
            first = read_answer(sock)[2]
            time.sleep(0.6)  # past the 0.2 s linger: the connection is back with the poller
            sock.sendall(request("/later"))
            _, path, handoffs = read_answer(sock)
            assert path == "/later"
            assert handoffs == first + 1  # the poller handed the quiet connection over again
    finally:
        stop(server)


def test_a_client_closing_while_its_thread_lingers_does_not_hurt_the_server(long_linger: Server) -> None:
    for _ in range(3):
        sock = long_linger.connect()
        sock.sendall(request("/bye"))
        read_answer(sock)
        sock.close()
    with long_linger.connect() as sock:
        sock.sendall(request("/still"))
        assert read_answer(sock)[1] == "/still"
    assert long_linger.proc.poll() is None
    assert "Traceback" not in long_linger.log.read_text()


def test_tls_back_to_back_requests_stay_on_one_thread(tmp_path: Path) -> None:
    server = start(tmp_path, "Long", tls=True)
    try:
        with server.connect() as sock:
            threads = set()
            counts = set()
            for k in range(10):
                sock.sendall(request(f"/t{k}", b"y" * 3000))
                ident, path, handoffs = read_answer(sock)
                assert path == f"/t{k}"
                threads.add(ident)
                counts.add(handoffs)
        assert len(threads) == 1
        assert len(counts) == 1  # no hand-off after the first request
    finally:
        stop(server)


def test_stop_with_a_thread_lingering_exits_promptly(long_linger: Server) -> None:
    sock = long_linger.connect()
    sock.sendall(request("/last"))
    read_answer(sock)
    start_s = time.monotonic()
    long_linger.proc.send_signal(signal.SIGTERM)
    long_linger.proc.wait(timeout=15)
    assert time.monotonic() - start_s < 8  # the linger (2 s) plus gthread's own stop linger (2 s)
    sock.close()
