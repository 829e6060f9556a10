"""Figures for DRA: vGPU pods per second through kube-scheduler's DRA allocator, beside the
extender path, on the same KWOK nodes in one run (docs/dra.md).

Run (needs a 1.34+ control plane; shares of one card, as here, need 1.36):
    .venv/bin/python bench/bench_dra.py \\
        [--nodes 1000] [--pods 500] [--pairs 1] [--shapes main,current,bare,plain,current@10] \\
        [--profile DIR [--profile-seconds 10]] [--keep DIR]

``--shapes``: the slice, DeviceClass and claim shapes of bench/dra_shapes.py, a DRA burst each per
round, in turn (each round starts where the last ended, so the slices are replaced as seldom as
possible); ``NAME@P`` runs the shape with kube-scheduler's ``percentageOfNodesToScore`` P.
``--profile``: a CPU profile of kube-scheduler over each DRA burst's first seconds
(bench/dra_profile.py), its top frames printed. (The other processes' CPU per pod in a DRA burst
is mostly the cluster's upkeep, which the run prints first: KWOK's node heartbeats cost the API
server, etcd and KWOK the same CPU per second whatever is scheduled, so per pod they grow with
the burst's length.)

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
3. the DRA path, once per shape: P pods each with a claim from the template, kube-scheduler
   alone (its DRA allocator). The claims are made by kube-controller-manager from the template
   when the pods are created, before kube-scheduler starts.

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
    cpu_seconds,
    create,
    node_items,
    settle,
    start_scheduler,
)
from dra_profile import Profiled, top
from dra_shapes import SHAPES, Shape
from vgpu_sandbox import controlplane, product
from vgpu_sandbox.cluster import Sandbox, Spec

from vgpu.dra.slices import DRIVER
from vgpu.kube.client import Kube

TEMPLATE = "bench-1000mi-10"
RESOURCE = "/apis/resource.k8s.io/v1"


def base(variant: str) -> str:
    """The shape of a ``--shapes`` entry: ``main@10`` is the shape ``main``."""
    return variant.partition("@")[0]


def percentage(variant: str) -> int | None:
    """kube-scheduler's ``percentageOfNodesToScore`` of a ``--shapes`` entry (``main@10``: 10),
    None for its default (at 1,000 nodes: 42 %, at least 100 nodes)."""
    pct = variant.partition("@")[2]
    return int(pct) if pct.isdigit() else None


def cpu_cores(seconds: float) -> str:
    """CPU cores each watched process uses over ``seconds`` with nothing scheduled."""
    before = {k: cpu_seconds(p) for k, p in WATCHED.items()}
    time.sleep(seconds)
    return ", ".join(f"{k} {(cpu_seconds(p) - before[k]) / seconds:.2f}" for k, p in WATCHED.items())


def apply_shape(sb: Sandbox, kube: Kube, nodes: list[dict[str, Any]], shape: Shape, first: bool) -> None:
    """Every node's slice, the DeviceClass and the claim template as ``shape`` has them."""
    if not first:
        # one collection delete: kubectl's --all deletes the slices one by one (minutes at 1,000)
        sb.kubectl("delete", "--raw", f"{RESOURCE}/resourceslices", timeout=600)
        while kube.get(f"{RESOURCE}/resourceslices?limit=1").get("items"):
            time.sleep(0.5)
        sb.kubectl("delete", "deviceclass", DRIVER, timeout=120)
        sb.kubectl("delete", "resourceclaimtemplate", "-n", NAMESPACE, TEMPLATE, timeout=120)
    create(sb, shape.slices(nodes))
    create(sb, shape.objects(NAMESPACE, TEMPLATE))


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


def dra_burst(
    sb: Sandbox, kube: Kube, folder: Path, pods: int, config: str, profiled: Profiled | None = None
) -> float:
    """Pods/s placing ``pods`` claim pods with kube-scheduler alone, their claims made first
    (``profiled``: kube-scheduler started with its pprof endpoint, and profiled)."""
    create(sb, [claim_pod(f"dra-bench-{i}", "dra-bench") for i in range(pods)])
    wait_claims(kube, pods)
    if profiled is not None:
        start = lambda: profiled.start("dra", config)  # noqa: E731
    else:
        start = lambda: start_scheduler(sb, folder, "dra", config)  # noqa: E731
    rate = burst(sb, kube, "dra-bench", pods, {}, start, create_pods=False)
    if profiled is not None and (why := profiled.wait()):
        print(f"  {why}", flush=True)
    return rate


