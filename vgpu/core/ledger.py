"""The ledger: what every card has committed (memory, cores, vGPUs), pod by pod.

A pod holds on each card the most it needs at any one time (see :mod:`vgpu.core.requests`: init
containers run before the app containers, so their capacity is reused). That per-card maximum is
the pod's *footprint*; the ledger adds footprints per card. It is a plain data structure, not
thread-safe: its owner serialises access.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from vgpu.core.annotations import Allocation, MigGrant


class Usage(NamedTuple):
    """What is committed on one card: memory (MiB), cores (percent), vGPUs, exclusive vGPUs among them.

    A NamedTuple rather than a dataclass: the fit builds millions of these at 1,000 nodes.
    """

    memory_mib: int = 0
    cores: int = 0
    count: int = 0  # type: ignore[assignment]  # shadows tuple.count, on purpose
    exclusive: int = 0

    def __add__(self, other: object) -> Usage:
        assert isinstance(other, Usage)
        return Usage(
            self[0] + other[0],
            self[1] + other[1],
            self[2] + other[2],
            self[3] + other[3],
        )

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self[0] - other[0], self[1] - other[1], self[2] - other[2], self[3] - other[3])

    def max(self, other: Usage) -> Usage:
        return Usage(
            self[0] if self[0] > other[0] else other[0],
            self[1] if self[1] > other[1] else other[1],
            self[2] if self[2] > other[2] else other[2],
            self[3] if self[3] > other[3] else other[3],
        )

    @property
    def empty(self) -> bool:
        return self.count == 0 and self.memory_mib == 0 and self.cores == 0


ZERO = Usage()
_EMPTY: dict[str, Usage] = {}
Footprint = Mapping[str, Usage]


def vgpu_usage(memory_mib: int, cores: int) -> Usage:
    """The usage of one vGPU; 100 cores or more means the card exclusively."""
    return Usage(memory_mib, cores, 1, 1 if cores >= 100 else 0)


# A MIG placement booked on a card cut on demand (vgpu/core/migfit.py) is a key of its own beside
# the card's: "<card uuid>/mig/<profile>@<start>", holding BOOKED (one pod alone), so the ledger
# books placements, not only memory, and a restart of the extender books them again.
MIG_KEY = "/mig/"
BOOKED = Usage(0, 0, 0, 1)


def mig_key(uuid: str, grant: MigGrant) -> str:
    return f"{uuid}{MIG_KEY}{grant.profile}@{grant.start}"


def parse_mig_key(key: str) -> tuple[str, str, int] | None:
    """(card uuid, profile, start) of a booking key; None for a card's own key."""
    if MIG_KEY not in key:
        return None
    uuid, _, rest = key.partition(MIG_KEY)
    profile, _, start = rest.rpartition("@")
    return (uuid, profile, int(start)) if start.isdigit() and profile else None


def footprint(allocation: Allocation, phases: Iterable[Iterable[str]] | None = None) -> dict[str, Usage]:
    """Per-card footprint of an allocation, given which containers run at the same time.

    ``phases`` lists groups of container names that hold their vGPUs together. Containers of the
    allocation that no phase names (or all of them, when ``phases`` is None) are counted as one
    more phase together, which is never less than the truth.
    """
    groups = [set(p) for p in phases] if phases is not None else []
    named = set().union(*groups) if groups else set()
    leftovers = {c.name for c in allocation.containers if c.name not in named}
    if leftovers:
        groups.append(leftovers)
    out: dict[str, Usage] = {}
    for group in groups:
        phase: dict[str, Usage] = {}
        for c in allocation.containers:
            if c.name in group:
                for d in c.devices:
                    phase[d.uuid] = phase.get(d.uuid, ZERO) + vgpu_usage(d.memory_mib, d.cores)
                    if d.mig is not None:
                        phase[mig_key(d.uuid, d.mig)] = BOOKED
        for uuid, u in phase.items():
            out[uuid] = out.get(uuid, ZERO).max(u)
    return out


class Ledger:
    """Committed capacity per node and card, keyed by pod UID."""

    def __init__(self) -> None:
        self._pods: dict[str, tuple[str, dict[str, Usage]]] = {}
        self._nodes: dict[str, dict[str, Usage]] = {}
        self.version = 0  # bumped on every change; lets readers cache what they derive
        self._node_versions: dict[str, int] = {}
        self._totals: dict[str, tuple[int, int]] = {}  # node -> (memory MiB, vGPUs) over its cards
        self._changed: set[str] = set()  # nodes whose totals changed since take_changed()

    def commit(self, uid: str, node: str, fp: Footprint) -> None:
        """Record (or replace) what pod ``uid`` holds on ``node``."""
        self.release(uid)
        cards = self._nodes.setdefault(node, {})
        mem, count = self._totals.get(node, (0, 0))
        for uuid, u in fp.items():
            cards[uuid] = cards.get(uuid, ZERO) + u
            mem += u[0]
            count += u[2]
        self._totals[node] = (mem, count)
        self._changed.add(node)
        self._pods[uid] = (node, dict(fp))
        self.version += 1
        self._node_versions[node] = self.version

    def release(self, uid: str) -> bool:
        """Forget pod ``uid``; True when it held something."""
        entry = self._pods.pop(uid, None)
        if entry is None:
            return False
        node, fp = entry
        cards = self._nodes[node]
        mem, count = self._totals[node]
        for uuid, u in fp.items():
            left = cards[uuid] - u
            mem -= u[0]
            count -= u[2]
            if left.empty:
                del cards[uuid]
            else:
                cards[uuid] = left
        if not cards:
            del self._nodes[node]
            del self._totals[node]
        else:
            self._totals[node] = (mem, count)
        self._changed.add(node)
        self.version += 1
        self._node_versions[node] = self.version
        return True

    def release_node(self, node: str) -> dict[str, Footprint]:
        """Forget every pod on ``node`` (its Node was deleted); what each held, by pod UID."""
        held: dict[str, Footprint] = {uid: fp for uid, (where, fp) in self._pods.items() if where == node}
        for uid in held:
            self.release(uid)
        return held

    def node_version(self, node: str) -> int:
        """Changes whenever what ``node`` holds changes: a key for caching per-node results."""
        return self._node_versions.get(node, 0)

    def totals(self, node: str) -> tuple[int, int]:
        """(memory MiB, vGPUs) committed on ``node`` over all its cards, kept as pods come and go."""
        return self._totals.get(node, (0, 0))

    def take_changed(self) -> set[str]:
        """The nodes whose :meth:`totals` changed since the last call (for an index kept over them)."""
        changed, self._changed = self._changed, set()
        return changed

    def node_of(self, uid: str) -> str | None:
        entry = self._pods.get(uid)
        return entry[0] if entry else None

    def usage(self, node: str, excluding: str | None = None) -> Mapping[str, Usage]:
        """Committed usage per card of ``node``, leaving out pod ``excluding`` (its own earlier plan).

        A read-only view, valid until the ledger next changes: no copy is made unless needed.
        """
        cards = self._nodes.get(node, _EMPTY)
        if excluding is not None:
            entry = self._pods.get(excluding)
            if entry is not None and entry[0] == node:
                cards = dict(cards)
                for uuid, u in entry[1].items():
                    cards[uuid] = cards[uuid] - u
        return cards

    def pods(self) -> dict[str, str]:
        """pod UID -> node."""
        return {uid: node for uid, (node, _) in self._pods.items()}

    def nodes(self) -> list[str]:
        return list(self._nodes)
