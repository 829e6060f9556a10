"""What must hold for any input to each parser: one ``check_*`` function per fuzz harness.

Each takes the raw bytes a fuzzer made and returns normally when the parser behaved: it gave a
valid object, or refused the input with its declared error (``AnnotationError``,
``RequestError``, ``RegionError``, a 400 answer...). Any other exception, or a failed
``assert``, is a bug. The atheris runner (``fuzz/run_atheris.py``) fuzzes these functions and
``tests/unit/test_fuzz_regressions.py`` replays every input saved under
``fuzz/regressions/<harness>/`` through the same function, so a crash found once stays fixed.

Everything the harnesses reach is imported here, at the top: fuzz/run_atheris.py instruments for
coverage only the modules imported while it imports this one. Only ``vgpu`` and ``fuzz`` are
imported, never the tests (they import this).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fuzz.references import gunicorn_reads
from vgpu.commands.status import build_status, render_text
from vgpu.core import annotations as ann
from vgpu.core.config import SchedulerConfig
from vgpu.core.errors import AnnotationError, RequestError
from vgpu.core.requests import asks_for_vgpu, parse_pod
from vgpu.dra import claims as dra_claims
from vgpu.extender import worker
from vgpu.extender.app import _dumps, create_app
from vgpu.extender.state import SchedulerState
from vgpu.hookabi import grant as grants
from vgpu.hookabi import layout, region
from vgpu.node.discovery import Card

CONFIG = SchedulerConfig()


def _json(data: bytes) -> Any:
    """The JSON document in ``data``, or None when it is none (then the harness has nothing to try)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # the stdlib decoder's own limits, not our parser's
        return None


# ---------------------------------------------------------------------------------------------
# vgpu/core/annotations.py: contracts 2 and 3 (docs/contracts.md)


def check_devices_annotation(data: bytes) -> None:
    """decode_devices: an inventory that re-encodes to itself, or AnnotationError."""
    for text in (data, data.decode("utf-8", "replace")):
        try:
            inventory = ann.decode_devices(text)
        except AnnotationError:
            continue
        assert ann.decode_devices(ann.encode_devices(inventory)) == inventory
        for d in inventory.devices:
            assert d.uuid and d.index >= 0 and d.memory_mib >= 0 and d.split >= 1 and d.numa >= -1


def check_allocation_annotation(data: bytes) -> None:
    """decode_allocation: an allocation that re-encodes to itself, or AnnotationError."""
    for text in (data, data.decode("utf-8", "replace")):
        try:
            allocation = ann.decode_allocation(text)
        except AnnotationError:
            continue
        assert ann.decode_allocation(ann.encode_allocation(allocation)) == allocation
        assert allocation.node
        for c in allocation.containers:
            assert c.name and all(d.uuid and d.memory_mib >= 0 and d.cores >= 0 for d in c.devices)


# ---------------------------------------------------------------------------------------------
# vgpu/core/requests.py: contract 1 (docs/contracts.md)


def check_pod_request(data: bytes) -> None:
    """parse_pod over any pod object: a request within the bounds of contract 1, or RequestError.

    asks_for_vgpu runs on every pod the webhook sees, before any validation: it must not raise.
    """
    pod = _json(data)
    if not isinstance(pod, dict):
        return  # the extender and the webhook refuse a pod that is not an object before this
    wants = asks_for_vgpu(pod)
    try:
        request = parse_pod(pod, CONFIG)
    except RequestError as err:
        assert err.field, f"a RequestError must name the field: {err}"
        return
    for c in request.containers:
        assert c.name and c.count >= 0 and 0 <= c.cores <= 100 and c.priority in (0, 1)
        if c.count:
            assert (c.memory_mib is None) != (c.memory_percent is None)
            assert c.memory_mib is None or c.memory_mib >= 1
            assert c.memory_percent is None or 1 <= c.memory_percent <= 100
    assert not request.wants_vgpu or wants, "parse_pod found vGPUs asks_for_vgpu did not see"
    request.phases()


# ---------------------------------------------------------------------------------------------
# vgpu/extender/app.py and webhook.py: the verbs' and the webhook's request bodies

