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

from vgpu.annotations import Allocation, ContainerAllocation, Device, DeviceAllocation, NodeInventory
from vgpu.config import BINPACK
from vgpu.ledger import ZERO, Usage, footprint, vgpu_usage
from vgpu.requests import ContainerRequest, PodRequest, Selection

MAX_COMBINATIONS = 256  # card sets tried per multi-vGPU container
DEFAULT_BUDGET = 20_000  # search steps per node


@dataclass(frozen=True)
class Plan:
    """Where a pod's vGPUs go on one node; ``utilization`` is the node's, after the plan (0..1)."""

    node: str
    allocation: Allocation
    footprint: dict[str, Usage]
    utilization: float


@dataclass(frozen=True)
class Rejection:
    """Why a node cannot hold a pod; ``unresolvable`` when it could not even if it were empty."""

    node: str
    reason: str
    unresolvable: bool = False


@dataclass
class _Search:
    cards: Sequence[Device]
    usage: Mapping[str, Usage]
    selection: Selection
    binpack: bool
    budget: int
    steps: int = 0
    failure: str | None = None
    failure_depth: int = -1
    chosen: dict[int, tuple[Device, ...]] = field(default_factory=dict)

    # -- one card -------------------------------------------------------------------------------
    def why_not(self, card: Device, fp: Usage, cur: Usage, add: Usage) -> str | None:
        if not card.healthy:
            return "unhealthy"
        sel = self.selection.why_not(card.uuid, card.model)
        if sel is not None:
            return "not selected"
        other = self.usage.get(card.uuid, ZERO)
        new_cur = cur + add
        new_fp = fp.max(new_cur)
        if other.exclusive > 0 or (new_fp.exclusive > 0 and other.count > 0):
            return "held exclusively"
        if new_cur.exclusive > 0 and new_cur.count > 1:
            return "held exclusively"
        if other.count + new_fp.count > card.split:
            return "vGPU limit (split) reached"
        if other.memory_mib + new_fp.memory_mib > card.memory_mib:
            return "insufficient memory"
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
            self.failure = self.failure or "placement search gave up (pod too complex); simplify the request"
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
        for card in self.cards:
            add = vgpu_usage(c.memory_on(card.memory_mib), c.cores)
            cfp, ccur = fp.get(card.uuid, ZERO), cur.get(card.uuid, ZERO)
            why = self.why_not(card, cfp, ccur, add)
            if why is None:
                after = cfp.max(ccur + add)
                eligible.append((self.load(card, after), card))
            else:
                reasons[why] += 1
        if len(eligible) < c.count and depth >= self.failure_depth:
            self.failure_depth = depth
            self.failure = _describe(c, len(eligible), reasons)
        eligible.sort(key=lambda x: (-x[0] if self.binpack else x[0], x[1].index))
        if c.count == 1:
            return [(card,) for _, card in eligible]
        if len(eligible) < c.count:
            return []
        scored = []
        for combo in itertools.islice(itertools.combinations(eligible, c.count), MAX_COMBINATIONS):
            cards = tuple(card for _, card in combo)
            load = sum(x for x, _ in combo)
            scored.append(((*_topology(cards), -load if self.binpack else load), cards))
        scored.sort(key=lambda x: x[0])
        return [cards for _, cards in scored]


def _topology(cards: Sequence[Device]) -> tuple[int, int]:
    """Sort key preferring card sets joined by NVLink, then on one NUMA node (smaller is better)."""
    nvlink = numa = 0
    for a, b in itertools.combinations(cards, 2):
        if a.links.get(b.uuid, "").lower().startswith("nvlink") or b.links.get(a.uuid, "").lower().startswith(
            "nvlink"
        ):
            nvlink += 1
        if a.numa >= 0 and a.numa == b.numa:
            numa += 1
    return (-nvlink, -numa)


def _describe(c: ContainerRequest, eligible: int, reasons: Counter[str]) -> str:
    mem = f"{c.memory_mib} MiB" if c.memory_mib is not None else f"{c.memory_percent}% of memory"
    want = f"container {c.name!r} needs {c.count} vGPU(s) of {mem}, {c.cores}% cores each"
    if not reasons:
        return f"{want}: the node has only {eligible} card(s)"
    parts = ", ".join(f"{n} card(s) {why}" for why, n in sorted(reasons.items(), key=lambda x: (-x[1], x[0])))
    return f"{want}: {eligible} card(s) fit; {parts}"


def fit_node(
    node: str,
    inventory: NodeInventory,
    usage: Mapping[str, Usage],
    pod: PodRequest,
    gpu_policy: str = BINPACK,
    budget: int = DEFAULT_BUDGET,
) -> Plan | Rejection:
    """Place ``pod`` on ``node`` given what other pods hold there (``usage``, per card uuid)."""
    policy = pod.gpu_policy or gpu_policy
    if not pod.wants_vgpu:
        return Plan(node, Allocation(node, ()), {}, _utilization(inventory, usage, {}))
    search = _Search(inventory.devices, usage, pod.selection, policy == BINPACK, budget)
    steps = _steps(pod)
    if not search.run(steps, 0, {}, {}):
        reason = search.failure or "no card fits"
        empty = _Search(inventory.devices, {}, pod.selection, True, budget)
        unresolvable = not empty.run(steps, 0, {}, {}) and empty.steps <= budget
        return Rejection(node, reason, unresolvable)
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
        return Rejection(node, "internal: plan exceeds a card; please report this", False)
    return Plan(node, allocation, fp, _utilization(inventory, usage, fp))


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


def _utilization(inventory: NodeInventory, usage: Mapping[str, Usage], fp: Mapping[str, Usage]) -> float:
    mem = slots = 0.0
    total_mem = total_slots = 0
    for card in inventory.devices:
        u = usage.get(card.uuid, ZERO) + fp.get(card.uuid, ZERO)
        mem += u.memory_mib
        slots += u.count
        total_mem += card.memory_mib
        total_slots += card.split
    if not total_mem or not total_slots:
        return 1.0
    return (mem / total_mem + slots / total_slots) / 2


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
