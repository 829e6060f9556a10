"""The device plugin and the kubelet stand-in, in this process, against the sandbox's real API server.

Each test gets a Node of its own (KWOK-managed, tainted so the schedulers leave it alone) with
the plugin on a real unix socket and the kubelet stand-in as its peer. Pods are created already
bound to it with the allocation annotation the extender would write (contract 3,
docs/contracts.md); the stand-in then admits them as kubelet does and the tests read what each
container would start with.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from vgpu_sandbox import product
from vgpu_sandbox.cluster import Sandbox
from vgpu_sandbox.kubelet import ERROR_ANNOTATION, RECORD_ANNOTATION, Kubelet

from tests.support import bound_pod, poll, short_dir
from tests.support.tenant import AS_SCHEDULER
from vgpu.core.annotations import (
    DEVICES_ANNOTATION,
    PHASE_ANNOTATION,
    decode_devices,
    lease_name,
)
from vgpu.deviceplugin.daemon import Daemon
from vgpu.kube.agent import NodeAgentClient
from vgpu.node.config import NodeConfig
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.paths import HostPaths

NAMESPACE = "kube-system"
SPLIT = 4
TEST_NS = "vgpu-plugin-it"


def gpus_yaml(node: str, unhealthy: tuple[int, ...] = ()) -> str:
    return yaml.safe_dump(
        {
            "gpus": [
                {"uuid": f"GPU-{node}-{i}", "memoryMiB": 24000, "healthy": i not in unhealthy, "numa": 0}
                for i in range(4)
            ]
        }
    )


@dataclass
class Agent:
    name: str
    root: Path
    gpus: Path
    sandbox: Sandbox
    daemon: Daemon
    kubelet: Kubelet
    client: NodeAgentClient

    def uuid(self, i: int) -> str:
        return f"GPU-{self.name}-{i}"

    def node(self) -> dict[str, Any]:
        return json.loads(self.sandbox.kubectl("get", "node", self.name, "-o", "json").stdout)

    def create_pod(
        self,
        name: str,
        containers: dict[str, list[tuple[int, int, int]]],
        init: tuple[str, ...] = (),
        annotation: str | None = None,
    ) -> None:
        devices = {c: [(self.uuid(i), m, k) for i, m, k in devs] for c, devs in containers.items()}
        pod = bound_pod(
            name,
            self.name,
            devices,
            init=init,
            annotation=annotation,
            namespace=TEST_NS,
            tolerations=[{"key": "vgpu-test", "operator": "Exists"}],
        )
        # placed as the scheduler places pods: its account alone may write placements
        self.sandbox.kubectl(*AS_SCHEDULER, "create", "-f", "-", input=json.dumps(pod))

    def pod(self, name: str) -> dict[str, Any]:
        return json.loads(self.sandbox.kubectl("get", "pod", "-n", TEST_NS, name, "-o", "json").stdout)

    def admit(self, expected: int) -> None:
        """Play one kubelet round once ``expected`` pods are listed on the node."""
        assert poll(lambda: len(self.client.list_node_pods(self.name)) >= expected, timeout=30, every=0.1), (
            "pods never showed up"
        )
        self.kubelet.admit_pending()

    def record(self, pod: str) -> dict[str, Any]:
        annotations = self.pod(pod)["metadata"]["annotations"]
        return {
            "containers": json.loads(annotations.get(RECORD_ANNOTATION, "{}")),
            "error": annotations.get(ERROR_ANNOTATION),
        }

    def start_kubelet(self) -> Kubelet:
        kubelet = Kubelet(self.name, self.root, self.client)
        kubelet.start()
        self.kubelet = kubelet
        return kubelet

    def advertised(self, kubelet: Kubelet | None = None) -> dict[str, str]:
        plugin = (kubelet or self.kubelet).plugins.get("nvidia.com/gpu")
        return dict(plugin.devices) if plugin else {}


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short folder instead of pytest's: a unix socket path under it must stay within 107 bytes."""
    with short_dir("vgpu-dp-") as path:
        yield path


@pytest.fixture(scope="module")
def namespace(sandbox: Sandbox) -> Iterator[str]:
    sandbox.kubectl("create", "namespace", TEST_NS)
    try:
        yield TEST_NS
    finally:
        sandbox.kubectl("delete", "namespace", TEST_NS, "--wait=false", check=False)


