"""The fit: can a node hold a pod's vGPUs, and on which cards? Pure functions, no I/O.

For one node, :func:`fit_node` searches an assignment of every container's vGPUs to cards such
that, on every card, what other pods committed plus this pod's footprint stays within memory,
cores and ``split``; each vGPU of one container on a different card; a vGPU asking 100 % of the
cores has its card alone; only healthy cards the pod's selection annotations accept.

The search is complete: cards are tried in the order the GPU policy prefers (and, for a container
taking several cards, sets on one NUMA node and joined by NVLink first), backtracking when a later
container does not fit, so a pod that fits the node is never rejected. A step budget bounds the
work on pathological pods; running out is reported as a rejection with that reason.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vgpu.core.annotations import Allocation, ContainerAllocation, Device, DeviceAllocation, NodeInventory
from vgpu.core.config import BINPACK
from vgpu.core.ledger import ZERO, Usage, footprint, vgpu_usage
from vgpu.core.migfit import fit_dynamic
from vgpu.core.requests import ContainerRequest, PodRequest
from vgpu.core.selection import Selection

MAX_COMBINATIONS = 256  # card sets tried per multi-vGPU container
DEFAULT_BUDGET = 20_000  # search steps per node


@dataclass(frozen=True)
class Plan:
    """Where a pod's vGPUs go on one node, and the per-card footprint that commits."""

    node: str
    allocation: Allocation
    footprint: dict[str, Usage]


@dataclass(frozen=True)
class Rejection:
    """Why a node cannot hold a pod; ``unresolvable`` when it could not even if it were empty.

    ``reason`` is a predicate with the node left out ("had no room now for container 'main', ..."):
    :func:`for_nodes` makes it kube-scheduler's per-node reason, which kube-scheduler prints after
    the count of nodes that gave it ("0/3 nodes are available: 3 node(s) had no room now for ...");
    a message about one node puts the node first ("node a had no room now for ...").

    No reason holds a ``%``: kube-scheduler passes its message to a printf-style event recorder as
    the format, where ``30%`` followed by a letter becomes ``30%!c(MISSING)``.
    """

    node: str
    reason: str
    unresolvable: bool = False


def for_nodes(predicate: str) -> str:
    """A reason as kube-scheduler shows it, after how many nodes gave it: ``node(s) had ...``.

    kube-scheduler's own reasons read the same way ("3 node(s) didn't match Pod's node affinity").
    """
    return "node(s) " + predicate


UNHEALTHY = "unhealthy"
INSUFFICIENT_MEMORY = "insufficient memory"
MOST_FREE = INSUFFICIENT_MEMORY + " (the most free: {} MiB)"  # one figure for all nodes: placement.py


