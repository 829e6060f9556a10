"""Running the extender: gunicorn over HTTPS, one worker process with threads.

Why one worker: the ledger is the extender's memory of what it committed, and ``bind`` must
re-check and reserve against *all* earlier binds. Several gunicorn worker processes would each
hold their own ledger and could hand the same capacity to two pods. So there is one worker
process holding the one ledger (and the watches and the Lease), with ``--workers N`` threads
(gunicorn's ``gthread`` worker, as :class:`vgpu.extender.worker.LingeringThreadWorker`: a thread
serves a connection's next request itself when it comes within 10 ms) answering calls
concurrently; the state's lock serialises what must be serialised. Scaling out is by replicas,
of which the Lease lets one serve at a time.

Metrics: Prometheus multiprocess mode. The master serves ``/metrics`` on ``--metrics-listen``
from the files the worker writes in ``PROMETHEUS_MULTIPROC_DIR``, so the endpoint survives a
worker restart; ``child_exit`` marks a dead worker's gauges gone.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import ssl
import sys
from typing import Any

from gunicorn.app.base import BaseApplication

from vgpu.core.config import SchedulerConfig
from vgpu.core.hostport import split_hostport

log = logging.getLogger(__name__)
SWITCH_INTERVAL_S = 0.0005


def tune_gil() -> None:
    """Hand the GIL over every 0.5 ms instead of CPython's 5 ms.

    kube-scheduler waits for each filter answer before it looks at the next pod, while binds,
    watches and gunicorn's loop share the GIL with it: a filter call should not wait behind a
    busy thread. Measured with bench/bench_scheduler.py (docs/scheduling.md#speed).
    """
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def build_worker_app(config: SchedulerConfig, filter_keep: int | None = None) -> Any:
    """In the worker: the state, its feeds from the API server, and the Flask app over it."""
    tune_gil()
    from vgpu.extender import fastpath
    from vgpu.extender.app import create_app
    from vgpu.extender.state import FILTER_KEEP, SchedulerState
    from vgpu.extender.sync import Syncer
    from vgpu.kube.client import Kube

    paths = fastpath.choose()
    kube = Kube(config.kubeconfig, wire=paths.wire)
    state = SchedulerState(config, kube, filter_keep=filter_keep or FILTER_KEEP)
    syncer = Syncer(state, kube, config.identity or socket.gethostname())
    syncer.start()
    app = create_app(config, state)
    app.extensions["vgpu_syncer"] = syncer
    return app


class ExtenderServer(BaseApplication):  # type: ignore[misc]
    def __init__(self, config: SchedulerConfig, filter_keep: int | None = None) -> None:
        self.config_ = config
        self.filter_keep = filter_keep
        super().__init__()

    def load_config(self) -> None:
        from vgpu.extender import fastpath

        cfg = self.config_
        paths = fastpath.choose()
        fastpath.report(paths)
        settings: dict[str, Any] = {
            "bind": [cfg.listen],
            "workers": 1,
            # gthread, or the same keeping a busy connection in its thread: see worker.py
            "worker_class": "vgpu.extender.worker.LingeringThreadWorker" if paths.worker else "gthread",
            "threads": cfg.workers,
            "timeout": 120,
            "graceful_timeout": 10,
            "keepalive": 30,
            "accesslog": None,
            "loglevel": "info",
            "when_ready": _when_ready(cfg),
            "child_exit": _child_exit,
            "worker_exit": _worker_exit,
            "proc_name": "vgpu-extender",
            "ssl_context": _cached_ssl_context,
        }
        if "control_socket_disable" in self.cfg.settings:  # gunicorn >= 24: one shared path per user
            settings["control_socket_disable"] = True
        if cfg.cert_file and cfg.key_file:
            settings["certfile"] = cfg.cert_file
            settings["keyfile"] = cfg.key_file
            if cfg.client_ca_file:
                # asked for, verified against the CA when given; the verbs refuse a call without
                # one (vgpu.extender.app), the webhooks and probes take none
                settings["ca_certs"] = cfg.client_ca_file
                settings["cert_reqs"] = ssl.CERT_OPTIONAL
        for key, value in settings.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        return build_worker_app(self.config_, self.filter_keep)


_SSL_CACHE: dict[str, Any] = {}


def _cached_ssl_context(conf: Any, default_factory: Any) -> Any:
    """One SSLContext per process, rebuilt when the certificate, key or client CA file changes.

    gunicorn's default builds a new context (and reads the key) for every connection; under a
    burst, when kube-scheduler opens more connections than it keeps idle, that dominated the CPU.
    """
    stamp = tuple(
        os.stat(p).st_mtime_ns if p and os.path.exists(p) else 0
        for p in (conf.certfile, conf.keyfile, conf.ca_certs)
    )
    if _SSL_CACHE.get("stamp") != stamp:
        _SSL_CACHE["context"] = default_factory()
        _SSL_CACHE["stamp"] = stamp
    return _SSL_CACHE["context"]


def _when_ready(cfg: SchedulerConfig) -> Any:
    def hook(server: Any) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        registry.register(LiveGauges())
        host, port = split_hostport(cfg.metrics_listen, "--metrics-listen")
        start_http_server(port, addr=host, registry=registry)
        server.log.info("metrics on http://%s:%d/metrics", host, port)

    return hook


class LiveGauges:
    """The worker's metrics from its multiprocess files, less the gauge series it removed.

    prometheus_client has no removal in multiprocess mode, so the worker sets a removed series
    to NaN (vgpu.extender.metrics.GONE: a deleted node's card and node gauges); no gauge of the
    extender is NaN otherwise, so a NaN gauge sample is left out here."""

    def __init__(self, path: str | None = None) -> None:
        from prometheus_client import multiprocess

        self._files = multiprocess.MultiProcessCollector(None, path)

    def collect(self) -> Any:
        for family in self._files.collect():
            if family.type == "gauge":
                family.samples = [s for s in family.samples if not math.isnan(s.value)]
            yield family


def _child_exit(server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def _worker_exit(server: Any, worker: Any) -> None:
    app = getattr(worker, "wsgi", None)
    syncer = getattr(app, "extensions", {}).get("vgpu_syncer") if app is not None else None
    if syncer is not None:
        syncer.close()  # hand the Lease over at once instead of letting it expire


def run(config: SchedulerConfig, filter_keep: int | None = None) -> int:
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        raise RuntimeError("PROMETHEUS_MULTIPROC_DIR must be set before the server starts (the CLI does it)")
    ExtenderServer(config, filter_keep).run()
    return 0
