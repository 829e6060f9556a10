"""``vgpu dra-plugin`` speaking the kubelet's protocols over real gRPC on unix sockets, and a
process started through a prepared claim's CDI edits held by the hook to the claim's memory.

The claims here come from a claim source in memory: an API server that serves
``resource.k8s.io/v1`` with consumable capacity is Kubernetes 1.34 or later, which
tests/integration/test_dra_apiserver.py uses where it is built. Everything else is real: the
command, the sockets, the files on the host, the hook over the stub driver.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hook_harness import build

from tests.support import VGPU, running, short_dir, wait_for
from tests.support.dra import allocation_result, asked_for
from vgpu.dra import cdi
from vgpu.dra.api import (
    dra_health_pb2,
    dra_health_pb2_grpc,
    dra_pb2,
    dra_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)
from vgpu.dra.prepare import Preparer, StatePaths
from vgpu.dra.server import DraServer
from vgpu.node.config import NodeConfig
from vgpu.node.discovery import Card
from vgpu.node.hooklib import install_hook

NODE = "node-a"
UID = "0b7c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3"
CARDS = [Card(uuid="GPU-stub-0", index=0, model="Stub", memory_mib=8192)]
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
V1BETA1 = "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources"


def claim(name: str, uid: str, memory: str = "3000Mi", cores: str = "30", pool: str = NODE) -> dict[str, Any]:
    results = [allocation_result(pool, memory, cores, share_id=f"share-{name}")]
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid},
        "spec": {"devices": asked_for(results)},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": f"pod-{uid}"}],
        },
    }


class Claims:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.reads = 0

    def add(self, c: dict[str, Any]) -> None:
        self.claims[(c["metadata"]["namespace"], c["metadata"]["name"])] = c

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return self.claims.get((namespace, name))


class Node:
    """The plugin's gRPC servers in this process, on one node's folders; ``restart`` makes a new
    plugin on the same folders, as a restarted process would find them."""

    def __init__(self, top: Path, claims: Claims) -> None:
        self.top = top
        self.claims = claims
        self.hook = build().lib
        self.server: DraServer | None = None
        self.preparer: Preparer | None = None
        self.start()

    def start(self) -> None:
        paths = StatePaths(Path("/"), self.top / "state")
        self.preparer = Preparer(
            NODE,
            paths,
            self.top / "cdi",
            NodeConfig(),
            self.claims,
            lambda: list(CARDS),
            hook=install_hook(self.hook, paths),
        )
        self.server = DraServer(self.preparer, self.top / "plugins", self.top / "registry")
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def restart(self) -> None:
        self.stop()
        self.start()

    def prepare(self, *claims: tuple[str, str]) -> dra_pb2.NodePrepareResourcesResponse:
        with grpc.insecure_channel(f"unix://{self.top / 'plugins/dra.sock'}") as ch:
            return dra_pb2_grpc.DRAPluginStub(ch).NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(
                    claims=[dra_pb2.Claim(namespace="ns", name=n, uid=u) for n, u in claims]
                ),
                timeout=10,
            )

    def unprepare(self, *claims: tuple[str, str]) -> dra_pb2.NodeUnprepareResourcesResponse:
        with grpc.insecure_channel(f"unix://{self.top / 'plugins/dra.sock'}") as ch:
            return dra_pb2_grpc.DRAPluginStub(ch).NodeUnprepareResources(
                dra_pb2.NodeUnprepareResourcesRequest(
                    claims=[dra_pb2.Claim(namespace="ns", name=n, uid=u) for n, u in claims]
                ),
                timeout=10,
            )


@pytest.fixture
def node() -> Iterator[Node]:
    with short_dir("vgpu-dra-") as top:
        n = Node(top, Claims())
        try:
            yield n
        finally:
            n.stop()


def test_prepare_answers_cdi_ids_and_a_bad_claim_gets_its_own_error(node: Node) -> None:
    node.claims.add(claim("a", UID))
    node.claims.add(claim("far", "uid-far", pool="node-b"))
    node.claims.add(claim("frac", "uid-frac", memory="1000000"))
    answer = node.prepare(("a", UID), ("far", "uid-far"), ("frac", "uid-frac"), ("gone", "uid-gone"))
    ok = answer.claims[UID]
    assert ok.error == ""
    assert [
        (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in ok.devices
    ] == [(["gpu"], NODE, "gpu-0", [f"vgpu.openaios.io/claim={UID}-gpu"])]
    assert (
        "results[0].pool" in answer.claims["uid-far"].error
        and "another node" in answer.claims["uid-far"].error
    )
    assert "consumedCapacity.memory" in answer.claims["uid-frac"].error
    assert "whole MiB" in answer.claims["uid-frac"].error
    assert "not found" in answer.claims["uid-gone"].error
    assert cdi.spec_path(node.top / "cdi", UID).is_file()
    assert not cdi.spec_path(node.top / "cdi", "uid-far").exists()


def test_the_v1beta1_service_answers_the_same(node: Node) -> None:
    node.claims.add(claim("a", UID))
    with grpc.insecure_channel(f"unix://{node.top / 'plugins/dra.sock'}") as ch:
        call = ch.unary_unary(
            V1BETA1,
            request_serializer=dra_pb2.NodePrepareResourcesRequest.SerializeToString,
            response_deserializer=dra_pb2.NodePrepareResourcesResponse.FromString,
        )
        answer = call(
            dra_pb2.NodePrepareResourcesRequest(claims=[dra_pb2.Claim(namespace="ns", name="a", uid=UID)]),
            timeout=10,
        )
    assert list(answer.claims[UID].devices[0].cdi_device_ids) == [f"vgpu.openaios.io/claim={UID}-gpu"]


def test_prepare_is_idempotent_across_a_restart_and_unprepare_removes_it(node: Node) -> None:
    node.claims.add(claim("a", UID))
    first = node.prepare(("a", UID))
    spec = cdi.spec_path(node.top / "cdi", UID)
    grant = node.top / f"state/grants/dra_{UID}_gpu.limits"
    stamps = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (spec, grant)]
    assert node.prepare(("a", UID)) == first  # the kubelet retries
    node.restart()
    assert node.prepare(("a", UID)) == first  # a new plugin on the same folders
    assert node.claims.reads == 1  # answered from the checkpoint: no second read, no second write
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (spec, grant)] == stamps
    gone = node.unprepare(("a", UID))
    assert gone.claims[UID].error == ""
    assert not spec.exists() and not grant.exists()
    assert not (node.top / f"state/containers/dra_{UID}_gpu").exists()
    assert not (node.top / f"state/dra/claims/{UID}.json").exists()
    assert node.unprepare(("a", UID)).claims[UID].error == ""  # again: nothing left is no error
    node.restart()
    assert node.unprepare(("a", UID)).claims[UID].error == ""


def _can_make_a_container_position() -> str | None:
    if os.geteuid() != 0:
        return "needs root to make a mount namespace"
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    return None


# Root in a fresh mount namespace: the container's view made from the CDI spec's mounts (the
# folders they land in are fresh tmpfs, /etc an overlay), then the tenant's process with the
# spec's environment alone, as an unprivileged user.
SCRIPT = r"""
set -eu
mkdir "$T/up" "$T/work"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$T/up,workdir=$T/work" /etc
mkdir -p /usr/local/vgpu /var/lib/vgpu
mount -t tmpfs tmpfs /usr/local/vgpu
mount -t tmpfs tmpfs /var/lib/vgpu
while IFS=' ' read -r host inside mode; do
  if [ -d "$host" ]; then mkdir -p "$inside"; else mkdir -p "$(dirname "$inside")"; : > "$inside"; fi
  mount --bind "$host" "$inside"
  if [ "$mode" = ro ]; then mount -o remount,bind,ro "$inside"; fi
