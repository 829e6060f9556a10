"""Figures for the scheduler: pods per second through the real kube-scheduler, and filter latency.

Run: .venv/bin/python bench/bench_scheduler.py [--nodes 100,1000] [--pods 500] [--pairs 1]
         [--extender-src DIR]
         [--filter-calls 200] [--percentage-of-nodes-to-score P] [--kube-api-qps Q]
         [--short-parser on|off] [--client-auth on|off] [--policies both|off|on]

For each cluster size: a control-plane-only sandbox in a temp folder, N KWOK nodes of 8 GPUs
(80 GiB, split 10) with an inventory annotation and a fresh plugin Lease, and our own extender
with a kube-scheduler profile calling it over verified TLS. Then, on the same cluster:

1. kube-scheduler alone (a profile without extender): P pods asking for plain ``cpu``.
2. with the extender (filter and bind; prioritize too with ``--filter-keep`` above 1): P pods asking
   ``nvidia.com/gpumem: 1000``.
   In both, the pods are created first and the scheduler started after (once the extender is
   quiet), since creating pods through the API is slower than scheduling them here; pods/s from
   the first bound pod to the last, as a watch on the pods sees them.
3. the extender's own latency per verb over the burst (mean, and the histogram bucket holding
   p50/p99), and, at the largest size once the pods are gone and the cluster is quiet, ``/filter``
   called directly over HTTPS with every node's name for a pod asking one vGPU: p50/p99 as the
   caller sees it (JSON and TLS included), and the extender's CPU per call.
4. CPU per pod of each process (kube-apiserver, etcd, KWOK, kube-controller-manager,
   kube-scheduler, the extender) over each burst, from /proc; and, before the bursts, what the
   idle cluster's upkeep takes (KWOK renews 1,000 node Leases every 10 s, as kubelets do), in cores.
5. With ``--pairs N``: N alone/with-extender pairs back to back and the median share, since on a
   shared machine single bursts vary by a factor of two.
6. How many nodes the burst's pods landed on: under the extender's default node policy
   (binpack) the fewest that hold them is ceil(pods / 80); kube-scheduler offers the extender
   only the nodes its own search collected (42 % of 1,000 by default; all of them with
   ``--percentage-of-nodes-to-score 100``, which both profiles then use).
7. kube-scheduler's own API client runs at 200 QPS, burst 400, in both profiles (its default is
   50 / 100); ``--kube-api-qps Q`` sets Q and 2Q. It limits the binds kube-scheduler alone makes,
   not the extender's (the extender writes the Binding itself): on a machine with cores to spare,
   kube-scheduler alone runs at that limit. ``bench/offline.sh`` runs this bench on such a
   machine when it has neither Go nor a package index.
8. ``--short-parser off`` runs the extender with ``VGPU_EXTENDER_SHORT_PARSER=0`` (every request
   through gunicorn's own HTTP parser), for an A/B of the worker's short parser.
9. ``--client-auth off`` runs the extender without ``--client-ca-file`` and kube-scheduler without
   its client certificate (the chart's ``scheduler.extender.clientAuth: false``), for an A/B of
   what the client certificate costs in each TLS handshake (default on, as the chart).
10. ``--policies both`` (the default) runs the bursts without, then with the chart's tenant-boundary
    admission policies (docs/security.md), on the same cluster: the cost of the CEL checks on every
    pod write and Binding. The extender runs as the scheduler's account in both (the sandbox's
    identity impersonating it, as the sandbox runs it), which the placement policy trusts.
    ``off`` or ``on``: one of the two.
11. ``--extender-src DIR`` (a checkout of another commit, e.g. ``git worktree add --detach DIR
    main``): before and after in one run. Each round runs kube-scheduler alone, then the
    extender from DIR ("base") and this checkout's ("new"), the two in turn first, one extender
    process at a time (each started for its burst, so neither's watches take CPU from the
    other's), then ``/filter`` idle twice each; the median share of each. Policies off. With
    ``VGPU_BENCH_PROFILE=DIR`` (and py-spy in the venv), py-spy samples each extender and its
    gunicorn worker over each burst into ``DIR/<nodes>-<base|new>-<round>.txt`` (raw stacks).

Prints one line per figure and the machine; asserts nothing.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
from vgpu_sandbox import controlplane, product
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.pki import CertificateAuthority

from vgpu.core import annotations as ann
from vgpu.extender.worker import SHORT_PARSER_ENV
from vgpu.kube.client import Kube, now_micro

SCHEDULER = "vgpu-bench"
NAMESPACE = "bench"
GROUP = "vgpu.openaios.io/bench"
MANAGED = ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_items(n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    nodes, leases = [], []
    for i in range(n):
        name = f"bench-{i}"
        devices = tuple(
            ann.Device(f"GPU-{name}-{k}", k, "NVIDIA A100", 81920, 100, 10, numa=k // 4) for k in range(8)
        )
        res = {"cpu": "64", "memory": "512Gi", "pods": "250", "nvidia.com/gpu": "80"}
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {GROUP: "yes", "kubernetes.io/hostname": name, "type": "kwok"},
                    "annotations": {
                        "kwok.x-k8s.io/node": "fake",
                        ann.DEVICES_ANNOTATION: ann.encode_devices(ann.NodeInventory(devices)),
                    },
                },
                "status": {"capacity": res, "allocatable": res},
            }
        )
        leases.append(
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": ann.lease_name(name), "namespace": "kube-system"},
                "spec": {"holderIdentity": name, "leaseDurationSeconds": 36000, "renewTime": now_micro()},
            }
        )
    return nodes, leases


def create(sb: Sandbox, items: list[dict[str, Any]], chunk: int = 250) -> None:
    for i in range(0, len(items), chunk):
        doc = {"apiVersion": "v1", "kind": "List", "items": items[i : i + chunk]}
        sb.kubectl("create", "-f", "-", input=json.dumps(doc), timeout=600)


def pod(name: str, scheduler: str, limits: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "schedulerName": scheduler,
            "nodeSelector": {GROUP: "yes"},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "main", "image": "x", "resources": {"limits": limits, "requests": limits}}
            ],
        },
    }


def start_scheduler(sb: Sandbox, folder: Path, name: str, config_json: str) -> subprocess.Popen[bytes]:
    config = folder / f"{name}.json"
    config.write_text(config_json)
    log = (folder / f"{name}.log").open("ab")
    argv = controlplane.scheduler_argv(sb.bin("kube-scheduler"), config)
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
            for child in children:
                out.extend(_tree(int(child)))
    except OSError:
        pass
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its descendants, in seconds."""
    total = 0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def cpu_report(before: dict[str, float], after: dict[str, float], pods: int) -> str:
    parts = [f"{k} {(after[k] - before.get(k, 0)) * 1000 / pods:.1f}" for k in after]
    return "CPU ms per pod: " + ", ".join(parts)


