"""The pods between filter and bind: parsed once, fitted once per node, assumed until bound.

As kube-scheduler's own cache (``pkg/scheduler/backend/cache``) keeps the pods it has *assumed* on
a node before their Binding is written, :class:`PodCache` keeps the one node filter answered for
a vGPU pod, holding the pod's plan in the :class:`~vgpu.core.ledger.Ledger`, so that the next
pod's filter, arriving while this pod's bind is still on its way, does not see that room as free:

- :meth:`PodCache.assume` (filter answered one node): the plan's footprint is committed in the
  ledger and the pod is marked assumed, with a deadline.
- :meth:`PodCache.forget` (the pod is filtered again, or its bind failed): the assumed capacity
  is freed.
- :meth:`PodCache.confirm` (our bind wrote the Binding, or the pod watch delivered the pod with
  its allocation): the ledger's entry stays, as the pod's own; no longer assumed, never counted
  twice (the ledger keys every entry by pod UID).
- :meth:`PodCache.expire` (at each filter): an assumption bind never came for is freed after
  :data:`ASSUME_TTL_S` (a later plugin of kube-scheduler turned the pod down).

Nothing here survives a restart, and nothing needs to: an assumption is a promise filter made to
one kube-scheduler call; the bound pods come back from the API server (their allocation
annotation) when the mirror lists them again.

The same cache remembers each pod as filter parsed it (:meth:`PodCache.parsed`, keyed by UID and
``resourceVersion``, at most :data:`MEMO_KEPT` pods) and the plan fitted on the node it was assumed
on, so bind neither parses the pod nor fits it again. A memo is dropped on forget and confirm.
Not thread-safe: its owner (:class:`vgpu.extender.state.SchedulerState`) serialises calls
under its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vgpu.core.annotations import NodeInventory
from vgpu.core.config import SchedulerConfig
from vgpu.core.errors import RequestError
from vgpu.core.fit import Plan
from vgpu.core.ledger import Ledger, Usage
from vgpu.core.requests import PodRequest, parse_pod

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# How long filter's answer for a pod holds its capacity while kube-scheduler has yet to call bind.
# kube-scheduler binds within milliseconds, or seconds on a saturated API server; a pod it never
# binds (a later plugin turned it down) frees the capacity after this, or at once when it is
# filtered again or deleted.
ASSUME_TTL_S = 30.0
# pods remembered as parsed at filter (bind has only the pod's name and UID)
MEMO_KEPT = 4096


@dataclass
class Parsed:
    """A pod as filter parsed it: its request (or why it has none), and the plan on its node."""

    rv: str
    pod: Obj
    request: PodRequest | None
    error: RequestError | None = None
    # the node filter assumed the pod on, the inventory object the plan was fitted against, the plan
    plan: tuple[str, NodeInventory, Plan] | None = field(default=None)


def _beside(inventory: NodeInventory, others: Mapping[str, Usage], fp: Mapping[str, Usage]) -> bool:
    """Whether footprint ``fp``, fitted on ``inventory``, still fits beside ``others`` on its cards:
    the limits :func:`vgpu.core.capacity.quick_fits` checks, over the cards the plan uses only."""
    cards = None
    for key, mine in fp.items():
        other = others.get(key)
        if other is None or other.empty:
            continue
        if cards is None:
            cards = {d.uuid: d for d in inventory.devices}
        card = cards.get(key)
        if card is None:  # a MIG placement (vgpu.core.ledger.mig_key) someone else holds now
            return False
        u = other + mine
        if u.memory_mib > card.memory_mib or u.cores > card.cores or u.count > card.split:
            return False
        if other.exclusive or (mine.exclusive and other.count):
            return False
    return True


def _key(pod: Mapping[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")


class PodCache:
    """Assumed pods and the filter-time memo, over the ledger the mirror shares."""

    def __init__(self, ledger: Ledger, kept: int = MEMO_KEPT) -> None:
        self.ledger = ledger
        self.kept = kept
        # uid -> when the assumption lapses, in the order made (a pod assumed again goes last)
        self.assumed: dict[str, float] = {}
        self.binding: set[str] = set()  # uids with a bind in flight
        self._memo: dict[str, Parsed] = {}  # uid -> the pod as filter parsed it, oldest first
        self.parses = 0  # pods parsed (each once per uid and resourceVersion)

    # -- parsed once -------------------------------------------------------------------------------
    def parsed(self, pod: Obj, config: SchedulerConfig) -> Parsed:
        """The pod's request, parsed on its first filter for this resourceVersion only (a pod
        without one, never stored by the API server, is parsed each time)."""
        uid, rv = _key(pod)
        hit = self._memo.get(uid) if uid and rv else None
        if hit is not None and hit.rv == rv:
            return hit
        entry = self._parse(pod, rv, config)
        if uid:
            self._memo.pop(uid, None)
            self._memo[uid] = entry
            while len(self._memo) > self.kept:
                self._memo.pop(next(iter(self._memo)))
        return entry

    def memo(self, uid: str) -> Parsed | None:
        """The pod as its last filter parsed it, if still remembered."""
        return self._memo.get(uid)

    def parse_for_bind(self, pod: Obj, config: SchedulerConfig) -> Parsed:
        """A pod bind had to read from the API server (no filter here remembers it): parsed, not kept."""
        return self._parse(pod, _key(pod)[1], config)

    def _parse(self, pod: Obj, rv: str, config: SchedulerConfig) -> Parsed:
        self.parses += 1
        try:
            return Parsed(rv, pod, parse_pod(pod, config))
        except RequestError as err:
            return Parsed(rv, pod, None, err)

    # -- assume, forget, confirm, expire -------------------------------------------------------------
    def assume(self, uid: str, node: str, inventory: NodeInventory, plan: Plan, until: float) -> None:
        """Hold ``plan`` on ``node`` for the pod until bind (or ``until``)."""
        self.ledger.commit(uid, node, plan.footprint)
        self.assumed.pop(uid, None)
        self.assumed[uid] = until
        entry = self._memo.get(uid)
        if entry is not None:
            entry.plan = (node, inventory, plan)

    def assumed_plan(self, uid: str, node: str, inventory: NodeInventory) -> Plan | None:
        """The plan filter assumed the pod on ``node`` with, while it still holds there against the
        same inventory and beside what else the ledger holds now (the watch may have booked a pod
        it did not know of: reality wins over an assumption); else None (fit again)."""
        if uid not in self.assumed or self.ledger.node_of(uid) != node:
            return None
        entry = self._memo.get(uid)
        if entry is None or entry.plan is None:
            return None
        where, against, plan = entry.plan
        if where != node or against is not inventory:
            return None
        others = self.ledger.usage(node, excluding=uid)
        return plan if _beside(inventory, others, plan.footprint) else None

    def begin_bind(self, uid: str) -> None:
        """The pod's bind reserved its plan in the ledger: that entry replaces filter's assumption
        (no deadline any more), and the pod counts as being bound."""
        self.binding.add(uid)
        self.assumed.pop(uid, None)

    def end_bind(self, uid: str) -> None:
        self.binding.discard(uid)

    def forget(self, uid: str) -> bool:
        """Free what filter assumed for the pod (filtered again, its bind failed, or it is gone);
        True when it held something."""
        entry = self._memo.get(uid)
        if entry is not None:
            entry.plan = None
        if self.assumed.pop(uid, None) is None:
            return False
        self.ledger.release(uid)
        return True

    def confirm(self, uid: str) -> None:
        """The pod is bound with its allocation: its ledger entry is its own from now on."""
        self.assumed.pop(uid, None)
        self._memo.pop(uid, None)

    def gone(self, uid: str) -> None:
        """The pod was deleted or finished: no assumption and no memo left for it (the ledger's
        entry is its owner's to release)."""
        self.assumed.pop(uid, None)
        self._memo.pop(uid, None)

    def expire(self, now: float) -> None:
        """Free the assumptions bind never came for."""
        assumed = self.assumed
        while assumed:
            uid, until = next(iter(assumed.items()))
            if until > now:
                return  # in the order made, so the rest lapse later too
            self.forget(uid)
            log.info(
                "pod uid %s: filtered %.0f s ago and not bound; its capacity is free again", uid, ASSUME_TTL_S
            )