@pytest.fixture
def agent(sandbox: Sandbox, namespace: str, tmp_path: Path) -> Iterator[Agent]:
    name = f"dp-it-{secrets.token_hex(3)}"
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"}, "labels": {"type": "kwok"}},
        "spec": {"taints": [{"key": "vgpu-test", "value": "plugin", "effect": "NoSchedule"}]},
    }
    sandbox.kubectl("create", "-f", "-", input=json.dumps(node))
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(gpus_yaml(name))
    client = NodeAgentClient(str(sandbox.kubeconfig))  # the kubelet stand-in's: the cluster's admin
    # the plugin as a node's plugin runs: the plugin's account, with its node in the token
    plugin_client = NodeAgentClient(
        str(product.account_kubeconfig(sandbox, name, product.PLUGIN_ACCOUNT, name))
    )
    kubelet = Kubelet(name, tmp_path, client)
    kubelet.start()
    daemon = Daemon(
        name,
        NAMESPACE,
        HostPaths(tmp_path),
        NodeConfig(split=SPLIT),
        FakeDiscovery(gpus, poll_s=0.05),
        plugin_client,
        None,
    )
    daemon.server.watch_interval_s = 0.1
    daemon.start()
    a = Agent(name, tmp_path, gpus, sandbox, daemon, kubelet, client)
    try:
        assert kubelet.wait_for(lambda k: len(a.advertised(k)) == 4 * SPLIT, 20)
        yield a
    finally:
        daemon.stop()
        a.kubelet.stop()
        sandbox.kubectl(
            "delete",
            "pods",
            "-n",
            TEST_NS,
            f"--field-selector=spec.nodeName={name}",
            "--grace-period=0",
            "--force",
            check=False,
        )
        sandbox.kubectl("delete", "node", name, "--wait=false", check=False)
        sandbox.kubectl("delete", "lease", "-n", NAMESPACE, lease_name(name), check=False)
        client.close()
        plugin_client.close()


def test_the_node_gets_its_inventory_lease_and_device_count(agent: Agent) -> None:
    def reported() -> dict[str, Any] | None:
        node = agent.node()
        ann = node["metadata"].get("annotations") or {}
        ok = DEVICES_ANNOTATION in ann and node["status"].get("allocatable", {}).get("nvidia.com/gpu") == "16"
        return node if ok else None

    node = poll(reported, timeout=30, every=0.1)
    assert node is not None
    inv = decode_devices(node["metadata"]["annotations"][DEVICES_ANNOTATION])
    assert [(d.uuid, d.memory_mib, d.split) for d in inv.devices] == [
        (agent.uuid(i), 24000, SPLIT) for i in range(4)
    ]
    lease = agent.client.get_lease(NAMESPACE, lease_name(agent.name))
    assert lease is not None and lease["spec"]["holderIdentity"] == f"vgpu-device-plugin/{agent.name}"


def test_a_single_container_pod_starts_with_the_scheduled_limits(agent: Agent) -> None:
    agent.create_pod("single", {"main": [(2, 6000, 40)]})
    agent.admit(1)
    record = agent.record("single")
    assert record["error"] is None
    envs = record["containers"]["main"]["envs"]
    uid = agent.pod("single")["metadata"]["uid"]
    assert envs["NVIDIA_VISIBLE_DEVICES"] == agent.uuid(2)
    assert (envs["CUDA_DEVICE_MEMORY_LIMIT_0"], envs["CUDA_DEVICE_SM_LIMIT_0"]) == ("6000m", "40")
    assert envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == f"/var/lib/vgpu/containers/{uid}_main/vgpu.region"
    assert (agent.root / f"var/lib/vgpu/containers/{uid}_main").is_dir()
    assert agent.pod("single")["metadata"]["annotations"][PHASE_ANNOTATION] == "allocated"


