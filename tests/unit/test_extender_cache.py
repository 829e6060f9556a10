"""The extender as a cache (vgpu/extender/cache.py): pods assumed between filter and bind, each
parsed once and fitted once on the filter -> bind path, and nothing of it needed after a restart."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.support import FakeKube
from tests.unit.test_extender_state import NOW, _cluster, lease
from vgpu.core import annotations as ann
from vgpu.core import placement
from vgpu.core.ledger import Usage
from vgpu.extender import binder, cache, state
from vgpu.extender.state import ASSUME_TTL_S, SchedulerState


def _pod(uid: str, mem: int = 1000, rv: str = "7") -> dict[str, Any]:
    limits = {"nvidia.com/gpumem": str(mem)}
    return {
        "metadata": {"uid": uid, "name": uid, "namespace": "d", "resourceVersion": rv},
        "spec": {"containers": [{"name": "c0", "resources": {"limits": limits}}]},
    }


def _ready(loads: list[int], kube: FakeKube) -> tuple[SchedulerState, list[float]]:
    st = _cluster(loads, keep=1)
    now = [NOW]
    st.clock = lambda: now[0]
    st.kube = kube
    return st, now


def _held(st: SchedulerState, node: str) -> int:
    return sum(u.memory_mib for u in st.ledger.usage(node).values())


def _as_bound(pod: dict[str, Any], kube: FakeKube, rv: str) -> dict[str, Any]:
    """The pod as the watch delivers it after our bind: the API server's copy, a newer version."""
    got = kube.find("d", pod["metadata"]["name"])
    assert got is not None and got["spec"].get("nodeName")
    return {**got, "metadata": {**got["metadata"], "resourceVersion": rv}, "status": {"phase": "Running"}}


def test_a_failed_bind_frees_what_filter_assumed() -> None:
    kube = FakeKube(fail_bind=True)
    st, _ = _ready([9000, 0], kube)
    assert st.filter(_pod("p1"), ["n0", "n1"]).nodes == ["n0"]
    assert list(st.assumed) == ["p1"] and _held(st, "n0") == 10000
    error, kind = st.bind("d", "p1", "p1", "n0")
    assert kind == "error" and "said no" in error
    assert st.assumed == {} and st.ledger.node_of("p1") is None and _held(st, "n0") == 9000
    # the room is there for the next pod
    assert st.filter(_pod("p2"), ["n0", "n1"]).nodes == ["n0"]


def test_an_expired_assumption_frees_the_room() -> None:
    st, now = _ready([9000, 0], FakeKube())
    st.filter(_pod("p1"), ["n0", "n1"])
    now[0] += ASSUME_TTL_S + 1
    for i in range(2):
        st.apply_lease(lease(f"vgpu-n{i}", now[0]))
    assert st.filter(_pod("p2"), ["n0", "n1"]).nodes == ["n0"]  # p1's assumption expired first
    assert st.ledger.node_of("p1") is None and list(st.assumed) == ["p2"]


def test_a_confirmed_pod_is_counted_once() -> None:
    kube = FakeKube()
    st, _ = _ready([0], kube)
    pod = _pod("p1", mem=3000)
    kube.pods.append(pod)
    st.filter(pod, ["n0"])
    assert st.bind("d", "p1", "p1", "n0") == ("", "ok")
    assert st.assumed == {} and _held(st, "n0") == 3000
    bound = _as_bound(pod, kube, "8")
    st.apply_pod(bound)  # the watch's copy of our own Binding
    st.apply_pod(bound)  # and again (a relist)
    st.replace_pods([bound])
    assert _held(st, "n0") == 3000 and st.ledger.pods() == {"p1": "n0"}
    assert st.cache.memo("p1") is None  # dropped on confirm


def test_the_watch_confirming_an_assumed_pod_replaces_the_assumption() -> None:
    """A pod bound elsewhere (another replica before a failover) while we had assumed it: the
    watch's allocation is the booking, and no assumption is left to expire or be freed."""
    st, now = _ready([0, 0], FakeKube())
    assert st.filter(_pod("p1"), ["n0", "n1"]).nodes
    allocation = ann.Allocation(
        "n1", (ann.ContainerAllocation("c0", (ann.DeviceAllocation("GPU-n1", 1000, 0),)),)
    )
    bound = _pod("p1", rv="9")
    bound["metadata"]["annotations"] = {ann.ALLOCATION_ANNOTATION: ann.encode_allocation(allocation)}
    bound["spec"]["nodeName"] = "n1"
    bound["status"] = {"phase": "Running"}
    st.apply_pod(bound)
    assert st.assumed == {} and st.ledger.pods() == {"p1": "n1"}
    assert (_held(st, "n0"), _held(st, "n1")) == (0, 1000)
    now[0] += ASSUME_TTL_S + 1
    st.filter(_pod("p2"), ["n0", "n1"])  # expiry runs: p1 is not an assumption any more
    assert st.ledger.node_of("p1") == "n1"


