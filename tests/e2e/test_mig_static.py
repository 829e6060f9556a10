"""Static MIG on the sandbox's real control plane: simulated nodes whose cards are H100 80GB in
MIG mode (the fake NVML's tables), the device plugin under migStrategy single and mixed, the real
kube-scheduler with the extender and the webhook.

Pods of each profile land on whole slices of their profile (single's one profile, a pod of two
slices among them; mixed's four, the media extension's ``1g.10gb+me`` among them), each Allocate
hands the slice's MIG uuid and its memory as the limit, no slice ever holds two pods, a pod past
the free slices waits, removing a pod frees its slice for the next one, and a restart of the
device plugin between keeps every MIG device as it was.

Each strategy starts a sandbox of its own (one node, two cards), beside the session's.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vgpu_sandbox import procs
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.kubelet import ERROR_ANNOTATION, RECORD_ANNOTATION

from tests.support import container, pod, poll
from vgpu.core.annotations import DEVICES_ANNOTATION, decode_devices

pytestmark = pytest.mark.e2e
NODE = "vgpu-node-0"


@pytest.fixture(scope="module", params=["single", "mixed"])
def mig_sandbox(request: pytest.FixtureRequest) -> Iterator[tuple[str, Sandbox]]:
    state_dir = Path(tempfile.mkdtemp(prefix="vgpu-mig-", dir="/tmp"))
    sb = Sandbox(state_dir)
    try:
        sb.up(Spec(nodes=1, gpus_per_node=2, mig=request.param))
        yield request.param, sb
    finally:
        sb.down()
        shutil.rmtree(state_dir, ignore_errors=True)


def node_doc(sb: Sandbox) -> dict[str, Any]:
    return json.loads(sb.kubectl("get", "node", NODE, "-o", "json").stdout)  # type: ignore[no-any-return]


def slices(sb: Sandbox) -> dict[str, str]:
    """The node's MIG devices as its inventory says: uuid -> profile."""
    inv = decode_devices(node_doc(sb)["metadata"]["annotations"][DEVICES_ANNOTATION])
    return {d.uuid: d.mig.profile for d in inv.devices if d.mig is not None}


def create(sb: Sandbox, name: str, **limits: int) -> None:
    c = container(limits={k: str(v) for k, v in limits.items()})
    sb.kubectl("create", "-f", "-", input=json.dumps(pod(name, c)))


def allocated(sb: Sandbox, name: str, timeout: float = 90) -> dict[str, str]:
    """The environment Allocate gave pod ``name``'s container, once the node admitted it."""

    def record() -> dict[str, str] | None:
        got = json.loads(sb.kubectl("get", "pod", name, "-o", "json").stdout)
        annotations = got["metadata"].get("annotations") or {}
        assert not annotations.get(ERROR_ANNOTATION), f"{name}: {annotations[ERROR_ANNOTATION]}"
        text = annotations.get(RECORD_ANNOTATION)
        return json.loads(text)["main"]["envs"] if text else None

    envs = poll(record, timeout=timeout, every=0.5)
    assert envs is not None, sb.kubectl("describe", "pod", name).stdout
    return envs  # type: ignore[no-any-return]


def pending(sb: Sandbox, name: str) -> bool:
    got = json.loads(sb.kubectl("get", "pod", name, "-o", "json").stdout)
    return not got["spec"].get("nodeName") and got["status"].get("phase") == "Pending"


def restart_plugin(sb: Sandbox) -> None:
    """Stop the node's device plugin (SIGTERM) and start it again as it ran."""
    state = sb.state()
    assert state is not None
    plugin = next(c for c in reversed(state.components) if c.name == f"device-plugin-{NODE}")
    procs.stop_all([plugin.pid], None)
    assert not procs.alive(plugin.pid)
    sb.launch(plugin.name, plugin.argv, plugin.port)


def delete(sb: Sandbox, *names: str) -> None:
    sb.kubectl("delete", "pod", *names, "--wait=true", "--timeout=60s", check=False)


