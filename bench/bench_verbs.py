"""CPU per pod of the extender's verbs in-process: ``filter`` then ``bind``, no HTTP, no API server.

Run: .venv/bin/python bench/bench_verbs.py [--nodes 1000] [--pods 2000] [--rounds 3] [--src DIR]

A :class:`~vgpu.extender.state.SchedulerState` with N nodes of 8 cards (80 GiB, split 10) and fresh
plugin Leases; each pod asks ``nvidia.com/gpumem: 1000``, is filtered over the nodes kube-scheduler
would send at that size (its adaptive ``percentageOfNodesToScore``: 50 % - N/125, at least 100
nodes), then bound (the Binding a no-op), then, after the round, deleted. Prints the thread CPU
per pod of each verb, per round. ``--src DIR`` runs the ``vgpu`` of another checkout (``git
worktree add --detach DIR main``) in place of this one, for before and after on one machine:
run the two alternately and compare medians.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=2000, help="pods per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src", default=None, help="a checkout whose vgpu to measure instead")
    args = parser.parse_args()
    if args.src:  # the editable install's finder would find this checkout's vgpu first
        sys.meta_path[:] = [
            f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable___vgpu_0")
        ]
        sys.path.insert(0, args.src)
    from vgpu.core import annotations as ann
    from vgpu.core.config import SchedulerConfig
    from vgpu.extender import state as state_module
    from vgpu.extender.state import SchedulerState

    class NoKube:
        def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
            return None

        def bind_pod(self, namespace: str, name: str, uid: str, node: str, annotations: Any = None) -> None:
            return None

    now = time.time()
    st = SchedulerState(SchedulerConfig(), kube=NoKube(), clock=lambda: now)
    cards = tuple(ann.Device(f"GPU-{i}", i, "H100", 81920, 100, 10) for i in range(8))
    inventory = ann.encode_devices(ann.NodeInventory(cards))
    renewed = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    names = [f"bench-{i}" for i in range(args.nodes)]
    for name in names:
        st.apply_node({"metadata": {"name": name, "annotations": {ann.DEVICES_ANNOTATION: inventory}}})
        spec = {"renewTime": renewed, "leaseDurationSeconds": 3600}
        st.apply_lease({"metadata": {"name": ann.lease_name(name)}, "spec": spec})
    st.synced.set()
    st.leader.set()
    asked = names[: max(100, args.nodes * max(5, 50 - args.nodes // 125) // 100)]

    def pod(i: int) -> dict[str, Any]:
        limits = {"nvidia.com/gpumem": "1000"}
        return {
            "metadata": {"uid": f"u{i}", "name": f"p{i}", "namespace": "b", "resourceVersion": str(i + 1)},
            "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
        }

    filters, binds = [], []
    for r in range(args.rounds):
        spent_filter = spent_bind = 0.0
        uids = range(r * args.pods, (r + 1) * args.pods)
        for i in uids:
            p = pod(i)
            t0 = time.thread_time()
            result = st.filter(p, asked)
            t1 = time.thread_time()
            error, kind = st.bind("b", p["metadata"]["name"], p["metadata"]["uid"], result.nodes[0])
            t2 = time.thread_time()
            assert kind == "ok", error
            spent_filter += t1 - t0
            spent_bind += t2 - t1
        filters.append(spent_filter / args.pods * 1e6)
        binds.append(spent_bind / args.pods * 1e6)
        for i in uids:
            st.apply_pod({"metadata": {"uid": f"u{i}"}}, deleted=True)
    print(
        f"{state_module.__file__}: {args.nodes} nodes, {len(asked)} asked, {args.pods} pods a round: "
        f"filter {', '.join(f'{x:.0f}' for x in filters)} µs per pod "
        f"(median {statistics.median(filters):.0f}), "
        f"bind {', '.join(f'{x:.0f}' for x in binds)} µs (median {statistics.median(binds):.0f})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