def test_init_and_app_containers_each_get_their_own_share(agent: Agent) -> None:
    agent.create_pod(
        "multi",
        {
            "prep": [(0, 1000, 10)],
            "train": [(1, 8000, 60), (3, 8000, 60)],
            "sidecar": [],
            "eval": [(0, 2000, 0)],
        },
        init=("prep",),
    )
    agent.admit(1)
    record = agent.record("multi")
    assert record["error"] is None
    got = {c: v["envs"] for c, v in record["containers"].items()}
    assert set(got) == {"prep", "train", "eval"}  # the sidecar asks for no vGPU
    assert got["prep"]["NVIDIA_VISIBLE_DEVICES"] == agent.uuid(0)
    assert got["prep"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m"
    assert got["train"]["NVIDIA_VISIBLE_DEVICES"] == f"{agent.uuid(1)},{agent.uuid(3)}"
    assert got["train"]["CUDA_DEVICE_MEMORY_LIMIT_1"] == "8000m"
    assert got["eval"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2000m"
    assert agent.pod("multi")["metadata"]["annotations"][PHASE_ANNOTATION] == "allocated"


def test_several_pods_waiting_at_once_each_get_their_own_limits(agent: Agent) -> None:
    threading.Thread(target=agent.kubelet.run, kwargs={"interval_s": 0.2}, daemon=True).start()
    wanted = {f"wait-{k}": (k % 4, 1000 + 100 * k, 5 * k) for k in range(6)}
    for name, (card, mem, cores) in wanted.items():
        agent.create_pod(name, {"main": [(card, mem, cores)]})
    assert poll(
        lambda: all(agent.record(n)["containers"] or agent.record(n)["error"] for n in wanted),
        timeout=30,
        every=0.1,
    )
    uids = {name: agent.pod(name)["metadata"]["uid"] for name in wanted}
    for name, (card, mem, cores) in wanted.items():
        # GetPreferredAllocation steered kubelet to IDs on the card the scheduler chose
        assert [i.split("::")[0] for i in agent.kubelet._in_use[uids[name]]["nvidia.com/gpu"]] == [
            agent.uuid(card)
        ]
        envs = agent.record(name)["containers"]["main"]["envs"]
        assert envs["NVIDIA_VISIBLE_DEVICES"] == agent.uuid(card), name
        assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{mem}m", name
        assert envs["CUDA_DEVICE_SM_LIMIT_0"] == str(cores), name
        assert (
            envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
            == f"/var/lib/vgpu/containers/{uids[name]}_main/vgpu.region"
        )


def test_pods_a_restarted_kubelet_cannot_order_are_refused_never_swapped(agent: Agent) -> None:
    # kubelet down while pods are bound: back up, it admits them as one batch sorted by
    # creation second, ties in no defined order. Where the plugin cannot know that order it
    # must refuse (kubelet fails that pod) and never give a pod another's limits.
    agent.daemon.allocator.tie_wait_s = 1.0
    agent.kubelet.stop()
    pods = {f"tie-{k}": (k, 1000 * (k + 1), 10 * (k + 1)) for k in range(3)}
    for name, (card, mem, cores) in pods.items():
        agent.create_pod(name, {"main": [(card, mem, cores)]})
    kubelet = agent.start_kubelet()
    assert kubelet.wait_for(lambda k: len(agent.advertised(k)) == 4 * SPLIT, 20)
    threading.Thread(target=kubelet.run, kwargs={"interval_s": 0.2}, daemon=True).start()
    assert poll(
        lambda: all(agent.record(n)["containers"] or agent.record(n)["error"] for n in pods),
        timeout=30,
        every=0.1,
    )
    created = {n: agent.pod(n)["metadata"]["creationTimestamp"] for n in pods}
    served = refused = 0
    for name, (card, mem, cores) in pods.items():
        record = agent.record(name)
        if record["error"]:
            assert "cannot tell which of the pods" in record["error"], record["error"]
            # only a pod sharing its creation second with another can be refused
            assert list(created.values()).count(created[name]) > 1
            pod = agent.pod(name)
            assert (pod["status"]["phase"], pod["status"].get("reason")) == (
                "Failed",
                "UnexpectedAdmissionError",
            )
            refused += 1
            continue
        envs = record["containers"]["main"]["envs"]
        assert (envs["NVIDIA_VISIBLE_DEVICES"], envs["CUDA_DEVICE_MEMORY_LIMIT_0"]) == (
            agent.uuid(card),
            f"{mem}m",
        )
        assert envs["CUDA_DEVICE_SM_LIMIT_0"] == str(cores)
        served += 1
    assert served >= 1 and served + refused == len(pods)


def test_a_malformed_allocation_is_refused_and_disturbs_nothing_else(agent: Agent) -> None:
    agent.create_pod("broken", {"main": [(0, 1, 0)]}, annotation='{"version": 1, "node": ')
    agent.admit(1)
    record = agent.record("broken")
    assert "FAILED_PRECONDITION" in record["error"]
    assert "not valid JSON" in record["error"] and "vgpu.openaios.io/allocation" in record["error"]
    assert agent.pod("broken")["metadata"]["annotations"][PHASE_ANNOTATION] == "bound"
    agent.create_pod("fine", {"main": [(1, 500, 0)]})
    agent.admit(2)
    assert agent.record("fine")["containers"]["main"]["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "500m"


def test_after_a_kubelet_restart_pods_are_allocated_again(agent: Agent) -> None:
    before = agent.daemon.server.registrations
    agent.kubelet.stop()
    kubelet = agent.start_kubelet()
    assert kubelet.wait_for(lambda k: len(agent.advertised(k)) == 4 * SPLIT, 20)
    # the kubelet follows the plugin from inside Register, so the devices can arrive before the
    # plugin's own Register call has returned and counted itself
    assert poll(lambda: agent.daemon.server.registrations > before, timeout=5, every=0.05)
    assert agent.daemon.server.registrations == before + 1
    threading.Thread(target=kubelet.run, kwargs={"interval_s": 0.2}, daemon=True).start()
    agent.create_pod("after-restart", {"main": [(3, 700, 0)]})
    assert poll(lambda: agent.record("after-restart")["containers"].get("main"), timeout=30, every=0.1)
    assert agent.record("after-restart")["containers"]["main"]["envs"][
        "NVIDIA_VISIBLE_DEVICES"
    ] == agent.uuid(3)


def test_a_card_turning_unhealthy_leaves_allocatable_and_the_inventory(agent: Agent) -> None:
    assert poll(
        lambda: agent.node()["status"].get("allocatable", {}).get("nvidia.com/gpu") == "16",
        timeout=30,
        every=0.1,
    )
    agent.gpus.write_text(gpus_yaml(agent.name, unhealthy=(1,)))

    def updated() -> bool:
        node = agent.node()
        inv = decode_devices(node["metadata"]["annotations"][DEVICES_ANNOTATION])
        return (
            node["status"]["allocatable"].get("nvidia.com/gpu") == str(3 * SPLIT)
            and node["status"]["capacity"].get("nvidia.com/gpu") == str(4 * SPLIT)
            and [d.healthy for d in inv.devices] == [True, False, True, True]
        )

    assert poll(updated, timeout=30, every=0.1)
    agent.create_pod("on-sick-card", {"main": [(1, 100, 0)]})
    agent.admit(1)
    assert "unhealthy" in agent.record("on-sick-card")["error"]
    assert agent.pod("on-sick-card")["metadata"]["annotations"][PHASE_ANNOTATION] == "failed"


def test_labelled_dra_the_node_gets_no_vgpu_from_the_plugin_until_labelled_back(agent: Agent) -> None:
    """One mode per node: the plugin reads its Node's label openaios.io/gpu-mode from the API
    server at every renewal and offers nothing to the kubelet nor the extender on a DRA node."""
    agent.daemon.reporter.renew_s = 0.2

    def inventory() -> int:
        ann = agent.node()["metadata"].get("annotations") or {}
        return len(decode_devices(ann[DEVICES_ANNOTATION]).devices) if DEVICES_ANNOTATION in ann else -1

    agent.sandbox.kubectl("label", "node", agent.name, "openaios.io/gpu-mode=dra")
    assert agent.kubelet.wait_for(lambda k: len(agent.advertised(k)) == 0, 20)
    assert poll(lambda: inventory() == 0, timeout=20, every=0.1)
    agent.sandbox.kubectl("label", "node", agent.name, "--overwrite", "openaios.io/gpu-mode=device-plugin")
    assert agent.kubelet.wait_for(lambda k: len(agent.advertised(k)) == 4 * SPLIT, 20)
    assert poll(lambda: inventory() == 4, timeout=20, every=0.1)


def test_a_plugin_whose_node_is_deleted_says_so_once_backs_off_and_publishes_when_it_returns(
    agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    """It logged a WARNING every second for as long as the Node was gone: now one line with the
    fix, retries after 1, 2, 4 .. 30 s, and the inventory is back once the Node is."""
    reporter = agent.daemon.reporter
    node = agent.node()
    with caplog.at_level(logging.INFO, logger="vgpu.deviceplugin.report"):
        agent.sandbox.kubectl("delete", "node", agent.name)
        assert poll(lambda: reporter.failures >= 1, timeout=20, every=0.1)
        time.sleep(10)
        failures = reporter.failures
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.name == "vgpu.deviceplugin.report" and r.levelno == logging.WARNING
        ]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith(f"node {agent.name} does not exist (deleted?)")
        assert "restart its kubelet" in warnings[0] and "up to every 30 s" in warnings[0]
        assert 2 <= failures <= 5, failures  # 1, 2, 4 s apart (plus the loop's 1 s), not every second
        for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
            node["metadata"].pop(key, None)
        node["metadata"]["annotations"].pop(DEVICES_ANNOTATION, None)
        node.pop("status", None)
        agent.sandbox.kubectl("create", "-f", "-", input=json.dumps(node))  # the Node registers again
        assert poll(
            lambda: DEVICES_ANNOTATION in (agent.node()["metadata"].get("annotations") or {}), 40, 0.2
        )
        # said when the loop's round ends, after the publish the poll above saw: wait for it here,
        # while INFO is still captured
        assert poll(lambda: f"reporting node {agent.name} works again" in caplog.text, 10, 0.1)