def test_pods_get_whole_slices_and_free_them(mig_sandbox: tuple[str, Sandbox]) -> None:
    strategy, sb = mig_sandbox
    on_node = slices(sb)
    allocatable = node_doc(sb)["status"]["allocatable"]
    if strategy == "single":
        # seven 1g.10gb a card, offered as nvidia.com/gpu; the cards themselves are not
        assert set(on_node.values()) == {"1g.10gb"} and len(on_node) == 14
        assert allocatable["nvidia.com/gpu"] == "14"
        small, large = {"nvidia.com/gpu": 1}, {"nvidia.com/gpu": 2}
        small_profile = large_profile = "1g.10gb"
        free_small = 12  # and the large pod's two: every slice of the node
    else:
        profiles = ["1g.10gb", "1g.10gb+me", "2g.20gb", "3g.40gb"]
        assert sorted(on_node.values()) == sorted(profiles * 2)
        for profile in profiles:  # one resource per profile, "+me" written ".me"
            assert allocatable["nvidia.com/mig-" + profile.replace("+", ".")] == "2"
        assert int(allocatable.get("nvidia.com/gpu", "0")) == 0
        small, large = {"nvidia.com/mig-1g.10gb": 1}, {"nvidia.com/mig-3g.40gb": 1}
        small_profile, large_profile = "1g.10gb", "3g.40gb"
        free_small = 2
    names = [f"small-{i}" for i in range(free_small)]
    # mixed: a pod of each other profile too, each on a slice of its own profile
    others = {"media": "1g.10gb+me", "mid": "2g.20gb"} if strategy == "mixed" else {}
    try:
        create(sb, "large", **large)
        for n in names:
            create(sb, n, **small)
        for n, profile in others.items():
            create(sb, n, **{"nvidia.com/mig-" + profile.replace("+", "."): 1})
        envs = {n: allocated(sb, n) for n in [*names, "large", *others]}
        given = {n: e["NVIDIA_VISIBLE_DEVICES"].split(",") for n, e in envs.items()}
        everything = [u for us in given.values() for u in us]
        assert len(everything) == len(set(everything)), given  # never two pods on one slice
        for n in names:
            (u,) = given[n]
            assert on_node[u] == small_profile and envs[n]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "9984m"
        assert all(on_node[u] == large_profile for u in given["large"])
        for n, profile in others.items():
            assert [on_node[u] for u in given[n]] == [profile]
        if strategy == "single":
            assert len(given["large"]) == 2  # two slices, two different ones
        else:
            assert envs["large"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40448m"
        # the plugin restarts: the cards kept their instances (the same MIG devices, re-read)
        restart_plugin(sb)
        assert poll(lambda: slices(sb) == on_node or None, timeout=30, every=0.5)
        # every small slice is taken: the next small pod waits, scheduled nowhere
        create(sb, "waiting", **small)
        assert poll(lambda: pending(sb, "waiting") or None, timeout=10, every=0.5)
        assert not poll(lambda: not pending(sb, "waiting") or None, timeout=5, every=0.5)
        # a pod removed: its slice is free again and the waiting pod gets exactly that slice
        freed = given[names[0]][0]
        delete(sb, names[0])
        again = allocated(sb, "waiting", timeout=120)
        assert again["NVIDIA_VISIBLE_DEVICES"] == freed
    finally:
        delete(sb, *names, "large", "waiting", *others)


def test_a_profile_no_table_has_is_refused_at_admission(mig_sandbox: tuple[str, Sandbox]) -> None:
    _, sb = mig_sandbox
    c = container(limits={"nvidia.com/mig-9g.90gb": "1"})
    result = sb.kubectl("create", "-f", "-", input=json.dumps(pod("bad-profile", c)), check=False)
    assert result.returncode != 0
    assert "nvidia.com/mig-9g.90gb" in result.stderr and "no MIG profile '9g.90gb'" in result.stderr
