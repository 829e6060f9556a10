"""The scheduler end to end: the real kube-scheduler calling the extender over verified TLS.

One test goes through the sandbox's own ``vgpu-scheduler`` and webhook, onto nodes with a device
plugin. The others run a second extender + kube-scheduler pair of their own (scheduler name
``vgpu-e2e``, its own Lease), so that one test can kill and restart the extender, on Nodes they
create (KWOK runs their pods; a fresh plugin Lease and an inventory annotation stand in for the
device plugin), tainted so nothing else lands there. Everything created is deleted afterwards.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from vgpu_sandbox import controlplane, product
from vgpu_sandbox.cluster import Sandbox
from vgpu_sandbox.pki import CertificateAuthority
from vgpu_sandbox.procs import free_port

from tests.support import container, pod, start, stop, wait_for
from vgpu.core import annotations as ann
from vgpu.kube.client import now_micro

pytestmark = pytest.mark.e2e

SCHEDULER = "vgpu-e2e"
NAMESPACE = "vgpu-sched-e2e"
TAINT = "vgpu.openaios.io/e2e"
GROUP = "vgpu.openaios.io/e2e-group"
MANAGED = (
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
    "nvidia.com/priority",
)


class OwnScheduler:
    """An extender and a kube-scheduler for ``vgpu-e2e``, started and stopped by the tests."""

    def __init__(self, sandbox: Sandbox, folder: Path) -> None:
        self.sandbox = sandbox
        self.folder = folder
        ca = CertificateAuthority(folder / "pki")
        self.ca_path = ca.cert_path
        pair = ca.issue("extender", ["127.0.0.1"])
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        # as the scheduler's account, as the sandbox's own extender runs: the tenant boundary's
        # policy lets it alone write placements (docs/security.md)
        kubeconfig = product.account_kubeconfig(sandbox, "vgpu-e2e-extender", product.SCHEDULER_ACCOUNT)
        self.argv = [
            sys.executable, "-m", "vgpu.commands.cli", "extender",
            f"--kubeconfig={kubeconfig}", f"--listen=127.0.0.1:{self.port}",
            f"--cert-file={pair.cert}", f"--key-file={pair.key}",
            f"--metrics-listen=127.0.0.1:{self.metrics_port}",
            "--namespace=kube-system", f"--scheduler-name={SCHEDULER}", "--identity=e2e",
        ]  # fmt: skip
        config = folder / "kube-scheduler.json"
        config.write_text(
            controlplane.scheduler_config(
                sandbox.kubeconfig,
                scheduler_name=SCHEDULER,
                extender_url=self.url,
                extender_ca_b64=base64.b64encode(ca.pem).decode(),
                managed_resources=MANAGED,
            )
        )
        # as the sandbox's product runs it (sandbox/vgpu_sandbox/product.py): a pod the extender refused
        # is retried at least every 10 s. Without it the retry rides on cluster events only, and
        # the event of a freed pod can reach kube-scheduler before the extender's watch frees the
        # capacity: the retry is refused and the next one waits for another event or 5 minutes.
        self.scheduler_argv = controlplane.scheduler_argv(
            sandbox.bin("kube-scheduler"), config, requeue_unschedulable_s=10
        )
        self.extender: subprocess.Popen[bytes] | None = None
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def _spawn(
        self, argv: list[str], name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        return start(argv, self.folder / f"{name}.log", env)

    def start_extender(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env["VGPU_LEADER_LEASE"] = "vgpu-e2e-extender"
        self.starts += 1
        self.extender = self._spawn(self.argv, "extender", env)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                r = requests.get(self.url + "/readyz", verify=str(self.ca_path), timeout=2)
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            if self.extender.poll() is not None:
                break
            time.sleep(0.3)
        raise AssertionError(f"extender not ready:\n{(self.folder / 'extender.log').read_text()[-3000:]}")

    def stop_extender(self) -> None:
        assert self.extender is not None
        os.killpg(self.extender.pid, signal.SIGTERM)
        self.extender.wait(timeout=30)

    def kill_extender(self) -> None:
        assert self.extender is not None
        os.killpg(self.extender.pid, signal.SIGKILL)
        self.extender.wait(timeout=30)

    def start(self) -> None:
        self.start_extender()
        self.scheduler = self._spawn(self.scheduler_argv, "kube-scheduler")

    def stop(self) -> None:
        for proc in (self.scheduler, self.extender):
            if proc is not None:
                stop(proc, grace=20)


@pytest.fixture(scope="module")
def own(sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnScheduler]:
    sandbox.kubectl("create", "namespace", NAMESPACE, check=False)
    pair = OwnScheduler(sandbox, tmp_path_factory.mktemp("own-scheduler"))
    pair.start()
    try:
        yield pair
    finally:
        pair.stop()
        sandbox.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        sandbox.kubectl("delete", "lease", "-n", "kube-system", "vgpu-e2e-extender", check=False)


# -- nodes and pods of our own ---------------------------------------------------------------------


def card(
    node: str, i: int, mem: int = 10000, model: str = "NVIDIA A100-SXM4-80GB", split: int = 4
) -> ann.Device:
    return ann.Device(f"GPU-{node}-{i}", i, model, mem, 100, split, numa=0)


def node_manifest(name: str, group: str, cards: list[ann.Device]) -> dict[str, Any]:
    inventory = ann.encode_devices(ann.NodeInventory(tuple(cards)))
    resources = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "250",
        "nvidia.com/gpu": str(sum(c.split for c in cards)),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", ann.DEVICES_ANNOTATION: inventory},
            "labels": {GROUP: group, "kubernetes.io/hostname": name, "type": "kwok"},
        },
        "spec": {"taints": [{"key": TAINT, "value": "only", "effect": "NoSchedule"}]},
        "status": {"capacity": resources, "allocatable": resources},
    }


def lease_manifest(node: str, renewed: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": ann.lease_name(node), "namespace": "kube-system"},
        "spec": {
            "holderIdentity": f"e2e-{node}",
            "leaseDurationSeconds": 3600,
            "renewTime": renewed or now_micro(),
        },
    }


def apply_list(sandbox: Sandbox, items: list[dict[str, Any]]) -> None:
    sandbox.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    )


@pytest.fixture
def make_nodes(sandbox: Sandbox, own: OwnScheduler) -> Iterator[Callable[..., tuple[str, list[str]]]]:
    groups: list[tuple[str, list[str]]] = []

    def make(count: int, cards: Callable[[str], list[ann.Device]] | None = None) -> tuple[str, list[str]]:
        group = "g" + uuid.uuid4().hex[:8]
        names = [f"e2e-{group}-{i}" for i in range(count)]
        build = cards or (lambda n: [card(n, 0), card(n, 1)])
        apply_list(sandbox, [node_manifest(n, group, build(n)) for n in names])
        apply_list(sandbox, [lease_manifest(n) for n in names])
        # KWOK must report them Ready before kube-scheduler considers them
        wait_for(lambda: all(ready(sandbox, n) for n in names), f"nodes {names} Ready", 60, every=0.5)
        groups.append((group, names))
        return group, names

    yield make
    for group, names in groups:
        sandbox.kubectl(
            "delete", "pods", "-n", NAMESPACE, "-l", f"{GROUP}={group}", "--wait=false", check=False
        )
        sandbox.kubectl("delete", "nodes", *names, "--wait=false", check=False)
        sandbox.kubectl(
            "delete", "leases", "-n", "kube-system", *[ann.lease_name(n) for n in names], check=False
        )


def ready(sandbox: Sandbox, node: str) -> bool:
    out = sandbox.kubectl("get", "node", node, "-o", "json", check=False)
    if out.returncode != 0:
        return False
    conds = json.loads(out.stdout).get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def pod_manifest(
    name: str, group: str, limits: dict[str, Any], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    return pod(
        name,
        container("main", "registry.invalid/cuda:none", **limits),
        namespace=NAMESPACE,
        labels={GROUP: group},
        annotations=annotations or {},
        scheduler=SCHEDULER,
        node_selector={GROUP: group},
        tolerations=[{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}],
        grace=0,
    )


def pods(sandbox: Sandbox, group: str) -> dict[str, dict[str, Any]]:
    out = sandbox.kubectl("get", "pods", "-n", NAMESPACE, "-l", f"{GROUP}={group}", "-o", "json")
    return {p["metadata"]["name"]: p for p in json.loads(out.stdout)["items"]}


def bound(pod: dict[str, Any]) -> bool:
    return bool(pod["spec"].get("nodeName"))


def allocation(pod: dict[str, Any]) -> ann.Allocation:
    return ann.decode_allocation(pod["metadata"]["annotations"][ann.ALLOCATION_ANNOTATION])


def wait_bound(sandbox: Sandbox, group: str, name: str, timeout: float = 60) -> dict[str, Any]:
    wait_for(
        lambda: bound(pods(sandbox, group).get(name, {"spec": {}})), f"pod {name} bound", timeout, every=0.5
    )
    return pods(sandbox, group)[name]


def assert_within_cards(all_pods: dict[str, dict[str, Any]], cards: dict[str, ann.Device]) -> dict[str, int]:
    """Sum the allocations of bound pods per card; assert none exceeds the card. Returns vGPUs per card."""
    mem: dict[str, int] = {}
    count: dict[str, int] = {}
    for p in all_pods.values():
        if not bound(p):
            continue
        a = allocation(p)
        assert a.node == p["spec"]["nodeName"], p["metadata"]["name"]
        for c in a.containers:
            for d in c.devices:
                assert d.uuid.startswith(f"GPU-{a.node}-"), (d.uuid, a.node)
                mem[d.uuid] = mem.get(d.uuid, 0) + d.memory_mib
                count[d.uuid] = count.get(d.uuid, 0) + 1
    for uuid_, used in mem.items():
        assert used <= cards[uuid_].memory_mib, (uuid_, used)
        assert count[uuid_] <= cards[uuid_].split, (uuid_, count[uuid_])
    return count


# -- the tests -------------------------------------------------------------------------------------


def test_a_vgpu_pod_without_a_scheduler_name_is_routed_placed_and_allocated_in_the_sandbox(
    sandbox: Sandbox,
) -> None:
    name = "sched-smoke-" + uuid.uuid4().hex[:6]
    smoke = pod(name, container("main", "x", gpumem=2000), grace=0)  # no schedulerName: the webhook sets it
    apply_list(sandbox, [smoke])
    try:

        def get() -> dict[str, Any]:
            return json.loads(sandbox.kubectl("get", "pod", name, "-n", "default", "-o", "json").stdout)

        assert get()["spec"]["schedulerName"] == "vgpu-scheduler"  # the mutating webhook
        wait_for(lambda: bool(get()["spec"].get("nodeName")), "the sandbox pod bound", 60, every=0.5)
        p = get()
        a = allocation(p)
        assert a.node == p["spec"]["nodeName"]
        (c,) = a.containers
        assert c.name == "main" and len(c.devices) == 1 and c.devices[0].memory_mib == 2000
        node = json.loads(sandbox.kubectl("get", "node", a.node, "-o", "json").stdout)
        inv = ann.decode_devices(node["metadata"]["annotations"][ann.DEVICES_ANNOTATION])
        assert c.devices[0].uuid in {d.uuid for d in inv.devices}
    finally:
        sandbox.kubectl("delete", "pod", name, "-n", "default", "--wait=false", check=False)


def test_an_impossible_request_is_refused_at_admission_naming_the_field(sandbox: Sandbox) -> None:
    pod = pod_manifest("impossible", "none", {"gpumem": 1000, "gpumem_percentage": 20})
    pod["metadata"]["namespace"] = "default"
    r = sandbox.kubectl("create", "-f", "-", input=json.dumps(pod), check=False)
    assert r.returncode != 0 and "nvidia.com/gpumem-percentage" in r.stderr


def test_a_pod_that_fits_is_bound_with_an_allocation_on_a_card_of_its_node(
    sandbox: Sandbox, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    group, (node,) = make_nodes(1)
    apply_list(sandbox, [pod_manifest("fits", group, {"gpumem": 3000, "gpucores": 30})])
    p = wait_bound(sandbox, group, "fits")
    a = allocation(p)
    assert a.node == node == p["spec"]["nodeName"]
    assert [(c.name, [(d.memory_mib, d.cores) for d in c.devices]) for c in a.containers] == [
        ("main", [(3000, 30)])
    ]
    assert a.containers[0].devices[0].uuid in (f"GPU-{node}-0", f"GPU-{node}-1")
    assert p["metadata"]["annotations"][ann.PHASE_ANNOTATION] == ann.PHASE_BOUND


def test_a_pod_that_cannot_fit_stays_pending_with_the_shortage_in_its_reason(
    sandbox: Sandbox, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    group, _ = make_nodes(1)
    apply_list(sandbox, [pod_manifest("filler", group, {"gpu": 2, "gpumem": 8000})])
    wait_bound(sandbox, group, "filler")
    apply_list(sandbox, [pod_manifest("waits", group, {"gpumem": 5000})])

    def reason() -> str:
        p = pods(sandbox, group)["waits"]
        conds = [c for c in p.get("status", {}).get("conditions") or [] if c["type"] == "PodScheduled"]
        return conds[0].get("message", "") if conds and conds[0]["status"] == "False" else ""

    wait_for(
        lambda: "insufficient memory" in reason(), "a FailedScheduling reason naming memory", 60, every=0.5
    )
    assert not bound(pods(sandbox, group)["waits"])
    assert "5000 MiB" in reason()
    # deleting the pod that holds the cards frees them: the waiting pod gets its place
    sandbox.kubectl("delete", "pod", "filler", "-n", NAMESPACE, "--wait=false")
    wait_bound(sandbox, group, "waits", timeout=90)


def failed_scheduling(sandbox: Sandbox, name: str) -> list[str]:
    """The messages of the pod's FailedScheduling events, as ``kubectl describe pod`` shows them."""
    out = sandbox.kubectl(
        "get", "events", "-n", NAMESPACE, "--field-selector", f"involvedObject.name={name}", "-o", "json"
    )
    return [
        e.get("message", "") for e in json.loads(out.stdout)["items"] if e.get("reason") == "FailedScheduling"
    ]


