"""Figures for vgpu.kube.client's calls per scheduled pod: CPU of a Binding, and of reading watch events.

Run: .venv/bin/python bench/bench_kube_client.py [--pods 300]

Against a control-plane-only sandbox (a real API server): ``--pods`` pods are bound one after
another on one thread, first through vgpu.kube.wire (what the extender uses), then through urllib3
(the generated client's connection pool, what a kubeconfig with a proxy uses), and the CPU time of
the calling thread per Binding is printed for each, with the wall time. Then the pods' watch is
read from the start through each path, and the CPU per event printed. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vgpu_sandbox.cluster import Sandbox, Spec

from vgpu.kube.client import Kube

NS = "bench-kube"


def make_pods(sb: Sandbox, kube: Kube, prefix: str, count: int) -> list[tuple[str, str]]:
    items = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{prefix}-{i}", "namespace": NS},
            "spec": {"schedulerName": "nobody", "containers": [{"name": "c", "image": "x"}]},
        }
        for i in range(count)
    ]
    sb.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    pods, _ = kube.list_pods(field_selector=f"metadata.namespace={NS}")
    return [
        (p["metadata"]["name"], p["metadata"]["uid"])
        for p in pods
        if p["metadata"]["name"].startswith(prefix)
    ]


def bind_all(kube: Kube, pods: list[tuple[str, str]], node: str) -> tuple[float, float]:
    """(CPU, wall) seconds per Binding, each with a 300-byte allocation annotation."""
    annotations = {"vgpu.openaios.io/allocation": "x" * 300}
    cpu, wall = time.thread_time(), time.perf_counter()
    for name, uid in pods:
        kube.bind_pod(NS, name, uid, node, annotations)
    return (time.thread_time() - cpu) / len(pods), (time.perf_counter() - wall) / len(pods)


def read_watch(kube: Kube, rv: str, expect: int) -> tuple[float, int]:
    """(CPU seconds per event, events) reading the namespace's pod watch from ``rv``."""
    events = 0
    cpu = time.thread_time()
    for _kind, _obj in kube.watch_pods(rv, field_selector=f"metadata.namespace={NS}", timeout_s=5):
        events += 1
        if events >= expect:
            break
    return (time.thread_time() - cpu) / max(events, 1), events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pods", type=int, default=300, help="Bindings per path")
    args = parser.parse_args()
    print(
        f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}", flush=True
    )
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-kube-") as tmp:
        sb = Sandbox(Path(tmp) / "sandbox")
        sb.up(Spec(nodes=1, product=False))
        try:
            sb.kubectl("create", "namespace", NS)
            lean = Kube(str(sb.kubeconfig))
            generated = Kube(str(sb.kubeconfig))
            generated._wire = None  # what a kubeconfig with a proxy gets: everything through urllib3
            node = str(lean.list_nodes()[0][0]["metadata"]["name"])
            _, rv = lean.list_pods(field_selector=f"metadata.namespace={NS}")
            results: dict[str, Any] = {}
            for label, kube in (("kubewire", lean), ("urllib3", generated)):
                pods = make_pods(sb, kube, label, args.pods)
                kube.bind_pod(NS, pods[0][0], pods[0][1], node)  # the connection is open before timing
                results[label] = bind_all(kube, pods[1:], node)
            for label, (cpu, wall) in results.items():
                print(
                    f"Binding via {label:8s}: {cpu * 1e6:7.0f} us CPU, {wall * 1e3:6.2f} ms wall per call "
                    f"({args.pods - 1} calls, one thread, kept-alive HTTPS)",
                    flush=True,
                )
            expect = 4 * args.pods  # each pod: ADDED and the Binding's MODIFIED, per path
            for label, kube in (("kubewire", lean), ("urllib3", generated)):
                per_event, events = read_watch(kube, rv, expect)
                print(
                    f"watch via {label:8s}: {per_event * 1e6:7.1f} us CPU per event ({events} events)",
                    flush=True,
                )
            lean.close()
            generated.close()
        finally:
            sb.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
