"""Which hand-written parts of the extender's request path run, checked once at start.

The stock path is Flask's routing on gunicorn's ``gthread`` worker, with the kubernetes client for
the Binding and the watches. Two parts replace pieces of it, kept because each gives more than
10 % more pods per second (docs/scheduling.md#speed, bench/RESULTS.md; a third, a WSGI layer
handing the verbs past Flask's routing, gave less and was dropped):

- the worker (:mod:`vgpu.extender.worker`), which reaches into gunicorn's ``gthread`` internals;
- the wire client (:mod:`vgpu.kube.wire`), which reads the kubernetes client's Configuration.

Each runs only with the version of the library it was tested with (:data:`TESTED`, the
lock's pins: tests/unit/test_lock.py checks they agree); with another, the extender takes the
stock path for that part and says so in one log line. An environment variable turns a part off by
hand (``0``, ``false``, ``no`` or ``off``): :data:`WORKER_ENV`, :data:`WIRE_ENV`
(and the worker's short parser alone: ``VGPU_EXTENDER_SHORT_PARSER``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata

log = logging.getLogger(__name__)

# the versions the hand-written parts were tested with: requirements.lock's pins
TESTED = {"gunicorn": "27.0.1", "kubernetes": "37.0.2"}

WORKER_ENV = "VGPU_EXTENDER_WORKER"
WIRE_ENV = "VGPU_KUBE_WIRE"
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Paths:
    worker: bool  # vgpu.extender.worker.LingeringThreadWorker instead of gunicorn's gthread
    wire: bool  # vgpu.kube.wire for the Binding and the watches instead of the kubernetes client
    notes: tuple[str, ...] = ()  # why a part takes the stock path, one line each


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def choose(
    environ: Mapping[str, str] | None = None,
    version: Callable[[str], str | None] | None = None,
    tested: Mapping[str, str] = TESTED,
) -> Paths:
    """The parts to run, given the environment and the installed library versions."""
    env = os.environ if environ is None else environ
    version = version or installed
    notes: list[str] = []

    def on(env_name: str) -> bool:
        return env.get(env_name, "1").strip().lower() not in _OFF

    def part(env_name: str, package: str, what: str) -> bool:
        if not on(env_name):
            return False
        got, want = version(package), tested[package]
        if got != want:
            notes.append(
                f"{package} {got or 'not installed'} is not the version {what} was tested with "
                f"({want}): using the stock path for it"
            )
            return False
        return True

    worker = part(WORKER_ENV, "gunicorn", "the extender's gunicorn worker (vgpu.extender.worker)")
    wire = part(WIRE_ENV, "kubernetes", "the extender's wire client (vgpu.kube.wire)")
    return Paths(worker=worker, wire=wire, notes=tuple(notes))


def report(paths: Paths) -> None:
    """One log line per part that fell back for its library's version."""
    for note in paths.notes:
        log.warning("%s", note)
