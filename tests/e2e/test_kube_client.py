"""vgpu.kube.client's own HTTP/1.1 calls (Binding, watches: vgpu.kube.wire) on the real API server."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from vgpu_sandbox.cluster import Sandbox

from tests.support import container, pod
from vgpu.core.errors import ConflictError, KubeError
from vgpu.kube.client import Gone, Kube
from vgpu.kube.informer import Informer

NS = "vgpu-kube-client"


@pytest.fixture(scope="module")
def kube(sandbox: Sandbox) -> Iterator[Kube]:
    sandbox.kubectl("create", "namespace", NS, check=False)
    k = Kube(str(sandbox.kubeconfig))
    assert k._wire is not None  # the sandbox's kubeconfig has no proxy: the lean path is the one tested
    yield k
    k.close()


def make_pod(sandbox: Sandbox, kube: Kube) -> tuple[str, str]:
    name = f"p-{secrets.token_hex(4)}"
    manifest = pod(name, container("c", "x"), namespace=NS, scheduler="nobody")
    sandbox.kubectl("create", "-f", "-", input=json.dumps(manifest))
    got = kube.get_pod(NS, name)
    assert got is not None
    return name, got["metadata"]["uid"]


def a_node(kube: Kube) -> str:
    return str(kube.list_nodes()[0][0]["metadata"]["name"])


def test_bind_sets_node_and_annotations_in_one_write(sandbox: Sandbox, kube: Kube) -> None:
    name, uid = make_pod(sandbox, kube)
    node = a_node(kube)
    kube.bind_pod(NS, name, uid, node, {"example.com/a": "1"})
    pod = kube.get_pod(NS, name)
    assert pod is not None
    assert pod["spec"]["nodeName"] == node
    assert pod["metadata"]["annotations"]["example.com/a"] == "1"
    # binding it again is refused by the API server: a ConflictError naming the pod
    with pytest.raises(ConflictError, match=f"bind pod {NS}/{name} to {node}: HTTP 409"):
        kube.bind_pod(NS, name, uid, node, {"example.com/a": "2"})


def test_bind_errors_name_the_pod_and_status(sandbox: Sandbox, kube: Kube) -> None:
    with pytest.raises(KubeError, match=f"bind pod {NS}/no-such-pod to .*HTTP 404") as err:
        kube.bind_pod(NS, "no-such-pod", "u", a_node(kube))
    assert err.value.status == 404


def test_the_api_server_does_not_hold_a_binding_to_its_uid(sandbox: Sandbox, kube: Kube) -> None:
    """What bind_pod's docstring says: the uid sent is not a precondition (as for kube-scheduler)."""
    name, _ = make_pod(sandbox, kube)
    kube.bind_pod(NS, name, "00000000-0000-0000-0000-000000000000", a_node(kube))
    assert kube.get_pod(NS, name)["spec"]["nodeName"] == a_node(kube)  # type: ignore[index]


def test_many_binds_from_threads_share_kept_alive_connections(sandbox: Sandbox, kube: Kube) -> None:
    pods = [make_pod(sandbox, kube) for _ in range(12)]
    node = a_node(kube)
    errors: list[Exception] = []

    def bind(name: str, uid: str) -> None:
        try:
            kube.bind_pod(NS, name, uid, node)
        except Exception as err:  # collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=bind, args=p) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert all(kube.get_pod(NS, n)["spec"]["nodeName"] == node for n, _ in pods)  # type: ignore[index]
    assert kube._wire is not None and 1 <= len(kube._wire._idle) <= 12


