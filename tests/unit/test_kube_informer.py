"""The one informer loop (vgpu.kube.informer), its Backoff and the Service it runs on.

The source below answers list and watch as vgpu.kube.client.Kube does (a 410 Gone as the
client's Gone, other failures as KubeError); tests/e2e/test_kube_client.py runs the informer
against the real API server.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from vgpu.core.backoff import Backoff
from vgpu.core.errors import KubeError
from vgpu.core.service import Service
from vgpu.kube.client import Gone
from vgpu.kube.informer import Informer

Obj = dict[str, Any]


def obj(name: str, rv: int) -> Obj:
    return {"metadata": {"name": name, "resourceVersion": str(rv)}}


class Source:
    """list: the current items at version "10"; watch: what the test queues (an error raises),
    ending when nothing came for ``expire_s``; with ``gone`` every watch is a 410 at once."""

    def __init__(self, items: list[str]) -> None:
        self.items = list(items)
        self.events: queue.Queue[tuple[str, Obj] | Exception] = queue.Queue()
        self.lists = 0
        self.list_errors: list[Exception] = []
        self.watched_from: list[str] = []
        self.expire_s = 0.05
        self.gone = False

    def list(self) -> tuple[list[Obj], str]:
        if self.list_errors:
            raise self.list_errors.pop(0)
        self.lists += 1
        return [obj(n, 1) for n in self.items], "10"

    def watch(self, rv: str) -> Iterator[tuple[str, Obj]]:
        self.watched_from.append(rv)
        if self.gone:
            raise Gone(f"watch things from {rv}: too old resource version", status=410)
        while True:
            try:
                item = self.events.get(timeout=self.expire_s)
            except queue.Empty:
                return  # the watch expired: the informer watches again from its version
            if isinstance(item, Exception):
                raise item
            yield item


class Seen:
    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []
        self.broken = 0

    def on_list(self, items: list[Obj]) -> None:
        self.lists.append([i["metadata"]["name"] for i in items])

    def on_event(self, kind: str, o: Obj) -> None:
        if o["metadata"]["name"] == "poison":
            raise ValueError("a handler that fails")
        self.events.append((kind, o["metadata"]["name"]))

    def on_broken(self) -> None:
        self.broken += 1


def wait(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def informer(source: Source, seen: Seen, backoff: Backoff | None = None, **kw: Any) -> Informer:
    return Informer(
        "things",
        source.list,
        source.watch,
        seen.on_list,
        seen.on_event,
        backoff=backoff or Backoff(0.01, 0.01),
        on_broken=seen.on_broken,
        **({"min_watch_s": 0.0} | kw),  # the source's watches expire after 50 ms
    )


def test_synced_is_set_once_the_first_list_is_applied_and_on_synced_runs_once() -> None:
    source, seen = Source(["a", "b"]), Seen()
    calls: list[list[list[str]]] = []
    inf = informer(source, seen, on_synced=lambda: calls.append(list(seen.lists)))
    assert not inf.synced.is_set()
    inf.start()
    try:
        assert inf.wait_synced(5)
        assert calls == [[["a", "b"]]]  # the list was applied before synced
        source.events.put(Gone("watch things: too old", status=410))
        assert wait(lambda: inf.lists == 2)
        assert len(calls) == 1
    finally:
        inf.stop()


def test_events_are_handed_on_and_bookmarks_only_move_the_version() -> None:
    source, seen = Source([]), Seen()
    inf = informer(source, seen).start()
    try:
        assert inf.wait_synced(5)
        source.events.put(("ADDED", obj("x", 11)))
        source.events.put(("BOOKMARK", {"metadata": {"resourceVersion": "15"}}))
        source.events.put(("DELETED", obj("x", 16)))
        assert wait(lambda: len(seen.events) == 2)
        assert seen.events == [("ADDED", "x"), ("DELETED", "x")]
        assert wait(lambda: inf.resource_version == "16")
        # a watch that merely expires goes on from the last version, without a list
        assert wait(lambda: "16" in source.watched_from)
        assert source.watched_from[0] == "10" and source.lists == 1
    finally:
        inf.stop()


def test_a_410_gone_lists_again_at_once_without_the_backoff() -> None:
    source, seen = Source(["a"]), Seen()
    inf = informer(source, seen, backoff=Backoff(30.0, 30.0)).start()
    try:
        assert inf.wait_synced(5)
        source.items = ["a", "missed"]
        source.events.put(Gone("watch things: too old resource version", status=410))
        assert wait(lambda: source.lists == 2, timeout=2.0)  # long before the 30 s backoff
        assert seen.lists == [["a"], ["a", "missed"]] and seen.broken == 1
        assert inf.backoff.current_s == 30.0  # a 410 is no failure: the delay did not grow
    finally:
        inf.stop(timeout_s=None)


def test_a_watch_that_ends_at_once_with_no_event_is_opened_again_only_after_a_growing_backoff() -> None:
    """A proxy that closes every watch at once must not make the informer spin on the API server;
    the version is still good, so it watches again from it without listing."""
    source, seen = Source(["a"]), Seen()
    source.expire_s = 0.0
    backoff = Backoff(0.05, 0.4)
    inf = informer(source, seen, backoff=backoff, min_watch_s=1.0).start()
    try:
        assert inf.wait_synced(5)
        time.sleep(1.0)
        opened = list(source.watched_from)
        # at 0, 0.05, 0.15, 0.35, 0.75 s (and one more on a slow machine); at once, thousands
        assert 3 <= len(opened) <= 7, len(opened)
        assert set(opened) == {"10"} and source.lists == 1 and seen.broken == 0
        assert backoff.current_s == 0.4
        # a watch that lasts: events flow again and the delay starts over
        source.expire_s = 0.05
        source.events.put(("ADDED", obj("b", 11)))
        assert wait(lambda: seen.events == [("ADDED", "b")] and backoff.current_s == 0.05)
    finally:
        inf.stop()


def test_a_410_right_after_a_410_lists_again_only_after_the_backoff() -> None:
    """One 410 lists at once; a watch that is 410 again from the new list's version, before any
    event, waits the backoff, so a version the server keeps refusing never spins list and watch."""
    source, seen = Source(["a"]), Seen()
    source.gone = True
    inf = informer(source, seen, backoff=Backoff(0.2, 0.2)).start()
    try:
        assert inf.wait_synced(5)
        time.sleep(0.5)
        # list, 410, list at once, 410, 0.2 s, list, 410, 0.2 s, list: 3 or 4 lists
        assert 2 <= source.lists <= 5, source.lists
        source.gone = False
        source.events.put(("ADDED", obj("b", 11)))
        assert wait(lambda: seen.events == [("ADDED", "b")])
    finally:
        inf.stop()


def test_errors_list_again_after_a_growing_backoff_that_a_good_watch_resets() -> None:
    source, seen = Source(["a"]), Seen()
    backoff = Backoff(0.05, 0.2)
    source.list_errors = [KubeError("list things: HTTP 500"), KubeError("list things: HTTP 500")]
    started = time.monotonic()
    inf = informer(source, seen, backoff=backoff).start()
    try:
        assert inf.wait_synced(5)
        assert time.monotonic() - started >= 0.05 + 0.1  # waited 0.05 then 0.1 s
        assert seen.broken == 2 and source.lists == 1
        # the first watch that ends well (it expires) resets the delay
        assert wait(lambda: backoff.current_s == 0.05)
        source.events.put(KubeError("watch things: stream broke"))
        assert wait(lambda: source.lists == 2)
        source.events.put(("ADDED", obj("poison", 12)))  # a handler raising counts as an error
        assert wait(lambda: source.lists == 3)
        assert seen.broken == 4
    finally:
        inf.stop()


def test_stop_ends_the_loop_and_a_shared_stop_event_ends_several() -> None:
    stop = threading.Event()
    sources = [Source([]), Source([])]
    infs = [informer(s, Seen(), stop=stop).start() for s in sources]
    assert all(i.wait_synced(5) for i in infs)
    stop.set()
    assert wait(lambda: not any(i._service.alive for i in infs), timeout=2.0)


def test_backoff_doubles_up_to_its_ceiling_and_resets() -> None:
    b = Backoff(0.5, 3.0)
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.next() == 0.5
    fixed = Backoff(1.0, 1.0)
    assert [fixed.next() for _ in range(3)] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)
    stop = threading.Event()
    stop.set()
    assert Backoff(10.0, 10.0).wait(stop)  # a set stop cuts the wait short


def test_a_service_runs_until_stopped_and_every_outlives_a_failing_step() -> None:
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("one bad round")

    service = Service.every("test-every", 0.01, step).start()
    assert service.alive
    assert wait(lambda: len(calls) >= 3)
    service.stop()
    assert not service.alive
    n = len(calls)
    time.sleep(0.05)
    assert len(calls) == n
    ran = threading.Event()
    body = Service("test-body", lambda stop: (ran.set(), stop.wait())[0])
    body.start().start()  # a second start leaves the running thread alone
    assert ran.wait(2)
    body.stop()
    assert not body.alive