def burst(
    sb: Sandbox,
    kube: Kube,
    scheduler: str,
    count: int,
    limits: dict[str, str],
    start: Any,
    create_pods: bool = True,
) -> float:
    """Pods/s binding ``count`` pods that wait for their scheduler, once ``start()`` has started it.

    The pods are created first (creating them is slower than scheduling them here), then the
    scheduler starts; the rate is taken from the first bound pod to the last, as a watch sees them.
    ``create_pods=False``: the caller created them (bench_dra.py: pods with claims).
    """
    if create_pods:
        create(sb, [pod(f"{scheduler}-{i}", scheduler, limits) for i in range(count)])
    selector = f"metadata.namespace={NAMESPACE},spec.schedulerName={scheduler}"
    _, rv = kube.list_pods(field_selector=selector)
    settle()
    proc = start()
    watched = dict(WATCHED)
    watched["kube-scheduler"] = proc.pid
    before = {name: cpu_seconds(pid) for name, pid in watched.items()}
    bound: dict[str, float] = {}
    on_nodes: set[str] = set()
    try:
        deadline = time.monotonic() + 900
        while len(bound) < count and time.monotonic() < deadline:
            for kind, obj in kube.watch_pods(rv, field_selector=selector, timeout_s=60):
                rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                if kind != "BOOKMARK" and (obj.get("spec") or {}).get("nodeName"):
                    bound.setdefault(obj["metadata"]["name"], time.monotonic())
                    on_nodes.add(obj["spec"]["nodeName"])
                if len(bound) >= count:
                    break
        if len(bound) < count:
            raise RuntimeError(f"{scheduler}: {count - len(bound)} pods still pending after 900 s")
        after = {name: cpu_seconds(pid) for name, pid in watched.items()}
        LAST_CPU[0] = cpu_report(before, after, count) + f"; on {len(on_nodes)} nodes"
        times = sorted(bound.values())
        return (count - 1) / max(times[-1] - times[0], 1e-3)
    finally:
        stop(proc)


