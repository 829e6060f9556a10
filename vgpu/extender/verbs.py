"""The HTTP handlers: the JSON of kube-scheduler's extender verbs and of the admission webhooks.

The JSON of the verbs is kube-scheduler's (``k8s.io/kube-scheduler/extender/v1``, Go field names
without tags, so capitalised): ``ExtenderArgs`` {Pod, Nodes, NodeNames} in, ``ExtenderFilterResult``
{Nodes, NodeNames, FailedNodes, FailedAndUnresolvableNodes, Error}, ``HostPriorityList``
[{Host, Score}], ``ExtenderBindingArgs`` {PodName, PodNamespace, PodUID, Node} and
``ExtenderBindingResult`` {Error}. Like Go's decoder, keys match case-insensitively. Malformed
JSON or fields get HTTP 400 with ``Error`` naming the problem. Each handler takes the request's
body and gives (status, JSON answer); :mod:`vgpu.extender.app` routes to them. They only
translate: the work happens in :class:`vgpu.extender.state.SchedulerState`
(:class:`SchedulingVerbs`) and :mod:`vgpu.extender.webhook` (:class:`AdmissionVerbs`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from vgpu.core.config import SchedulerConfig
from vgpu.extender import metrics, webhook
from vgpu.extender.state import NotReady, SchedulerState

log = logging.getLogger(__name__)
Obj = dict[str, Any]
Handler = Callable[[bytes], tuple[int, Any]]


class BadRequest(ValueError):
    pass


def _event_safe(text: str) -> str:
    """``text`` with every ``%`` as ``％`` (U+FF05, the full-width percent sign).

    kube-scheduler hands the message built from a failed filter or bind to its event recorder as
    a printf format (``Eventf(pod, ..., msg)``): a ``%`` there turns ``30% cores`` into
    ``30%!c(MISSING)ores``. The extender's own reasons hold none; this keeps out the ones a user's
    value or an inventory brings in (``got '50%'``), and the full-width sign reads the same in the
    event and in the pod's PodScheduled condition, which takes the message as it is.
    """
    return text.replace("%", "\uff05") if "%" in text else text


def _safe_reasons(reasons: dict[str, str]) -> dict[str, str]:
    return {node: _event_safe(r) for node, r in reasons.items()} if reasons else reasons


def _field(obj: Obj, name: str) -> Any:
    """Go's encoding/json matches keys case-insensitively; so do we (exact match first)."""
    if name in obj:
        return obj[name]
    low = name.lower()
    for k, v in obj.items():
        if isinstance(k, str) and k.lower() == low:
            return v
    return None


def _body(raw: bytes) -> Any:
    if not raw:
        raise BadRequest("empty body; expected a JSON object")
    try:
        return orjson.loads(raw)
    except ValueError as err:
        raise BadRequest(f"body is not valid JSON: {err}") from err


def _extender_args(body: Any) -> tuple[Obj, list[str], list[Obj] | None]:
    """(pod, node names, the Nodes items when sent instead of NodeNames)."""
    if not isinstance(body, dict):
        raise BadRequest("ExtenderArgs must be a JSON object")
    pod = _field(body, "Pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs.Pod is missing or not an object")
    for part in ("metadata", "spec"):
        if not isinstance(pod.get(part), dict):
            raise BadRequest(f"ExtenderArgs.Pod.{part} is missing or not an object")
    if not isinstance(pod["metadata"].get("uid", ""), str):  # the key of filter's hold until bind
        raise BadRequest("ExtenderArgs.Pod.metadata.uid must be a string")
    names = _field(body, "NodeNames")
    nodes = _field(body, "Nodes")
    if names is not None:
        # set(map(type, ...)) and `in` run in C: at 1,000 nodes a per-name Python check cost more
        # than the filter itself
        if not isinstance(names, list) or not set(map(type, names)) <= {str} or "" in names:
            raise BadRequest("ExtenderArgs.NodeNames must be a list of node names")
        return pod, names, None
    if nodes is not None:
        items = nodes.get("items") if isinstance(nodes, dict) else None
        if not isinstance(items, list) or not all(
            isinstance(n, dict)
            and isinstance(n.get("metadata"), dict)
            and isinstance(n["metadata"].get("name"), str)
            for n in items
        ):
            raise BadRequest("ExtenderArgs.Nodes must be a NodeList whose items have metadata.name")
        return pod, [n["metadata"]["name"] for n in items], items
    raise BadRequest("ExtenderArgs needs NodeNames (nodeCacheCapable: true) or Nodes")


