"""The extender as it runs: the `vgpu extender` CLI, real gunicorn over HTTPS on a free port.

No API server here (its kubeconfig points at a closed port), so the extender stays "loading":
these tests cover what does not need cluster state (TLS, health, 400s, metrics, the CLI's checks).
Scheduling against a real control plane is in tests/e2e.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from vgpu_sandbox.pki import CertificateAuthority

from tests.support import start, stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    url: str
    metrics_url: str
    ca: Path
    proc: subprocess.Popen[bytes]
    log: Path


def _kubeconfig(path: Path) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    return path


def _run(tmp: Path, ca: CertificateAuthority, *extra: str) -> Running:
    pair = ca.issue("extender", ["127.0.0.1", "localhost"])
    port, mport = free_port(), free_port()
    log = tmp / "extender.log"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    argv = [
        sys.executable, "-m", "vgpu.commands.cli", "extender",
        "--kubeconfig", str(_kubeconfig(tmp / "kubeconfig")),
        "--listen", f"127.0.0.1:{port}",
        "--cert-file", str(pair.cert), "--key-file", str(pair.key),
        "--metrics-listen", f"127.0.0.1:{mport}",
        "--namespace", "kube-system", "--scheduler-name", "vgpu-scheduler", "--workers", "4",
        *extra,
    ]  # fmt: skip
    proc = start(argv, log, env)
    running = Running(
        f"https://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics", ca.cert_path, proc, log
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(running.url + "/healthz", verify=str(ca.cert_path), timeout=2).status_code == 200:
                return running
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"extender did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def extender(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("extender")
    running = _run(tmp, CertificateAuthority(tmp / "pki"))
    yield running
    stop(running.proc, grace=20)


def post(ext: Running, route: str, data: bytes) -> requests.Response:
    return requests.post(
        ext.url + route,
        data=data,
        headers={"Content-Type": "application/json"},
        verify=str(ext.ca),
        timeout=10,
    )


def test_it_serves_https_verified_by_the_ca_and_refuses_unverified_clients(extender: Running) -> None:
    assert requests.get(extender.url + "/healthz", verify=str(extender.ca), timeout=5).text == "ok\n"
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(extender.url + "/healthz", timeout=5)  # the system CAs do not know ours


def test_it_is_not_ready_and_answers_verbs_with_an_error_until_cluster_state_is_loaded(
    extender: Running,
) -> None:
    r = requests.get(extender.url + "/readyz", verify=str(extender.ca), timeout=5)
    assert r.status_code == 503 and "loading" in r.text
    pod = b'{"metadata":{"name":"p","uid":"u"},"spec":{"containers":[]}}'
    body = post(extender, "/filter", b'{"Pod":' + pod + b',"NodeNames":["a"]}').json()
    assert "loading" in body["Error"]


@pytest.mark.parametrize(
    ("route", "payload", "words"),
    [
        ("/filter", b"{", "not valid JSON"),
        ("/filter", b'{"Pod": 3, "NodeNames": []}', "ExtenderArgs.Pod"),
        ("/prioritize", b'{"Pod": {"metadata": {}, "spec": {}}, "NodeNames": [1]}', "NodeNames"),
        ("/bind", b'{"PodName": "p"}', "PodNamespace"),
        ("/webhook/mutate", b'{"request": []}', "AdmissionReview.request"),
        ("/webhook/validate", b"null", "AdmissionReview"),
    ],
)
def test_malformed_json_or_fields_get_400_with_error_naming_the_problem(
    extender: Running, route: str, payload: bytes, words: str
) -> None:
    r = post(extender, route, payload)
    assert r.status_code == 400, r.text
    assert words in r.json()["Error"]


def test_many_concurrent_calls_are_all_answered(extender: Running) -> None:
    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda _: post(extender, "/bind", b"{}").status_code, range(64)))
    assert codes == [400] * 64


def test_metrics_are_served_on_their_own_port_from_the_worker_in_multiprocess_mode(extender: Running) -> None:
    post(extender, "/bind", b"[]")
    text = requests.get(extender.metrics_url, timeout=5).text
    bad = [
        line
        for line in text.splitlines()
        if line.startswith('vgpu_scheduler_bad_requests_total{route="bind"}')
    ]
    assert bad and float(bad[0].split()[-1]) >= 1
    assert "vgpu_scheduler_verb_duration_seconds_bucket" in text


def test_the_cli_refuses_to_start_without_a_certificate(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "vgpu.commands.cli", "extender", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--cert-file" in r.stderr


def test_the_cli_names_a_bad_setting(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "vgpu.commands.cli", "extender", "--default-cores", "300", "--insecure-http"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--default-cores" in r.stderr


@dataclass
class Certified:
    ext: Running
    client: tuple[str, str]  # a client certificate and key the extender's client CA signed
    stranger: tuple[str, str]  # one another CA signed


@pytest.fixture(scope="module")
def certified(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Certified]:
    """An extender with --client-ca-file: its one CA signs its serving and client certificates."""
    tmp = tmp_path_factory.mktemp("certified")
    ca = CertificateAuthority(tmp / "pki")
    client = ca.issue("kube-scheduler", [], client=True)
    other = CertificateAuthority(tmp / "other", name="not-the-release-ca").issue("intruder", [], client=True)
    running = _run(tmp, ca, "--client-ca-file", str(ca.cert_path))
    yield Certified(running, (str(client.cert), str(client.key)), (str(other.cert), str(other.key)))
    stop(running.proc, grace=20)


FILTER = b'{"Pod":{"metadata":{"name":"p","uid":"u"},"spec":{"containers":[]}},"NodeNames":["a"]}'


def _chunks(body: bytes) -> Iterator[bytes]:
    yield body  # a generator body goes chunked: gunicorn's own parser, not the worker's short one


@pytest.mark.parametrize("chunked", [False, True], ids=["short-parser", "gunicorn-parser"])
def test_with_a_client_ca_the_scheduling_verbs_answer_only_its_certificates(
    certified: Certified, chunked: bool
) -> None:
    ext = certified.ext

    def call(route: str, cert: tuple[str, str] | None) -> requests.Response:
        return requests.post(
            ext.url + route,
            data=_chunks(FILTER) if chunked else FILTER,
            headers={"Content-Type": "application/json"},
            verify=str(ext.ca),
            cert=cert,
            timeout=10,
        )

    for route in ("/filter", "/prioritize", "/bind"):
        refused = call(route, None)
        assert refused.status_code == 403, (route, refused.text)
        error = refused.json()["Error"]
        assert route[1:] in error and "--client-ca-file" in error and "certFile and keyFile" in error
    answered = call("/filter", certified.client)
    assert answered.status_code == 200 and "loading" in answered.json()["Error"]  # past the check
    # a certificate another CA signed never gets past the handshake
    with pytest.raises(requests.exceptions.ConnectionError):
        call("/filter", certified.stranger)
    # the webhooks (the API server gives no certificate) and the probes answer anyone
    review = call("/webhook/validate", None)
    assert review.status_code == 400 and "AdmissionReview" in review.json()["Error"]
    assert requests.get(ext.url + "/healthz", verify=str(ext.ca), timeout=5).text == "ok\n"


def test_refused_calls_are_counted_by_verb_and_logged_once(certified: Certified) -> None:
    for _ in range(3):
        requests.post(certified.ext.url + "/bind", data=b"{}", verify=str(certified.ext.ca), timeout=10)
    text = requests.get(certified.ext.metrics_url, timeout=5).text
    counted = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('vgpu_scheduler_uncertified_calls_total{verb="bind"}')
    ]
    assert counted and counted[0] >= 3, text[-2000:]
    logged = certified.ext.log.read_text()
    assert logged.count("refused bind from 127.0.0.1") == 1, logged[-2000:]


def test_the_cli_refuses_a_client_ca_without_https_or_without_the_file(tmp_path: Path) -> None:
    kubeconfig = str(_kubeconfig(tmp_path / "kubeconfig"))
    base = [sys.executable, "-m", "vgpu.commands.cli", "extender", "--kubeconfig", kubeconfig]
    plain = subprocess.run(
        [*base, "--insecure-http", "--client-ca-file", str(tmp_path / "kubeconfig")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plain.returncode == 2 and "--client-ca-file needs HTTPS" in plain.stderr, plain.stderr
    ca = CertificateAuthority(tmp_path / "pki")
    pair = ca.issue("extender", ["127.0.0.1"])
    missing = subprocess.run(
        [*base, "--cert-file", str(pair.cert), "--key-file", str(pair.key),
         "--client-ca-file", "/no/such.pem"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2 and "--client-ca-file /no/such.pem: no such file" in missing.stderr
