"""The Flask app: kube-scheduler extender verbs, the admission webhook, health.

The JSON of the verbs is kube-scheduler's (``k8s.io/kube-scheduler/extender/v1``, Go field names
without tags, so capitalised): ``ExtenderArgs`` {Pod, Nodes, NodeNames} in, ``ExtenderFilterResult``
{Nodes, NodeNames, FailedNodes, FailedAndUnresolvableNodes, Error}, ``HostPriorityList``
[{Host, Score}], ``ExtenderBindingArgs`` {PodName, PodNamespace, PodUID, Node} and
``ExtenderBindingResult`` {Error}. Like Go's decoder, keys match case-insensitively. Malformed
JSON or fields get HTTP 400 with ``Error`` naming the problem. With a client CA
(``client_ca_file``) the scheduling verbs answer only a caller whose TLS client certificate that CA
signed (HTTP 403 otherwise); the webhooks, which the API server calls without one, and the probes
answer anyone. The handlers only translate: the work happens in
:class:`vgpu.extender.state.SchedulerState`. Every request goes through Flask's
routing: a WSGI layer that handed the verbs' POSTs to their handlers past Flask was measured and
dropped, since it gave under 10 % more pods per second (bench/RESULTS.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
from flask import Flask, Response, request

from vgpu.core.config import SchedulerConfig
from vgpu.extender import metrics, webhook
from vgpu.extender.state import NotReady, SchedulerState

log = logging.getLogger(__name__)
Obj = dict[str, Any]
MAX_BODY = 64 * 1024 * 1024
SCHEDULING_VERBS = ("/filter", "/prioritize", "/bind")  # kube-scheduler's: with a client CA, its alone
UNCERTIFIED = (
    "this extender answers {verb} only to a caller with a TLS client certificate signed by its client "
    "CA (--client-ca-file); give kube-scheduler's extender tlsConfig a certFile and keyFile that CA "
    "signed (the chart does: docs/install.md, 'Who may call the extender')"
)


class BadRequest(ValueError):
    pass


def _dumps(body: Any) -> bytes:
    return orjson.dumps(body)


def _json(status: int, body: Any) -> Response:
    return Response(_dumps(body), status=status, mimetype="application/json")


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


def create_app(config: SchedulerConfig, state: SchedulerState | None = None) -> Flask:
    """The app; ``state`` defaults to an empty one (its owner feeds it, see vgpu.extender.server)."""
    app = Flask("vgpu.extender")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    st = state if state is not None else SchedulerState(config)
    app.extensions["vgpu_state"] = st

    def verb(name: str, error_shape: Callable[[str], Any]) -> Callable[[Handler], Handler]:
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

    @verb("filter", lambda e: {"NodeNames": None, "FailedNodes": {}, "Error": e})
    def filter_(raw: bytes) -> tuple[int, Any]:
        pod, names, items = _extender_args(_body(raw))
        result = st.filter(pod, names)
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

    @verb("prioritize", lambda e: {"Error": e})
    def prioritize(raw: bytes) -> tuple[int, Any]:
        pod, names, _ = _extender_args(_body(raw))
        try:
            scores = st.prioritize(pod, names)
        except NotReady as err:
            return 503, {"Error": str(err)}
        return 200, [{"Host": n, "Score": scores[n]} for n in names]

    @verb("bind", lambda e: {"Error": e})
    def bind(raw: bytes) -> tuple[int, Any]:
        body = _body(raw)
        if not isinstance(body, dict):
            raise BadRequest("ExtenderBindingArgs must be a JSON object")
        args = {}
        for key in ("PodName", "PodNamespace", "PodUID", "Node"):
            value = _field(body, key)
            if not isinstance(value, str) or not value:
                raise BadRequest(f"ExtenderBindingArgs.{key} is missing or not a non-empty string")
            args[key] = value
        start = time.perf_counter()
        error, result = st.bind(args["PodNamespace"], args["PodName"], args["PodUID"], args["Node"])
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

    @verb("mutate", lambda e: {"Error": e})
    def mutate(raw: bytes) -> tuple[int, Any]:
        try:
            return 200, webhook.mutate(_body(raw), config)
        except webhook.ReviewError as err:
            raise BadRequest(str(err)) from err

    @verb("validate", lambda e: {"Error": e})
    def validate(raw: bytes) -> tuple[int, Any]:
        try:
            largest = st.largest_card() if config.reject_unsatisfiable else None
            return 200, webhook.validate(_body(raw), config, largest, st.known_cards)
        except webhook.ReviewError as err:
            raise BadRequest(str(err)) from err

    @verb("validate-config", lambda e: {"Error": e})
    def validate_config(raw: bytes) -> tuple[int, Any]:
        try:
            return 200, webhook.validate_config(_body(raw), config.boundary)
        except webhook.ReviewError as err:
            raise BadRequest(str(err)) from err

    routes = {
        "/filter": filter_,
        "/prioritize": prioritize,
        "/bind": bind,
        "/webhook/mutate": mutate,
        "/webhook/validate": validate,
        "/webhook/validate-config": validate_config,
    }
    for path, handler in routes.items():
        guarded = bool(config.client_ca_file) and path in SCHEDULING_VERBS
        view = _certified(_view(handler), path.lstrip("/")) if guarded else _view(handler)
        app.add_url_rule(path, endpoint=handler.__name__, view_func=view, methods=["POST"])
    app.extensions["vgpu_verbs"] = routes  # path -> handler (body bytes -> status, answer): the fuzzers

    @app.get("/healthz")
    def healthz() -> Response:
        return Response("ok\n", mimetype="text/plain")

    @app.get("/readyz")
    def readyz() -> Response:
        if not st.synced.is_set():
            return Response("loading cluster state\n", status=503, mimetype="text/plain")
        if not st.leader.is_set():
            return Response("standby: another replica holds the Lease\n", status=503, mimetype="text/plain")
        return Response("ok\n", mimetype="text/plain")

    @app.errorhandler(413)
    def too_large(_: Exception) -> Response:
        return _json(413, TOO_LARGE)

    return app


Handler = Callable[[bytes], tuple[int, Any]]
TOO_LARGE = {"Error": f"body larger than {MAX_BODY} bytes"}


def peer_certified(environ: dict[str, Any]) -> bool:
    """Whether the caller gave a TLS client certificate: the server asks for one and verifies a
    given one against the client CA in the handshake (``CERT_OPTIONAL``), so one here is signed."""
    getpeercert = getattr(environ.get("gunicorn.socket"), "getpeercert", None)
    if getpeercert is None:
        return False
    try:
        return bool(getpeercert(True))  # the DER bytes: a tenth of the decoded dict's cost
    except (ValueError, OSError):  # no handshake (plain HTTP) or the connection is gone
        return False


_refusals_logged: set[str] = set()


def _certified(view: Callable[[], Response], verb: str) -> Callable[[], Response]:
    """``view``, answered only to a caller with a client certificate (HTTP 403 otherwise; the
    first refusal of each verb is logged, every one counted)."""
    message = UNCERTIFIED.format(verb=verb)

    def guarded() -> Response:
        if peer_certified(request.environ):
            return view()
        metrics.UNCERTIFIED.labels(verb).inc()
        if verb not in _refusals_logged:
            _refusals_logged.add(verb)
            log.warning("refused %s from %s: %s", verb, request.remote_addr, message)
        return _json(403, {"Error": message})

    guarded.__name__ = view.__name__
    return guarded


def _view(handler: Handler) -> Callable[[], Response]:
    """The Flask view of a verb: the body as bytes to its handler, the answer as JSON."""

    def view() -> Response:
        return _json(*handler(request.get_data(cache=False)))

    view.__name__ = f"view_{handler.__name__}"
    return view