_INVENTORY = ann.encode_devices(
    ann.NodeInventory(
        devices=tuple(
            ann.Device(
                uuid=f"GPU-fuzz-{i}", index=i, model="NVIDIA H200", memory_mib=143771, cores=100, split=10
            )
            for i in range(2)
        )
    )
)
VERBS = (
    "/filter",
    "/prioritize",
    "/bind",
    "/webhook/mutate",
    "/webhook/validate",
    "/webhook/validate-config",
)
_routes: dict[str, Callable[[bytes], tuple[int, Any]]] | None = None


class _Kube:
    """The API server as bind sees it: no pod is found, every binding succeeds."""

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: Any = None
    ) -> None:  # pragma: no cover - trivial
        return None


def _verb_routes() -> dict[str, Callable[[bytes], tuple[int, Any]]]:
    """The app's verb handlers (body bytes -> status, answer) over a ready state with two GPU nodes."""
    global _routes
    if _routes is None:
        state = SchedulerState(CONFIG, kube=_Kube())
        for name in ("node-a", "node-b"):
            state.apply_node(
                {"metadata": {"name": name, "annotations": {ann.DEVICES_ANNOTATION: _INVENTORY}}}
            )
            state.lease_expiry[name] = float("inf")
        state.synced.set()
        state.leader.set()
        app = create_app(CONFIG, state)
        _routes = app.extensions["vgpu_verbs"]
    return _routes


def check_extender_body(data: bytes) -> None:
    """Each verb's handler: an answer (200, 400 or 503) that serialises, never an exception.

    The first byte picks the verb, the rest is the body as the handler gets it off the wire.
    """
    if not data:
        return
    path = VERBS[data[0] % len(VERBS)]
    status, answer = _verb_routes()[path](data[1:])
    assert status in (200, 400, 503), f"{path} answered {status}"
    _dumps(answer)
    if status == 400:
        assert isinstance(answer, dict) and answer.get("Error"), f"{path}: a 400 must say why"


# ---------------------------------------------------------------------------------------------
# vgpu/extender/worker.py: the short HTTP/1.1 parser


def check_worker_head(data: bytes) -> None:
    """parse_head: None (gunicorn's parser reads it) or what gunicorn's parser reads alike."""
    head = data.split(b"\r\n\r\n", 1)[0]  # the worker hands it everything before the blank line
    ours = worker.parse_head(head)
    if ours is None:
        return
    method, target, environ, length = ours
    theirs = gunicorn_reads(head, length)
    assert theirs is not None, "the short parser accepted a head gunicorn refuses"
    ours_read = {"method": method, "target": target, "environ": environ, "length": length}
    assert theirs == ours_read, f"the short parser read {ours_read}, gunicorn's parser {theirs}"


# ---------------------------------------------------------------------------------------------
# vgpu/hookabi/region.py: the node monitor's reader of a container's region file

_region_dir: str | None = None


def check_region_file(data: bytes) -> None:
    """Region(path) on a file of these bytes, both modes: a region that reads, or RegionError.

    The first byte is a switch: even, the rest is the file as is (short files are refused early);
    odd, the rest is padded with zeros to a whole region, so the header checks and the snapshot
    decoder see every field.
    """
    global _region_dir
    if not data:
        return
    body = data[1:]
    if data[0] % 2:
        body = body[: layout.REGION_SIZE].ljust(layout.REGION_SIZE, b"\0")
    if _region_dir is None:
        _region_dir = tempfile.mkdtemp(prefix="vgpu-fuzz-region-")
        atexit.register(shutil.rmtree, _region_dir, True)  # (fuzz/run.sh also cleans its TMPDIR)
    path = os.path.join(_region_dir, "region")
    Path(path).write_bytes(body)
    for mapped in (False, True):
        try:
            with region.Region(path, mapped=mapped) as r:
                header = r.read_header()
                snap = r.snapshot(attempts=1)
        except region.RegionError:
            continue
        assert len(snap.devices) == header.num_devices <= layout.MAX_DEVICES
        assert all(len(p.used_bytes) == len(snap.devices) for p in snap.processes)
        assert len(snap.processes) <= layout.MAX_PROCS
        for d in snap.devices:
            assert d.uuid == header.uuid(d.index)


# vgpu/hookabi/grant.py: a container's grant as the monitor, the arbiter and `vgpu limits` read it


