"""MPS shares on the DRA path end to end (docs/dra.md#mps-shares): two ``vgpu dra-plugin``s, one
per node of the sandbox, one run with ``--sharing-mode mps``, against the real API server (which
compiles the DeviceClasses' CEL) and kube-scheduler's own DRA allocator (which evaluates it).

A claim of the DeviceClass mps.vgpu.openaios.io is allocated on the MPS node's card, and its
prepare (over the kubelet's gRPC: the sandbox's KWOK nodes have no kubelet, so the test calls
what the kubelet calls) writes a CDI spec mounting the card's MPS pipe folder read-only with the
CUDA_MPS_* variables; claims of vgpu.openaios.io all land on the time-sliced node, never the MPS
one, even with room on both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.nodes import node_name

from tests.support import VGPU, short_dir, start, stop, wait_for
from tests.support.dra import resource_claim
from vgpu.core.claimconfig import MPS_CLASS
from vgpu.dra import cdi
from vgpu.dra.api import dra_pb2, dra_pb2_grpc
from vgpu.dra.migslices import MPS_SELECTOR, SHARED_SELECTOR
from vgpu.dra.slices import DRIVER
from vgpu.hookabi.layout import MPS_PIPE_IN_CONTAINER
from vgpu.node.mps import accepts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MPS_NODE, TS_NODE = node_name(0), node_name(1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Sandbox]:
    with short_dir("vgpu-dramps-") as top:
        sb = Sandbox(top / "sandbox")
        try:
            sb.up(Spec(nodes=2, gpus_per_node=1, product=False))
            if "resource.k8s.io/v1" not in sb.kubectl("api-versions").stdout.split():
                version = sb.api_get("/version")["gitVersion"]
                pytest.skip(f"the control plane ({version}) serves no resource.k8s.io/v1")
            yield sb
        finally:
            sb.down()


class Plugin:
    def __init__(self, sb: Sandbox, top: Path, node: str, sharing: str) -> None:
        self.top = top
        self.uuid = f"GPU-{sharing}-0"
        gpus = top / "gpus.yaml"
        gpus.write_text(
            "driverVersion: 580.65.06\ngpus:\n"
            f"  - {{uuid: {self.uuid}, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, "
            "computeCapability: '9.0'}\n"
        )
        # the card's MPS control daemon's pipe folder: the plugin starts the daemon there itself
        # (vgpu/node/mps.py), here the fake one (vgpu/node/fake_mps.py) found on PATH
        self.pipe = top / "state/mps" / self.uuid / "pipe"
        tools = top / "tools"
        tools.mkdir()
        self.tool = tools / "nvidia-cuda-mps-control"
        self.tool.write_text(f'#!/bin/sh\nexec {sys.executable} -m vgpu.node.fake_mps "$@"\n')
        self.tool.chmod(0o755)
        env = dict(os.environ, PATH=f"{tools}{os.pathsep}{os.environ.get('PATH', '')}")
        self.log = top / "plugin.log"
        self.proc = start(
            [
                *VGPU,
                "dra-plugin",
                f"--node-name={node}",
                f"--plugin-dir={top / 'plugins'}",
                f"--registry-dir={top / 'registry'}",
                f"--cdi-dir={top / 'cdi'}",
                f"--state-dir={top / 'state'}",
                f"--fake-nvml={gpus}",
                f"--kubeconfig={sb.kubeconfig}",
                f"--sharing-mode={sharing}",
                "--slice-interval=1",
            ],
            self.log,
            env,
        )

    def quit_daemon(self) -> None:
        """``echo quit | nvidia-cuda-mps-control`` with the card's pipe: the plugin leaves its
        daemons running when it stops (their clients' work goes on)."""
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(self.pipe))
        subprocess.run(
            [str(self.tool)], input=b"quit\n", env=env, capture_output=True, timeout=10, check=False
        )

    def prepare(self, claim: dict[str, Any]) -> Any:
        sock = self.top / "plugins/dra.sock"
        wait_for(sock.exists, "the DRA socket", timeout=30)
        meta = claim["metadata"]
        one = dra_pb2.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            answer = dra_pb2_grpc.DRAPluginStub(ch).NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(claims=[one]), timeout=30, wait_for_ready=True
            )
        return answer.claims[meta["uid"]]


