"""MIG on demand through every real part: the sandbox's control plane (etcd, kube-apiserver,
kube-scheduler, the webhook and the extender) over one simulated node whose two fake H100 80GB
cards are in MIG mode, its device plugin in ``migStrategy: dynamic``.

Pods of different sizes get the smallest profile that holds them, at placements that never
overlap; the node makes each instance at Allocate and reclaims it once its pod is gone; a request
no profile holds is Pending with the reason. The device plugin is killed mid-way (a pod deleted
while it is down leaves an instance no pod names: reconcile at start reclaims it) and the
extender is restarted (its ledger rebuilt from the pods' allocations books their placements
again): at every step the cards hold exactly the instances the live pods' allocations name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vgpu_sandbox import procs
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.kubelet import ERROR_ANNOTATION, RECORD_ANNOTATION
from vgpu_sandbox.nodes import gpu_uuid, node_name

from tests.support import container, pod
from vgpu.core.annotations import ALLOCATION_ANNOTATION, PHASE_ANNOTATION, decode_allocation
from vgpu.core.mig import H100_80GB, Placement
from vgpu.node.fake_nvml import FakeDiscovery

pytestmark = pytest.mark.e2e

NODE = node_name(0)
CARDS = [gpu_uuid(NODE, 0), gpu_uuid(NODE, 1)]
Key = tuple[str, str, int]  # (card, profile, start)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    state_dir = Path(tempfile.mkdtemp(prefix="vgpu-mig-", dir="/tmp"))
    sb = Sandbox(state_dir)
    try:
        sb.up(
            Spec(
                nodes=1,
                gpus_per_node=2,
                gpu_memory_mib=81559,
                gpu_model="NVIDIA H100 80GB HBM3",
                split=7,
                mig="dynamic",
            )
        )
        yield sb
    finally:
        sb.down()
        shutil.rmtree(state_dir, ignore_errors=True)


def _wait(what: str, check: Callable[[], Any], timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def _instances(sb: Sandbox) -> dict[Key, str]:
    """The cards' MIG devices as the node's fake NVML holds them: (card, profile, start) -> uuid."""
    discovery = FakeDiscovery(sb.layout.node_root(NODE) / "gpus.yaml")
    try:
        assert discovery.mig is not None
        return {
            (card, d.profile, d.placement.start): d.uuid
            for card in CARDS
            for d in discovery.mig.devices(card)
        }
    finally:
        discovery.close()


def _pods(sb: Sandbox) -> list[dict[str, Any]]:
    return list(json.loads(sb.kubectl("get", "pods", "-n", "default", "-o", "json").stdout)["items"])


def _grants(sb: Sandbox) -> dict[str, list[Key]]:
    """Each live pod's MIG placements, from its allocation annotation."""
    out: dict[str, list[Key]] = {}
    for p in _pods(sb):
        raw = (p["metadata"].get("annotations") or {}).get(ALLOCATION_ANNOTATION)
        if raw is None or p["metadata"].get("deletionTimestamp"):
            continue
        alloc = decode_allocation(raw)
        out[p["metadata"]["name"]] = [
            (d.uuid, d.mig.profile, d.mig.start) for c in alloc.containers for d in c.devices if d.mig
        ]
    return out


def _no_overlap(grants: dict[str, list[Key]]) -> None:
    taken: dict[str, list[tuple[str, Placement]]] = {}
    for name, keys in grants.items():
        for card, profile, start in keys:
            place = Placement(start, H100_80GB.profile(profile).memory_slices)
            clash = [n for n, other in taken.get(card, []) if other.overlaps(place)]
            assert not clash, f"{name}'s {profile} at {start} on {card} overlaps {clash}"
            taken.setdefault(card, []).append((name, place))


def _consistent(sb: Sandbox) -> dict[Key, str]:
    """Once the node reclaimed what it should: exactly the instances the live pods name."""

    def check() -> tuple[dict[Key, str]] | None:  # a tuple: no instance at all is an answer too
        grants = _grants(sb)
        named = {k for keys in grants.values() for k in keys}
        made = _instances(sb)
        return (made,) if set(made) == named else None

    (made,) = _wait("the cards to hold exactly the live pods' instances", check)
    _no_overlap(_grants(sb))
    return made


