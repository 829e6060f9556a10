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

import json
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
from typing import Any

import pytest
from vgpu_sandbox.pki import CertificateAuthority
from vgpu_sandbox.procs import free_port

from tests import support

APP = textwrap.dedent(
    """
    import json
    import threading
    from gunicorn.workers.gthread import ThreadWorker
    from vgpu.extender.worker import LingeringThreadWorker

    HANDOFFS = [0]
    FALLBACKS = [0]

    class Counting:
        def enqueue_req(self, conn):
            HANDOFFS[0] += 1
            super().enqueue_req(conn)

    class Long(Counting, LingeringThreadWorker):
        linger_s = 2.0

        def fallback(self, conn):
            FALLBACKS[0] += 1
            return super().fallback(conn)

    class Short(Counting, LingeringThreadWorker):
        linger_s = 0.2

    class Plain(Counting, ThreadWorker):
        pass

    SKIP = {
        "wsgi.input", "wsgi.errors", "wsgi.file_wrapper", "wsgi.early_hints", "gunicorn.socket", "REMOTE_PORT"
    }

    def app(environ, start_response):
        path = environ["PATH_INFO"]
        if path == "/boom":
            raise RuntimeError("the app failed")
        if path.startswith("/env"):  # what the app was given, and which parser read it
            body = environ["wsgi.input"].read()
            seen = {
                k: v if isinstance(v, (str, bool, int)) else repr(v)
                for k, v in environ.items()
                if k not in SKIP
            }
            answer = json.dumps({"environ": seen, "body": body.decode("latin-1"), "fallbacks": FALLBACKS[0]})
            data = answer.encode()
            length = str(len(data))
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", length)])
            return [data]
        if path == "/count":
            data = str(FALLBACKS[0]).encode()
            start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(data)))])
            return [data]
        if path == "/hop":  # headers gunicorn drops or passes on as they are
            start_response("200 OK", [
                ("X_Under", "1"), ("Connection", "close"), ("Server", "mine"), ("Date", "then"),
                ("Keep-Alive", "timeout=5"), ("X-Spaced", "  v  "), ("Content-Length", "2"),
            ])
            return [b"ok"]
        if path == "/nolength":  # in pieces, without a Content-Length: the server frames it
            start_response("200 OK", [("Content-Type", "text/plain"), ("Connection", "keep-alive")])
            return [b"in ", b"three ", b"pieces"]
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
    proc = support.start(argv, log)
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
    support.stop(server.proc, grace=15)


def request(path: str, body: bytes = b"x") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]  # lower-case names, in order, less Date
    body: bytes
    closed: bool  # the server closed the connection after it


class Reader:
    """Answers off one connection, in order (pipelined answers may arrive in one read)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed mid-answer: {self.buf!r}")
        self.buf += chunk

    def take(self, size: int) -> bytes:
        while len(self.buf) < size:
            self.more()
        data, self.buf = self.buf[:size], self.buf[size:]
        return data

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self.more()
        data, _, self.buf = self.buf.partition(b"\r\n")
        return data

    def answer(self) -> Answer:
        """The next final answer (a 100 Continue before it is passed over), framed by
        Content-Length, chunked coding or the connection's end."""
        while True:
            while b"\r\n\r\n" not in self.buf:
                self.more()
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            if status >= 200:
                break
        headers = [(k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:])]
        fields = dict(headers)
        closed = False
        if "content-length" in fields:
            body = self.take(int(fields["content-length"]))
        elif fields.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self.line().split(b";")[0], 16):
                body += self.take(size)
                self.take(2)
            self.take(2)
        else:
            while chunk := self.sock.recv(65536):
                self.buf += chunk
            body, self.buf, closed = self.buf, b"", True
        return Answer(status, [h for h in headers if h[0] != "date"], body, closed)


def read_answer(sock: socket.socket) -> tuple[int, str, int]:
    """The 200 answer to the one request sent: (thread id, path, hand-offs so far)."""
    reader = Reader(sock)
    answer = reader.answer()
    assert answer.status == 200, answer
    assert reader.buf == b"", "more bytes than one answer (pipelined answers are read one at a time)"
    ident, path, handoffs = answer.body.decode().split(" ")
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
        reader = Reader(sock)
        answers = [reader.answer().body.decode().split(" ")[1] for _ in range(3)]  # the paths
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