def test_watch_sees_a_pod_created_bound_and_deleted(sandbox: Sandbox, kube: Kube) -> None:
    _, rv = kube.list_pods(field_selector=f"metadata.namespace={NS}")
    name, uid = make_pod(sandbox, kube)
    kube.bind_pod(NS, name, uid, a_node(kube), {"example.com/w": "x"})
    sandbox.kubectl("delete", "pod", "-n", NS, name, "--grace-period=0", "--force", "--wait=false")
    seen: list[tuple[str, str | None]] = []
    deadline = time.monotonic() + 30
    for kind, obj in kube.watch_pods(rv, field_selector=f"metadata.namespace={NS}", timeout_s=10):
        if obj.get("metadata", {}).get("name") == name:
            seen.append((kind, obj["spec"].get("nodeName")))
        if kind == "DELETED" or time.monotonic() > deadline:
            break
    assert seen[0] == ("ADDED", None)
    assert ("MODIFIED", a_node(kube)) in seen
    assert seen[-1][0] == "DELETED"


@pytest.fixture(scope="module")
def stale(sandbox: Sandbox, kube: Kube) -> str:
    """A version the API server no longer serves pod watches from: "1", once its watch cache's
    window has moved past it. Until then the cache replays a watch from "1" from its oldest event
    instead (no 410, whatever etcd has compacted). In a whole e2e session the window moved long
    before this module runs; run alone, this makes pods until it has (about 100 s on a fresh
    sandbox: the cache keeps its last 75 s of events)."""
    deadline, made = time.monotonic() + 240, 0
    while True:
        try:
            for _ in kube.watch_pods("1", timeout_s=1):
                pass
        except Gone:
            return "1"
        assert time.monotonic() < deadline, f"a watch from version 1 was still served after {made} pods"
        for _ in range(5):
            make_pod(sandbox, kube)
            made += 1
        sandbox.kubectl("delete", "pods", "--all", "-n", NS, "--wait=false")


def test_watch_from_a_compacted_version_is_gone(kube: Kube, stale: str) -> None:
    with pytest.raises(Gone) as err:
        for _ in kube.watch_pods(stale, timeout_s=5):
            pass
    assert err.value.status == 410 and "too old resource version" in str(err.value)


def test_an_informer_relists_after_a_410_and_follows_the_watch(
    sandbox: Sandbox, kube: Kube, stale: str
) -> None:
    """The one informer on the real API server: a stale version (its first list claims one) is
    Gone, so it lists again at once, then hands on the watch's events."""
    selector = f"metadata.namespace={NS}"
    lists: list[list[str]] = []
    events: list[tuple[str, str]] = []

    def list_fn() -> tuple[list[dict[str, Any]], str]:
        items, rv = kube.list_pods(field_selector=selector)
        return items, stale if not lists else rv

    informer = Informer(
        "pods",
        list_fn,
        lambda rv: kube.watch_pods(rv, field_selector=selector, timeout_s=10),
        lambda items: lists.append([i["metadata"]["name"] for i in items]),
        lambda kind, obj: events.append((kind, obj["metadata"]["name"])),
    ).start()
    try:
        assert informer.wait_synced(10)
        deadline = time.monotonic() + 10
        while len(lists) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lists) == 2 and informer.lists == 2  # the 410 listed again
        assert informer.backoff.current_s == informer.backoff.initial_s  # no error backoff for a 410
        name, _ = make_pod(sandbox, kube)
        while ("ADDED", name) not in events and time.monotonic() < deadline + 10:
            time.sleep(0.05)
        assert ("ADDED", name) in events and name not in lists[-1]
    finally:
        informer.stop(timeout_s=None)


def test_get_reads_any_path_and_errors_carry_the_status(kube: Kube) -> None:
    assert kube.get("/readyz") == "ok"  # not JSON: the text
    assert kube.get(f"/api/v1/namespaces/{NS}")["metadata"]["name"] == NS
    with pytest.raises(KubeError, match="GET /api/v1/namespaces/no-such-namespace: HTTP 404") as err:
        kube.get("/api/v1/namespaces/no-such-namespace")
    assert err.value.status == 404