@dataclass
class _Search:
    cards: Sequence[Device]
    usage: Mapping[str, Usage]
    selection: Selection
    binpack: bool
    budget: int
    steps: int = 0
    failure: str | None = None  # the search gave up (budget)
    failure_depth: int = -1
    shortfall: tuple[ContainerRequest, int, Counter[str]] | None = None  # at the deepest step
    chosen: dict[int, tuple[Device, ...]] = field(default_factory=dict)

    # -- one card -------------------------------------------------------------------------------
    def why_not(self, card: Device, fp: Usage, cur: Usage, add: Usage, count: int) -> str | None:
        if not card.healthy:
            return UNHEALTHY
        sel = self.selection.why_not_card(card, count)
        if sel is not None:
            return sel
        other = self.usage.get(card.uuid, ZERO)
        new_cur = cur + add
        new_fp = fp.max(new_cur)
        # the pod alone is more than the card, empty or not: no waiting helps on this card
        if new_fp.memory_mib > card.memory_mib:
            return _smaller(card)
        if new_fp.cores > card.cores:
            return _fewer_cores(card)
        if other.exclusive > 0 or (new_fp.exclusive > 0 and other.count > 0):
            return "held exclusively"
        if new_cur.exclusive > 0 and new_cur.count > 1:
            return "held exclusively"
        if other.count + new_fp.count > card.split:
            return "vGPU limit (split) reached"
        if other.memory_mib + new_fp.memory_mib > card.memory_mib:
            return INSUFFICIENT_MEMORY
        if other.cores + new_fp.cores > card.cores:
            return "insufficient cores"
        return None

    def load(self, card: Device, fp: Usage) -> float:
        """How full the card would be, 0..2: memory fraction plus vGPU-slot fraction."""
        u = self.usage.get(card.uuid, ZERO) + fp
        mem = u.memory_mib / card.memory_mib if card.memory_mib else 1.0
        return mem + u.count / card.split

    # -- the backtracking search ---------------------------------------------------------------
    def run(self, steps: list[_Step], i: int, fp: dict[str, Usage], cur: dict[str, Usage]) -> bool:
        if i == len(steps):
            return True
        self.steps += 1
        if self.steps > self.budget:
            self.failure = (
                self.failure or "gave up the placement search (the pod is too complex): simplify the request"
            )
            return False
        step = steps[i]
        if step.container is None:  # a phase ends: its usage folds into the footprint
            merged = {u: fp.get(u, ZERO).max(v) for u, v in cur.items()}
            nxt: dict[str, Usage] = {}
            for key, c in step.carried:  # sidecars already placed hold their cards in the next phase too
                for card in self.chosen[key]:
                    nxt[card.uuid] = nxt.get(card.uuid, ZERO) + vgpu_usage(
                        c.memory_on(card.memory_mib), c.cores
                    )
            return self.run(steps, i + 1, {**fp, **merged}, nxt)
        c = step.container
        for combo in self.candidates(c, fp, cur, i):
            new_cur = dict(cur)
            for card in combo:
                new_cur[card.uuid] = cur.get(card.uuid, ZERO) + vgpu_usage(
                    c.memory_on(card.memory_mib), c.cores
                )
            self.chosen[step.key] = combo
            if self.run(steps, i + 1, fp, new_cur):
                return True
            if self.steps > self.budget:
                return False
        self.chosen.pop(step.key, None)
        return False

    def candidates(
        self, c: ContainerRequest, fp: Mapping[str, Usage], cur: Mapping[str, Usage], depth: int
    ) -> list[tuple[Device, ...]]:
        eligible: list[tuple[float, Device]] = []
        reasons: Counter[str] = Counter()
        most_free = -1  # MiB, on one of the cards short of memory (other pods' bookings taken off)
        for card in self.cards:
            add = vgpu_usage(c.memory_on(card.memory_mib), c.cores)
            cfp, ccur = fp.get(card.uuid, ZERO), cur.get(card.uuid, ZERO)
            why = self.why_not(card, cfp, ccur, add, c.count)
            if why is None:
                after = cfp.max(ccur + add)
                eligible.append((self.load(card, after), card))
            else:
                reasons[why] += 1
                if why == INSUFFICIENT_MEMORY:
                    most_free = max(most_free, card.memory_mib - self.usage.get(card.uuid, ZERO).memory_mib)
        if len(eligible) < c.count and depth >= self.failure_depth:
            self.failure_depth = depth
            if most_free >= 0:  # how far off the request is: "insufficient memory (the most free: N MiB)"
                reasons[MOST_FREE.format(most_free)] = reasons.pop(INSUFFICIENT_MEMORY)
            self.shortfall = (c, len(eligible), reasons)
        eligible.sort(key=lambda x: (-x[0] if self.binpack else x[0], x[1].index))
        if c.count == 1:
            return [(card,) for _, card in eligible]
        if len(eligible) < c.count:
            return []
        scored = []
        pairs = _pairs(self.cards)
        for combo in itertools.islice(itertools.combinations(eligible, c.count), MAX_COMBINATIONS):
            cards = tuple(card for _, card in combo)
            load = sum(x for x, _ in combo)
            scored.append(((*_topology(cards, pairs), -load if self.binpack else load), cards))
        scored.sort(key=lambda x: x[0])
        return [cards for _, cards in scored]


