"""Where a pod goes: filtering nodes in the node policy's order, their scores, the best few.

Pure (no Kubernetes, no Flask): the extender's state (:mod:`vgpu.extender.state`) holds one
:class:`Placement` next to its ledger and mirror of the nodes, and asks it under its lock. What it
needs of the mirror comes in as two functions: ``lookup(name)`` (the node's inventory and capacity
shape, or None when it has no usable inventory) and ``problem(name)`` (why the node takes nothing
new, or None).

The ranking of a group of alike nodes uses :func:`vgpu.core.capacity.node_utilization`, the same
formula (same integers, same floats) :func:`vgpu.core.capacity.quick_utilization` applies node by node,
so the indexed filter answers exactly what fitting every node answers
(tests/unit/test_filter_index.py).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vgpu.core import annotations as ann
from vgpu.core.capacity import (
    CardSummary,
    card_summary,
    may_fit,
    node_utilization,
    quick_fits,
    quick_utilization,
    utilization,
)
from vgpu.core.config import BINPACK, SPREAD
from vgpu.core.fit import MOST_FREE, Plan, fit_node, for_nodes
from vgpu.core.ledger import Ledger, Usage
from vgpu.core.requests import ContainerRequest, PodRequest

# (memory MiB, vGPU slots) over all cards, and the first card's memory: the node policy's terms
Shape = tuple[int, int, int]
# per node, the pod's utilisation there: (ledger node version, inventory, utilisation with the pod)
Cache = dict[str, tuple[int, Any, float]]
Lookup = Callable[[str], "tuple[ann.NodeInventory, Shape] | None"]
Problem = Callable[[str], "str | None"]


def shape(inventory: ann.NodeInventory) -> Shape:
    devices = inventory.devices
    first = devices[0].memory_mib if devices else 0
    return sum(d.memory_mib for d in devices), sum(d.split for d in devices), first


@dataclass
class FilterResult:
    nodes: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    error: str = ""


_MOST_FREE_RE = re.compile(re.escape(MOST_FREE).replace(r"\{\}", r"(\d+)"))


def one_free_figure(failed: dict[str, str]) -> dict[str, str]:
    """The nodes' reasons with one free figure in all: the most memory free on one card of any of
    them. kube-scheduler prints each distinct reason with the count of nodes that gave it, so a
    figure per node would make one line per node of a large cluster; and the largest figure is the
    one that tells how small a request would fit now."""
    figures = {int(m.group(1)) for reason in failed.values() for m in _MOST_FREE_RE.finditer(reason)}
    if len(figures) < 2:
        return failed
    text = MOST_FREE.format(max(figures))
    return {node: _MOST_FREE_RE.sub(text, reason) for node, reason in failed.items()}


def binpacks(request: PodRequest, default_policy: str) -> bool:
    return (request.node_policy or default_policy) == BINPACK


def group_utilization(group_shape: Shape, totals: tuple[int, int], c: ContainerRequest) -> float:
    """Utilisation of any node of ``group_shape`` whose ledger totals are ``totals``, with ``c`` added."""
    total_mem, total_slots, first = group_shape
    used_mem, used_slots = totals
    mem = c.memory_mib if c.memory_mib is not None else first * (c.memory_percent or 0) // 100
    return node_utilization(total_mem, total_slots, used_mem + mem * c.count, used_slots + c.count)


def best(feasible: list[str], binpack: bool, keep: int, cache: Cache) -> list[str]:
    """The ``keep`` best of ``feasible`` by the node policy, in their given order.

    ``cache`` holds each feasible node's utilisation with the pod on it. Ties keep kube-scheduler's
    order (it rotates where it starts), so equal nodes share the load.
    """
    sign = -1.0 if binpack else 1.0
    order = {name: i for i, name in enumerate(feasible)}
    kept = heapq.nsmallest(keep, feasible, key=lambda n: (sign * cache[n][2], order[n]))
    kept.sort(key=order.__getitem__)
    return kept


def _mig_on_demand(inventory: ann.NodeInventory) -> bool:
    return any(d.mig_dynamic is not None for d in inventory.devices)


class Placement:
    """The index the filter keeps over the ledger: nodes grouped by (capacity shape, committed
    totals), since nodes of one group rank alike under the node policy, and each node's
    :class:`CardSummary`. Not thread-safe: its owner serialises calls."""

    def __init__(self, ledger: Ledger, filter_keep: int) -> None:
        if filter_keep < 1:
            raise ValueError(f"filter_keep must be at least 1, got {filter_keep}")
        self.ledger = ledger
        self.filter_keep = filter_keep
        self._groups: dict[tuple[Shape, tuple[int, int]], set[str]] = {}
        self._group_of: dict[str, tuple[Shape, tuple[int, int]]] = {}
        self._regroup: set[str] = set()  # nodes whose inventory changed since the last regrouping
        # node -> (ledger node version, inventory, what its cards can still take)
        self._summaries: dict[str, tuple[int, ann.NodeInventory, CardSummary]] = {}

    def node_changed(self, name: str, gone: bool = False) -> None:
        """The node's inventory changed (or, with ``gone``, the node is no more)."""
        self._regroup.add(name)
        if gone:
            self._summaries.pop(name, None)

    def in_policy_order(
        self,
        request: PodRequest,
        c: ContainerRequest,
        node_names: list[str],
        binpack: bool,
        lookup: Lookup,
        problem: Problem,
        cache: Cache,
        plans: dict[str, Plan] | None = None,
        gpu_policy: str = SPREAD,
    ) -> list[str] | None:
        """The nodes :meth:`every_node` keeps, found by fitting only the best candidates.

        For a pod whose vGPUs are all in one container ``c`` and that holds nothing yet. A node's
        utilisation with the pod on it depends only on its capacity shape and the ledger's totals
        for it, so it is worked out once per group of nodes alike in both, not per node. Groups are
        visited best first by the node policy; within equal utilisation, nodes in the order given;
        the first ``filter_keep`` that fit are the answer: exactly the full scan's choice. A node is
        turned away by its :class:`CardSummary` when that shows it cannot take ``c``, before any
        card is looked at. None when fewer than ``filter_keep`` nodes fit: then the full scan runs,
        for every node's reason.

        With ``plans``, each candidate is fitted with :func:`~vgpu.core.fit.fit_node` (the card
        chosen by ``gpu_policy``) instead of checked with :func:`~vgpu.core.capacity.quick_fits`,
        and the kept nodes' plans are left there: filter then assumes the plan without a second
        fit. On a node with MIG cut on demand the quick check stands (it turns such a node away,
        as the full scan's quick check does before its own fit).
        """
        self._refresh_groups(lookup)
        ranked: dict[float, list[set[str]]] = {}
        for (group_shape, totals), members in self._groups.items():
            ranked.setdefault(group_utilization(group_shape, totals, c), []).append(members)
        position: dict[str, int] | None = None
        kept: list[tuple[int, str]] = []
        for util in sorted(ranked, reverse=binpack):
            groups = ranked[util]
            members = groups[0] if len(groups) == 1 else set().union(*groups)
            candidates: Iterable[tuple[int, str]]
            if len(members) * 4 >= len(node_names):
                # a large group (on an idle cluster, every node): walk the names in order, stopping
                # at the first that fits, rather than sorting where each member was asked
                candidates = ((i, n) for i, n in enumerate(node_names) if n in members)
            else:
                if position is None:
                    position = dict(zip(node_names, range(len(node_names)), strict=True))
                found = position.keys() & members
                candidates = ((i, node_names[i]) for i in sorted(map(position.__getitem__, found)))
            for i, name in candidates:
                if name in cache:
                    continue  # named twice in the request: kept once
                if problem(name) is not None:
                    continue
                found_node = lookup(name)
                assert found_node is not None
                inventory = found_node[0].offering(request.resource)
                version = self.ledger.node_version(name)
                usage = self.ledger.usage(name)
                if not may_fit(self._summary(name, inventory, version, usage), c):
                    continue
                if plans is not None and not _mig_on_demand(inventory):
                    outcome = fit_node(name, inventory, usage, request, gpu_policy)
                    if not isinstance(outcome, Plan):
                        continue
                    plans[name] = outcome
                elif not quick_fits(inventory, usage, c, request.selection):
                    continue
                kept.append((i, name))
                cache[name] = (version, inventory, util)
                if len(kept) == self.filter_keep:
                    kept.sort()
                    return [name for _, name in kept]
        return None

    def every_node(
        self,
        request: PodRequest,
        uid: str | None,
        node_names: list[str],
        binpack: bool,
        gpu_policy: str,
        lookup: Lookup,
        problem: Problem,
        cache: Cache,
    ) -> FilterResult:
        """Fit the pod on every node (with each one's reason), then keep the best."""
        result = FilterResult()
        single = request.single_container
        for name in node_names:
            why = problem(name)
            if why is not None:
                result.unresolvable[name] = for_nodes(why)
                continue
            found = lookup(name)
            assert found is not None
            inventory = found[0].offering(request.resource)
            usage = self.ledger.usage(name, excluding=uid)
            if single is not None and quick_fits(inventory, usage, single, request.selection):
                result.nodes.append(name)
                util = quick_utilization(inventory, usage, single)
                cache[name] = (self.ledger.node_version(name), inventory, util)
                continue
            outcome = fit_node(name, inventory, usage, request, gpu_policy, decide=False)
            if isinstance(outcome, Plan):
                result.nodes.append(name)
                util = utilization(inventory, usage, outcome.footprint)
                cache[name] = (self.ledger.node_version(name), inventory, util)
            elif outcome.unresolvable:
                result.unresolvable[name] = for_nodes(outcome.reason)
            else:
                result.failed[name] = for_nodes(outcome.reason)
        result.failed = one_free_figure(result.failed)
        if len(result.nodes) > self.filter_keep:
            result.nodes = best(result.nodes, binpack, self.filter_keep, cache)
        return result

    def utilizations(
        self,
        request: PodRequest,
        uid: str | None,
        node_names: list[str],
        gpu_policy: str,
        lookup: Lookup,
        problem: Problem,
        cached: Cache,
    ) -> dict[str, float]:
        """Each usable node's utilisation with the pod on it (prioritize), reusing filter's ``cached``."""
        util: dict[str, float] = {}
        for name in node_names:
            found = lookup(name)
            if found is None or problem(name):
                continue
            inventory = found[0].offering(request.resource)
            hit = cached.get(name)
            if hit is not None and hit[0] == self.ledger.node_version(name) and hit[1] is inventory:
                util[name] = hit[2]
                continue
            usage = self.ledger.usage(name, excluding=uid)
            if request.single_container is not None:
                util[name] = quick_utilization(inventory, usage, request.single_container)
                continue
            outcome = fit_node(name, inventory, usage, request, gpu_policy, decide=False)
            if isinstance(outcome, Plan):
                util[name] = utilization(inventory, usage, outcome.footprint)
        return util

    def _refresh_groups(self, lookup: Lookup) -> None:
        """Move the nodes whose totals or inventory changed to their group."""
        changed = self.ledger.take_changed()
        if self._regroup:
            changed |= self._regroup
            self._regroup = set()
        for name in changed:
            old = self._group_of.pop(name, None)
            if old is not None:
                members = self._groups[old]
                members.discard(name)
                if not members:
                    del self._groups[old]
            found = lookup(name)
            if found is None:
                continue
            key = (found[1], self.ledger.totals(name))
            self._groups.setdefault(key, set()).add(name)
            self._group_of[name] = key

    def _summary(
        self, name: str, inventory: ann.NodeInventory, version: int, usage: Mapping[str, Usage]
    ) -> CardSummary:
        """The node's :class:`CardSummary`, recomputed only when its ledger entry or inventory changed."""
        hit = self._summaries.get(name)
        if hit is not None and hit[0] == version and hit[1] is inventory:
            return hit[2]
        summary = card_summary(inventory, usage)
        self._summaries[name] = (version, inventory, summary)
        return summary