done < "$T/mounts"
exec setpriv --reuid 65534 --regid 65534 --clear-groups env -i PATH=/usr/bin:/bin \
  LD_LIBRARY_PATH="$T/stub" STUB_CUDA_MEMORY_MIB=8192 $(cat "$T/env") "$T/t_alloc" procaddr alloc 256
"""


def test_a_process_started_through_the_cdi_edits_is_held_to_the_claims_memory(node: Node) -> None:
    why = _can_make_a_container_position()
    if why:
        pytest.skip(f"cannot put a process in a container's position here: {why}")
    node.claims.add(claim("a", UID, memory="3000Mi", cores="30"))
    assert node.prepare(("a", UID)).claims[UID].error == ""
    spec = json.loads(cdi.spec_path(node.top / "cdi", UID).read_text())
    (device,) = spec["devices"]
    edits = device["containerEdits"]
    built = build()
    top = Path(tempfile.mkdtemp(prefix="vgpu-cdi-"))
    try:
        top.chmod(0o755)
        shutil.copy2(built.tests / "t_alloc", top / "t_alloc")
        shutil.copytree(built.stub_dir, top / "stub", symlinks=True)
        # the host's folders the mounts come from: traversable by the tenant, as on a node
        for folder in (node.top, node.top / "state", node.top / "state/lib"):
            folder.chmod(0o755)
        (top / "mounts").write_text(
            "".join(f"{m['hostPath']} {m['containerPath']} {m['options'][0]}\n" for m in edits["mounts"])
        )
        (top / "env").write_text(" ".join(edits["env"]) + "\n")
        proc = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", SCRIPT],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "T": str(top)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # The claim's 3000 MiB hold the context's charge (640 MiB, the grant's default, as for a
        # device-plugin container) and 9 chunks of 256 MiB (2304); a 10th would pass 3000 MiB.
        assert (int(out["chunks"]), int(out["refused"])) == (9, OUT_OF_MEMORY), proc.stderr
        region = node.top / f"state/containers/dra_{UID}_gpu/vgpu.region"
        assert region.is_file()  # the hook made the region where the monitor reads it
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_command_registers_with_the_kubelets_plugin_watcher_and_stops_on_sigterm(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(
        "driverVersion: 570.124.06\n"
        "gpus:\n  - {uuid: GPU-stub-0, memoryMiB: 8192, computeCapability: '9.0'}\n"
    )
    kubeconfig = tmp_path / "kubeconfig"  # an API server that is not there: the slice waits, the sockets not
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "current-context: x\n"
    )
    with short_dir("vgpu-dra-") as top:
        argv = [
            *VGPU,
            "dra-plugin",
            "--node-name",
            NODE,
            "--plugin-dir",
            str(top / "plugins"),
            "--registry-dir",
            str(top / "registry"),
            "--cdi-dir",
            str(top / "cdi"),
            "--state-dir",
            str(top / "state"),
            "--fake-nvml",
            str(gpus),
            "--kubeconfig",
            str(kubeconfig),
            "--hook-library",
            str(build().lib),
        ]
        reg = top / "registry/vgpu.openaios.io-reg.sock"
        with running(argv, tmp_path / "plugin.log") as proc:
            wait_for(reg.exists, "the registration socket", timeout=30)
            with grpc.insecure_channel(f"unix://{reg}") as ch:
                stub = registration_pb2_grpc.RegistrationStub(ch)
                info = stub.GetInfo(registration_pb2.InfoRequest(), timeout=10)
                stub.NotifyRegistrationStatus(
                    registration_pb2.RegistrationStatus(plugin_registered=True), timeout=10
                )
            assert info.type == "DRAPlugin" and info.name == "vgpu.openaios.io"
            assert info.endpoint == str(top / "plugins/dra.sock")
            assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
            assert Path(info.endpoint).exists()
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            assert proc.wait(timeout=20) == 0
            assert time.monotonic() - started < 15
        assert not reg.exists() and not (top / "plugins/dra.sock").exists()
        log = (tmp_path / "plugin.log").read_text()
        assert "the kubelet registered vgpu.openaios.io" in log
        assert "Traceback" not in log


def test_the_kubelets_health_stream_gets_every_card_and_a_card_going_unhealthy_at_once(
    tmp_path: Path,
) -> None:
    """DRAResourceHealth, as a 1.36 kubelet calls it on the DRA socket: every card at once, then
    the whole list again as soon as a card's health changes (here: the --fake-nvml file edited,
    as an Xid would through NVML), and the stream ended when the plugin stops."""
    gpus = tmp_path / "gpus.yaml"
    two = "gpus:\n  - {uuid: GPU-stub-0, memoryMiB: 8192}\n  - {uuid: GPU-stub-1, memoryMiB: 8192%s}\n"
    gpus.write_text(two % "")
    kubeconfig = tmp_path / "kubeconfig"  # no API server: the health stream does not need one
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "current-context: x\n"
    )
    with short_dir("vgpu-dra-") as top:
        argv = [*VGPU, "dra-plugin", "--node-name", NODE, "--plugin-dir", str(top / "plugins")]
        argv += ["--registry-dir", str(top / "registry"), "--cdi-dir", str(top / "cdi")]
        argv += ["--state-dir", str(top / "state"), "--fake-nvml", str(gpus), "--kubeconfig", str(kubeconfig)]
        sock = top / "plugins/dra.sock"
        with running(argv, tmp_path / "plugin.log") as proc:
            wait_for(sock.exists, "the DRA socket", timeout=30)
            with grpc.insecure_channel(f"unix://{sock}") as ch:
                call = dra_health_pb2_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
                    dra_health_pb2.NodeWatchResourcesRequest(), timeout=60
                )
                first = next(call)
                seen = {(d.device.pool_name, d.device.device_name): d for d in first.devices}
                assert set(seen) == {(NODE, "gpu-0"), (NODE, "gpu-1")}
                assert all(d.health == dra_health_pb2.HEALTHY and d.message == "" for d in seen.values())
                assert all(d.health_check_timeout_seconds == 60 for d in seen.values())
                assert abs(seen[(NODE, "gpu-0")].last_updated_time - time.time()) < 30
                gpus.write_text(two % ", healthy: false")
                started = time.monotonic()
                second = next(call)
                told = time.monotonic() - started
                health = {d.device.device_name: d for d in second.devices}
                assert health["gpu-0"].health == dra_health_pb2.HEALTHY
                assert health["gpu-1"].health == dra_health_pb2.UNHEALTHY
                assert "marked unhealthy in" in health["gpu-1"].message
                print(f"[dra health] a card marked unhealthy reached the stream in {told:.1f} s")
                assert told < 15, "a change goes out at once, not at the next refresh (20 s)"
                proc.send_signal(signal.SIGTERM)
                try:  # the stream ends with the plugin (the kubelet calls again once it is back)
                    list(call)
                except grpc.RpcError as err:
                    assert err.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), err
            assert proc.wait(timeout=20) == 0
        log = (tmp_path / "plugin.log").read_text()
        assert "the kubelet watches the health of node-a's cards" in log and "Traceback" not in log


def test_a_bad_flag_is_one_line_naming_it(tmp_path: Path) -> None:
    from tests.support import vgpu

    r = vgpu(
        "dra-plugin", "--node-name", NODE, "--cdi-dir", "relative/cdi", "--fake-nvml", str(tmp_path / "x")
    )
    assert r.returncode == 2 and "--cdi-dir" in r.stderr and "absolute" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_cdi_library_containerd_uses_reads_the_spec(node: Node) -> None:
    """nvidia-ctk (built from Go modules by tools/build.sh) loads specs with the CNCF CDI library
    that containerd 2 and CRI-O use: a spec it refuses, the runtime would refuse too."""
    ctk = Path(os.environ.get("VGPU_BIN_DIR", Path.home() / ".cache/vgpu/bin")) / "current/nvidia-ctk"
    if not ctk.exists():
        pytest.skip(f"nvidia-ctk is not built at {ctk} (tools/build.sh nvidia-ctk)")
    node.claims.add(claim("a", UID))
    node.claims.add(claim("b", "uid-b"))
    node.prepare(("a", UID), ("b", "uid-b"))
    listed = subprocess.run(
        [str(ctk), "cdi", "list", "--spec-dir", str(node.top / "cdi")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert listed.stdout.split() == [
        f"vgpu.openaios.io/claim={UID}-gpu",
        "vgpu.openaios.io/claim=uid-b-gpu",
    ], listed.stderr
    assert "error" not in listed.stderr.lower(), listed.stderr