_TOPOLOGY: dict[int, tuple[Sequence[Device], dict[tuple[str, str], tuple[int, int]]]] = {}


def _pairs(cards: Sequence[Device]) -> dict[tuple[str, str], tuple[int, int]]:
    """Per ordered card pair: (1 if joined by NVLink, 1 if on one NUMA node); cached per inventory."""
    cached = _TOPOLOGY.get(id(cards))
    if cached is not None and cached[0] is cards:
        return cached[1]
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for a, b in itertools.permutations(cards, 2):
        nvlink = any(x.links.get(y.uuid, "").lower().startswith("nvlink") for x, y in ((a, b), (b, a)))
        out[(a.uuid, b.uuid)] = (int(nvlink), int(a.numa >= 0 and a.numa == b.numa))
    if len(_TOPOLOGY) > 4096:
        _TOPOLOGY.clear()
    _TOPOLOGY[id(cards)] = (cards, out)  # holding ``cards`` keeps its id from being reused
    return out


def _topology(cards: Sequence[Device], pairs: Mapping[tuple[str, str], tuple[int, int]]) -> tuple[int, int]:
    """Sort key preferring card sets joined by NVLink, then on one NUMA node (smaller is better)."""
    nvlink = numa = 0
    for a, b in itertools.combinations(cards, 2):
        link, same = pairs[(a.uuid, b.uuid)]
        nvlink += link
        numa += same
    return (-nvlink, -numa)


def _smaller(card: Device) -> str:
    return f"smaller than asked ({card.memory_mib} MiB)"


def _fewer_cores(card: Device) -> str:
    return f"fewer cores than asked ({card.cores} percent)"


def _wanted(c: ContainerRequest) -> str:
    """What one container asks, to follow a verb: "container 'main', which needs ..."."""
    if c.memory_mib is not None:
        mem = f"{c.memory_mib} MiB"
    else:
        mem = f"{c.memory_percent} percent of a card's memory"
    cores = f" and {c.cores} percent of the cores" if c.cores else ""
    each = " each, one per card" if c.count > 1 else ""
    return f"container {c.name!r}, which needs {c.count} vGPU(s) of {mem}{cores}{each}"


_UUIDS_SHOWN = 8


def _cards_by_reason(reasons: Counter[str], cards: Sequence[Device]) -> str:
    """``4 card(s) insufficient memory (the most free: 21920 MiB), 1 card(s) unhealthy``, most first;
    where the selection by UUID ruled cards out, the node's UUIDs after it (the models are in the reasons)."""
    text = ", ".join(f"{n} card(s) {why}" for why, n in sorted(reasons.items(), key=lambda x: (-x[1], x[0])))
    if any("gpuuuid" in why for why in reasons):
        shown = ", ".join(card.uuid for card in cards[:_UUIDS_SHOWN])
        more = f" and {len(cards) - _UUIDS_SHOWN} more" if len(cards) > _UUIDS_SHOWN else ""
        text += f" (the node's cards: {shown}{more})"
    return text


def _never(card: Device, c: ContainerRequest, selection: Selection) -> str | None:
    """Why ``card`` could never take one vGPU of ``c``, were it empty; None when it could."""
    if not card.healthy:
        return UNHEALTHY
    sel = selection.why_not_card(card, c.count)
    if sel is not None:
        return sel
    if c.memory_on(card.memory_mib) > card.memory_mib:
        return _smaller(card)
    if c.cores > card.cores:
        return _fewer_cores(card)
    return None


