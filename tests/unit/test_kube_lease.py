"""The one Lease code (vgpu.kube.lease) against a fake that compares resourceVersions as the
API server does; tests/e2e/test_plugin_apiserver.py and test_scheduler.py use the real one."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import pytest

from vgpu.core.errors import ConflictError, KubeError
from vgpu.kube import lease as leases

Obj = dict[str, Any]


class FakeLeases:
    def __init__(self) -> None:
        self.stored: dict[str, Obj] = {}
        self.version = 0
        self.conflicts = 0  # the next writes that lose to a concurrent writer

    def get_lease(self, namespace: str, name: str) -> Obj | None:
        got = self.stored.get(name)
        return copy.deepcopy(got) if got is not None else None

    def _write(self, lease: Obj) -> Obj:
        if self.conflicts:
            self.conflicts -= 1
            raise ConflictError("lease: HTTP 409", status=409)
        self.version += 1
        lease = copy.deepcopy(lease)
        lease["metadata"]["resourceVersion"] = str(self.version)
        self.stored[lease["metadata"]["name"]] = lease
        return lease

    def create_lease(self, namespace: str, lease: Obj) -> Obj:
        if lease["metadata"]["name"] in self.stored:
            raise ConflictError("exists", status=409)
        return self._write(lease)

    def replace_lease(self, namespace: str, lease: Obj) -> Obj:
        name = lease["metadata"]["name"]
        if self.stored[name]["metadata"]["resourceVersion"] != lease["metadata"].get("resourceVersion"):
            raise ConflictError("changed", status=409)
        return self._write(lease)


def ago(seconds: float) -> str:
    return (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_the_first_taker_creates_it_and_others_wait_until_it_runs_out_or_is_released() -> None:
    api = FakeLeases()
    assert leases.acquire(api, "ns", "leader", "a", 15)
    first = api.stored["leader"]["spec"]
    assert first["holderIdentity"] == "a" and first["leaseTransitions"] == 0
    assert not leases.acquire(api, "ns", "leader", "b", 15)  # a renewed it just now
    assert leases.acquire(api, "ns", "leader", "a", 15)  # a renews its own
    api.stored["leader"]["spec"]["renewTime"] = ago(20)  # a stopped renewing 20 s ago
    assert leases.acquire(api, "ns", "leader", "b", 15)
    spec = api.stored["leader"]["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    leases.release(api, "ns", "leader", "a")  # not a's to release: unchanged
    assert leases.holder(api.stored["leader"]) == "b"
    leases.release(api, "ns", "leader", "b")
    assert leases.holder(api.stored["leader"]) == ""
    assert leases.acquire(api, "ns", "leader", "a", 15)  # released: free at once


def test_a_lost_compare_and_swap_is_not_held_and_renew_retries_three_times() -> None:
    api = FakeLeases()
    api.conflicts = 1
    assert not leases.acquire(api, "ns", "leader", "a", 15)
    api.conflicts = 2
    leases.renew(api, "ns", "vgpu-n1", "plugin/n1", 40, {"usage": "{}"})  # the third try lands
    stored = api.stored["vgpu-n1"]
    assert stored["metadata"]["annotations"] == {"usage": "{}"}
    api.conflicts = 3
    with pytest.raises(KubeError, match="3 conflicts"):
        leases.renew(api, "ns", "vgpu-n1", "plugin/n1", 40)


def test_renew_takes_a_nodes_lease_whoever_holds_it_and_merges_the_annotations() -> None:
    api = FakeLeases()
    leases.renew(api, "ns", "vgpu-n1", "someone-else", 40, {"old": "1", "usage": "a"})
    leases.renew(api, "ns", "vgpu-n1", "plugin/n1", 40, {"usage": "b"})
    stored = api.stored["vgpu-n1"]
    assert leases.holder(stored) == "plugin/n1"
    assert stored["metadata"]["annotations"] == {"old": "1", "usage": "b"}


def test_expires_at_reads_renewal_or_acquisition_plus_duration() -> None:
    renewed = "2026-01-01T00:00:00.000000Z"
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC).timestamp()
    assert leases.expires_at({"spec": {"renewTime": renewed, "leaseDurationSeconds": 40}}) == at + 40
    assert leases.expires_at({"spec": {"acquireTime": renewed, "leaseDurationSeconds": 40}}) == at + 40
    assert leases.expires_at({"spec": {"renewTime": renewed}}, default_duration_s=15) == at + 15
    assert leases.expires_at({"spec": {"renewTime": "garbage", "leaseDurationSeconds": 40}}) is None
    assert leases.expires_at({"spec": {"renewTime": renewed, "leaseDurationSeconds": "40"}}) is None
    assert leases.expires_at({}) is None