# -- the short parser: each request answered as plain gthread answers it --------------------------


def read_http(sock: socket.socket) -> Answer:
    """The one answer to the one request sent, and whether the server then closed the connection."""
    reader = Reader(sock)
    answer = reader.answer()
    assert reader.buf == b"", "bytes after the answer"
    if not answer.closed:
        sock.settimeout(0.3)
        try:
            answer.closed = sock.recv(1) == b""
        except TimeoutError:
            pass
        finally:
            sock.settimeout(10)
    return answer


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return f"POST {path} HTTP/1.1\r\nHost: t\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


BIG = 4 * 1024 * 1024 + 1  # one byte over the short parser's body limit
# (what the second request on a connection is, its bytes, whether the short parser takes it)
CASES = [
    ("plain", post("/env/a", b'{"x": 1}', "Content-Type: application/json"), True),
    ("a query", post("/env/q?a=1&b=%20x", b"hi"), True),
    ("an empty body", post("/env", b""), True),
    (
        "lower-case names, spaces around values, more headers",
        b"POST /env HTTP/1.1\r\nhost: h\r\ncontent-length: 3\r\ncontent-type: text/x\r\n"
        b"X-Trace-Id:  abc \r\nAccept: */*\r\nUser-Agent: Go-http-client/1.1\r\n\r\nabc",
        True,
    ),
    ("GET without a body", b"GET /env HTTP/1.1\r\nHost: h\r\n\r\n", False),
    ("PUT", b"PUT /env HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi", False),
    (
        "chunked",
        b"POST /env HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        False,
    ),
    ("Expect", post("/env", b"hi", "Expect: 100-continue"), False),
    ("HTTP/1.0", b"POST /env HTTP/1.0\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi", False),
    ("a percent-encoded path", post("/env/a%20b", b""), False),
    ("a repeated header", post("/env", b"", "X-A: 1", "X-A: 2"), False),
    ("an underscore in a name", post("/env", b"", "X_A: 1"), False),
    ("Connection: close", post("/env", b"", "Connection: close"), False),
    ("Connection: keep-alive, as Python's clients send", post("/env", b"", "Connection: keep-alive"), True),
    (
        "two lengths",
        b"POST /env HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi",
        False,
    ),
    ("a signed length", b"POST /env HTTP/1.1\r\nHost: h\r\nContent-Length: +2\r\n\r\nhi", False),
    ("a folded header", post("/env", b"", "X-A: 1", " 2"), False),
    ("a space in a name", post("/env", b"", "X A: 1"), False),
    ("a space before the colon", post("/env", b"", "X-A : 1"), False),
    ("a control byte in a value", post("/env", b"", "X-A: a\x01b"), False),
    ("a head past the short parser's limit", post("/env", b"", "X-Long: " + "v" * 9000), False),
    ("a body past the short parser's limit", post("/env", b"z" * BIG), False),
    ("an answer with headers gunicorn drops", post("/hop", b""), True),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    plain = start(tmp_path_factory.mktemp("plain"), "Plain")
    ours = start(tmp_path_factory.mktemp("ours"), "Long")
    yield plain, ours
    stop(plain)
    stop(ours)


def fallbacks(server: Server) -> int:
    with server.connect() as sock:  # a connection's first request is gunicorn's anyway: not counted
        sock.sendall(post("/count", b""))
        return int(read_http(sock).body)


def second_request(server: Server, raw: bytes) -> Answer:
    """``raw`` on a connection that has served one request (the short parser's ground)."""
    with server.connect() as sock:
        sock.sendall(post("/warm", b"w"))
        read_answer(sock)
        sock.sendall(raw)
        return read_http(sock)


def comparable(answer: Answer) -> tuple[int, list[tuple[str, str]], Any, bool]:
    """The answer less what differs between two servers (their ports, the count of fallbacks)."""
    body: Any = answer.body
    headers = answer.headers
    if answer.body.startswith(b'{"environ"'):
        body = json.loads(answer.body)
        body.pop("fallbacks")
        body["environ"].pop("SERVER_PORT")
        headers = [h for h in headers if h[0] != "content-length"]  # the echoed port's digits
    return answer.status, headers, body, answer.closed


@pytest.mark.parametrize(("name", "raw", "fast"), CASES, ids=[c[0] for c in CASES])
def test_the_short_parser_answers_as_gthread_and_leaves_the_rest_to_it(
    pair: tuple[Server, Server], name: str, raw: bytes, fast: bool
) -> None:
    plain, ours = pair
    expected = comparable(second_request(plain, raw))
    before = fallbacks(ours)
    got = comparable(second_request(ours, raw))
    assert got == expected, name
    assert fallbacks(ours) - before == (0 if fast else 1), (
        "served by the short parser" if fast else "by gunicorn's"
    )


def test_the_environ_of_a_plain_request_is_what_the_app_expects(pair: tuple[Server, Server]) -> None:
    """Not only equal to gthread's: the values themselves (so a shared mistake shows too)."""
    _, ours = pair
    answer = second_request(ours, post("/env/x?k=v", b"payload", "Content-Type: text/plain", "X-Id: 7"))
    environ = json.loads(answer.body)["environ"]
    assert answer.status == 200
    assert json.loads(answer.body)["body"] == "payload"
    expected = {
        "REQUEST_METHOD": "POST", "PATH_INFO": "/env/x", "QUERY_STRING": "k=v", "RAW_URI": "/env/x?k=v",
        "SCRIPT_NAME": "", "SERVER_PROTOCOL": "HTTP/1.1", "CONTENT_TYPE": "text/plain", "CONTENT_LENGTH": "7",
        "HTTP_HOST": "t", "HTTP_X_ID": "7", "SERVER_NAME": "127.0.0.1", "SERVER_PORT": str(ours.port),
        "REMOTE_ADDR": "127.0.0.1", "wsgi.url_scheme": "http", "wsgi.multithread": True,
        "wsgi.run_once": False,
    }  # fmt: skip
    assert {k: environ.get(k) for k in expected} == expected


def test_an_answer_without_a_length_gets_one_and_the_connection_stays_open(
    pair: tuple[Server, Server],
) -> None:
    plain, ours = pair
    theirs = second_request(plain, post("/nolength", b""))
    mine = second_request(ours, post("/nolength", b""))
    assert mine.body == theirs.body == b"in three pieces"
    assert ("content-length", "15") in mine.headers
    assert ("connection", "keep-alive") in mine.headers
    assert not mine.closed


def test_an_app_error_is_a_500_and_the_server_goes_on(pair: tuple[Server, Server]) -> None:
    plain, ours = pair
    before = fallbacks(ours)
    mine = second_request(ours, post("/boom", b""))
    assert comparable(mine) == comparable(second_request(plain, post("/boom", b"")))
    assert mine.status == 500 and mine.closed
    assert fallbacks(ours) == before  # the short parser read it, and answered the error itself
    assert "the app failed" in ours.log.read_text()
    assert second_request(ours, post("/env", b"after")).status == 200


def test_plain_and_other_requests_pipelined_are_answered_in_order(pair: tuple[Server, Server]) -> None:
    _, ours = pair
    chunked = b"POST /env/2 HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nbb\r\n0\r\n\r\n"
    with ours.connect() as sock:
        sock.sendall(post("/warm", b"w"))
        read_answer(sock)
        sock.sendall(post("/env/1", b"a") + chunked + post("/env/3", b"ccc"))
        reader = Reader(sock)
        echoes = [json.loads(reader.answer().body) for _ in range(3)]
    assert [(e["environ"]["PATH_INFO"], e["body"]) for e in echoes] == [
        ("/env/1", "a"),
        ("/env/2", "bb"),
        ("/env/3", "ccc"),
    ]


def test_a_client_gone_mid_body_leaves_the_server_serving(pair: tuple[Server, Server]) -> None:
    _, ours = pair
    with ours.connect() as sock:
        sock.sendall(post("/warm", b"w"))
        read_answer(sock)
        sock.sendall(post("/env", b"0123456789")[:-5])  # half the body, then gone
    assert second_request(ours, post("/env", b"next")).status == 200
    assert ours.proc.poll() is None


def test_tls_requests_after_the_first_take_the_short_parser(tmp_path: Path) -> None:
    server = start(tmp_path, "Long", tls=True)
    try:
        with server.connect() as sock:
            for k in range(5):
                sock.sendall(post(f"/env/{k}", b"y" * 20000))
                echo = json.loads(read_http(sock).body)
                assert echo["environ"]["wsgi.url_scheme"] == "https"
                assert len(echo["body"]) == 20000
                assert echo["fallbacks"] == 0
    finally:
        stop(server)
