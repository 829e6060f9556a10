"""The Flask app: routes to kube-scheduler's extender verbs and the admission webhooks, health.

The handlers and the JSON they read and write are :mod:`vgpu.extender.verbs`'. With a client CA
(``client_ca_file``) the scheduling verbs answer only a caller whose TLS client certificate that CA
signed (HTTP 403 otherwise); the webhooks, which the API server calls without one, and the probes
answer anyone. Every request goes through Flask's
routing: a WSGI layer that handed the verbs' POSTs to their handlers past Flask was measured and
dropped, since it gave under 10 % more pods per second (bench/RESULTS.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson
from flask import Flask, Response, request

from vgpu.core.config import SchedulerConfig
from vgpu.extender import metrics
from vgpu.extender.state import SchedulerState
from vgpu.extender.verbs import AdmissionVerbs, Handler, SchedulingVerbs

log = logging.getLogger(__name__)
MAX_BODY = 64 * 1024 * 1024
SCHEDULING_VERBS = ("/filter", "/prioritize", "/bind")  # kube-scheduler's: with a client CA, its alone
UNCERTIFIED = (
    "this extender answers {verb} only to a caller with a TLS client certificate signed by its client "
    "CA (--client-ca-file); give kube-scheduler's extender tlsConfig a certFile and keyFile that CA "
    "signed (the chart does: docs/install.md, 'Who may call the extender')"
)


def _dumps(body: Any) -> bytes:
    return orjson.dumps(body)


def _json(status: int, body: Any) -> Response:
    return Response(_dumps(body), status=status, mimetype="application/json")


def create_app(config: SchedulerConfig, state: SchedulerState | None = None) -> Flask:
    """The app; ``state`` defaults to an empty one (its owner feeds it, see vgpu.extender.server)."""
    app = Flask("vgpu.extender")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    st = state if state is not None else SchedulerState(config)
    app.extensions["vgpu_state"] = st
    scheduling = SchedulingVerbs(st)
    admission = AdmissionVerbs(config, st)
    routes: dict[str, Handler] = {
        "/filter": scheduling.filter,
        "/prioritize": scheduling.prioritize,
        "/bind": scheduling.bind,
        "/webhook/mutate": admission.mutate,
        "/webhook/validate": admission.validate,
        "/webhook/validate-config": admission.validate_config,
    }
    for path, handler in routes.items():
        guarded = bool(config.process.client_ca_file) and path in SCHEDULING_VERBS
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
