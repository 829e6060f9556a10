"""The pod watch ranks pods in the order they arrived on the node, as kubelet sees them.

The fake API server (``tests.support.FakeKube``) answers list and watch like the API server's
JSON (one event per line of a watch, a 410 Gone as a KubeError); the e2e tests run the same
code against the real one.
"""

from __future__ import annotations

import time
from typing import Any

from tests.support import FakeKube, poll
from vgpu.core.errors import KubeError
from vgpu.deviceplugin.arrivals import Arrivals, ArrivalWatch, PodWatchSource


def pod(uid: str, rv: int) -> dict[str, Any]:
    return {"metadata": {"uid": uid, "name": uid, "namespace": "default", "resourceVersion": str(rv)}}


def test_pods_are_ranked_by_the_watch_event_they_arrived_in() -> None:
    source = FakeKube([pod("already-a", 1), pod("already-b", 1)])
    arrivals = Arrivals()
    watch = ArrivalWatch(source, "node-a", arrivals)
    assert isinstance(source, PodWatchSource)
    watch.start()
    try:
        assert source.selectors == ["spec.nodeName=node-a"] and arrivals.watched
        for k, uid in enumerate(["third", "first-created-but-bound-later"]):
            source.events.put(("ADDED", pod(uid, 11 + k)))
        source.events.put(("MODIFIED", pod("third", 20)))  # an update keeps the first rank
        assert poll(lambda: arrivals.rank("first-created-but-bound-later") is not None)
        ranks = {
            u: arrivals.rank(u) for u in ["already-a", "already-b", "third", "first-created-but-bound-later"]
        }
        assert ranks["already-a"] == ranks["already-b"]  # one list: one batch
        assert ranks["already-a"] < ranks["third"] < ranks["first-created-but-bound-later"]  # type: ignore[operator]
        source.events.put(("DELETED", pod("third", 21)))
        assert poll(lambda: arrivals.rank("third") is None)
    finally:
        watch.stop()


def test_after_a_410_gone_the_pods_new_in_the_relist_are_one_batch_after_the_known_ones() -> None:
    source = FakeKube([pod("known", 1)])
    arrivals = Arrivals()
    watch = ArrivalWatch(source, "node-a", arrivals, retry_s=0.01)
    watch.start()
    try:
        source.pods = [pod(u, 1) for u in ["known", "missed-1", "missed-2"]]  # bound while the watch was gone
        source.events.put(KubeError("watch pods: too old resource version", status=410))
        assert poll(lambda: source.lists == 2 and arrivals.rank("missed-2") is not None)
        assert arrivals.rank("missed-1") == arrivals.rank("missed-2")
        assert arrivals.rank("known") < arrivals.rank("missed-1")  # type: ignore[operator]
    finally:
        watch.stop()


def test_a_watch_that_merely_expires_goes_on_without_listing_again() -> None:
    source = FakeKube()
    arrivals = Arrivals()
    watch = ArrivalWatch(source, "node-a", arrivals)
    watch.start()
    try:
        time.sleep(0.3)  # several expiries of the source's 50 ms watch
        source.events.put(("ADDED", pod("late", 12)))
        assert poll(lambda: arrivals.rank("late") is not None)
        assert source.lists == 1
    finally:
        watch.stop()