def check_grant_file(data: bytes) -> None:
    """decode() of any bytes: a Grant that encodes back to a file decoding to the same grant, or
    GrantError. The first byte is a switch: odd, the rest gets a correct checksum (so the checks
    past the checksum see fuzzed fields too); even, the bytes as they are."""
    if not data:
        return
    body = bytearray(data[1:])
    if data[0] % 2 and len(body) >= grants.GRANT_SIZE:
        checksum = layout.fnv1a64(bytes(body[layout.GRANT_PAYLOAD : grants.GRANT_SIZE]))
        body[layout.GRANT_LAYOUT.offsets["checksum"] : layout.GRANT_LAYOUT.offsets["checksum"] + 8] = (
            checksum.to_bytes(8, "little")
        )
    try:
        got = grants.decode(bytes(body))
    except grants.GrantError:
        return
    assert 1 <= len(got.uuids) <= layout.MAX_DEVICES
    assert grants.decode(grants.encode(got, got.seq)) == got


# ---------------------------------------------------------------------------------------------
# vgpu/dra/claims.py: a ResourceClaim as the DRA plugin reads it at NodePrepareResources

_DRA_CARDS = {
    "gpu-0": Card(uuid="GPU-0", index=0, model="m", memory_mib=81920),
    "gpu-1": Card(uuid="GPU-1", index=1, model="m", memory_mib=81920, minor=5),
}


def check_resource_claim(data: bytes) -> None:
    """plan over any claim object: shares of the node's known cards within their bounds (whole
    MiB, at least 1, 1..100 cores) and each request's configuration in range (contract 8), or a
    ClaimError naming the field."""
    claim = _json(data)
    if not isinstance(claim, dict):
        return  # the API server answers a claim object or nothing
    meta = claim.get("metadata")
    uid = str(meta.get("uid")) if isinstance(meta, dict) else ""
    try:
        got = dra_claims.plan(claim, uid, _DRA_CARDS, "node-a")
    except dra_claims.ClaimError as err:
        assert err.field, f"a ClaimError must name the field: {err}"
        return
    assert got.shares
    for share in got.shares:
        card = _DRA_CARDS[share.device]
        assert share.uuid == card.uuid and share.memory_mib >= 1 and 1 <= share.cores <= 100
        assert share.request
    assert sum(len(v) for v in got.requests().values()) == len(got.shares)
    for request in got.requests():  # the configuration of each request: checked, so in range
        config = got.config(request)
        assert config.priority in (None, 0, 1) and config.sm_policy in (None, "cap", "elastic")


_INVENTORY = ann.encode_devices(ann.NodeInventory((ann.Device("GPU-0", 0, "m", 81920, 100, 10),)))
_PLACED = ann.encode_allocation(
    ann.Allocation("n1", (ann.ContainerAllocation("main", (ann.DeviceAllocation("GPU-0", 1000, 30),)),))
)


def check_lease_view(data: bytes) -> None:
    """vgpu status over a node whose Lease carries these bytes as its usage, memory-lines and codec
    annotations (contract 2; the first byte picks which, the rest is the text): a text rendering,
    never an exception (a malformed report reads as none)."""
    if not data:
        return
    keys = [
        k
        for i, k in enumerate((ann.USAGE_ANNOTATION, ann.LINES_ANNOTATION, ann.CODEC_ANNOTATION))
        if data[0] >> i & 1
    ]
    text = data[1:].decode("utf-8", "replace")
    lease = {
        "metadata": {"name": ann.lease_name("n1"), "annotations": dict.fromkeys(keys, text)},
        "spec": {"renewTime": "2026-01-01T12:00:00.000000Z", "leaseDurationSeconds": 40},
    }
    node = {"metadata": {"name": "n1", "annotations": {ann.DEVICES_ANNOTATION: _INVENTORY}}}
    pod = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u",
            "annotations": {ann.ALLOCATION_ANNOTATION: _PLACED},
        }
    }
    [status] = build_status([node], [pod], [lease])
    [share] = status.cards[0].shares
    assert share.used_bytes is None or share.used_bytes >= 0
    assert share.lines is None or all(isinstance(x, str) for x in share.lines)
    assert isinstance(render_text([status]), str)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "devices_annotation": check_devices_annotation,
    "allocation_annotation": check_allocation_annotation,
    "pod_request": check_pod_request,
    "extender_body": check_extender_body,
    "worker_head": check_worker_head,
    "region_file": check_region_file,
    "grant_file": check_grant_file,
    "resource_claim": check_resource_claim,
    "lease_view": check_lease_view,
}