def test_the_failed_scheduling_event_of_an_unschedulable_vgpu_pod_reads_right(
    sandbox: Sandbox, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    """kube-scheduler passes its message to the event recorder as a printf format: a "%" in the
    extender's reason read "30%!c(MISSING)ores" in every event. Each node's reason also follows
    kube-scheduler's count of nodes ("3 node(s) had ..."), the most decisive one per node."""
    group, _ = make_nodes(3, lambda n: [card(n, i) for i in range(4)])
    apply_list(
        sandbox,
        [
            pod_manifest("five", group, {"gpu": 5, "gpumem": 3000, "gpucores": 30}),
            pod_manifest(
                "t4", group, {"gpumem_percentage": 50, "gpucores": 30}, {"nvidia.com/use-gputype": "T4"}
            ),
        ],
    )
    expected = {
        "five": "3 node(s) had too few cards for container 'main', which needs 5 vGPU(s) of 3000 MiB "
        "and 30 percent of the cores each, one per card: the node has only 4 card(s)",
        "t4": "3 node(s) had no card that can ever take container 'main', which needs 1 vGPU(s) of "
        "50 percent of a card's memory and 30 percent of the cores: 4 card(s) of model "
        "'NVIDIA A100-SXM4-80GB', not in nvidia.com/use-gputype 'T4'",
    }

    def condition(name: str) -> str:
        p = pods(sandbox, group)[name]
        conds = [c for c in p.get("status", {}).get("conditions") or [] if c["type"] == "PodScheduled"]
        return str(conds[0].get("message", "")) if conds and conds[0]["status"] == "False" else ""

    for name, reason in expected.items():
        # the event is recorded asynchronously, after the condition: wait for the two to meet
        wait_for(
            lambda: reason in condition(name) and condition(name) in failed_scheduling(sandbox, name),  # noqa: B023
            f"a FailedScheduling event of {name} reading as its PodScheduled condition",
            60,
            every=0.5,
        )
        events = failed_scheduling(sandbox, name)
        assert not [m for m in events if "%" in m or "(MISSING)" in m], events
        assert not bound(pods(sandbox, group)[name])


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_node_and_gpu_policies_place_as_they_promise(
    sandbox: Sandbox, make_nodes: Callable[..., tuple[str, list[str]]], policy: str
) -> None:
    group, names = make_nodes(2)
    annos = {ann.NODE_POLICY_ANNOTATION: policy, ann.GPU_POLICY_ANNOTATION: policy}
    placed = []
    for i in range(3):
        apply_list(sandbox, [pod_manifest(f"p{i}", group, {"gpumem": 1000}, annos)])
        a = allocation(wait_bound(sandbox, group, f"p{i}"))
        placed.append((a.node, a.containers[0].devices[0].uuid))
    nodes_used = {n for n, _ in placed}
    cards_used = {c for _, c in placed}
    if policy == "binpack":
        assert len(nodes_used) == 1 and len(cards_used) == 1, placed
    else:
        assert nodes_used == set(names), placed  # the second pod went to the other node
        assert len(cards_used) == 3, placed  # the third to the emptier card of a used node


def test_gpu_type_and_uuid_selection_are_honoured(
    sandbox: Sandbox, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    def mixed(n: str) -> list[ann.Device]:
        return [card(n, 0, model="NVIDIA A100-SXM4-80GB"), card(n, 1, model="Tesla T4"), card(n, 2)]

    group, (node,) = make_nodes(1, mixed)
    apply_list(
        sandbox,
        [
            pod_manifest("t4", group, {"gpumem": 100}, {ann.USE_GPUTYPE_ANNOTATION: "T4"}),
            pod_manifest(
                "not0",
                group,
                {"gpumem": 100},
                {
                    ann.NOUSE_GPUUUID_ANNOTATION: f"GPU-{node}-0,GPU-{node}-1",
                    ann.GPU_POLICY_ANNOTATION: "binpack",
                },
            ),
            pod_manifest("h100", group, {"gpumem": 100}, {ann.USE_GPUTYPE_ANNOTATION: "H100"}),
        ],
    )
    assert allocation(wait_bound(sandbox, group, "t4")).containers[0].devices[0].uuid == f"GPU-{node}-1"
    assert allocation(wait_bound(sandbox, group, "not0")).containers[0].devices[0].uuid == f"GPU-{node}-2"
    time.sleep(3)
    assert not bound(pods(sandbox, group)["h100"])  # no such card: it waits


def test_two_hundred_pods_at_once_on_twenty_nodes_overcommit_nothing(
    sandbox: Sandbox, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    group, names = make_nodes(20)
    cards = {c.uuid: c for n in names for c in (card(n, 0), card(n, 1))}
    # 40 cards of 10000 MiB hold 3 pods of 3000 MiB each: 120 of the 200 fit
    apply_list(
        sandbox, [pod_manifest(f"burst-{i}", group, {"gpumem": 3000, "gpucores": 10}) for i in range(200)]
    )
    wait_for(
        lambda: sum(bound(p) for p in pods(sandbox, group).values()) >= 120, "120 pods bound", 240, every=0.5
    )
    time.sleep(5)  # let the scheduler keep trying the other 80
    now = pods(sandbox, group)
    assert sum(bound(p) for p in now.values()) == 120
    per_card = assert_within_cards(now, cards)
    assert sorted(per_card.values()) == [3] * 40


def test_killing_the_extender_mid_burst_loses_and_double_books_nothing(
    sandbox: Sandbox, own: OwnScheduler, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    group, names = make_nodes(10)
    cards = {c.uuid: c for n in names for c in (card(n, 0), card(n, 1))}
    # 20 cards x 3 = 60 places for 100 pods
    apply_list(sandbox, [pod_manifest(f"k-{i}", group, {"gpumem": 3000}) for i in range(100)])
    wait_for(
        lambda: sum(bound(p) for p in pods(sandbox, group).values()) >= 15, "some pods bound", 120, every=0.5
    )
    own.kill_extender()
    before = {n for n, p in pods(sandbox, group).items() if bound(p)}
    own.start_extender()
    wait_for(
        lambda: sum(bound(p) for p in pods(sandbox, group).values()) >= 60, "60 pods bound", 240, every=0.5
    )
    time.sleep(5)
    after = pods(sandbox, group)
    assert sum(bound(p) for p in after.values()) == 60
    assert before <= {n for n, p in after.items() if bound(p)}  # nothing bound before the kill was lost
    assert sorted(assert_within_cards(after, cards).values()) == [3] * 20


def test_nodes_with_an_expired_plugin_lease_or_a_malformed_inventory_get_nothing_and_others_still_schedule(
    sandbox: Sandbox, own: OwnScheduler, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    group, (good, stale, broken) = make_nodes(3)
    old = "2020-01-01T00:00:00.000000Z"
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(lease_manifest(stale, renewed=old)))
    sandbox.kubectl(
        "annotate", "node", broken, "--overwrite", f"{ann.DEVICES_ANNOTATION}=" + '{"version": 1}'
    )
    apply_list(sandbox, [pod_manifest(f"s{i}", group, {"gpumem": 9000}) for i in range(3)])
    placed = [allocation(wait_bound(sandbox, group, f"s{i}")).node for i in range(2)]
    assert placed == [good, good]  # two cards, both on the healthy node

    def reason() -> str:
        p = pods(sandbox, group)["s2"]
        conds = [c for c in p.get("status", {}).get("conditions") or [] if c["type"] == "PodScheduled"]
        return conds[0].get("message", "") if conds else ""

    wait_for(
        lambda: "expired" in reason() and "malformed" in reason(),
        "reasons for both skipped nodes",
        60,
        every=0.5,
    )
    assert not bound(pods(sandbox, group)["s2"])
    metrics = requests.get(f"http://127.0.0.1:{own.metrics_port}/metrics", timeout=10).text
    assert f'vgpu_scheduler_inventory_errors_total{{node="{broken}"}} 1.0' in metrics


def test_a_deleted_node_leaves_no_card_or_node_series_behind(
    sandbox: Sandbox, own: OwnScheduler, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    """The extender served a deleted node's series at their last values for as long as it ran
    (prometheus_client's multiprocess files keep them): they go within a gauge refresh (5 s)."""
    group, _ = make_nodes(2, lambda n: [card(n, 0)])
    apply_list(sandbox, [pod_manifest("held", group, {"gpumem": 9000})])
    node = allocation(wait_bound(sandbox, group, "held")).node

    def series() -> list[str]:
        text = requests.get(f"http://127.0.0.1:{own.metrics_port}/metrics", timeout=10).text
        return [line for line in text.splitlines() if f'node="{node}"' in line and line.startswith("vgpu_")]

    booked = f'vgpu_node_memory_allocated_bytes{{node="{node}"}} {9000 * 2**20:.6e}'
    wait_for(lambda: booked in series(), f"{booked} served", 30, every=0.5)
    sandbox.kubectl("delete", "node", node)
    wait_for(lambda: series() == [], f"no series of the deleted node {node}", 30, every=0.5)


def test_a_dra_node_gets_no_device_plugin_pod_and_the_event_says_why_and_how_to_fix(
    sandbox: Sandbox, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    """One mode per node: a node labelled openaios.io/gpu-mode=dra keeps its (stale) inventory,
    fresh Lease and nvidia.com/gpu capacity, yet the extender gives its cards to no vGPU pod; a
    pod that fits only there stays Pending with the label and the fix in its event, and takes the
    node as soon as the label says device-plugin again."""
    group, (dp, dra) = make_nodes(2, lambda n: [card(n, 0)])
    sandbox.kubectl("label", "node", dra, "openaios.io/gpu-mode=dra")
    apply_list(sandbox, [pod_manifest(f"d{i}", group, {"gpumem": 9000}) for i in range(2)])
    first = allocation(wait_bound(sandbox, group, "d0")).node
    assert first == dp
    fix = (
        "1 node(s) had label openaios.io/gpu-mode=dra (DRA mode): DRA hands out the GPUs there, "
        "through ResourceClaims of the DeviceClass vgpu.openaios.io, not nvidia.com/gpu; give the pod "
        "a claim (docs/dra.md), or label the node openaios.io/gpu-mode=device-plugin"
    )
    wait_for(
        lambda: any(fix in m for m in failed_scheduling(sandbox, "d1")),
        "d1's FailedScheduling event naming the DRA node's label",
        60,
        every=0.5,
    )
    assert not bound(pods(sandbox, group)["d1"])
    sandbox.kubectl("label", "node", dra, "--overwrite", "openaios.io/gpu-mode=device-plugin")
    assert allocation(wait_bound(sandbox, group, "d1")).node == dra


def test_a_second_replica_stands_by_until_the_first_gives_up_the_lease(
    sandbox: Sandbox, own: OwnScheduler, tmp_path: Path
) -> None:
    second = OwnScheduler(sandbox, tmp_path)
    second.argv = [a if not a.startswith("--identity=") else "--identity=e2e-standby" for a in second.argv]
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["VGPU_LEADER_LEASE"] = "vgpu-e2e-extender"
    second.extender = second._spawn(second.argv, "extender", env)
    try:

        def readyz(pair: OwnScheduler) -> requests.Response | None:
            try:
                return requests.get(pair.url + "/readyz", verify=str(pair.ca_path), timeout=2)
            except requests.RequestException:
                return None

        wait_for(
            lambda: (r := readyz(second)) is not None and "standby" in r.text,
            "the second on standby",
            60,
            every=0.5,
        )
        own.stop_extender()  # a clean stop hands the Lease over at once
        wait_for(
            lambda: (r := readyz(second)) is not None and r.status_code == 200,
            "the second serving",
            30,
            every=0.5,
        )
    finally:
        second.stop()
        own.start_extender()


def test_a_two_vgpu_container_gets_two_cards_joined_by_nvlink(
    sandbox: Sandbox, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    def linked(n: str) -> list[ann.Device]:
        cards = [card(n, i) for i in range(4)]
        # only cards 1 and 2 share an NVLink; the policy alone would pick 0 and 1 (lowest index)
        links = {1: {f"GPU-{n}-2": "nvlink"}, 2: {f"GPU-{n}-1": "nvlink"}}
        return [dataclasses.replace(c, links=links.get(c.index, {})) for c in cards]

    group, (node,) = make_nodes(1, linked)
    apply_list(sandbox, [pod_manifest("pair", group, {"gpu": 2, "gpumem": 1000})])
    devices = allocation(wait_bound(sandbox, group, "pair")).containers[0].devices
    assert sorted(d.uuid for d in devices) == [f"GPU-{node}-1", f"GPU-{node}-2"]


def test_an_mps_pod_lands_only_on_the_mps_card_and_others_never_do(
    sandbox: Sandbox, make_nodes: Callable[..., tuple[str, list[str]]]
) -> None:
    """nvidia.com/vgpu-mode: mps takes only a card the node shares through MPS; an unannotated pod
    and a hami-core one never land there, and kube-scheduler's reason names the card's mode."""

    def mixed(n: str) -> list[ann.Device]:
        return [dataclasses.replace(card(n, 0), sharing=ann.SHARING_MPS), card(n, 1)]

    group, (node,) = make_nodes(1, mixed)
    mps = {"nvidia.com/vgpu-mode": "mps"}
    core = {"nvidia.com/vgpu-mode": "hami-core"}
    binpack = {ann.GPU_POLICY_ANNOTATION: "binpack"}
    apply_list(
        sandbox,
        [
            pod_manifest(f"mps{i}", group, {"gpumem": 1000, "gpucores": 20}, {**mps, **binpack})
            for i in range(2)
        ]
        + [pod_manifest(f"plain{i}", group, {"gpumem": 1000}, binpack) for i in range(2)]
        + [pod_manifest(f"core{i}", group, {"gpumem": 1000}, {**core, **binpack}) for i in range(2)],
    )
    for i in range(2):
        for name, uuid_ in (
            (f"mps{i}", f"GPU-{node}-0"),
            (f"plain{i}", f"GPU-{node}-1"),
            (f"core{i}", f"GPU-{node}-1"),
        ):
            got = allocation(wait_bound(sandbox, group, name)).containers[0].devices
            assert [d.uuid for d in got] == [uuid_], name

    # a node of MPS cards only: the others wait, told why
    only, _ = make_nodes(1, lambda n: [dataclasses.replace(card(n, 0), sharing=ann.SHARING_MPS)])
    apply_list(
        sandbox,
        [pod_manifest("plain", only, {"gpumem": 1000}), pod_manifest("core", only, {"gpumem": 1000}, core)],
    )
    expected = {
        "plain": "1 card(s) shared through MPS (mps), taken only by a pod whose nvidia.com/vgpu-mode "
        "names mps",
        "core": "1 card(s) shared through MPS (mps), not one nvidia.com/vgpu-mode hami-core takes",
    }
    for name, reason in expected.items():
        wait_for(
            lambda: any(reason in m for m in failed_scheduling(sandbox, name)),  # noqa: B023
            f"a FailedScheduling event of {name} naming the card's mode",
            60,
            every=0.5,
        )
        assert not bound(pods(sandbox, only)[name])