def _static_shortfall(cards: Sequence[Device], pod: PodRequest) -> str | None:
    """The most decisive reason the node could never hold the pod, looking at one container at a
    time, or None: more vGPUs than the node has cards, else than it has cards able to take one."""
    for c in pod.containers:
        if c.count == 0:
            continue
        if c.count > len(cards):
            return f"had too few cards for {_wanted(c)}: the node has only {len(cards)} card(s)"
        reasons: Counter[str] = Counter()
        for card in cards:
            why = _never(card, c, pod.selection)
            if why is not None:
                reasons[why] += 1
        usable = len(cards) - sum(reasons.values())
        if usable < c.count:
            verb = (
                "had no card that can ever take"
                if usable == 0
                else f"had only {usable} card(s) that can ever take"
            )
            return f"{verb} {_wanted(c)}: {_cards_by_reason(reasons, cards)}"
    return None


def _search_shortfall(search: _Search, unresolvable: bool) -> str:
    """The reason the search failed: at its deepest step, the container short of cards."""
    if search.shortfall is None:  # the search ran out of budget before any step fell short
        return search.failure or "had no card that fits"
    c, eligible, reasons = search.shortfall
    cards = f"{eligible} card(s) fit; {_cards_by_reason(reasons, search.cards)}"
    if unresolvable:
        return f"could never hold {_wanted(c)} together with the pod's other vGPUs: {cards}"
    return f"had no room now for {_wanted(c)}: {cards}"


def fit_node(
    node: str,
    inventory: NodeInventory,
    usage: Mapping[str, Usage],
    pod: PodRequest,
    gpu_policy: str = BINPACK,
    budget: int = DEFAULT_BUDGET,
    fast: bool = True,
    decide: bool = True,
) -> Plan | Rejection:
    """Place ``pod`` on ``node`` given what other pods hold there (``usage``, per card uuid); MIG
    on demand: vgpu/core/migfit.py. ``decide=False`` (filter, prioritize: whether it fits, a plan
    to score) gives a container of several cards the policy's best cards without weighing
    NVLink/NUMA, as bind does. ``fast=False`` forces the general search (tests compare the two)."""
    policy = pod.gpu_policy or gpu_policy
    if not pod.wants_vgpu:
        return Plan(node, Allocation(node, ()), {})
    if any(d.mig_dynamic is not None for d in inventory.devices):
        out = fit_dynamic(node, inventory.devices, usage, pod)
        return Plan(node, *out.plan) if out.plan else Rejection(node, out.reason, out.unresolvable)
    single = pod.single_container if fast else None
    if single is not None:  # one container with vGPUs, no init containers: kept fast for 1,000 nodes
        binpack = policy == BINPACK
        eligible = _eligible(inventory.devices, usage, single, pod.selection, binpack)
        if len(eligible) >= single.count:
            if single.count == 1 or not decide:
                chosen = tuple(card for _, card in eligible[: single.count])
            else:
                chosen = _best_set(inventory.devices, eligible, single.count, binpack)
            devices = tuple(
                DeviceAllocation(c.uuid, single.memory_on(c.memory_mib), single.cores) for c in chosen
            )
            allocation = Allocation(node, (ContainerAllocation(single.name, devices),))
            return Plan(node, allocation, {d.uuid: vgpu_usage(d.memory_mib, d.cores) for d in devices})
        # not enough cards: the general search below finds the reason
    # the most decisive reason first: a node that could never hold a container, whatever it holds
    never = _static_shortfall(inventory.devices, pod)
    if never is not None:
        return Rejection(node, never, True)
    search = _Search(inventory.devices, usage, pod.selection, policy == BINPACK, budget)
    steps = _steps(pod)
    if not search.run(steps, 0, {}, {}):
        empty = _Search(inventory.devices, {}, pod.selection, True, budget)
        unresolvable = not empty.run(steps, 0, {}, {}) and empty.steps <= budget
        return Rejection(node, _search_shortfall(search, unresolvable), unresolvable)
    containers = []
    for k, c in enumerate(pod.containers):
        if c.count == 0:
            continue
        cards = search.chosen[k]
        devices = tuple(DeviceAllocation(card.uuid, c.memory_on(card.memory_mib), c.cores) for card in cards)
        containers.append(ContainerAllocation(c.name, devices))
    allocation = Allocation(node, tuple(containers))
    fp = plan_footprint(allocation, pod)
    if not fit_plan_within(inventory, usage, fp):  # defensive: the search and the footprint disagree
        return Rejection(node, "hit an internal error (a plan exceeds a card): please report this", False)
    return Plan(node, allocation, fp)