def settle(quiet_s: int = 6, limit_s: float = 90.0) -> None:
    """Wait until the extender has been quiet (under 5 % of a core) for ``quiet_s`` seconds running.

    Its first gauge refresh (every card of every node, 5 s after it starts) would otherwise fall
    into the first burst and take CPU from kube-scheduler alone.
    """
    pid = WATCHED.get("extender")
    deadline = time.monotonic() + limit_s
    quiet = 0
    while pid is not None and quiet < quiet_s and time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(1.0)
        quiet = quiet + 1 if cpu_seconds(pid) - before < 0.05 else 0


PROFILE = os.environ.get("VGPU_BENCH_PROFILE", "")  # a folder: py-spy's samples of each A/B burst
WATCHED: dict[str, int] = {}  # name -> pid of the processes whose CPU a burst reports
LAST_CPU = [""]


def delete_pods(sb: Sandbox, kube: Kube) -> None:
    sb.kubectl("delete", "pods", "-n", NAMESPACE, "--all", "--wait=false", timeout=600)
    while kube.list_pods(field_selector=f"metadata.namespace={NAMESPACE}")[0]:
        time.sleep(0.5)


def python_of(src: str | None) -> list[str]:
    """The command that runs ``vgpu.commands.cli`` from ``src`` (a checkout of another commit,
    ``--extender-src``) instead of this one: the editable install's finder is taken out of the
    import path first, so ``vgpu`` is the one in ``src``."""
    if src is None:
        return [sys.executable, "-m", "vgpu.commands.cli"]
    boot = (
        "import runpy, sys; "
        "sys.meta_path[:] = [f for f in sys.meta_path "
        "if not getattr(f, '__module__', '').startswith('__editable___vgpu_0')]; "
        f"sys.path.insert(0, {src!r}); sys.argv[0] = 'vgpu'; "
        "runpy.run_module('vgpu.commands.cli', run_name='__main__')"
    )
    return [sys.executable, "-c", boot]


