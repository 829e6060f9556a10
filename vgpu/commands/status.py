"""``vgpu status``: per node and card, which container got what.

Read from the API server only: the nodes' inventory annotations and the device plugins' Leases
(contract 2), and the pods' allocation and phase annotations (contract 3; both in
docs/contracts.md); for DRA nodes the ResourceSlices and allocated ResourceClaims of the driver
(vgpu.commands.status_dra; none on clusters before 1.34). In the sandbox,
the kubelet stand-in also records the env each container was started with; it is shown too.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vgpu.commands.status_dra import CLAIMS_PATH, SLICES_PATH, add_dra
from vgpu.commands.status_lines import NodeExtras, extras_text, node_extras
from vgpu.commands.status_model import CardStatus, NodeStatus, Share
from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    DEVICES_ANNOTATION,
    PHASE_ANNOTATION,
    REASON_ANNOTATION,
    USAGE_ANNOTATION,
    Device,
    decode_allocation,
    decode_devices,
    lease_name,
)
from vgpu.core.booking import book, finished
from vgpu.core.config import SchedulerConfig
from vgpu.core.errors import AnnotationError, KubeError
from vgpu.core.gpumode import DRA, gpu_mode
from vgpu.core.ledger import ZERO, Ledger
from vgpu.core.selection import card_kind
from vgpu.kube.lease import expires_at

RECORD_ANNOTATION = "sandbox.vgpu.openaios.io/containers"  # written by vgpu_sandbox.kubelet


def _lease_state(lease: dict[str, Any] | None, now: dt.datetime) -> str:
    if lease is None:
        return "missing"
    ends = expires_at(lease)
    return "fresh" if ends is not None and ends > now.timestamp() else "expired"


def build_status(
    nodes: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    leases: list[dict[str, Any]],
    now: dt.datetime | None = None,
    slices: list[dict[str, Any]] | None = None,
    claims: list[dict[str, Any]] | None = None,
    config: SchedulerConfig | None = None,
) -> list[NodeStatus]:
    """Pure: join nodes, pods and leases (and DRA's slices and claims) into per-card shares.

    Each card's totals are what the scheduler's ledger holds (vgpu.core.booking, with the
    scheduler's settings ``config``); ``nodes`` are all of the cluster's, so that a pod bound to
    a node that is not among them shows under that node as gone."""
    now = now or dt.datetime.now(dt.UTC)
    config = config or SchedulerConfig()
    by_lease = {lease["metadata"]["name"]: lease for lease in leases}
    usage: dict[str, dict[str, Any]] = {}  # node -> the usage its Lease reports
    inventories: dict[str, dict[str, Device]] = {}  # node -> its cards by UUID
    extras: dict[str, NodeExtras] = {}  # node -> the lines and media engines its Lease reports
    existing = {node["metadata"]["name"] for node in nodes}
    out: dict[str, NodeStatus] = {}
    for node in nodes:
        name = node["metadata"]["name"]
        annotations = node["metadata"].get("annotations") or {}
        if DEVICES_ANNOTATION not in annotations or gpu_mode(node["metadata"].get("labels")) == DRA:
            continue  # not a device-plugin vGPU node
        lease = by_lease.get(lease_name(name))
        status = NodeStatus(name, _lease_state(lease, now))
        usage[name] = _usage(lease)
        extras[name] = node_extras(lease)
        try:
            inv = decode_devices(annotations[DEVICES_ANNOTATION])
            inventories[name] = {d.uuid: d for d in inv.devices}
            status.cards = [
                CardStatus(
                    d.index, d.uuid, d.model, d.memory_mib, d.cores, d.split, d.healthy, mode=card_kind(d)
                )
                for d in inv.devices
            ]
        except AnnotationError as err:
            status.error = str(err)
        out[name] = status
    ledger = Ledger()
    for pod in pods:
        meta = pod["metadata"]
        annotations = meta.get("annotations") or {}
        if ALLOCATION_ANNOTATION not in annotations:
            continue
        try:
            alloc = decode_allocation(annotations[ALLOCATION_ANNOTATION])
        except AnnotationError:
            continue
        if alloc.node not in existing:
            out.setdefault(alloc.node, NodeStatus(alloc.node, "", gone=True))
        node_status = out.get(alloc.node)
        if node_status is None:
            continue  # a DRA node, or one without an inventory: no device-plugin cards to show
        done = finished(pod)
        if not done and not node_status.gone:
            booking = book(pod, alloc, config, inventories.get(alloc.node))
            ledger.commit(
                str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"),
                alloc.node,
                booking.footprint,
            )
        try:
            record = json.loads(annotations.get(RECORD_ANNOTATION) or "{}")
        except ValueError:
            record = {}
        cards = {c.uuid: c for c in node_status.cards}
        phase, reason = _phase(pod)
        inits = _init_containers(pod)
        for c in alloc.containers:
            env = (record.get(c.name) or {}).get("envs") or {}
            for d in c.devices:
                share = Share(
                    namespace=str(meta.get("namespace", "")),
                    pod=str(meta.get("name", "")),
                    container=c.name,
                    memory_mib=d.memory_mib,
                    cores=d.cores,
                    phase=phase,
                    reason=reason,
                    env={k: v for k, v in env.items() if k.startswith(("CUDA_", "NVIDIA_"))},
                    init=c.name in inits,
                    finished=done,
                    mig=f"{d.mig.profile} at slice {d.mig.start}" if d.mig else "",
                )
                folder = f"{meta.get('uid', '')}_{c.name}"
                per_card = usage.get(alloc.node, {}).get(folder)
                used = per_card.get(d.uuid) if isinstance(per_card, dict) else None
                share.used_bytes = used if isinstance(used, int) and used >= 0 else None
                share.lines, share.codec = extras.get(alloc.node, NodeExtras()).of(folder, d.uuid)
                card = cards.get(d.uuid)
                if card is None:
                    share.card = d.uuid
                (card.shares if card else node_status.unplaced).append(share)
    for name, node_status in out.items():
        held = ledger.usage(name)
        for card in node_status.cards:
            u = held.get(card.uuid, ZERO)
            card.memory_used_mib, card.cores_used, card.vgpus_used = u.memory_mib, u.cores, u.count
    add_dra(out, slices or [], claims or [])
    return [out[n] for n in sorted(out)]


def _phase(pod: dict[str, Any]) -> tuple[str, str]:
    """The pod's placement phase (contract 3) and why, or how it finished."""
    annotations = pod["metadata"].get("annotations") or {}
    phase = str(annotations.get(PHASE_ANNOTATION, ""))
    reason = str(annotations.get(REASON_ANNOTATION) or "")
    pod_status = pod.get("status") or {}
    if pod_status.get("phase") == "Succeeded":
        return "succeeded", ""
    if pod_status.get("phase") == "Failed" and phase != "failed":
        # kubelet rejected the pod at admission (a refused Allocate, for one): it never started
        return "rejected", ": ".join(
            str(x) for x in (pod_status.get("reason"), pod_status.get("message")) if x
        )
    return phase, reason


def _init_containers(pod: dict[str, Any]) -> set[str]:
    """The names of the pod's init containers that run before the app containers (not sidecars)."""
    spec = pod.get("spec")
    items = spec.get("initContainers") if isinstance(spec, dict) else None
    if not isinstance(items, list):
        return set()
    return {str(c.get("name")) for c in items if isinstance(c, dict) and c.get("restartPolicy") != "Always"}


def _usage(lease: dict[str, Any] | None) -> dict[str, Any]:
    """The Lease's usage report; a malformed one reads as none (status must never fail on it)."""
    text = ((lease or {}).get("metadata", {}).get("annotations") or {}).get(USAGE_ANNOTATION)
    try:
        loaded = json.loads(text) if text else {}
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def render_text(nodes: list[NodeStatus], finished_too: bool = False) -> str:
    """The text form. Succeeded pods' shares (they hold nothing) only with ``finished_too``, else
    counted in one line at the end; failed ones always, with why (a refused Allocate, say)."""
    if not nodes:
        return (
            f"no vGPU nodes: no Node carries {DEVICES_ANNOTATION} (is the device plugin running?) "
            "and no ResourceSlice is of the driver vgpu.openaios.io (is the DRA plugin?)\n"
        )
    lines: list[str] = []
    hidden = set()

    def shown(shares: list[Share]) -> list[str]:
        out = []
        for share in shares:
            if share.finished and share.phase == "succeeded" and not finished_too:
                hidden.add((share.namespace, share.pod))
            else:
                out.append(_share_line(share))
        return out

    for n in nodes:
        if n.gone:
            pods = sorted({f"{s.namespace}/{s.pod}" for s in n.unplaced})
            lines.append(
                f"node {n.name}  GONE: no such Node, yet {len(pods)} pod(s) are still bound to it; they "
                "hold nothing in the scheduler (the pod garbage collector deletes them; kubectl delete pod "
                "does it now)"
            )
            lines += shown(n.unplaced)
            continue
        head = "mode dra (ResourceSlice)" if n.mode == DRA else f"lease {n.lease}"
        lines.append(f"node {n.name}  {head}" + (f"  ERROR {n.error}" if n.error else ""))
        for c in n.cards:
            slots = f"claims {len(c.shares)}" if n.mode == DRA else f"vgpus {c.vgpus_used}/{c.split}"
            lines.append(
                f"  gpu {c.index} {c.uuid} {c.model}  mem {c.memory_used_mib}/{c.memory_mib} MiB  "
                f"cores {c.cores_used}/{c.cores}  {slots}"
                + (f"  mode {c.mode}" if c.mode else "")
                + ("" if c.healthy else "  UNHEALTHY")
            )
            lines += shown(c.shares)
        unlisted = shown(n.unplaced)
        if unlisted:
            lines.append("  on cards the node does not list:")
            lines += unlisted
    if hidden:
        lines.append(f"({len(hidden)} succeeded pod(s) not shown: they hold nothing; --all lists them)")
    return "\n".join(lines) + "\n"


def _share_line(s: Share) -> str:
    who = (
        f"{s.namespace}/{s.pod or '-'} claim {s.claim}" if s.claim else f"{s.namespace}/{s.pod} {s.container}"
    )
    if s.init:
        who += " (init)"
    cores = f"cores {s.cores}%" if s.cores else "cores uncapped"  # 0: no cap, the whole card's compute
    phase = (s.phase or "-") + (", holds nothing" if s.finished else "")
    text = f"    {who}  {s.memory_mib} MiB  {cores}  {phase}" + (f"  on {s.card}" if s.card else "")
    text += f"  MIG {s.mig}" if s.mig else ""
    if s.used_bytes is not None:
        text += f"  using {s.used_bytes / 2**20:.0f} MiB"
    text += extras_text(s.lines, s.codec)
    if s.reason:
        text += f" ({s.reason})"
    if s.env:
        text += "\n      env " + " ".join(f"{k}={v}" for k, v in sorted(s.env.items()))
    return text


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig; default $KUBECONFIG, else the local sandbox's")
    parser.add_argument("--namespace", default="kube-system", help="namespace of the device plugins' Leases")
    parser.add_argument("--node", action="append", help="only this node (repeatable)")
    parser.add_argument("--output", "-o", choices=("text", "json"), default="text")
    parser.add_argument(
        "--all",
        action="store_true",
        help="list succeeded pods too (they hold nothing; failed ones are always listed, the JSON has all)",
    )


def sandbox_dir() -> Path:
    """The developer's sandbox's folder (``vgpu sandbox up``; docs/sandbox.md), whose ``kubeconfig``
    status reads by default: $VGPU_SANDBOX_DIR, else $XDG_STATE_HOME/vgpu/sandbox, else
    ~/.local/state/vgpu/sandbox. The sandbox takes its default from here."""
    env = os.environ.get("VGPU_SANDBOX_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "vgpu" / "sandbox"


def _kubeconfig(arg: str | None) -> tuple[str | None, str]:
    """The kubeconfig to read, and where that choice came from (for the hint of an error)."""
    if arg:
        return arg, "--kubeconfig"
    if os.environ.get("KUBECONFIG"):
        return os.environ["KUBECONFIG"].split(os.pathsep)[0], "KUBECONFIG"
    path = sandbox_dir() / "kubeconfig"
    return (str(path), "sandbox") if path.exists() else (None, "")


def _hint(source: str, path: str | None) -> str:
    """What to check when the API server gave no answer, by where the kubeconfig came from."""
    if source == "sandbox":
        return f"is the sandbox up? (vgpu sandbox up; its kubeconfig is {path}), or give --kubeconfig"
    if source == "KUBECONFIG":
        return f"is the cluster up, and is $KUBECONFIG ({path}) its kubeconfig? (or give --kubeconfig)"
    if source:
        return f"is the cluster up, and is {path} its kubeconfig?"
    return "is the cluster up? (vgpu sandbox up, or --kubeconfig)"


def _missing_nodes(wanted: list[str], nodes: list[dict[str, Any]]) -> str:
    """Why ``--node`` names nothing to show, or "" when every name is a vGPU node."""
    by_name = {n["metadata"]["name"]: n for n in nodes}
    for name in wanted:
        node = by_name.get(name)
        if node is None:
            known = sorted(by_name)
            listed = ", ".join(known[:5]) + (", ..." if len(known) > 5 else "")
            return f"no such node: {name} (the cluster has {len(known)}: {listed or 'none'})"
        is_dra = gpu_mode(node["metadata"].get("labels")) == DRA
        if DEVICES_ANNOTATION not in (node["metadata"].get("annotations") or {}) and not is_dra:
            return (
                f"node {name} is not a vGPU node: it carries no {DEVICES_ANNOTATION} "
                "(is the device plugin running there?)"
            )
    return ""


def _dra_objects(kube: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The cluster's ResourceSlices and ResourceClaims; none where resource.k8s.io/v1 is not
    served (before 1.34: 404) or the caller may not list them (403)."""
    try:
        slices = kube.get(SLICES_PATH).get("items") or []
        claims = kube.get(CLAIMS_PATH).get("items") or []
    except KubeError as err:
        if err.status in (403, 404):
            return [], []
        raise
    return slices, claims


def run(args: argparse.Namespace) -> int:
    from vgpu.kube.client import Kube

    path, source = _kubeconfig(args.kubeconfig)
    if path is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        print(
            "vgpu status: no kubeconfig: give --kubeconfig, set KUBECONFIG, "
            "or start the sandbox (vgpu sandbox up)",
            file=sys.stderr,
        )
        return 1
    try:
        kube = Kube(path)
        nodes, _ = kube.list_nodes()
        pods, _ = kube.list_pods()
        leases, _ = kube.list_leases(args.namespace)
        slices, claims = _dra_objects(kube)
    except KubeError as err:
        hint = f": {_hint(source, path)}" if err.unreachable else ""
        print(f"vgpu status: {err}{hint}", file=sys.stderr)
        return 1
    if args.node:
        missing = _missing_nodes(args.node, nodes)
        if missing:
            print(f"vgpu status: {missing}", file=sys.stderr)
            return 1
        nodes = [n for n in nodes if n["metadata"]["name"] in args.node]
        pods = [p for p in pods if (p.get("spec") or {}).get("nodeName") in args.node]
        slices = [s for s in slices if (s.get("spec") or {}).get("nodeName") in args.node]
    status = build_status(nodes, pods, leases, slices=slices, claims=claims)
    if args.output == "json":
        doc = [
            asdict(n) | {"cards": [asdict(c) | {"memoryUsedMiB": c.memory_used_mib} for c in n.cards]}
            for n in status
        ]
        print(json.dumps(doc, indent=2))
    else:
        sys.stdout.write(render_text(status, finished_too=args.all))
    return 0