def test_a_restart_rebuilds_the_ledger_from_the_api_server_without_the_assumptions() -> None:
    kube = FakeKube()
    st, _ = _ready([0, 0], kube)
    for uid in ("p1", "p2"):
        pod = _pod(uid, mem=2000)
        kube.pods.append(pod)
        st.filter(pod, ["n0", "n1"])
    assert st.bind("d", "p1", "p1", "n0") == ("", "ok")  # p2 filtered, assumed, never bound
    before = {n: dict(st.ledger.usage(n)) for n in ("n0", "n1")}
    assert sum(u.memory_mib for u in before["n0"].values()) == 4000  # p1 bound, p2 assumed

    fresh, _ = _ready([0, 0], kube)  # a new process: nodes and Leases listed, then the pods
    fresh.replace_pods([_as_bound(kube.pods[0], kube, "8"), kube.pods[1]])
    assert fresh.ledger.pods() == {"p1": "n0"} and fresh.assumed == {}
    assert dict(fresh.ledger.usage("n0")) == {"GPU-n0": Usage(2000, 0, 1, 0)}
    # and it binds p2 afresh: read from the API server, since this process never filtered it
    assert fresh.bind("d", "p2", "p2", "n0") == ("", "ok")
    assert _held(fresh, "n0") == 4000


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    calls = [0]
    real: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_pod_is_parsed_once_and_fitted_once_from_filter_to_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube()
    st, _ = _ready([9000, 0, 5000], kube)
    parses = _counting(monkeypatch, cache, "parse_pod")
    fits = [
        _counting(monkeypatch, placement, "fit_node"),
        _counting(monkeypatch, state, "fit_node"),
        _counting(monkeypatch, binder, "fit_node"),
    ]
    quick = _counting(monkeypatch, placement, "quick_fits")
    pod = _pod("p1")
    kube.pods.append(pod)
    assert st.filter(pod, ["n0", "n1", "n2"]).nodes == ["n0"]
    st.prioritize(pod, ["n0"])  # with --filter-keep above 1 kube-scheduler calls it
    assert st.bind("d", "p1", "p1", "n0") == ("", "ok")
    assert parses == [1]
    assert sum(f[0] for f in fits) == 1 and quick == [0]  # one fit, on the node kept, none at bind
    assert kube.bound == [("p1", "n0")]


def test_a_new_version_of_the_pod_is_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    st, _ = _ready([0], FakeKube())
    parses = _counting(monkeypatch, cache, "parse_pod")
    st.filter(_pod("p1", rv="7"), ["n0"])
    st.filter(_pod("p1", rv="7"), ["n0"])
    assert parses == [1]
    st.filter(_pod("p1", mem=2000, rv="8"), ["n0"])
    assert parses == [2] and _held(st, "n0") == 2000


def test_bind_fits_again_when_the_node_changed_since_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The assumed plan is only reused against the inventory it was fitted on."""
    kube = FakeKube()
    st, _ = _ready([0], kube)
    pod = _pod("p1")
    kube.pods.append(pod)
    st.filter(pod, ["n0"])
    inv = ann.encode_devices(ann.NodeInventory((ann.Device("GPU-other", 0, "m", 10000, 100, 10),)))
    st.apply_node({"metadata": {"name": "n0", "annotations": {ann.DEVICES_ANNOTATION: inv}}})
    fits = _counting(monkeypatch, binder, "fit_node")
    assert st.bind("d", "p1", "p1", "n0") == ("", "ok")
    assert fits == [1]
    assert set(st.ledger.usage("n0")) == {"GPU-other"}


def test_the_memo_is_bounded() -> None:
    c = cache.PodCache(SchedulerState(state.SchedulerConfig()).ledger, kept=3)
    for i in range(5):
        c.parsed(_pod(f"p{i}"), state.SchedulerConfig())
    assert [c.memo(f"p{i}") is not None for i in range(5)] == [False, False, True, True, True]
