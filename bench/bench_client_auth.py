"""What the extender's client certificate check costs per TLS handshake, on this machine's OpenSSL.

Run: .venv/bin/python bench/bench_client_auth.py [--handshakes 300] [--rounds 3]

The extender's server side as gunicorn builds it (``ssl.create_default_context(CLIENT_AUTH)``, an
ECDSA P-256 serving certificate from one CA, as the chart makes them), without and with the
client CA (``CERT_OPTIONAL``: a client certificate asked for and verified); a client that
presents the CA's client certificate in the second case, as kube-scheduler does with
``scheduler.extender.clientAuth``. Prints, interleaved by round, the server thread's CPU per
handshake (from the accept to the first byte read), and what reading the peer's certificate per
request costs (``getpeercert``, decoded and as DER). kube-scheduler keeps a few connections
alive and opens new ones when more calls are in flight (about one per two pods in a burst:
bench_scheduler.py ``--client-auth on|off`` gives the end-to-end figures). Asserts nothing.
"""

from __future__ import annotations

import argparse
import platform
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox"))

from vgpu_sandbox.pki import CertificateAuthority  # noqa: E402


def server_context(ca: CertificateAuthority, cert: Path, key: Path, client_auth: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(
        ssl.Purpose.CLIENT_AUTH, cafile=str(ca.cert_path) if client_auth else None
    )
    context.load_cert_chain(str(cert), str(key))
    context.verify_mode = ssl.CERT_OPTIONAL if client_auth else ssl.CERT_NONE
    return context


def handshakes(server: ssl.SSLContext, client: ssl.SSLContext, n: int) -> float:
    """Server-thread CPU ms per handshake over ``n`` fresh connections."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    spent = [0.0]

    def serve() -> None:
        for _ in range(n):
            conn, _ = listener.accept()
            started = time.thread_time()
            tls = server.wrap_socket(conn, server_side=True)
            tls.recv(1)
            spent[0] += time.thread_time() - started
            tls.close()

    thread = threading.Thread(target=serve)
    thread.start()
    for _ in range(n):
        with client.wrap_socket(
            socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1"
        ) as tls:
            tls.sendall(b"x")
    thread.join()
    listener.close()
    return spent[0] / n * 1000


def peercert_cost(server: ssl.SSLContext, client: ssl.SSLContext, calls: int = 20000) -> tuple[float, float]:
    """µs per ``getpeercert()`` and per ``getpeercert(True)`` on a verified connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    raw = socket.create_connection(("127.0.0.1", listener.getsockname()[1]))
    accepted, _ = listener.accept()
    done: dict[str, ssl.SSLSocket] = {}
    thread = threading.Thread(
        target=lambda: done.setdefault("s", server.wrap_socket(accepted, server_side=True))
    )
    thread.start()
    tls = client.wrap_socket(raw, server_hostname="127.0.0.1")
    thread.join()
    peer = done["s"]
    started = time.perf_counter()
    for _ in range(calls):
        peer.getpeercert()
    decoded = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(calls):
        peer.getpeercert(True)
    der = time.perf_counter() - started
    tls.close()
    peer.close()
    listener.close()
    return decoded / calls * 1e6, der / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handshakes", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {ssl.OPENSSL_VERSION}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-tls-") as tmp:
        ca = CertificateAuthority(Path(tmp) / "pki")
        serving = ca.issue("extender", ["127.0.0.1"])
        kube_scheduler = ca.issue("kube-scheduler-client", [], client=True)
        plain_client = ssl.create_default_context(cafile=str(ca.cert_path))
        cert_client = ssl.create_default_context(cafile=str(ca.cert_path))
        cert_client.load_cert_chain(str(kube_scheduler.cert), str(kube_scheduler.key))
        plain = server_context(ca, serving.cert, serving.key, False)
        checked = server_context(ca, serving.cert, serving.key, True)
        without, with_ = [], []
        for r in range(args.rounds):
            without.append(handshakes(plain, plain_client, args.handshakes))
            with_.append(handshakes(checked, cert_client, args.handshakes))
            print(
                f"round {r + 1}: server CPU per handshake {without[-1]:.3f} ms without the client "
                f"certificate, {with_[-1]:.3f} ms with it",
                flush=True,
            )
        print(
            f"median: {statistics.median(without):.3f} ms without, {statistics.median(with_):.3f} ms with "
            f"(+{statistics.median(with_) - statistics.median(without):.3f} ms per new connection)"
        )
        decoded, der = peercert_cost(checked, cert_client)
        print(f"per request: getpeercert() {decoded:.1f} µs, getpeercert(True) {der:.1f} µs (the extender's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