class Extender:
    def __init__(
        self,
        sb: Sandbox,
        folder: Path,
        percentage: int | None = None,
        qps: int = 200,
        short_parser: bool = True,
        client_auth: bool = True,
        src: str | None = None,
        lease_name: str = "vgpu-bench-extender",
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        ca = CertificateAuthority(folder / "pki")
        self.ca_path = str(ca.cert_path)
        pair = ca.issue("extender", ["127.0.0.1"])
        client = ca.issue("bench-kube-scheduler", [], client=True) if client_auth else None
        self.client_cert = (str(client.cert), str(client.key)) if client else None
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env["VGPU_LEADER_LEASE"] = lease_name
        if not short_parser:
            env[SHORT_PARSER_ENV] = "0"
        # as the scheduler's account, which the tenant boundary's placement policy trusts
        kubeconfig = product.account_kubeconfig(sb, "bench-scheduler", product.SCHEDULER_ACCOUNT)
        argv = [
            *python_of(src), "extender", f"--kubeconfig={kubeconfig}",
            f"--listen=127.0.0.1:{self.port}", f"--cert-file={pair.cert}", f"--key-file={pair.key}",
            f"--metrics-listen=127.0.0.1:{self.metrics_port}", "--namespace=kube-system",
            f"--scheduler-name={SCHEDULER}", "--identity=bench",
        ]  # fmt: skip
        if client_auth:
            argv.append(f"--client-ca-file={ca.cert_path}")
        log = (folder / "extender.log").open("ab")
        self.procs = [
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        ]
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(self.url + "/readyz", verify=self.ca_path, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("extender not ready; see " + str(folder / "extender.log"))
            time.sleep(0.3)
        self.scheduler_config = controlplane.scheduler_config(
            sb.kubeconfig,
            scheduler_name=SCHEDULER,
            extender_url=self.url,
            extender_ca_b64=base64.b64encode(ca.pem).decode(),
            extender_client=(client.cert, client.key) if client else None,
            managed_resources=MANAGED,
            percentage_of_nodes_to_score=percentage,
            client_qps=qps,
        )

    def verb_latency(self) -> str:
        """Per verb, from the extender's histogram: calls, mean, and the bucket holding p50/p99."""
        text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        out = []
        for verb in ("filter", "prioritize", "bind"):
            buckets: list[tuple[float, float]] = []
            total = count = 0.0
            for line in text.splitlines():
                if f'verb="{verb}"' not in line:
                    continue
                value = float(line.split()[-1])
                if line.startswith("vgpu_scheduler_verb_duration_seconds_bucket{"):
                    le = line.split('le="')[1].split('"')[0]
                    buckets.append((float("inf") if le == "+Inf" else float(le), value))
                elif line.startswith("vgpu_scheduler_verb_duration_seconds_sum"):
                    total = value
                elif line.startswith("vgpu_scheduler_verb_duration_seconds_count"):
                    count = value
            if not count:
                continue
            buckets.sort()
            p50 = next(le for le, c in buckets if c >= count * 0.5)
            p99 = next(le for le, c in buckets if c >= count * 0.99)
            out.append(
                f"{verb} {int(count)} calls mean {total / count * 1000:.1f} ms "
                f"p50 <= {p50 * 1000:g} ms p99 <= {p99 * 1000:g} ms"
            )
        return "; ".join(out) or "no calls recorded"

    def stop(self) -> None:
        for p in self.procs:
            stop(p)


def filter_latency(ext: Extender, names: list[str], calls: int) -> tuple[float, float, int, float]:
    """(p50, p99 of the round trip, nodes passed, extender CPU seconds per call)."""
    body = json.dumps(
        {
            "Pod": {
                "metadata": {"name": "probe", "namespace": NAMESPACE, "uid": "probe-uid"},
                "spec": {
                    "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpumem": "1000"}}}]
                },
            },
            "NodeNames": names,
        }
    )
    session = requests.Session()  # one TLS connection, kept alive, as kube-scheduler does
    headers = {"Content-Type": "application/json"}
    times = []
    cpu0 = cpu_seconds(ext.procs[0].pid)
    for _ in range(calls):
        start = time.perf_counter()
        # verify= per call: a session-wide setting loses to REQUESTS_CA_BUNDLE in the environment
        r = session.post(
            ext.url + "/filter",
            data=body,
            headers=headers,
            verify=ext.ca_path,
            cert=ext.client_cert,
            timeout=30,
        )
        times.append(time.perf_counter() - start)
        answer = r.json()
        if r.status_code != 200 or answer.get("Error"):
            raise RuntimeError(f"filter failed: HTTP {r.status_code}: {r.text[:300]}")
        passed = len(answer["NodeNames"])
    cpu = (cpu_seconds(ext.procs[0].pid) - cpu0) / calls
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))], passed, cpu


