"""The pod watch ranks pods in the order they arrived on the node, as kubelet sees them.

The source below answers list and watch like the API server's JSON (one event per line of a
watch, a 410 Gone as a KubeError); the e2e tests run the same code against the real one.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

from vgpu.core.errors import KubeError
from vgpu.plugin.arrivals import Arrivals, ArrivalWatch, PodWatchSource


def pod(uid: str, rv: int) -> dict[str, Any]:
    return {"metadata": {"uid": uid, "name": uid, "namespace": "default", "resourceVersion": str(rv)}}


class Source:
    def __init__(self, listed: list[str]) -> None:
        self.listed = list(listed)
        self.events: queue.Queue[tuple[str, dict[str, Any]] | KubeError] = queue.Queue()
        self.selectors: list[str | None] = []
        self.lists = 0

    def list_pods(self, field_selector: str | None = None) -> tuple[list[dict[str, Any]], str]:
        self.selectors.append(field_selector)
        self.lists += 1
        return [pod(u, 1) for u in self.listed], "10"

    def watch_pods(
        self, resource_version: str, field_selector: str | None = None, timeout_s: int = 300
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        while True:
            try:
                item = self.events.get(timeout=0.05)
            except queue.Empty:
                return  # the watch expired: the caller watches again from its resourceVersion
            if isinstance(item, KubeError):
                raise item
            yield item


def wait(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_pods_are_ranked_by_the_watch_event_they_arrived_in() -> None:
    source = Source(["already-a", "already-b"])
    arrivals = Arrivals()
    watch = ArrivalWatch(source, "node-a", arrivals)
    assert isinstance(source, PodWatchSource)
    watch.start()
    try:
        assert source.selectors == ["spec.nodeName=node-a"] and arrivals.watched
        for k, uid in enumerate(["third", "first-created-but-bound-later"]):
            source.events.put(("ADDED", pod(uid, 11 + k)))
        source.events.put(("MODIFIED", pod("third", 20)))  # an update keeps the first rank
        assert wait(lambda: arrivals.rank("first-created-but-bound-later") is not None)
        ranks = {
            u: arrivals.rank(u) for u in ["already-a", "already-b", "third", "first-created-but-bound-later"]
        }
        assert ranks["already-a"] == ranks["already-b"]  # one list: one batch
        assert ranks["already-a"] < ranks["third"] < ranks["first-created-but-bound-later"]  # type: ignore[operator]
        source.events.put(("DELETED", pod("third", 21)))
        assert wait(lambda: arrivals.rank("third") is None)
    finally:
        watch.stop()


def test_after_a_410_gone_the_pods_new_in_the_relist_are_one_batch_after_the_known_ones() -> None:
    source = Source(["known"])
    arrivals = Arrivals()
    watch = ArrivalWatch(source, "node-a", arrivals, retry_s=0.01)
    watch.start()
    try:
        source.listed = ["known", "missed-1", "missed-2"]  # bound while the watch was gone
        source.events.put(KubeError("watch pods: too old resource version", status=410))
        assert wait(lambda: source.lists == 2 and arrivals.rank("missed-2") is not None)
        assert arrivals.rank("missed-1") == arrivals.rank("missed-2")
        assert arrivals.rank("known") < arrivals.rank("missed-1")  # type: ignore[operator]
    finally:
        watch.stop()


def test_a_watch_that_merely_expires_goes_on_without_listing_again() -> None:
    source = Source([])
    arrivals = Arrivals()
    watch = ArrivalWatch(source, "node-a", arrivals)
    watch.start()
    try:
        time.sleep(0.3)  # several expiries of the source's 50 ms watch
        source.events.put(("ADDED", pod("late", 12)))
        assert wait(lambda: arrivals.rank("late") is not None)
        assert source.lists == 1
    finally:
        watch.stop()