@pytest.fixture
def plugins(cluster: Sandbox) -> Iterator[tuple[Plugin, Plugin]]:
    with short_dir("vgpu-drampsa-") as a, short_dir("vgpu-drampsb-") as b:
        mps, ts = Plugin(cluster, a, MPS_NODE, "mps"), Plugin(cluster, b, TS_NODE, "timeslice")
        try:
            yield mps, ts
        finally:
            stop(mps.proc)
            stop(ts.proc)
            mps.quit_daemon()


def _apply(sb: Sandbox, *objs: dict[str, Any]) -> None:
    sb.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)})
    )


def _class(name: str, expr: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expr}}]},
    }


def _pod(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [{"name": "c", "image": "pause", "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }


def _allocated(sb: Sandbox, name: str) -> dict[str, Any] | None:
    got = json.loads(sb.kubectl("get", "resourceclaim", "-n", "default", name, "-o", "json").stdout)
    return got if (got.get("status") or {}).get("allocation") else None


def _shares(sb: Sandbox) -> dict[str, str]:
    """Each node's share device's attribute sharing, as its slice publishes it."""
    items = sb.api_get("/apis/resource.k8s.io/v1/resourceslices").get("items", [])
    return {
        s["spec"]["nodeName"]: d["attributes"]["sharing"]["string"]
        for s in items
        if s["spec"]["driver"] == DRIVER
        for d in s["spec"].get("devices") or []
    }


def test_an_mps_claim_lands_on_the_mps_share_with_the_pipe_mounted_and_others_never_do(
    cluster: Sandbox, plugins: tuple[Plugin, Plugin]
) -> None:
    mps_plugin, _ = plugins
    _apply(cluster, _class(DRIVER, SHARED_SELECTOR), _class(MPS_CLASS, MPS_SELECTOR))
    wait_for(
        lambda: _shares(cluster) == {MPS_NODE: "mps", TS_NODE: "timeslice"},
        "both nodes' slices",
        60,
        every=0.5,
    )
    mps_claim = resource_claim("mps", memory="3000Mi", cores="30")
    mps_claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = MPS_CLASS
    shared = [resource_claim(f"ts{i}", memory="1000Mi", cores="10") for i in range(3)]
    _apply(cluster, mps_claim, *shared, _pod("mps", "mps"), *[_pod(f"ts{i}", f"ts{i}") for i in range(3)])
    names = ["mps", "ts0", "ts1", "ts2"]
    wait_for(lambda: all(_allocated(cluster, n) for n in names), "the four claims allocated", 120, every=0.5)
    pools = {}
    for n in names:
        claim = _allocated(cluster, n)
        assert claim is not None
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        pools[n] = result["pool"]
    assert pools == {"mps": MPS_NODE, "ts0": TS_NODE, "ts1": TS_NODE, "ts2": TS_NODE}

    claim = _allocated(cluster, "mps")
    assert claim is not None
    # the plugin started the card's MPS daemon before it published (its control socket answers)
    assert accepts(mps_plugin.pipe), (mps_plugin.pipe, mps_plugin.log.read_text()[-2000:])
    entry = mps_plugin.prepare(claim)
    assert entry.error == "", entry.error
    spec = json.loads(cdi.spec_path(mps_plugin.top / "cdi", claim["metadata"]["uid"]).read_text())
    (dev,) = spec["devices"]
    edits = dev["containerEdits"]
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    assert mounts[MPS_PIPE_IN_CONTAINER]["hostPath"] == str(mps_plugin.pipe)
    assert "ro" in mounts[MPS_PIPE_IN_CONTAINER]["options"]
    env = dict(e.split("=", 1) for e in edits["env"])
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPE_IN_CONTAINER
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    cluster.kubectl("delete", "pods", "-n", "default", *names, "--wait=false")
