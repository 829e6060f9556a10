"""Two busy tenants capped 50/50 on one card (issue 39's time-slicing goal): each should keep at
least what the driver's own time-slicing gives it, the cap costing nothing while the other tenant
is within its share too.

Three runs of the same busy loop (``matmul``, kernels that fill the card) side by side, each
tenant's rate over its last SECONDS / 2 against the loop alone on the card:

- ``driver``: two bare processes, the driver's time slices alone;
- ``hook``: two containers granted 50 % each under the hook, no node. The hook measures its
  streams' busy time with events, and on a card shared in time slices that counts the time its
  work waited for the other's slice, so each reads about twice its share and holds itself to half
  of what the driver would give it (PyTorch prefill on an H100: 0.43 / 0.39 against 0.55 / 0.56,
  bench/bench_mps.py);
- ``node``: the same with the node running (the gate and the share scale it writes,
  vgpu/monitor/sharescale.py): the scale brings the hook's measure to the driver's, so a
  tenant within its share is not held, and each keeps what the driver gives (within 3 points).

Prints one JSON line (``compute-pair``). Part a of tests/gpu/procedure.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from gpu_figures import record
from test_compute_gate_gpu import Container, Node, lib, node, nvml  # noqa: F401 (fixtures)
from test_limits_gpu import Child, loop, plain_env, rate_between

pytestmark = pytest.mark.gpu

KIND = "matmul"
SECONDS = 10.0
SETTLE = 8.0  # the run with the node is longer by this: the scale steps by halves on 1.5 s spans
TOLERANCE = 0.03  # of the loop's rate alone


def _rates(children: list[Child], seconds: float) -> list[float]:
    """Start the children together; each one's rate over its run's last SECONDS / 2."""
    for child in children:
        child.send()
    out = []
    for child in children:
        windows = child.windows()
        assert child.finish() == 0
        end = int(windows[-1]["t"])
        out.append(rate_between(windows, end - int(SECONDS / 2 * 1e9), end))
    return out


def test_two_tenants_capped_50_50_keep_what_the_drivers_time_slices_give(lib: Path, node: Node) -> None:  # noqa: F811
    [alone] = _rates([loop(KIND, plain_env(), SECONDS, wait=True)], SECONDS)
    driver = _rates([loop(KIND, plain_env(), SECONDS, wait=True) for _ in range(2)], SECONDS)
    hooked = [Container(node, 50), Container(node, 50)]
    hook_only = _rates([c.loop(lib, KIND, SECONDS) for c in hooked], SECONDS)
    made = node.enforcer()
    made.start()
    try:
        pair = [Container(node, 50), Container(node, 50)]
        with_node = _rates([c.loop(lib, KIND, SECONDS + SETTLE) for c in pair], SECONDS + SETTLE)
    finally:
        made.stop()
    shares: dict[str, Any] = {
        name: [round(r / alone, 3) for r in rates]
        for name, rates in (("driver", driver), ("hook", hook_only), ("node", with_node))
    }
    record(
        "compute-pair",
        loop=KIND,
        alone_rate=round(alone, 1),
        shares=shares,
        scales=[round(a.scale.scale, 3) for a in made.accounts.values()],
        gate_writes=made.gate_writes,
        at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    floor = min(shares["driver"]) - TOLERANCE
    assert min(shares["node"]) >= floor, (
        f"capped 50/50 with the node, the tenants kept {shares['node']} of the loop alone; the "
        f"driver's time slices alone give {shares['driver']}: {shares}"
    )