def alone_then_extender(
    sb: Sandbox,
    kube: Kube,
    folder: Path,
    plain: str,
    ext: Extender,
    pods: int,
    tag: str,
    clean: Callable[[], None],
) -> tuple[float, float]:
    """One burst through kube-scheduler alone (``plain``: its config) and one through kube-scheduler
    with the extender, the first printed with its CPU and followed by ``clean``; (alone, extender)
    pods/s."""
    start = lambda: start_scheduler(sb, folder, "plain", plain)  # noqa: E731
    alone = burst(sb, kube, "plain-bench", pods, {"cpu": "10m"}, start)
    print(f"{tag} kube-scheduler alone:           {pods} pods, {alone:6.1f} pods/s", flush=True)
    print(f"{tag}   {LAST_CPU[0]}", flush=True)
    clean()
    rate = burst(
        sb,
        kube,
        SCHEDULER,
        pods,
        {"nvidia.com/gpumem": "1000"},
        lambda: start_scheduler(sb, folder, "vgpu", ext.scheduler_config),
    )
    return alone, rate


def run_pairs(
    sb: Sandbox,
    kube: Kube,
    folder: Path,
    plain: str,
    ext: Extender,
    n: int,
    pods: int,
    pairs: int,
    label: str,
) -> None:
    """``pairs`` alone/with-extender bursts back to back, each share printed, and their median."""
    shares = []
    for k in range(1, pairs + 1):
        tag = f"[{n} nodes{label}] pair {k}/{pairs}" if pairs > 1 else f"[{n} nodes{label}]"
        alone, rate = alone_then_extender(
            sb, kube, folder, plain, ext, pods, tag, lambda: delete_pods(sb, kube)
        )
        shares.append(100.0 * rate / alone)
        print(
            f"{tag} kube-scheduler + vGPU extender: {pods} pods, {rate:6.1f} pods/s "
            f"({shares[-1]:.0f} % of alone)",
            flush=True,
        )
        print(f"{tag}   {LAST_CPU[0]}", flush=True)
        delete_pods(sb, kube)
    if pairs > 1:
        print(
            f"[{n} nodes{label}] share of kube-scheduler's own rate over {pairs} pairs: median "
            f"{statistics.median(shares):.0f} %, each: " + ", ".join(f"{x:.0f} %" for x in shares),
            flush=True,
        )


