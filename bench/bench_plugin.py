"""Figures for the device plugin: Allocate time with many pods waiting, and resident memory.

Run: .venv/bin/python bench/bench_plugin.py [--pods 100] [--cards 8] [--split 10]
Starts a control-plane-only sandbox in a temp folder, a Node of its own, the plugin on a real
unix socket and the kubelet stand-in as its peer. Prints one line per figure; asserts nothing.

1. Allocate with N pods bound and waiting: every Allocate lists the node's pods from the API
   server and picks its pod, so its cost grows with the pods waiting; timed as kubelet sees it
   (GetPreferredAllocation excluded, Allocate over the socket included).
2. Resident memory (VmRSS, VmHWM) of a `vgpu device-plugin` process serving C cards split S ways,
   once registered and reporting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.kubelet import Kubelet

from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    PHASE_ANNOTATION,
    Allocation,
    ContainerAllocation,
    DeviceAllocation,
    encode_allocation,
)
from vgpu.deviceplugin.api import api_pb2
from vgpu.deviceplugin.daemon import Daemon
from vgpu.kube.agent import NodeAgentClient
from vgpu.node.config import NodeConfig
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.paths import HostPaths

NS = "bench"


def gpus(node: str, cards: int) -> str:
    return yaml.safe_dump({"gpus": [{"uuid": f"GPU-{node}-{i}", "memoryMiB": 81920} for i in range(cards)]})


def make_node(sb: Sandbox, name: str) -> None:
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"}, "labels": {"type": "kwok"}},
        "spec": {"taints": [{"key": "bench", "value": "yes", "effect": "NoSchedule"}]},
    }
    sb.kubectl("create", "-f", "-", input=json.dumps(node))


def pods(node: str, count: int, cards: int) -> dict[str, object]:
    items = []
    for k in range(count):
        alloc = Allocation(
            node, (ContainerAllocation("main", (DeviceAllocation(f"GPU-{node}-{k % cards}", 1000, 10),)),)
        )
        items.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"p{k:04d}",
                    "namespace": NS,
                    "annotations": {
                        ALLOCATION_ANNOTATION: encode_allocation(alloc),
                        PHASE_ANNOTATION: "bound",
                    },
                },
                "spec": {
                    "nodeName": node,
                    "tolerations": [{"key": "bench", "operator": "Exists"}],
                    "containers": [
                        {
                            "name": "main",
                            "image": "cuda:fake",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ],
                },
            }
        )
    return {"apiVersion": "v1", "kind": "List", "items": items}


def bench_allocate(sb: Sandbox, tmp: Path, count: int, cards: int, split: int) -> None:
    node = "bench-alloc"
    make_node(sb, node)
    (tmp / "a").mkdir()
    (tmp / "a/gpus.yaml").write_text(gpus(node, cards))
    client = NodeAgentClient(str(sb.kubeconfig))
    kubelet = Kubelet(node, tmp / "a", None)  # admission driven below, one container at a time
    kubelet.start()
    daemon = Daemon(
        node,
        "kube-system",
        HostPaths(tmp / "a"),
        NodeConfig(split=split),
        FakeDiscovery(tmp / "a/gpus.yaml"),
        client,
        None,
    )
    daemon.start()
    try:
        kubelet.wait_for(
            lambda k: len((k.plugins.get("nvidia.com/gpu") or object()).__dict__.get("devices", {})) > 0, 30
        )
        sb.kubectl("create", "-f", "-", input=json.dumps(pods(node, count, cards)))
        while len(client.list_node_pods(node)) < count:
            time.sleep(0.2)
        listed = sorted(
            client.list_node_pods(node),
            key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"]),
        )
        times = []
        endpoint = kubelet.plugins["nvidia.com/gpu"]
        for pod in listed:
            # the IDs kubelet would pass: one on the card the pod was given
            card = json.loads(pod["metadata"]["annotations"][ALLOCATION_ANNOTATION])["containers"][0][
                "devices"
            ][0]
            ids = [f"{card['uuid']}::0"]
            start = time.perf_counter()
            endpoint.stub.Allocate(
                api_pb2.AllocateRequest(
                    container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
                ),
                timeout=30,
            )
            times.append(time.perf_counter() - start)
        ms = sorted(t * 1000 for t in times)
        print(
            f"Allocate over the socket, {count} pods bound and waiting at the start (each call lists "
            f"the node's pods and patches the served pod's phase): mean {statistics.mean(ms):.1f} ms, "
            f"p50 {ms[len(ms) // 2]:.1f} ms, p95 {ms[int(len(ms) * 0.95) - 1]:.1f} ms, max {ms[-1]:.1f} ms, "
            f"first (100 waiting) {times[0] * 1000:.1f} ms, n={len(ms)}"
        )
    finally:
        daemon.stop()
        kubelet.stop()
        client.close()


def bench_rss(sb: Sandbox, tmp: Path, cards: int, split: int) -> None:
    node = "bench-rss"
    make_node(sb, node)
    root = tmp / "r"
    root.mkdir()
    (root / "gpus.yaml").write_text(gpus(node, cards))
    (root / "cfg.yaml").write_text(f"split: {split}\n")
    kubelet = Kubelet(node, root, None)
    kubelet.start()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vgpu.commands.cli",
            "device-plugin",
            f"--node={node}",
            f"--kubeconfig={sb.kubeconfig}",
            f"--root={root}",
            f"--fake-nvml={root / 'gpus.yaml'}",
            f"--config={root / 'cfg.yaml'}",
            "--monitor-listen=127.0.0.1:0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ok = kubelet.wait_for(
            lambda k: (
                "nvidia.com/gpu" in k.plugins and len(k.plugins["nvidia.com/gpu"].devices) == cards * split
            ),
            60,
        )
        time.sleep(3)  # a few reporter rounds
        status = Path(f"/proc/{proc.pid}/status").read_text()
        fields = {
            line.split(":")[0]: line.split(":")[1].strip() for line in status.splitlines() if ":" in line
        }
        print(
            f"device plugin process, {cards} cards split {split} ways ({cards * split} device IDs, "
            f"registered: {ok}): VmRSS {fields.get('VmRSS')}, peak VmHWM {fields.get('VmHWM')}, "
            f"threads {fields.get('Threads')}"
        )
    finally:
        proc.terminate()
        proc.wait(10)
        kubelet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--cards", type=int, default=8)
    parser.add_argument("--split", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-plugin-") as tmp_name:
        tmp = Path(tmp_name)
        sb = Sandbox(tmp / "sb")
        sb.up(Spec(nodes=1, product=False))
        try:
            sb.kubectl("create", "namespace", NS)
            bench_allocate(sb, tmp, args.pods, args.cards, args.split)
            bench_rss(sb, tmp, args.cards, args.split)
        finally:
            sb.down()


if __name__ == "__main__":
    main()
