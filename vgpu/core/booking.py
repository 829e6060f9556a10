"""What a placed pod holds on its node's cards, as the scheduler counts it: the one rule.

The extender's ledger (:class:`vgpu.extender.mirror.Mirror`) and ``vgpu status``
(:mod:`vgpu.commands.status`) both call :func:`book`, so the two never disagree on a pod:

- a finished pod (``Succeeded`` or ``Failed``) holds nothing;
- a pod holds, per card, the most its containers hold there at any one time
  (:func:`vgpu.core.ledger.footprint` over the pod's phases: init containers run one at a time
  before the app containers, so an init container's room is reused by the containers after it);
- a placement that is not what the pod's spec asks for (one the extender did not write itself;
  :mod:`vgpu.core.placementcheck`) counts at no less than the spec asks for.

Pure: the pod, its decoded allocation, the scheduler's settings and the node's cards go in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vgpu.core.annotations import Allocation, Device
from vgpu.core.config import SchedulerConfig
from vgpu.core.errors import RequestError
from vgpu.core.ledger import Usage, footprint
from vgpu.core.placementcheck import at_least_requested, placement_problems
from vgpu.core.requests import parse_pod

TERMINAL = ("Succeeded", "Failed")


def finished(pod: Mapping[str, Any]) -> bool:
    """A pod that ran to its end (or that kubelet refused): it holds nothing any more."""
    status = pod.get("status")
    return isinstance(status, dict) and status.get("phase") in TERMINAL


@dataclass(frozen=True)
class Booking:
    """What one pod holds: ``footprint`` per card UUID of ``allocation.node``.

    ``allocation`` is the pod's own, or raised to what its spec asks for where ``problems`` (one
    line each) say the placement is not what it asks for.
    """

    allocation: Allocation
    footprint: dict[str, Usage]
    problems: tuple[str, ...] = ()


def book(
    pod: Mapping[str, Any],
    allocation: Allocation,
    config: SchedulerConfig,
    cards: Mapping[str, Device] | None,
) -> Booking:
    """The booking of a pod that is not :func:`finished`, placed by ``allocation`` on the node
    whose ``cards`` (by UUID; None where the node has no usable inventory) it names.

    A spec that does not parse counts every container at once, which is never less than the truth.
    """
    try:
        request = parse_pod(pod, config)
    except RequestError:
        return Booking(allocation, footprint(allocation))
    problems: list[str] = []
    if cards is not None:
        problems = placement_problems(request, allocation, cards)
        if problems:
            allocation = at_least_requested(request, allocation, cards)
    phases = [[c.name for c in phase] for phase in request.phases()]
    return Booking(allocation, footprint(allocation, phases), tuple(problems))
