"""List then watch one kind of object, for as long as it runs: the one informer loop.

``list_fn()`` returns every object and the list's resourceVersion; ``on_list(items)`` replaces
what the user knew with them. ``watch_fn(rv)`` then yields ``(type, object)`` events from that
version, each handed to ``on_event`` (BOOKMARK events only move the version on). A watch that
simply ends (its timeout) is opened again from the last version seen, without listing; a stale
version (:class:`vgpu.kube.client.Gone`, HTTP 410) lists again at once; any other failure (an
error of the API server, a broken stream, a handler that raised) lists again after a
:class:`vgpu.core.backoff.Backoff` delay, which a successful watch resets.

Two answers that would otherwise loop at once, hammering the API server, wait the backoff too:
a watch that ends within ``min_watch_s`` (1 s) with no event at all (a proxy or load balancer
closing it; client-go's reflector calls this a "very short watch") is opened again from the same
version after the delay, and a 410 that follows a 410 with no event between them lists again
after the delay (one 410 lists at once, as before).

``synced`` is set once the first list is applied (``on_synced`` is then called once); ``lists``
counts the lists. The users: the extender's pods, nodes and Leases (:mod:`vgpu.extender.sync`),
the device plugin's arrival order (:mod:`vgpu.deviceplugin.arrivals`) and the sandbox's kubelet
stand-in. It speaks only through the two functions, so a fake source tests it (tests/unit).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from vgpu.core.backoff import Backoff
from vgpu.core.errors import KubeError
from vgpu.core.service import Service

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Lister = Callable[[], tuple[list[Obj], str]]
Watcher = Callable[[str], Iterable[tuple[str, Obj]]]


def _gone(err: KubeError) -> bool:
    return err.status == 410


class Informer:
    """One kind's list-then-watch loop; ``run`` blocks, ``start``/``stop`` run it on its own thread."""

    def __init__(
        self,
        name: str,
        list_fn: Lister,
        watch_fn: Watcher,
        on_list: Callable[[list[Obj]], None],
        on_event: Callable[[str, Obj], None],
        *,
        backoff: Backoff | None = None,
        stop: threading.Event | None = None,
        on_synced: Callable[[], None] | None = None,
        on_broken: Callable[[], None] | None = None,
        logger: logging.Logger | None = None,
        min_watch_s: float = 1.0,
    ) -> None:
        self.name = name
        self.list_fn = list_fn
        self.watch_fn = watch_fn
        self.on_list = on_list
        self.on_event = on_event
        self.backoff = backoff if backoff is not None else Backoff(0.5, 10.0)
        self.on_synced = on_synced
        self.on_broken = on_broken  # the watch stopped; a list follows (the user's view may lag)
        self.log = logger or log
        self.min_watch_s = min_watch_s  # a watch shorter than this with no event is a failure
        self.synced = threading.Event()
        self.lists = 0
        self.events = 0  # events the watches gave, bookmarks included
        self.resource_version: str | None = None  # None: list next
        self._service = Service(f"informer-{name}", lambda _stop: self.run(), stop)

    @property
    def stopping(self) -> threading.Event:
        return self._service.stopping

    def start(self) -> Informer:
        self._service.start()
        return self

    def stop(self, timeout_s: float | None = 5.0) -> None:
        self._service.stop(timeout_s)

    def wait_synced(self, timeout_s: float) -> bool:
        return self.synced.wait(timeout_s)

    def run(self) -> None:
        """List and watch until the stop Event is set."""
        stopping = self.stopping
        gone_before = False  # the last watch ended in a 410 before any event
        while not stopping.is_set():
            before = self.events
            try:
                if self.resource_version is None:
                    self._list()
                opened = time.monotonic()
                self._watch(self.watch_fn(str(self.resource_version)))
                seen = self.events - before
                gone_before = False
                lasted = time.monotonic() - opened
                if not seen and lasted < self.min_watch_s and not stopping.is_set():
                    delay = self.backoff.next()
                    self.log.warning(
                        "%s: the watch ended after %.2fs with no event (closed by a proxy or the API "
                        "server?); watching again in %.1fs",
                        self.name,
                        lasted,
                        delay,
                    )
                    stopping.wait(delay)
                    continue
                self.backoff.reset()
            except KubeError as err:
                self.resource_version = None
                if self.on_broken is not None:
                    self.on_broken()
                seen = self.events - before
                at_once = _gone(err) and (seen > 0 or not gone_before)
                gone_before = _gone(err) and not seen
                if at_once:
                    self.log.info("%s: %s; listing again", self.name, err)
                    continue
                delay = self.backoff.next()
                self.log.warning("%s: %s; listing again in %.1fs", self.name, err, delay)
                stopping.wait(delay)
            except Exception:  # never let a bad event or handler kill the loop
                self.resource_version = None
                gone_before = False
                if self.on_broken is not None:
                    self.on_broken()
                delay = self.backoff.next()
                self.log.exception("%s: unexpected error; listing again in %.1fs", self.name, delay)
                stopping.wait(delay)

    def _list(self) -> None:
        items, rv = self.list_fn()
        self.on_list(items)
        self.resource_version = rv
        self.lists += 1
        if not self.synced.is_set():
            self.synced.set()
            if self.on_synced is not None:
                self.on_synced()

    def _watch(self, events: Iterable[tuple[str, Obj]]) -> None:
        stopping = self.stopping
        for kind, obj in events:
            if stopping.is_set():
                return
            self.events += 1
            if kind != "BOOKMARK":
                self.on_event(kind, obj)
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if rv:
                self.resource_version = str(rv)
