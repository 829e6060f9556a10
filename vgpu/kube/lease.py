"""coordination.k8s.io/v1 Leases: build one, take or renew it, release it, read when it runs out.

Two Leases use this. Each device plugin renews ``vgpu-<node>`` (contract 2: the scheduler
counts a node whose Lease ran out as gone), taking it whoever held it, with the usage report as
an annotation. The extender's replicas share ``vgpu-scheduler-extender``: one takes it only
when it is free, released or run out, and holds it by renewing. Both are a read then a
compare-and-swap write (``metadata.resourceVersion``), so a concurrent writer (HTTP 409) loses.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from typing import Any, Protocol

from vgpu.core.errors import ConflictError, KubeError

Obj = dict[str, Any]


class LeaseAPI(Protocol):
    """The three calls on Leases (:class:`vgpu.kube.client.Kube` has them)."""

    def get_lease(self, namespace: str, name: str) -> Obj | None: ...

    def create_lease(self, namespace: str, lease: Obj) -> Obj: ...

    def replace_lease(self, namespace: str, lease: Obj) -> Obj: ...


def now_micro() -> str:
    """The current time as a Kubernetes MicroTime string."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> dt.datetime | None:
    """Parse a Kubernetes Time or MicroTime string; None when absent or malformed."""
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def build(
    namespace: str, name: str, holder: str, duration_s: int, annotations: Mapping[str, str] | None = None
) -> Obj:
    """A new Lease held by ``holder`` from now."""
    now = now_micro()
    meta: Obj = {"name": name, "namespace": namespace}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration_s,
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": 0,
        },
    }


def holder(lease: Obj | None) -> str:
    """Who holds it ("" when nobody: absent or released)."""
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


def expires_at(lease: Obj, default_duration_s: int = 0) -> float | None:
    """When it runs out (seconds since the epoch): the last renewal (or else the acquisition)
    plus its duration (or else ``default_duration_s``); None when those do not read."""
    spec = lease.get("spec") or {}
    renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds") or default_duration_s
    if renewed is None or not isinstance(duration, int):
        return None
    return renewed.timestamp() + duration


def acquire(
    api: LeaseAPI,
    namespace: str,
    name: str,
    identity: str,
    duration_s: int,
    annotations: Mapping[str, str] | None = None,
    *,
    force: bool = False,
    attempts: int = 1,
) -> bool:
    """Create, take or renew the Lease for ``identity``; returns whether it holds it now.

    Without ``force`` a Lease another holder renewed within its duration is left alone.
    ``annotations`` are merged into the Lease's own. A write that loses to a concurrent one
    (409) is tried again with a fresh copy, ``attempts`` times in all, then counts as not held.
    """
    for _ in range(attempts):
        lease = api.get_lease(namespace, name)
        if lease is None:
            try:
                api.create_lease(namespace, build(namespace, name, identity, duration_s, annotations))
                return True
            except ConflictError:
                continue
        spec = lease.get("spec") or {}
        current = holder(lease)
        if not force and current and current != identity:
            ends = expires_at(lease, duration_s)
            if ends is not None and ends >= time.time():
                return False
        now = now_micro()
        new_spec = {**spec, "holderIdentity": identity, "leaseDurationSeconds": duration_s, "renewTime": now}
        if current != identity:
            new_spec["acquireTime"] = now
            new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        lease["spec"] = new_spec
        if annotations:
            meta = lease.setdefault("metadata", {})
            meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
        try:
            api.replace_lease(namespace, lease)
            return True
        except ConflictError:
            continue
    return False


def renew(
    api: LeaseAPI,
    namespace: str,
    name: str,
    identity: str,
    duration_s: int,
    annotations: Mapping[str, str] | None = None,
) -> None:
    """Hold the Lease whoever had it (a node's own Lease); raises KubeError after 3 conflicts."""
    if not acquire(api, namespace, name, identity, duration_s, annotations, force=True, attempts=3):
        raise KubeError(f"renew lease {namespace}/{name}: it kept changing under us (3 conflicts)")


def release(api: LeaseAPI, namespace: str, name: str, identity: str) -> None:
    """Give the Lease up (empty holder) when ``identity`` holds it, so another can take it at once."""
    lease = api.get_lease(namespace, name)
    if lease is not None and holder(lease) == identity:
        lease["spec"]["holderIdentity"] = ""
        api.replace_lease(namespace, lease)
