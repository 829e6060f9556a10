"""Figures for DRA: vGPU pods per second through kube-scheduler's DRA allocator, beside the
extender path, on the same KWOK nodes in one run (docs/dra.md).

Run (needs a 1.34+ control plane; shares of one card, as here, need 1.36; ``--without-policies``
adds a fourth burst per round on slices whose capacities carry no ``requestPolicy``):
    .venv/bin/python bench/bench_dra.py \\
        [--nodes 1000] [--pods 500] [--pairs 1] [--without-policies]

One control-plane-only sandbox in a temp folder with N KWOK nodes of 8 cards (80 GiB each), each
node carrying both what the extender path reads (the inventory annotation and a fresh plugin
Lease, as bench_scheduler.py) and what the DRA path reads (a ResourceSlice of the driver
vgpu.openaios.io with the shapes of docs/dra.md: per card ``memory`` in bytes and ``cores`` 100,
``allowMultipleAllocations``), the DeviceClass ``vgpu.openaios.io``, and a ResourceClaimTemplate
asking 1000Mi and 10 cores. The bursts run one after another and their pods are deleted in
between, so the two books never hold the same card at once (a real cluster keeps each node in
one mode). For each pair:

1. kube-scheduler alone (no extender): P pods asking ``cpu``, the baseline;
2. the extender path: P pods asking ``nvidia.com/gpumem: 1000`` through kube-scheduler + extender;
3. the DRA path: P pods each with a claim from the template, kube-scheduler alone (its DRA
   allocator). The claims are made by kube-controller-manager from the template when the pods are
   created, before kube-scheduler starts.

Pods/s from the first bound pod to the last, as a watch sees them (bench_scheduler.burst), CPU per
pod of each process, and the share of kube-scheduler alone. Prints one line per figure and the
machine; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_scheduler import (
    LAST_CPU,
    NAMESPACE,
    WATCHED,
    Extender,
    alone_then_extender,
    burst,
    create,
    node_items,
    settle,
    start_scheduler,
)
from vgpu_sandbox import controlplane
from vgpu_sandbox.cluster import Sandbox, Spec

from vgpu.dra.slices import DRIVER, build_slice
from vgpu.kube.client import Kube
from vgpu.node.discovery import Card

CARD_MIB = 81920
TEMPLATE = "bench-1000mi-10"
RESOURCE = "/apis/resource.k8s.io/v1"


def slice_items(nodes: list[dict[str, Any]], policies: bool = True) -> list[dict[str, Any]]:
    """One ResourceSlice per node, 8 cards each, built by `vgpu dra-plugin`'s own builder;
    without ``policies``, its capacities lose their ``requestPolicy`` (what that costs the
    allocator: ``--without-policies``)."""
    out = []
    for node in nodes:
        name = node["metadata"]["name"]
        cards = [
            Card(f"GPU-{name}-{k}", k, "NVIDIA A100", CARD_MIB, numa=k // 4, compute_capability="8.0")
            for k in range(8)
        ]
        made = build_slice(name, cards, 1, driver_version="570.124.6")
        if not policies:
            for dev in made["spec"]["devices"]:
                for capacity in dev["capacity"].values():
                    capacity.pop("requestPolicy", None)
        out.append(made)
    return out


def replace_slices(sb: Sandbox, nodes: list[dict[str, Any]], policies: bool) -> None:
    sb.kubectl("delete", "resourceslices", "--all", timeout=600)
    create(sb, slice_items(nodes, policies))


def dra_objects() -> list[dict[str, Any]]:
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": DRIVER,
            "count": 1,
            "capacity": {"requests": {"memory": "1000Mi", "cores": "10"}},
        },
    }
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": TEMPLATE, "namespace": NAMESPACE},
        "spec": {"spec": {"devices": {"requests": [request]}}},
    }
    return [device_class, template]


def claim_pod(name: str, scheduler: str) -> dict[str, Any]:
    limits = {"cpu": "10m"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "schedulerName": scheduler,
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": TEMPLATE}],
            "containers": [
                {
                    "name": "main",
                    "image": "x",
                    "resources": {"limits": limits, "requests": limits, "claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def claims_of(kube: Kube) -> list[dict[str, Any]]:
    return list(kube.get(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims").get("items") or [])


def wait_claims(kube: Kube, count: int, limit_s: float = 600) -> None:
    """Until the namespace holds ``count`` claims (made from the template for the pods), or none."""
    deadline = time.monotonic() + limit_s
    while len(claims_of(kube)) != count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(claims_of(kube))} ResourceClaims, waiting for {count}")
        time.sleep(1)


def delete_all(sb: Sandbox, kube: Kube) -> None:
    sb.kubectl("delete", "pods", "-n", NAMESPACE, "--all", "--wait=false", timeout=600)
    while kube.list_pods(field_selector=f"metadata.namespace={NAMESPACE}")[0]:
        time.sleep(0.5)
    wait_claims(kube, 0)  # the claims go with their pods (the resourceclaim controller)


def dra_burst(sb: Sandbox, kube: Kube, folder: Path, pods: int, config: str) -> float:
    """Pods/s placing ``pods`` claim pods with kube-scheduler alone, their claims made first."""
    create(sb, [claim_pod(f"dra-bench-{i}", "dra-bench") for i in range(pods)])
    wait_claims(kube, pods)
    start = lambda: start_scheduler(sb, folder, "dra", config)  # noqa: E731
    return burst(sb, kube, "dra-bench", pods, {}, start, create_pods=False)


def run(n: int, pods: int, pairs: int, work: Path, without_policies: bool = False) -> None:
    sb = Sandbox(work / f"sandbox-{n}")
    sb.up(Spec(nodes=1, product=False))
    ext = None
    try:
        kube = Kube(str(sb.kubeconfig))
        version = kube.get("/version").get("gitVersion", "?")
        print(f"[{n} nodes] control plane {version}", flush=True)
        if "resource.k8s.io/v1" not in sb.kubectl("api-versions").stdout.split():
            raise SystemExit(
                f"the control plane ({version}) serves no resource.k8s.io/v1: DRA needs Kubernetes 1.34+ "
                "(`make setup` builds the pinned 1.36)"
            )
        sb.kubectl("create", "namespace", NAMESPACE)
        nodes, leases = node_items(n)
        t0 = time.monotonic()
        create(sb, nodes)
        create(sb, leases)
        create(sb, slice_items(nodes))
        create(sb, dra_objects())
        print(
            f"[{n} nodes] nodes, Leases and ResourceSlices created in {time.monotonic() - t0:.1f} s",
            flush=True,
        )
        folder = work / f"ext-{n}"
        ext = Extender(sb, folder)
        state = sb.state()
        WATCHED.clear()
        for c in state.components if state else []:
            if c.name in ("kube-apiserver", "etcd", "kwok", "kube-controller-manager"):
                WATCHED[c.name] = c.pid
        WATCHED["extender"] = ext.procs[0].pid
        settle()
        plain = controlplane.scheduler_config(sb.kubeconfig, scheduler_name="plain-bench")
        dra = controlplane.scheduler_config(sb.kubeconfig, scheduler_name="dra-bench")
        ext_share, dra_share, bare_share = [], [], []
        for k in range(1, pairs + 1):
            tag = f"[{n} nodes] {k}/{pairs}" if pairs > 1 else f"[{n} nodes]"
            alone, rate = alone_then_extender(
                sb, kube, folder, plain, ext, pods, tag, lambda: delete_all(sb, kube)
            )
            ext_share.append(100.0 * rate / alone)
            print(f"{tag} extender path (gpumem 1000):     {pods} pods, {rate:6.1f} pods/s", flush=True)
            print(f"{tag}   {LAST_CPU[0]}", flush=True)
            delete_all(sb, kube)
            claimed = dra_burst(sb, kube, folder, pods, dra)
            dra_share.append(100.0 * claimed / alone)
            print(f"{tag} DRA path (claim 1000Mi, 10 cores): {pods} pods, {claimed:6.1f} pods/s", flush=True)
            print(f"{tag}   {LAST_CPU[0]}", flush=True)
            delete_all(sb, kube)
            if without_policies:
                replace_slices(sb, nodes, policies=False)
                settle()
                bare = dra_burst(sb, kube, folder, pods, dra)
                bare_share.append(100.0 * bare / alone)
                print(f"{tag} DRA path, no requestPolicy:        {pods} pods, {bare:6.1f} pods/s", flush=True)
                print(f"{tag}   {LAST_CPU[0]}", flush=True)
                delete_all(sb, kube)
                replace_slices(sb, nodes, policies=True)
                settle()
        if bare_share:
            print(
                f"[{n} nodes] DRA path without requestPolicy, share of alone, median over {pairs}: "
                f"{statistics.median(bare_share):.0f} % ({', '.join(f'{x:.0f}' for x in bare_share)})",
                flush=True,
            )
        print(
            f"[{n} nodes] share of kube-scheduler alone, median over {pairs}: extender path "
            f"{statistics.median(ext_share):.0f} % ({', '.join(f'{x:.0f}' for x in ext_share)}), DRA path "
            f"{statistics.median(dra_share):.0f} % ({', '.join(f'{x:.0f}' for x in dra_share)})",
            flush=True,
        )
    finally:
        if ext is not None:
            ext.stop()
        sb.down()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=1000, help="KWOK nodes")
    parser.add_argument("--pods", type=int, default=500, help="pods per burst")
    parser.add_argument("--pairs", type=int, default=1, help="rounds of the three bursts (median share)")
    parser.add_argument(
        "--without-policies",
        action="store_true",
        help="a fourth burst per round: the DRA path on slices whose capacities have no requestPolicy",
    )
    args = parser.parse_args()
    print(
        f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"VGPU_BIN_DIR={os.environ.get('VGPU_BIN_DIR', '')}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-dra-") as tmp:
        run(args.nodes, args.pods, args.pairs, Path(tmp), args.without_policies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