def _apply(sb: Sandbox, name: str, annotations: dict[str, str] | None = None, **limits: int) -> None:
    manifest = pod(name, container("main", **limits), annotations=annotations)
    sb.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def _allocated(sb: Sandbox, name: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        p = json.loads(sb.kubectl("get", "pod", "-n", "default", name, "-o", "json").stdout)
        a = p["metadata"].get("annotations") or {}
        assert a.get(ERROR_ANNOTATION) is None, a.get(ERROR_ANNOTATION)
        return p if RECORD_ANNOTATION in a and a.get(PHASE_ANNOTATION) == "allocated" else None

    return dict(_wait(f"pod {name} allocated", check))


def _pending_reason(sb: Sandbox, name: str, words: str) -> str:
    def check() -> str | None:
        p = json.loads(sb.kubectl("get", "pod", "-n", "default", name, "-o", "json").stdout)
        for cond in (p.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and words in (cond.get("message") or ""):
                return str(cond["message"])
        return None

    return str(_wait(f"pod {name} pending with {words!r}", check))


def _delete(sb: Sandbox, *names: str) -> None:
    sb.kubectl("delete", "pod", "-n", "default", *names, "--wait=false")
    _wait(
        f"pods {names} gone",
        lambda: not {p["metadata"]["name"] for p in _pods(sb)} & set(names),
    )


def _profile(sb: Sandbox, name: str) -> Key:
    (key,) = _grants(sb)[name]
    return key


def _visible(p: dict[str, Any]) -> str:
    record = json.loads(p["metadata"]["annotations"][RECORD_ANNOTATION])
    return str(record["main"]["envs"]["NVIDIA_VISIBLE_DEVICES"])


def _kill(sb: Sandbox, component: str) -> tuple[list[str], int | None]:
    state = sb.state()
    assert state is not None
    (old,) = [c for c in state.components if c.name == component]
    os.killpg(old.pid, signal.SIGKILL)  # a crash: no clean-up at all
    _wait(f"{component} gone", lambda: not procs.alive(old.pid), 30)
    sb.adopt(state)
    state.components.remove(old)
    return old.argv, old.port


def test_pods_get_the_smallest_profiles_and_restarts_leak_or_double_use_nothing(sandbox: Sandbox) -> None:
    sb = sandbox
    # -- sizes: each pod the smallest profile that holds it, each instance made at Allocate
    for name, limits, profile in (
        ("big", {"gpumem": 60000}, "7g.80gb"),
        ("mid", {"gpumem": 30000}, "3g.40gb"),
        ("small", {"gpumem": 5000}, "1g.10gb"),
        ("wide", {"gpumem": 5000, "gpucores": 25}, "2g.20gb"),
    ):
        _apply(sb, name, **limits)
        allocated = _allocated(sb, name)
        card, got, start = _profile(sb, name)
        assert got == profile, (name, got)
        made = _consistent(sb)
        assert _visible(allocated) == made[(card, got, start)]  # the container sees its MIG device
    assert _profile(sb, "big")[0] != _profile(sb, "mid")[0]  # the 7g took a whole card

    # -- a request no profile holds: Pending, saying so; one with no room now: Pending too
    _apply(sb, "huge", gpumem=90000)
    reason = _pending_reason(sb, "huge", "no MIG profile that large")
    assert "7g.80gb" in reason
    _delete(sb, "huge")
    # HAMi's vgpu-mode: hami-core asks for a card shared under the hook, which this node has none of
    _apply(sb, "shared", annotations={"nvidia.com/vgpu-mode": "hami-core"}, gpumem=1000)
    _pending_reason(sb, "shared", "not one nvidia.com/vgpu-mode hami-core takes")
    _delete(sb, "shared")
    _apply(sb, "later", gpumem=40000)  # a 3g.40gb: no four free slices on either card now
    _pending_reason(sb, "later", "no free 3g.40gb placement")

    # -- the plugin crashes; a pod is deleted while it is down; it comes back and reconciles
    argv, port = _kill(sb, f"device-plugin-{NODE}")
    gone = _profile(sb, "small")
    _delete(sb, "small")
    assert gone in _instances(sb)  # nobody reclaimed it yet: the plugin is down
    sb.launch(f"device-plugin-{NODE}", argv, port)
    made = _consistent(sb)
    assert gone not in made and _profile(sb, "mid") in made and _profile(sb, "big") in made

    # -- the extender restarts (its ledger rebuilt from the pods' allocations), then room frees
    argv, port = _kill(sb, "vgpu-extender")
    sb.launch("vgpu-extender", argv, port)
    _delete(sb, "big")  # its card empties: the pending 3g goes there, beside no one
    _allocated(sb, "later")
    _apply(sb, "after", gpumem=5000)  # booked by the restarted extender beside the others
    _allocated(sb, "after")
    made = _consistent(sb)
    assert _profile(sb, "later") in made and _profile(sb, "after") in made

    # -- every pod gone: every instance reclaimed, and the node's /metrics says so
    _delete(sb, *_grants(sb))
    assert _consistent(sb) == {}
    state = sb.state()
    assert state is not None
    port = state.ports[f"monitor-{NODE}"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    made = [line for line in metrics.splitlines() if line.startswith("vgpu_mig_instances_made_total{")]
    assert made and "vgpu_mig_instances_reclaimed_total{" in metrics  # since the plugin's restart
    assert "vgpu_mig_instances{" not in metrics  # no instance left on any card
