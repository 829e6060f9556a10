"""Scheduler-side metrics (contract 6, docs/contracts.md): names start with ``vgpu_``, base units.

Under gunicorn these live in Prometheus multiprocess mode: the CLI sets ``PROMETHEUS_MULTIPROC_DIR``
before this module is first imported, the worker writes, and the master serves the aggregate on
``--metrics-listen``. Without that variable (the Flask test client) they are ordinary metrics.
"""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge, Histogram

MiB = 1024 * 1024
# prometheus_client cannot remove a series in multiprocess mode (the worker's file keeps every
# value it wrote): there a removed gauge series is set to GONE, which the master leaves out of
# /metrics (vgpu.extender.server.LiveGauges). Without multiprocess mode, remove() removes it.
GONE = float("nan")
_MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

VERB_SECONDS = Histogram(
    "vgpu_scheduler_verb_duration_seconds",
    "Time to answer a kube-scheduler extender call, by verb (filter, prioritize, bind).",
    ["verb"],
    buckets=_LATENCY,
)
BINDS = Counter(
    "vgpu_scheduler_binds",
    "Bind calls by result: ok, conflict (lost a race or no room any more; kube-scheduler retries), error.",
    ["result"],
)
BAD_REQUESTS = Counter(
    "vgpu_scheduler_bad_requests",
    "Calls rejected with HTTP 400 because their JSON or fields were malformed, by route.",
    ["route"],
)
UNCERTIFIED = Counter(
    "vgpu_scheduler_uncertified_calls",
    "Scheduling calls refused with HTTP 403: the caller gave no client certificate of the client CA.",
    ["verb"],
)
UNTRUSTED_PLACEMENTS = Counter(
    "vgpu_scheduler_untrusted_placements",
    "Allocation annotations the ledger did not take as they were: changed (after the extender "
    "booked the pod; the booking is kept) or mismatch (found after a restart, not what the pod's "
    "spec asks for; booked at least what it asks for). Placements are the extender's alone.",
    ["kind"],
)
INVENTORY_ERRORS = Counter(
    "vgpu_scheduler_inventory_errors",
    "Node inventory annotations that did not decode; the node is skipped until it is fixed.",
    ["node"],
)
NODES_SKIPPED = Gauge(
    "vgpu_scheduler_nodes_skipped",
    "Nodes currently skipped: malformed inventory annotation, or device-plugin Lease expired.",
    ["reason"],
    multiprocess_mode="livemostrecent",
)
LEADER = Gauge(
    "vgpu_scheduler_leader",
    "1 while this replica holds the extender Lease and serves scheduling calls.",
    multiprocess_mode="livemax",
)
_CARD = ["node", "uuid"]
CARD_MEMORY_CAPACITY = Gauge(
    "vgpu_card_memory_capacity_bytes",
    "Device memory a card offers (after scaling).",
    _CARD,
    multiprocess_mode="livemostrecent",
)
CARD_MEMORY_ALLOCATED = Gauge(
    "vgpu_card_memory_allocated_bytes",
    "Device memory committed to pods on a card.",
    _CARD,
    multiprocess_mode="livemostrecent",
)
CARD_CORES_ALLOCATED = Gauge(
    "vgpu_card_cores_allocated_ratio",
    "Share of a card's compute committed to pods (1 = one whole card).",
    _CARD,
    multiprocess_mode="livemostrecent",
)
CARD_VGPUS_CAPACITY = Gauge(
    "vgpu_card_vgpus_capacity", "vGPUs a card may carry (split).", _CARD, multiprocess_mode="livemostrecent"
)
CARD_VGPUS_ALLOCATED = Gauge(
    "vgpu_card_vgpus_allocated", "vGPUs committed on a card.", _CARD, multiprocess_mode="livemostrecent"
)
NODE_MEMORY_CAPACITY = Gauge(
    "vgpu_node_memory_capacity_bytes",
    "Device memory of a node's cards together.",
    ["node"],
    multiprocess_mode="livemostrecent",
)
NODE_MEMORY_ALLOCATED = Gauge(
    "vgpu_node_memory_allocated_bytes",
    "Device memory committed on a node's cards together.",
    ["node"],
    multiprocess_mode="livemostrecent",
)
CARD_MODE = Gauge(
    "vgpu_card_mode",
    "1 on the series of a card's mode: hami-core (time-sliced under the hook), mps (shared through "
    "its MPS daemon) or mig (cut into MIG instances on demand), as nvidia.com/vgpu-mode names it.",
    [*_CARD, "mode"],
    multiprocess_mode="livemostrecent",
)
_MODES: dict[tuple[str, str], str] = {}  # (node, uuid) -> the mode whose series is set
_CARD_GAUGES = (
    CARD_MEMORY_CAPACITY,
    CARD_MEMORY_ALLOCATED,
    CARD_CORES_ALLOCATED,
    CARD_VGPUS_CAPACITY,
    CARD_VGPUS_ALLOCATED,
)


def _remove(gauge: Gauge, *labels: str) -> None:
    if _MULTIPROCESS:
        gauge.labels(*labels).set(GONE)
    else:
        gauge.remove(*labels)


def set_card_mode(node: str, uuid: str, mode: str) -> None:
    """Set the card's :data:`CARD_MODE` series, removing the one of the mode it had before."""
    old = _MODES.get((node, uuid))
    if old is not None and old != mode:
        _remove(CARD_MODE, node, uuid, old)
    CARD_MODE.labels(node, uuid, mode).set(1)
    _MODES[(node, uuid)] = mode


def forget_card(node: str, uuid: str) -> None:
    """Remove a card's series: its node is gone, or its inventory no longer lists it."""
    for gauge in _CARD_GAUGES:
        _remove(gauge, node, uuid)
    mode = _MODES.pop((node, uuid), None)
    if mode is not None:
        _remove(CARD_MODE, node, uuid, mode)


def forget_node(node: str) -> None:
    """Remove a node's own series (its cards': forget_card): the Node is gone, or has no usable inventory."""
    for gauge in (NODE_MEMORY_CAPACITY, NODE_MEMORY_ALLOCATED):
        _remove(gauge, node)