def timed(name: str, error_shape: Callable[[str], Any]) -> Callable[[Handler], Handler]:
    """A verb's handler (request body -> status and JSON answer), timed, with 400 for bad input."""

    def wrap(fn: Handler) -> Handler:
        def handle(raw: bytes) -> tuple[int, Any]:
            start = time.perf_counter()
            try:
                return fn(raw)
            except BadRequest as err:
                metrics.BAD_REQUESTS.labels(name).inc()
                log.info("%s: bad request: %s", name, err)
                return 400, error_shape(str(err))
            finally:
                metrics.VERB_SECONDS.labels(name).observe(time.perf_counter() - start)

        handle.__name__ = f"handle_{name}"
        return handle

    return wrap


def _bind_args(body: Any) -> dict[str, str]:
    if not isinstance(body, dict):
        raise BadRequest("ExtenderBindingArgs must be a JSON object")
    args = {}
    for key in ("PodName", "PodNamespace", "PodUID", "Node"):
        value = _field(body, key)
        if not isinstance(value, str) or not value:
            raise BadRequest(f"ExtenderBindingArgs.{key} is missing or not a non-empty string")
        args[key] = value
    return args


class SchedulingVerbs:
    """kube-scheduler's three calls: ``filter``, ``prioritize``, ``bind``."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.filter = timed("filter", lambda e: {"NodeNames": None, "FailedNodes": {}, "Error": e})(
            self._filter
        )
        self.prioritize = timed("prioritize", lambda e: {"Error": e})(self._prioritize)
        self.bind = timed("bind", lambda e: {"Error": e})(self._bind)

    def _filter(self, raw: bytes) -> tuple[int, Any]:
        pod, names, items = _extender_args(_body(raw))
        result = self.state.filter(pod, names)
        out: Obj = {
            "Nodes": None,
            "NodeNames": result.nodes,
            "FailedNodes": _safe_reasons(result.failed),
            "FailedAndUnresolvableNodes": _safe_reasons(result.unresolvable),
            "Error": _event_safe(result.error),
        }
        if items is not None:  # answered in the shape we were asked in
            keep = set(result.nodes)
            out["Nodes"] = {"items": [n for n in items if n["metadata"]["name"] in keep]}
            out["NodeNames"] = None
        return 200, out

    def _prioritize(self, raw: bytes) -> tuple[int, Any]:
        pod, names, _ = _extender_args(_body(raw))
        try:
            scores = self.state.prioritize(pod, names)
        except NotReady as err:
            return 503, {"Error": str(err)}
        return 200, [{"Host": n, "Score": scores[n]} for n in names]

    def _bind(self, raw: bytes) -> tuple[int, Any]:
        args = _bind_args(_body(raw))
        start = time.perf_counter()
        error, result = self.state.bind(args["PodNamespace"], args["PodName"], args["PodUID"], args["Node"])
        metrics.BINDS.labels(result).inc()
        if error:
            log.info(
                "bind %s/%s -> %s failed in %.0f ms: %s",
                args["PodNamespace"],
                args["PodName"],
                args["Node"],
                (time.perf_counter() - start) * 1000,
                error,
            )
        return 200, {"Error": _event_safe(error)}


class AdmissionVerbs:
    """The API server's calls: the mutating and validating webhooks for pods and for claim configs."""

    def __init__(self, config: SchedulerConfig, state: SchedulerState) -> None:
        self.config = config
        self.state = state
        self.mutate = timed("mutate", lambda e: {"Error": e})(self._mutate)
        self.validate = timed("validate", lambda e: {"Error": e})(self._validate)
        self.validate_config = timed("validate-config", lambda e: {"Error": e})(self._validate_config)

    def _mutate(self, raw: bytes) -> tuple[int, Any]:
        try:
            return 200, webhook.mutate(_body(raw), self.config)
        except webhook.ReviewError as err:
            raise BadRequest(str(err)) from err

    def _validate(self, raw: bytes) -> tuple[int, Any]:
        st = self.state
        try:
            largest = st.largest_card() if self.config.reject_unsatisfiable else None
            return 200, webhook.validate(_body(raw), self.config, largest, st.known_cards)
        except webhook.ReviewError as err:
            raise BadRequest(str(err)) from err

    def _validate_config(self, raw: bytes) -> tuple[int, Any]:
        try:
            return 200, webhook.validate_config(_body(raw), self.config.boundary)
        except webhook.ReviewError as err:
            raise BadRequest(str(err)) from err