def run(
    n: int, pods: int, pairs: int, work: Path, shapes: list[str], profile: Path | None, seconds: float
) -> None:
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
        current = base(shapes[0])
        apply_shape(sb, kube, nodes, SHAPES[current], first=True)
        print(
            f"[{n} nodes] nodes, Leases and ResourceSlices created in {time.monotonic() - t0:.1f} s",
            flush=True,
        )
        folder = work / f"ext-{n}"
        product.grant_accounts(sb)  # the scheduler's account, which the extender impersonates
        ext = Extender(sb, folder)
        state = sb.state()
        WATCHED.clear()
        for c in state.components if state else []:
            if c.name in ("kube-apiserver", "etcd", "kwok", "kube-controller-manager"):
                WATCHED[c.name] = c.pid
        WATCHED["extender"] = ext.procs[0].pid
        settle()
        plain = controlplane.scheduler_config(sb.kubeconfig, scheduler_name="plain-bench")
        upkeep = cpu_cores(5.0)
        # the cluster's own upkeep (KWOK's 1,000 node heartbeats: Lease and node status writes),
        # which every burst pays for as long as it lasts: it weighs most on the slowest burst's
        # per-pod figures (per pod = these cores x the burst's seconds / pods)
        print(f"[{n} nodes] upkeep with no pods, CPU cores: {upkeep}", flush=True)
        ext_share: list[float] = []
        shares: dict[str, list[float]] = {name: [] for name in shapes}
        for k in range(1, pairs + 1):
            tag = f"[{n} nodes] {k}/{pairs}" if pairs > 1 else f"[{n} nodes]"
            alone, rate = alone_then_extender(
                sb, kube, folder, plain, ext, pods, tag, lambda: delete_all(sb, kube)
            )
            ext_share.append(100.0 * rate / alone)
            print(f"{tag} extender path (gpumem 1000):     {pods} pods, {rate:6.1f} pods/s", flush=True)
            print(f"{tag}   {LAST_CPU[0]}", flush=True)
            delete_all(sb, kube)
            # each round takes the shapes in turn, starting where the last round ended
            order = shapes if base(shapes[0]) == current else list(reversed(shapes))
            for name in order:
                if base(name) != current:
                    current = base(name)
                    apply_shape(sb, kube, nodes, SHAPES[current], first=False)
                    settle()
                dra = controlplane.scheduler_config(
                    sb.kubeconfig, scheduler_name="dra-bench", percentage_of_nodes_to_score=percentage(name)
                )
                profiled = None
                if profile is not None:
                    out = profile / f"dra-{n}-{name}-{k}.pb.gz"
                    profiled = Profiled(sb, folder, seconds, out)
                claimed = dra_burst(sb, kube, folder, pods, dra, profiled)
                shares[name].append(100.0 * claimed / alone)
                print(
                    f"{tag} DRA path, shape {name:9s}: {pods} pods, {claimed:6.1f} pods/s "
                    f"({shares[name][-1]:.0f} % of alone)",
                    flush=True,
                )
                print(f"{tag}   {LAST_CPU[0]}", flush=True)
                if profiled is not None and profiled.out.exists():
                    print(f"{tag}   profile {profiled.out}", flush=True)
                    print(top(sb.bin("kube-scheduler"), profiled.out), flush=True)
                delete_all(sb, kube)
        print(
            f"[{n} nodes] share of kube-scheduler alone, median over {pairs}: extender path "
            f"{statistics.median(ext_share):.0f} % ({', '.join(f'{x:.0f}' for x in ext_share)})",
            flush=True,
        )
        for name, got in shares.items():
            print(
                f"[{n} nodes]   DRA path, shape {name}: {statistics.median(got):.0f} % "
                f"({', '.join(f'{x:.0f}' for x in got)})",
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
    parser.add_argument("--pairs", type=int, default=1, help="rounds of the bursts (median share)")
    parser.add_argument(
        "--shapes",
        default="current",
        help=f"comma-separated shapes ({', '.join(SHAPES)}), a DRA burst each per round; NAME@P: with "
        "kube-scheduler's percentageOfNodesToScore P",
    )
    parser.add_argument(
        "--profile", type=Path, help="folder for a CPU profile of kube-scheduler per DRA burst"
    )
    parser.add_argument("--keep", type=Path, help="work in this folder (kept) instead of a temporary one")
    parser.add_argument("--profile-seconds", type=float, default=10, help="length of each profile")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if base(s) not in SHAPES or (percentage(s) or 1) not in range(1, 101)]
    if unknown or not shapes:
        parser.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    print(
        f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
        f"VGPU_BIN_DIR={os.environ.get('VGPU_BIN_DIR', '')}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-dra-") as tmp:
        run(
            args.nodes,
            args.pods,
            args.pairs,
            Path(args.keep or tmp),
            shapes,
            args.profile,
            args.profile_seconds,
        )
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
