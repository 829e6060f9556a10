"""The admission webhook (AdmissionReview v1), free of HTTP; it speaks contract 1
(docs/contracts.md), what a user writes on a pod, and contract 8, what a DRA claim configures.

* mutate: a pod that asks for vGPU resources and names no scheduler (or ``default-scheduler``)
  is routed to ours by a JSONPatch on ``/spec/schedulerName``; a container that gives
  ``gpumem``/``gpumem-percentage``/``gpucores``/``priority`` without ``nvidia.com/gpu`` gets
  ``nvidia.com/gpu: 1`` added (contract 1's default), since kubelet calls the device plugin's
  Allocate only for containers that ask for ``nvidia.com/gpu`` itself.
* validate: a pod whose vGPU request no node could ever hold is denied with a message naming the
  field: the static rules of contract 1 (see :mod:`vgpu.core.requests`: cores over 100, negative or
  fractional sizes, ``gpumem`` with ``gpumem-percentage``...). A request merely larger than the
  cluster is today (more memory per vGPU than the largest card, more vGPUs in a container than
  any node's cards) is admitted: a cluster autoscaler or a batch queue may add the node after the
  pod exists, and until then the pod waits Pending with the shortage in its scheduling reason.
  With ``reject_unsatisfiable`` (chart value ``scheduler.admission.rejectUnsatisfiable``) that
  cluster-shape check denies it too, once nodes are known.

  The selection annotations are a cluster-shape question too: a pod whose ``use-gputype`` or
  ``use-gpuuuid`` (with their ``nouse-`` pair) accepts no card the extender knows now is admitted
  with a warning naming the annotation and what the cluster has (``kubectl`` prints it), and
  denied with ``reject_unsatisfiable``.

  A pod that asks for vGPUs but names another scheduler than ours (``hami-scheduler`` left from
  HAMi, say) is admitted with a warning naming the field and the fix: no node refuses it for
  that, but no vgpu node serves it unless our scheduler placed it, and a scheduler that does not
  run leaves it Pending without an event.

  ``split`` (vGPUs per card) gives no rule of its own here: the vGPUs of one container each take
  a different card, so a request never asks for more than one vGPU of a card, and the number of
  cards a container needs is a cluster-shape question like the others.
* validate-config: a ResourceClaim, ResourceClaimTemplate or DeviceClass whose entries for the
  vgpu DRA driver (contract 8, :mod:`vgpu.core.claimconfig`: priority, SM policy) are malformed
  is denied, naming the field, before any pod waits on it; so is a claim or template asking the
  class ``vgpu.openaios.io`` for more cores than a card has, and one asking for less than 1Mi of
  memory (bytes, where MiB were meant) is admitted with a warning.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from vgpu.core import annotations as ann
from vgpu.core.boundary import CLAIM_PRIORITY, Boundary, placement_refusal, priority_refusal
from vgpu.core.claimconfig import DRIVER, ConfigEntryError, check_capacity, check_entries
from vgpu.core.config import SchedulerConfig
from vgpu.core.errors import RequestError
from vgpu.core.mig import RESOURCE_PREFIX as MIG_PREFIX
from vgpu.core.requests import RESOURCE_GPU, RESOURCES, asks_for_vgpu, parse_pod
from vgpu.core.selection import KINDS, Selection

Obj = dict[str, Any]


class ReviewError(ValueError):
    """The AdmissionReview itself is malformed (the view answers HTTP 400)."""


def _request(review: Any) -> tuple[Obj, Obj]:
    if not isinstance(review, dict):
        raise ReviewError("body must be an AdmissionReview JSON object")
    req = review.get("request")
    if not isinstance(req, dict):
        raise ReviewError("AdmissionReview.request is missing or not an object")
    if not isinstance(req.get("uid"), str) or not req["uid"]:
        raise ReviewError("AdmissionReview.request.uid is missing")
    obj = req.get("object")
    if not isinstance(obj, dict):
        raise ReviewError("AdmissionReview.request.object is missing or not an object")
    return req, obj


def _namespace(req: Obj, obj: Obj) -> str:
    """The request's namespace (the object's, where an older AdmissionReview leaves it out)."""
    meta = obj.get("metadata")
    own = meta.get("namespace") if isinstance(meta, dict) else None
    return str(req.get("namespace") or own or "default")


def _response(
    review: Obj,
    req: Obj,
    allowed: bool,
    message: str = "",
    patch: list[Obj] | None = None,
    warnings: list[str] | None = None,
) -> Obj:
    resp: Obj = {"uid": req["uid"], "allowed": allowed}
    if not allowed:
        resp["status"] = {"code": 422, "reason": "Invalid", "message": message}
    if warnings:
        resp["warnings"] = warnings
    if patch:
        resp["patchType"] = "JSONPatch"
        resp["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {
        "apiVersion": review.get("apiVersion") or "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": resp,
    }


def _default_gpu_count(spec: Obj) -> list[Obj]:
    """Patches adding ``nvidia.com/gpu: 1`` where a container names other vGPU resources only."""
    patch: list[Obj] = []
    key = RESOURCE_GPU.replace("~", "~0").replace("/", "~1")
    others = [r for r in RESOURCES if r != RESOURCE_GPU]
    for kind in ("initContainers", "containers"):
        containers = spec.get(kind)
        if not isinstance(containers, list):
            continue
        for i, c in enumerate(containers):
            res = c.get("resources") if isinstance(c, dict) else None
            if not isinstance(res, dict):
                continue
            parts: dict[str, Obj] = {
                p: res[p] for p in ("limits", "requests") if isinstance(res.get(p), dict)
            }
            if any(
                RESOURCE_GPU in v or any(str(r).startswith(MIG_PREFIX) for r in v) for v in parts.values()
            ):
                continue  # counted already, or whole MIG devices (nvidia.com/mig-<profile>)
            if not any(r in v for v in parts.values() for r in others):
                continue
            for part, values in parts.items():
                # requests and limits of an extended resource must agree: set it in both where both exist.
                if part == "limits" or any(r in values for r in others):
                    patch.append(
                        {"op": "add", "path": f"/spec/{kind}/{i}/resources/{part}/{key}", "value": "1"}
                    )
            if "limits" not in parts:
                patch.append(
                    {"op": "add", "path": f"/spec/{kind}/{i}/resources/limits", "value": {RESOURCE_GPU: "1"}}
                )
    return patch


def mutate(review: Any, config: SchedulerConfig) -> Obj:
    req, pod = _request(review)
    spec = pod.get("spec")
    if not isinstance(spec, dict) or not asks_for_vgpu(pod):
        return _response(review, req, True)
    current = spec.get("schedulerName")
    if current not in (None, "", "default-scheduler"):
        return _response(review, req, True)  # the user chose a scheduler on purpose
    op = "replace" if "schedulerName" in spec else "add"
    patch = [{"op": op, "path": "/spec/schedulerName", "value": config.scheduler_name}]
    patch += _default_gpu_count(spec)
    return _response(review, req, True, patch=patch)


def validate(
    review: Any,
    config: SchedulerConfig,
    largest: tuple[int, int] | None = None,
    cards: Callable[[], Sequence[ann.Device]] | None = None,
) -> Obj:
    """``largest``: (most MiB on one card, most cards on one node) in the cluster, when known; it
    is checked only with ``config.reject_unsatisfiable``. ``cards``: every card the extender
    knows now, asked only of a pod with selection annotations."""
    req, pod = _request(review)
    boundary = config.boundary
    found = req.get("userInfo")
    user: Obj = found if isinstance(found, dict) else {}
    refusal = placement_refusal(
        boundary,
        str(user.get("username") or ""),
        user.get("extra"),
        req.get("oldObject") if isinstance(req.get("oldObject"), dict) else None,
        pod,
        str(req.get("subResource") or ""),
    )
    if refusal:
        return _response(review, req, False, refusal)
    if req.get("operation") not in (None, "CREATE") or req.get("subResource") or not asks_for_vgpu(pod):
        return _response(review, req, True)
    try:
        request = parse_pod(pod, config)  # raises RequestError for the static rules
    except RequestError as err:
        return _response(review, req, False, f"vGPU request can never be satisfied: {err}")
    namespace = _namespace(req, pod)
    refusal = priority_refusal(boundary, namespace, [c.priority for c in request.containers])
    if refusal:
        return _response(review, req, False, refusal)
    problem = larger_than_cluster(pod, config, largest) if config.reject_unsatisfiable else None
    unselected = None
    if problem is None and cards is not None and request.wants_vgpu:
        unselected = selects_no_card(request.selection, cards)
    if config.reject_unsatisfiable and (problem or unselected):
        return _response(
            review,
            req,
            False,
            f"vGPU request cannot be satisfied by any node of this cluster now: {problem or unselected} "
            "(this cluster refuses such pods at admission: scheduler.admission.rejectUnsatisfiable)",
        )
    warnings = [w for w in (other_scheduler(pod, config.scheduler_name),) if w]
    if unselected:
        warnings.append(f"{unselected}; the pod waits Pending until one joins")
    return _response(review, req, True, warnings=warnings)


def other_scheduler(pod: Mapping[str, Any], ours: str) -> str | None:
    """The warning for a pod that asks for vGPUs but names a scheduler other than ``ours``.

    By validation the mutating webhook has routed a pod that named none (or ``default-scheduler``)
    to ours; what is left is the pod's own choice, so it is admitted, with what that choice does.
    """
    spec = pod.get("spec")
    name = spec.get("schedulerName") if isinstance(spec, dict) else None
    if not isinstance(name, str) or name in ("", ours):
        return None
    return (
        f"spec.schedulerName: {name!r} is not {ours!r}, the scheduler that places vGPUs: a scheduler "
        f"that does not run leaves the pod Pending with no event, and a vgpu node refuses a pod that "
        f"{ours!r} did not place; leave schedulerName out (the webhook then sets {ours!r}) "
        f"or set it to {ours!r}"
    )


# Where each DRA kind keeps its configuration entries (contract 8) and its requests.
CONFIG_FIELDS = {
    "ResourceClaim": ("spec", "devices", "config"),
    "ResourceClaimTemplate": ("spec", "spec", "devices", "config"),
    "DeviceClass": ("spec", "config"),
}
REQUEST_FIELDS = {
    "ResourceClaim": ("spec", "devices", "requests"),
    "ResourceClaimTemplate": ("spec", "spec", "devices", "requests"),
}


def _at(obj: Any, path: Sequence[str]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


NO_BOUNDARY = Boundary()


def validate_config(review: Any, boundary: Boundary = NO_BOUNDARY) -> Obj:
    """A ResourceClaim, ResourceClaimTemplate or DeviceClass whose configuration entries of the
    vgpu DRA driver are malformed (contract 8) is denied, naming the field; entries of other
    drivers, and every other object, are allowed. The DRA plugin checks them again at
    NodePrepareResources (a claim written while this webhook was away). A claim's or template's
    requests of the class vgpu.openaios.io: more cores than a card has is denied, under 1Mi of
    memory admitted with a warning (``check_capacity``)."""
    req, obj = _request(review)
    asked = req.get("kind")
    kind = str(obj.get("kind") or (asked.get("kind") if isinstance(asked, dict) else "") or "")
    path = CONFIG_FIELDS.get(kind)
    if path is None or req.get("operation") not in (None, "CREATE", "UPDATE"):
        return _response(review, req, True)
    found = obj.get("metadata")
    meta: Obj = found if isinstance(found, dict) else {}
    name = "/".join(
        str(p) for p in (meta.get("namespace"), meta.get("name") or meta.get("generateName")) if p
    )
    source = f"{kind} {name}"
    try:
        entries = check_entries(_at(obj, path), ".".join(path), source)
    except ConfigEntryError as err:
        return _response(review, req, False, f"{DRIVER} configuration: {err}")
    if kind != "DeviceClass":  # the admin's, cluster-wide
        priorities = [e.config.priority for e in entries if e.config.priority is not None]
        refusal = priority_refusal(boundary, _namespace(req, obj), priorities, CLAIM_PRIORITY)
        if refusal:
            return _response(review, req, False, refusal)
    warnings: list[str] = []
    requests = REQUEST_FIELDS.get(kind)
    if requests is not None:
        try:
            warnings = check_capacity(_at(obj, requests), ".".join(requests), source)
        except ConfigEntryError as err:
            return _response(review, req, False, f"{DRIVER} request can never be satisfied: {err}")
    return _response(review, req, True, warnings=warnings)


_MODELS_SHOWN = 4


def selects_no_card(selection: Selection, cards: Callable[[], Sequence[ann.Device]]) -> str | None:
    """Which selection annotation rules out every card the cluster has now, naming what it has.

    None when the pod selects nothing, when some card passes, or when no card is known yet. A
    card's mode (``nvidia.com/vgpu-mode``) is not weighed: a node may turn MPS or MIG on later.
    """
    if not (selection.use_types or selection.nouse_types or selection.use_uuids or selection.nouse_uuids):
        return None
    known = cards()
    any_kind = replace(selection, kinds=frozenset(KINDS))
    if not known or any(any_kind.why_not_card(d) is None for d in known):
        return None
    models = sorted({d.model for d in known})
    shown = ", ".join(repr(m) for m in models[:_MODELS_SHOWN])
    if len(models) > _MODELS_SHOWN:
        shown += f" and {len(models) - _MODELS_SHOWN} more"
    if selection.use_types and all(
        Selection(use_types=selection.use_types).why_not(d.uuid, d.model) for d in known
    ):
        value = ",".join(selection.use_types)
        value = value if len(value) <= 60 else value[:57] + "..."
        return (
            f"metadata.annotations[{ann.USE_GPUTYPE_ANNOTATION}]: {value!r} matches no card of this "
            f"cluster (its models: {shown})"
        )
    if selection.use_uuids and not {d.uuid for d in known} & set(selection.use_uuids):
        return (
            f"metadata.annotations[{ann.USE_GPUUUID_ANNOTATION}]: names no card of this cluster "
            f"({len(known)} cards known, of models {shown})"
        )
    return (
        "metadata.annotations: nvidia.com/use-gputype, nouse-gputype, use-gpuuuid and nouse-gpuuuid "
        f"together rule out every card of this cluster ({len(known)} cards, of models {shown})"
    )


def larger_than_cluster(
    pod: Mapping[str, Any], config: SchedulerConfig, largest: tuple[int, int] | None
) -> str | None:
    """Whether a container asks more than any card (memory) or node (cards) has now, naming the field.

    None also when no node is known yet: nothing to compare with.
    """
    if largest is None:
        return None
    request = parse_pod(pod, config)
    max_mem, max_cards = largest
    inits = sum(1 for x in request.containers if x.init)
    for i, c in enumerate(request.containers):
        kind = "initContainers" if c.init else "containers"
        index = i if c.init else i - inits
        where = f"pod: spec.{kind}[{index}].resources.limits"
        if c.memory_mib is not None and c.memory_mib > max_mem:
            return (
                f"{where}[nvidia.com/gpumem]: {c.memory_mib} MiB is more than the largest card has "
                f"({max_mem} MiB); ask for at most {max_mem}"
            )
        if c.count > max_cards:
            return (
                f"{where}[nvidia.com/gpu]: {c.count} vGPUs must each be on a different card, but no node "
                f"has more than {max_cards} cards; ask for at most {max_cards}"
            )
    return None
