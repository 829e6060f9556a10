"""The extender's request path, configuration against configuration, interleaved in rounds.

Run: .venv/bin/python bench/bench_request_path.py [--nodes 1000] [--pods 300] [--rounds 4]
         [--configs hand,stock,...] [--base DIR]

A control plane of etcd and kube-apiserver only (the sandbox's, with KWOK, kube-scheduler and
kube-controller-manager stopped once the namespace has its ServiceAccount), N Node objects of 8
GPUs (80 GiB, split 10) with an inventory annotation and a fresh plugin Lease, and no KWOK: the
nodes cost nothing while they sit there, so on a small machine the figures are the extender's and
the API server's. In each round every configuration, in an order rotated per round: P pods
created, the extender started with that configuration, then a client standing in for
kube-scheduler schedules the P pods through it: ``/filter`` with every node's name on one kept-alive
HTTPS connection, one pod after the other, and each answer's ``/bind`` handed to 16 threads with
a connection each, as kube-scheduler binds asynchronously. pods/s from the first filter to the last
bind answered; then the extender stops and the pods are deleted.

Configurations (environment of the extender; see vgpu/extender/fastpath.py):

- ``hand``: today's path: the worker with its short parser, the wire client;
- ``stock``: Flask's routing on gunicorn's gthread worker, the kubernetes client;
- ``no-parser``, ``no-worker``, ``no-wire``: ``hand`` less one part;
- ``base``: the extender from another checkout (``--base DIR``, e.g. a ``git worktree`` of the
  commit before a change), put first on PYTHONPATH.

Prints per configuration and round the pods/s and the extender's CPU per pod, then the median and
spread (min-max) per configuration; asserts nothing.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
from bench_scheduler import cpu_seconds, create, free_port, node_items, stop
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.pki import CertificateAuthority

from vgpu.extender.fastpath import WIRE_ENV, WORKER_ENV
from vgpu.extender.worker import SHORT_PARSER_ENV
from vgpu.kube.client import Kube

NAMESPACE = "bench"
OFF = "0"
CONFIGS: dict[str, dict[str, str]] = {
    "hand": {},
    "stock": {WORKER_ENV: OFF, WIRE_ENV: OFF},
    "no-parser": {SHORT_PARSER_ENV: OFF},
    "no-worker": {WORKER_ENV: OFF},
    "no-wire": {WIRE_ENV: OFF},
    "base": {},
}
BIND_THREADS = 16


def pod(name: str) -> dict[str, Any]:
    limits = {"nvidia.com/gpumem": "1000"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "schedulerName": "nobody",
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "x", "resources": {"limits": limits}}],
        },
    }


class Extender:
    def __init__(self, sb: Sandbox, folder: Path, env_extra: dict[str, str], pythonpath: str | None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        ca = CertificateAuthority(folder / "pki")
        self.ca_path = str(ca.cert_path)
        pair = ca.issue("extender", ["127.0.0.1"])
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env["VGPU_LEADER_LEASE"] = "vgpu-bench-extender"
        env.update(env_extra)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        argv = [
            sys.executable, "-m", "vgpu.commands.cli", "extender", f"--kubeconfig={sb.kubeconfig}",
            f"--listen=127.0.0.1:{self.port}", f"--cert-file={pair.cert}", f"--key-file={pair.key}",
            f"--metrics-listen=127.0.0.1:{free_port()}", "--namespace=kube-system",
            "--scheduler-name=nobody", "--identity=bench",
        ]  # fmt: skip
        log = (folder / "extender.log").open("ab")
        self.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(self.url + "/readyz", verify=self.ca_path, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("extender not ready; see " + str(folder / "extender.log"))
            time.sleep(0.3)

    def connection(self) -> http.client.HTTPSConnection:
        context = ssl.create_default_context(cafile=self.ca_path)
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=context, timeout=60)


def call(conn: http.client.HTTPSConnection, path: str, body: bytes) -> Any:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:300]!r}")
    return json.loads(data)


def schedule(ext: Extender, pods: list[dict[str, Any]], names: list[str]) -> tuple[float, int]:
    """(seconds from the first filter to the last bind answered, binds that failed)."""
    local = threading.local()
    failed = [0]

    def bind(p: dict[str, Any], node: str) -> None:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = ext.connection()
        meta = p["metadata"]
        args = {"PodName": meta["name"], "PodNamespace": NAMESPACE, "PodUID": meta["uid"], "Node": node}
        if call(conn, "/bind", json.dumps(args).encode()).get("Error"):
            failed[0] += 1

    conn = ext.connection()
    start = time.monotonic()
    with ThreadPoolExecutor(BIND_THREADS) as pool:
        futures = []
        for p in pods:
            body = json.dumps({"Pod": p, "NodeNames": names}).encode()
            answer = call(conn, "/filter", body)
            if answer.get("Error") or not answer.get("NodeNames"):
                raise RuntimeError(f"filter: {answer.get('Error') or 'no node fits'}")
            futures.append(pool.submit(bind, p, answer["NodeNames"][0]))
        for f in futures:
            f.result()
    return time.monotonic() - start, failed[0]


def delete_pods(sb: Sandbox, kube: Kube) -> None:
    sb.kubectl("delete", "pods", "-n", NAMESPACE, "--all", "--grace-period=0", "--force", timeout=600)
    while kube.list_pods(field_selector=f"metadata.namespace={NAMESPACE}")[0]:
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=300, help="pods per burst")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--configs", default="hand,stock", help="comma list of: " + ", ".join(CONFIGS))
    parser.add_argument("--base", default=None, help="checkout whose extender the 'base' configuration runs")
    args = parser.parse_args()
    configs = args.configs.split(",")
    for c in configs:
        if c not in CONFIGS:
            parser.error(f"unknown configuration {c!r}")
    if "base" in configs and not args.base:
        parser.error("the base configuration needs --base DIR")
    print(
        f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load "
        + " ".join(f"{x:.1f}" for x in os.getloadavg()),
        flush=True,
    )
    rates: dict[str, list[float]] = {c: [] for c in configs}
    cpus: dict[str, list[float]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-path-") as tmp:
        work = Path(tmp)
        sb = Sandbox(work / "sandbox")
        sb.up(Spec(nodes=1, product=False))
        try:
            kube = Kube(str(sb.kubeconfig))
            sb.kubectl("create", "namespace", NAMESPACE)
            for _ in range(120):
                try:
                    if sb.api_get(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default"):
                        break
                except OSError:  # 404 until kube-controller-manager made it
                    pass
                time.sleep(0.5)
            state = sb.state()
            for c in state.components if state else []:
                if c.name in ("kwok", "kube-scheduler", "kube-controller-manager"):
                    os.kill(c.pid, 15)
            nodes, leases = node_items(args.nodes)
            for n in nodes:
                n["metadata"]["annotations"].pop("kwok.x-k8s.io/node", None)
            create(sb, nodes)
            create(sb, leases)
            names = [n["metadata"]["name"] for n in nodes]
            print(
                f"{args.nodes} nodes (no KWOK), {args.pods} pods per burst, {args.rounds} rounds", flush=True
            )
            for r in range(args.rounds):
                order = configs[r % len(configs) :] + configs[: r % len(configs)]
                for c in order:
                    create(sb, [pod(f"p{r}-{c}-{i}") for i in range(args.pods)])
                    listed, _ = kube.list_pods(field_selector=f"metadata.namespace={NAMESPACE}")
                    pods = sorted(listed, key=lambda p: int(p["metadata"]["name"].rsplit("-", 1)[1]))
                    pods = [{"metadata": p["metadata"], "spec": p["spec"]} for p in pods]
                    ext = Extender(sb, work / f"ext-{c}", CONFIGS[c], args.base if c == "base" else None)
                    try:
                        time.sleep(2)
                        cpu0 = cpu_seconds(ext.proc.pid)
                        seconds, failed = schedule(ext, pods, names)
                        cpu = (cpu_seconds(ext.proc.pid) - cpu0) / len(pods)
                    finally:
                        stop(ext.proc)
                    rate = len(pods) / seconds
                    rates[c].append(rate)
                    cpus[c].append(cpu)
                    print(
                        f"round {r + 1} {c:10s} {rate:6.1f} pods/s, extender CPU {cpu * 1000:.2f} ms per pod"
                        + (f", {failed} binds failed" if failed else ""),
                        flush=True,
                    )
                    delete_pods(sb, kube)
        finally:
            sb.down()
    print("configuration: pods/s median (min-max), extender CPU ms per pod median", flush=True)
    ref = statistics.median(rates[configs[0]])
    for c in configs:
        med = statistics.median(rates[c])
        print(
            f"{c:10s} {med:6.1f} ({min(rates[c]):.1f}-{max(rates[c]):.1f}) pods/s, "
            f"{statistics.median(cpus[c]) * 1000:.2f} ms; {100 * med / ref:.0f} % of {configs[0]}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