def test_close_ends_a_running_watch(sandbox: Sandbox) -> None:
    k = Kube(str(sandbox.kubeconfig))
    _, rv = k.list_pods(field_selector=f"metadata.namespace={NS}")
    events: list[str] = []
    done = threading.Event()

    def run() -> None:
        for kind, _ in k.watch_pods(rv, field_selector=f"metadata.namespace={NS}", timeout_s=120):
            events.append(kind)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    time.sleep(1.0)
    k.close()
    assert done.wait(10), "the watch did not end when the client was closed"


def test_nodes_as_metadata_only_list_and_watch(sandbox: Sandbox, kube: Kube) -> None:
    """The extender's node feed: names and annotations, without the status kubelets keep rewriting."""
    nodes, rv = kube.list_node_metadata()
    full, _ = kube.list_nodes()
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(n["metadata"]["name"] for n in full)
    assert all("status" not in n and "spec" not in n for n in nodes)
    assert nodes[0]["metadata"].get("annotations") == next(
        f["metadata"].get("annotations")
        for f in full
        if f["metadata"]["name"] == nodes[0]["metadata"]["name"]
    )
    name = nodes[0]["metadata"]["name"]
    mark = secrets.token_hex(4)
    sandbox.kubectl("annotate", "node", name, f"example.com/kube-client-test={mark}", "--overwrite")
    try:
        deadline = time.monotonic() + 30
        got = None
        for kind, obj in kube.watch_node_metadata(rv, timeout_s=10):
            annotations = obj.get("metadata", {}).get("annotations") or {}
            if annotations.get("example.com/kube-client-test") == mark:
                got = (kind, obj)
                break
            if time.monotonic() > deadline:
                break
        assert got is not None and got[0] == "MODIFIED"
        assert got[1]["kind"] == "PartialObjectMetadata" and "status" not in got[1]
    finally:
        sandbox.kubectl("annotate", "node", name, "example.com/kube-client-test-")


class ConnectProxy:
    """An HTTP CONNECT proxy on a real socket, counting the tunnels it opened."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.tunnels: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._tunnel, args=(client,), daemon=True).start()

    def _tunnel(self, client: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            got = client.recv(4096)
            if not got:
                client.close()
                return
            head += got
        method, target, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
        host, port = target.decode().rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)))
        self.tunnels.append(target.decode())
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
        pipe(upstream, client)

    def close(self) -> None:
        self.listener.close()


def test_a_kubeconfig_with_a_proxy_binds_and_watches_through_it(sandbox: Sandbox, tmp_path: Path) -> None:
    """The generated-client path (vgpu.kube.wire does not speak to proxies) still binds and watches."""
    proxy = ConnectProxy()
    try:
        config = yaml.safe_load(Path(sandbox.kubeconfig).read_text())
        config["clusters"][0]["cluster"]["proxy-url"] = f"http://127.0.0.1:{proxy.port}"
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        k = Kube(str(kubeconfig))
        try:
            assert k._wire is None
            _, rv = k.list_pods(field_selector=f"metadata.namespace={NS}")
            name, uid = make_pod(sandbox, k)
            node = a_node(k)
            k.bind_pod(NS, name, uid, node, {"example.com/p": "1"})
            pod = k.get_pod(NS, name)
            assert pod is not None and pod["spec"]["nodeName"] == node
            assert pod["metadata"]["annotations"]["example.com/p"] == "1"
            with pytest.raises(ConflictError):
                k.bind_pod(NS, name, uid, node)
            seen = []
            for kind, obj in k.watch_pods(rv, field_selector=f"metadata.namespace={NS}", timeout_s=5):
                if obj.get("metadata", {}).get("name") == name:
                    seen.append((kind, obj["spec"].get("nodeName")))
                    if obj["spec"].get("nodeName"):
                        break
            assert seen[0] == ("ADDED", None) and seen[-1] == ("MODIFIED", node)
            nodes, _ = k.list_node_metadata()  # whole Nodes through the proxy: the same names
            assert node in {n["metadata"]["name"] for n in nodes}
        finally:
            k.close()
        assert proxy.tunnels, "nothing went through the proxy"
    finally:
        proxy.close()