def _eligible(
    cards: Sequence[Device],
    usage: Mapping[str, Usage],
    c: ContainerRequest,
    selection: Selection,
    binpack: bool,
) -> list[tuple[float, Device]]:
    """Cards that can take one more vGPU of ``c``, with their load, in the policy's order.

    The same rules and the same order as the general search's first step.
    """
    out: list[tuple[float, Device]] = []
    exclusive = c.cores >= 100
    for card in cards:
        if not card.healthy or selection.rules_out(card, c.count):
            continue
        mem = c.memory_mib if c.memory_mib is not None else card.memory_mib * (c.memory_percent or 0) // 100
        o = usage.get(card.uuid)
        om, oc, on = (0, 0, 0) if o is None else (o[0], o[1], o[2])
        if o is not None and (o[3] > 0 or (exclusive and on > 0)):
            continue
        if on + 1 > card.split or om + mem > card.memory_mib or oc + c.cores > card.cores:
            continue
        out.append((((om + mem) / card.memory_mib if card.memory_mib else 1.0) + (on + 1) / card.split, card))
    out.sort(key=lambda x: (-x[0] if binpack else x[0], x[1].index))
    return out


def _best_set(
    cards: Sequence[Device], eligible: list[tuple[float, Device]], count: int, binpack: bool
) -> tuple[Device, ...]:
    """The card set the general search would try first: NVLink, then NUMA, then the policy."""
    pairs = _pairs(cards)
    best: tuple[tuple[int, int, float], tuple[Device, ...]] | None = None
    for combo in itertools.islice(itertools.combinations(eligible, count), MAX_COMBINATIONS):
        chosen = tuple(card for _, card in combo)
        load = sum(x for x, _ in combo)
        key = (*_topology(chosen, pairs), -load if binpack else load)
        if best is None or key < best[0]:
            best = (key, chosen)
    assert best is not None
    return best[1]


@dataclass(frozen=True)
class _Step:
    """Place one container (``key`` = its index in the pod), or, with no container, end a phase.

    ``carried`` are the sidecars (placed earlier) that also run during the phase that follows.
    """

    key: int = -1
    container: ContainerRequest | None = None
    carried: tuple[tuple[int, ContainerRequest], ...] = ()


def _steps(pod: PodRequest) -> list[_Step]:
    """The search order: the app phase first (with every sidecar), then each init container.

    Init containers come after so that they can reuse the cards the app containers took. A
    sidecar is placed once, in the app phase, and counted again in each init phase it runs in.
    """
    phases = pod.phases()
    order = [phases[-1], *phases[:-1]]
    index = {id(c): k for k, c in enumerate(pod.containers)}
    out: list[_Step] = []
    for n, phase in enumerate(order):
        if n > 0:
            carried = tuple((index[id(c)], c) for c in phase if c.sidecar)
            out.append(_Step(carried=carried))
        out.extend(_Step(index[id(c)], c) for c in phase if n == 0 or not c.sidecar)
    out.append(_Step())
    return out


def plan_footprint(allocation: Allocation, pod: PodRequest) -> dict[str, Usage]:
    return footprint(allocation, [[c.name for c in phase] for phase in pod.phases()])


def fit_plan_within(inventory: NodeInventory, usage: Mapping[str, Usage], fp: Mapping[str, Usage]) -> bool:
    """True when ``usage`` plus ``fp`` stays within every card (the invariant the ledger keeps)."""
    cards = {d.uuid: d for d in inventory.devices}
    for uuid in set(usage) | set(fp):
        card = cards.get(uuid)
        u = usage.get(uuid, ZERO) + fp.get(uuid, ZERO)
        if card is None:
            return u.empty
        if u.memory_mib > card.memory_mib or u.cores > card.cores or u.count > card.split:
            return False
    return True