def profile(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` and its children (gunicorn's worker) until SIGINT, raw stacks in ``out``."""
    spy = Path(sys.executable).with_name("py-spy")
    argv = [str(spy), "record", "-p", str(pid), "-r", "250", "-f", "raw", "-o", str(out)]
    return subprocess.Popen(
        [*argv, "--threads", "--subprocesses"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def stop_profiles(spies: list[subprocess.Popen[bytes]]) -> None:
    while spies:
        spy = spies.pop()
        spy.send_signal(signal.SIGINT)
        spy.wait(60)


def run_ab(
    sb: Sandbox,
    kube: Kube,
    folder: Path,
    plain: str,
    start_ext: Callable[[str, str | None], Extender],
    src: str,
    n: int,
    pods: int,
    pairs: int,
    filter_calls: int,
    names: list[str],
) -> None:
    """``pairs`` rounds of kube-scheduler alone, then with the extender from ``src`` ("base") and
    with this checkout's ("new"), the two in turn first; one extender process runs at a time."""
    shares: dict[str, list[float]] = {"base": [], "new": []}
    for k in range(1, pairs + 1):
        tag = f"[{n} nodes] round {k}/{pairs}"
        WATCHED.pop("extender", None)
        start = lambda: start_scheduler(sb, folder, "plain", plain)  # noqa: E731
        alone = burst(sb, kube, "plain-bench", pods, {"cpu": "10m"}, start)
        print(f"{tag} kube-scheduler alone: {pods} pods, {alone:6.1f} pods/s", flush=True)
        print(f"{tag}   {LAST_CPU[0]}", flush=True)
        delete_pods(sb, kube)
        order = [("base", src), ("new", None)]
        for variant, where in order if k % 2 else order[::-1]:
            ext = start_ext(variant, where)
            spies: list[subprocess.Popen[bytes]] = []
            try:
                WATCHED["extender"] = ext.procs[0].pid

                def go(
                    e: Extender = ext,
                    v: str = variant,
                    k: int = k,
                    spies: list[subprocess.Popen[bytes]] = spies,
                ) -> subprocess.Popen[bytes]:
                    if PROFILE:  # py-spy on the extender over the burst, once it settled
                        spies.append(profile(e.procs[0].pid, Path(PROFILE) / f"{n}-{v}-{k}.txt"))
                    return start_scheduler(sb, folder, "vgpu", e.scheduler_config)

                rate = burst(sb, kube, SCHEDULER, pods, {"nvidia.com/gpumem": "1000"}, go)
                stop_profiles(spies)
                shares[variant].append(100.0 * rate / alone)
                print(
                    f"{tag} {variant} extender: {pods} pods, {rate:6.1f} pods/s "
                    f"({shares[variant][-1]:.0f} % of alone)",
                    flush=True,
                )
                print(f"{tag}   {variant} {LAST_CPU[0]}", flush=True)
                print(f"{tag}   {variant} server side: {ext.verb_latency()}", flush=True)
            finally:
                stop_profiles(spies)
                ext.stop()
                WATCHED.pop("extender", None)
            delete_pods(sb, kube)
    for variant, got in shares.items():
        print(
            f"[{n} nodes] {variant}: share of kube-scheduler alone, median "
            f"{statistics.median(got):.0f} %, each: " + ", ".join(f"{x:.0f} %" for x in got),
            flush=True,
        )
    if filter_calls:
        for variant, where in (("base", src), ("new", None), ("base", src), ("new", None)):
            ext = start_ext(variant, where)
            try:
                WATCHED["extender"] = ext.procs[0].pid
                settle()
                p50, p99, passed, cpu = filter_latency(ext, names, filter_calls)
                print(
                    f"[{n} nodes] {variant} /filter with all {n} nodes, {filter_calls} calls, idle: "
                    f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms ({passed} passed), "
                    f"extender CPU {cpu * 1000:.2f} ms per call",
                    flush=True,
                )
            finally:
                ext.stop()
                WATCHED.pop("extender", None)


def run_size(
    n: int,
    pods: int,
    filter_calls: int,
    work: Path,
    pairs: int = 1,
    percentage: int | None = None,
    qps: int = 200,
    short_parser: bool = True,
    client_auth: bool = True,
    policies: str = "both",
    extender_src: str | None = None,
) -> None:
    sb = Sandbox(work / f"sandbox-{n}")
    sb.up(Spec(nodes=1, product=False))
    ext = None
    try:
        kube = Kube(str(sb.kubeconfig))
        sb.kubectl("create", "namespace", NAMESPACE)
        nodes, leases = node_items(n)
        t0 = time.monotonic()
        create(sb, nodes)
        create(sb, leases)
        while True:
            listed, _ = kube.list_nodes()
            ready = sum(
                1
                for x in listed
                if x["metadata"]["name"].startswith("bench-")
                and any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in x.get("status", {}).get("conditions", [])
                )
            )
            if ready >= n:
                break
            time.sleep(1)
        print(f"[{n} nodes] {n} nodes created and Ready in {time.monotonic() - t0:.1f} s", flush=True)
        folder = work / f"ext-{n}"
        product.grant_accounts(sb)  # the scheduler's account, which the extender impersonates
        if extender_src is not None:
            folder.mkdir(parents=True, exist_ok=True)
            WATCHED.clear()
            up = sb.state()
            for c in up.components if up else []:
                if c.name in ("kube-apiserver", "etcd", "kwok", "kube-controller-manager"):
                    WATCHED[c.name] = c.pid
            plain = controlplane.scheduler_config(
                sb.kubeconfig, scheduler_name="plain-bench", percentage_of_nodes_to_score=percentage,
                client_qps=qps,
            )  # fmt: skip

            def start_ext(variant: str, src: str | None) -> Extender:
                return Extender(
                    sb, work / f"ext-{n}-{variant}", percentage, qps, short_parser, client_auth, src,
                    f"vgpu-bench-extender-{variant}",
                )  # fmt: skip

            names = [x["metadata"]["name"] for x in nodes]
            run_ab(sb, kube, folder, plain, start_ext, extender_src, n, pods, pairs, filter_calls, names)
            return
        ext = Extender(sb, folder, percentage, qps, short_parser, client_auth)
        state = sb.state()
        WATCHED.clear()
        for c in state.components if state else []:
            if c.name in ("kube-apiserver", "etcd", "kwok", "kube-controller-manager"):
                WATCHED[c.name] = c.pid
        WATCHED["extender"] = ext.procs[0].pid
        settle()
        before = {k: cpu_seconds(p) for k, p in WATCHED.items()}
        time.sleep(5)
        after = {k: cpu_seconds(p) for k, p in WATCHED.items()}
        upkeep = ", ".join(f"{k} {(after[k] - before[k]) / 5:.2f}" for k in after)
        # the cluster's own upkeep (KWOK's node heartbeats and what they cause), which every
        # burst shares the machine with: it weighs more on the slower burst's per-pod figures
        print(f"[{n} nodes] upkeep with no pods, CPU cores: {upkeep}", flush=True)
        plain = controlplane.scheduler_config(
            sb.kubeconfig,
            scheduler_name="plain-bench",
            percentage_of_nodes_to_score=percentage,
            client_qps=qps,
        )
        for phase in ("off", "on") if policies == "both" else (policies,):
            if phase == "on":
                product.apply_boundary(sb, lambda _: None)
            run_pairs(sb, kube, folder, plain, ext, n, pods, pairs, f" policies {phase}")
        print(f"[{n} nodes] extender, server side, over the bursts: {ext.verb_latency()}", flush=True)
        if filter_calls:
            time.sleep(5)  # let KWOK and the watches go quiet: this measures the verb, not the burst
            names = [x["metadata"]["name"] for x in nodes]
            p50, p99, passed, cpu = filter_latency(ext, names, filter_calls)
            print(
                f"[{n} nodes] /filter with all {n} nodes, {filter_calls} calls over HTTPS, cluster idle: "
                f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms ({passed} nodes passed), "
                f"extender CPU {cpu * 1000:.2f} ms per call",
                flush=True,
            )
    finally:
        if ext is not None:
            ext.stop()
        sb.down()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", default="100,1000", help="comma list of cluster sizes")
    parser.add_argument("--pods", type=int, default=500, help="pods per burst")
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="alone/with-extender bursts back to back, per size (median share)",
    )
    parser.add_argument(
        "--filter-calls", type=int, default=200, help="direct /filter calls at the largest size"
    )
    parser.add_argument(
        "--percentage-of-nodes-to-score",
        type=int,
        default=None,
        help="kube-scheduler's percentageOfNodesToScore in both profiles (default: its own)",
    )
    parser.add_argument(
        "--kube-api-qps",
        type=int,
        default=200,
        help="kube-scheduler's client QPS in both profiles, burst twice that (default 200; its own "
        "default is 50): caps the binds kube-scheduler alone makes, not the extender's",
    )
    parser.add_argument(
        "--short-parser",
        choices=("on", "off"),
        default="on",
        help="the extender worker's short HTTP parser (off: gunicorn's parser for every request)",
    )
    parser.add_argument(
        "--client-auth",
        choices=("on", "off"),
        default="on",
        help="kube-scheduler calls the extender with a client certificate it checks (off: neither)",
    )
    parser.add_argument(
        "--policies",
        choices=("both", "off", "on"),
        default="both",
        help="the bursts without, then with the chart's tenant-boundary admission policies (default both)",
    )
    parser.add_argument(
        "--extender-src",
        default=None,
        help="a checkout of another commit (git worktree add DIR main): each round runs "
        "kube-scheduler alone, then the extender from DIR and this checkout's, in turn first; "
        "one extender process at a time (policies off)",
    )
    args = parser.parse_args()
    sizes = [int(x) for x in args.nodes.split(",")]
    print(
        f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}", flush=True
    )
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-sched-") as tmp:
        for n in sizes:
            run_size(
                n,
                args.pods,
                args.filter_calls if n == max(sizes) else 0,
                Path(tmp),
                args.pairs,
                args.percentage_of_nodes_to_score,
                args.kube_api_qps,
                args.short_parser == "on",
                args.client_auth == "on",
                args.policies,
                args.extender_src,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
