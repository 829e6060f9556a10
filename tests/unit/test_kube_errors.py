"""The Kubernetes client's errors are one line that says what failed and why, whichever path the
call took (the generated client over urllib3, or vgpu.kube.wire), never urllib3's own exceptions."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from vgpu.core.errors import KubeError
from vgpu.kube.client import Kube


def kubeconfig(path: Path, server: str) -> str:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}', insecure-skip-tls-verify: true}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    return str(path)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def plain_http() -> Iterator[int]:
    """A plain-HTTP server answering 404 with a page of HTML to everything."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


CALLS = {
    "list nodes (wire)": lambda k: k.list_node_metadata(),
    "list pods (urllib3)": lambda k: k.list_pods(),
    "read a lease (urllib3)": lambda k: k.get_lease("kube-system", "x"),
    "bind (wire)": lambda k: k.bind_pod("ns", "p", "uid", "n1"),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_closed_port_is_one_line_naming_the_server_and_refused(tmp_path: Path, call: str) -> None:
    port = closed_port()
    kube = Kube(kubeconfig(tmp_path / "kc", f"https://127.0.0.1:{port}"))
    with pytest.raises(KubeError) as caught:
        CALLS[call](kube)
    message = str(caught.value)
    assert f"cannot reach the API server at https://127.0.0.1:{port} (connection refused)" in message
    assert "\n" not in message and "MaxRetryError" not in message
    assert caught.value.unreachable and caught.value.status is None


def test_tls_to_a_plain_http_server_says_tls(tmp_path: Path, plain_http: int) -> None:
    kube = Kube(kubeconfig(tmp_path / "kc", f"https://127.0.0.1:{plain_http}"))
    for call in (kube.list_pods, kube.list_node_metadata):
        with pytest.raises(KubeError, match=r"cannot reach the API server at .* \(TLS: ") as caught:
            call()
        assert "\n" not in str(caught.value) and caught.value.unreachable


def test_an_http_error_page_is_one_shortened_line(tmp_path: Path, plain_http: int) -> None:
    kube = Kube(kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{plain_http}"))
    with pytest.raises(KubeError, match="list pods: HTTP 404: ") as caught:
        kube.list_pods()
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400
    assert caught.value.status == 404 and not caught.value.unreachable


def test_a_missing_or_broken_kubeconfig_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(
        KubeError, match=f"^cannot load Kubernetes credentials from {tmp_path / 'none'}: no such file$"
    ):
        Kube(str(tmp_path / "none"))
    (tmp_path / "bad").write_text("clusters: [\n")
    with pytest.raises(KubeError, match="cannot load Kubernetes credentials from") as caught:
        Kube(str(tmp_path / "bad"))
    assert "\n" not in str(caught.value)
