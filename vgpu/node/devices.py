"""The node's cards as kubelet and the scheduler see them, with health that changes over time.

Each card is advertised to kubelet as ``split`` device IDs ``<uuid>::<n>``; the inventory of
contract 2 (docs/contracts.md) carries the card with the node's memory and core scaling applied.

Under ``migStrategy`` single or mixed a card in MIG mode is not offered itself: each of its MIG
devices is, whole (one device ID ``MIG-<uuid>::0``, split 1, its own memory, 100 % of its cores),
as ``nvidia.com/gpu`` (single) or ``nvidia.com/mig-<profile>`` (mixed, one kubelet resource per
profile: ``resources``), and the inventory says where it sits (``Device.mig``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from vgpu.core.annotations import (
    GPU_RESOURCE,
    SHARING_MPS,
    SHARING_TIMESLICE,
    Device,
    MigDynamic,
    MigSlice,
    NodeInventory,
)
from vgpu.core.mig import resource_for
from vgpu.node.config import NodeConfig
from vgpu.node.discovery import Card, Discovery
from vgpu.node.mig import MigDevice

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
ID_SEPARATOR = "::"
MAX_INSTANCES = 7  # MIG instances on one card (seven compute slices)


class KubeletDevice(NamedTuple):
    """One device ID as ListAndWatch sends it (vgpu/deviceplugin/server.py makes the message)."""

    ID: str
    health: str  # HEALTHY or UNHEALTHY
    numa: int  # the card's NUMA node; -1: unknown


def device_id(uuid: str, n: int) -> str:
    return f"{uuid}{ID_SEPARATOR}{n}"


def card_of(device_id: str) -> str:
    """The card UUID a kubelet device ID belongs to."""
    return device_id.rsplit(ID_SEPARATOR, 1)[0]


def prefer(available: list[str], must: list[str], size: int, wanted: list[str] | None = None) -> list[str]:
    """IDs on distinct cards (each vGPU of a container on its own card), the must-haves first.

    Then IDs on the ``wanted`` cards (those the scheduler gave the container kubelet is about
    to start), so the IDs kubelet records, and reports through its pod-resources API, name
    the cards the container really uses. Then cards with the most free IDs.
    """
    chosen = list(must)
    cards = {card_of(i) for i in chosen}
    free: dict[str, list[str]] = {}
    for i in available:
        free.setdefault(card_of(i), []).append(i)
    for card in wanted or []:
        if len(chosen) >= size or card in cards:
            continue
        pick = next((i for i in free.get(card, []) if i not in chosen), None)
        if pick is not None:
            chosen.append(pick)
            cards.add(card)
    for card, ids in sorted(free.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if len(chosen) >= size:
            break
        if card in cards:
            continue
        pick = next((i for i in ids if i not in chosen), None)
        if pick is not None:
            chosen.append(pick)
            cards.add(card)
    # Fewer cards than asked for: fill from any card rather than give kubelet too few.
    for i in available:
        if len(chosen) >= size:
            break
        if i not in chosen:
            chosen.append(i)
    return chosen[:size] if size > 0 else chosen


class DeviceState:
    """Cards, config and health; ``version`` grows on every change and waiters are woken."""

    def __init__(
        self, cards: list[Card], config: NodeConfig, migs: Mapping[str, Sequence[MigDevice]] | None = None
    ) -> None:
        """``migs``: the MIG devices of each card in MIG mode (by the card's uuid): offered under
        ``migStrategy`` single or mixed; under ``none`` such a card is not offered at all."""
        self.config = config
        self._mig: dict[str, MigDevice] = {}  # a MIG device offered, by its uuid
        self._children: dict[str, list[str]] = {}  # a card in MIG mode -> its MIG devices' uuids
        # cards in MIG mode that migStrategy none leaves out: CUDA cannot use such a card whole
        self.unoffered = sorted(migs or {}) if config.mig_strategy == "none" else []
        if self.unoffered:
            log.error(
                "card(s) %s in MIG mode are not offered: migStrategy none offers whole cards, which CUDA "
                "cannot use in MIG mode. Set migStrategy single or mixed (cards partitioned beforehand) "
                "or dynamic (cut on demand), or turn MIG off on them (nvidia-smi -i <index> -mig 0, "
                "then a GPU reset); docs/mig.md",
                ", ".join(self.unoffered),
            )
            cards = [c for c in cards if c.uuid not in self.unoffered]
        cards = self._offer_migs(cards, migs or {}) if config.mig_strategy != "none" else cards
        self._cards = {c.uuid: c for c in cards}
        self._order = [c.uuid for c in cards]
        self._cond = threading.Condition()
        self.version = 0
        # why the node's cards are not offered at all (one mode per node: a DRA node), or None
        self.withheld: str | None = None
        # migStrategy: dynamic: a card cut on demand, as the inventory lists it (migdynamic.py)
        self.mig_dynamic: Callable[[str], MigDynamic | None] = lambda _uuid: None
        self.mig_problem = self._single_problem(cards, migs or {})
        if self.mig_problem:
            log.error("%s", self.mig_problem)
            self.withheld = self.mig_problem

    def _offer_migs(self, cards: list[Card], migs: Mapping[str, Sequence[MigDevice]]) -> list[Card]:
        """Each card in MIG mode replaced by its MIG devices, as cards of their own."""
        out: list[Card] = []
        for c in cards:
            devices = migs.get(c.uuid)
            if devices is None:
                out.append(c)
                continue
            self._children[c.uuid] = [d.uuid for d in devices]
            for d in devices:
                self._mig[d.uuid] = d
                out.append(
                    replace(
                        c, uuid=d.uuid, model=f"{c.model} MIG {d.profile}", memory_mib=d.memory_mib, links={}
                    )
                )
        return out

    def _single_problem(self, cards: list[Card], migs: Mapping[str, Sequence[MigDevice]]) -> str | None:
        """Why ``migStrategy: single`` cannot offer this node's cards (as NVIDIA's plugin refuses
        them): cards in MIG mode beside cards that are not, or MIG devices of two profiles."""
        if self.config.mig_strategy != "single" or not migs:
            return None
        profiles = sorted({d.profile for devs in migs.values() for d in devs})
        whole = [c.uuid for c in cards if c.uuid not in self._mig]
        if len(profiles) > 1 or whole:
            found = f"MIG devices of profiles {', '.join(profiles)}" if len(profiles) > 1 else ""
            found += (" and " if found else "") + (
                f"cards not in MIG mode ({', '.join(whole)})" if whole else ""
            )
            return (
                f"migStrategy single needs every card in MIG mode with MIG devices of one profile, but this "
                f"node has {found}: no card is offered. Re-partition the cards to one profile, or set "
                f"migStrategy: mixed (docs/mig.md)"
            )
        return None

    def mig_device(self, uuid: str) -> MigDevice | None:
        """The MIG device offered as ``uuid``; None for a whole card."""
        return self._mig.get(uuid)

    def kubelet_resource(self, uuid: str) -> str:
        """The kubelet resource a card or MIG device is offered as."""
        d = self._mig.get(uuid)
        if d is None or self.config.mig_strategy != "mixed":
            return self.config.resource_name
        return resource_for(d.profile)

    def resources(self) -> list[str]:
        """Every kubelet resource the node offers: the node config's ``resourceName`` first (always
        registered, as before), then one per MIG profile under ``migStrategy: mixed``."""
        others = {self.kubelet_resource(u) for u in self._mig} - {self.config.resource_name}
        return [self.config.resource_name, *sorted(others)]

    def cards(self) -> list[Card]:
        with self._cond:
            return [self._cards[u] for u in self._order]

    def card(self, uuid: str) -> Card | None:
        with self._cond:
            return self._cards.get(uuid)

    def set_health(self, uuid: str, healthy: bool) -> bool:
        """Record a card's health (a card in MIG mode: its MIG devices'); returns whether it changed."""
        with self._cond:
            changed = False
            for u in self._children.get(uuid, [uuid]):
                card = self._cards.get(u)
                if card is None or card.healthy == healthy:
                    continue
                self._cards[u] = replace(card, healthy=healthy)
                changed = True
            if changed:
                self.version += 1
                self._cond.notify_all()
            return changed

    def wait_change(self, seen: int, timeout_s: float) -> int:
        """Block until ``version`` differs from ``seen`` or the timeout passes; returns the version."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != seen, timeout_s)
            return self.version

    def withhold(self, reason: str | None) -> bool:
        """Offer no card (``reason``: why) or, with None, every card again; returns whether it changed.

        Withheld, kubelet is told of no device and the inventory lists none, so neither kubelet
        nor the extender can hand out a card another path (DRA) books.
        """
        reason = reason or self.mig_problem  # a node single cannot offer stays withheld
        with self._cond:
            if reason == self.withheld:
                return False
            self.withheld = reason
            self.version += 1
            self._cond.notify_all()
            return True

    def kick(self) -> None:
        """Wake every waiter (used on shutdown)."""
        with self._cond:
            self.version += 1
            self._cond.notify_all()

    def kubelet_devices(self, resource: str | None = None) -> list[KubeletDevice]:
        """The device IDs of ``resource`` (default: the node config's ``resourceName``)."""
        out: list[KubeletDevice] = []
        if self.withheld is not None:
            return out
        resource = resource or self.config.resource_name
        for card in self.cards():
            if self.kubelet_resource(card.uuid) != resource:
                continue
            for n in range(1 if card.uuid in self._mig else self.config.split):
                out.append(
                    KubeletDevice(device_id(card.uuid, n), HEALTHY if card.healthy else UNHEALTHY, card.numa)
                )
        return out

    def offered(self, c: Card) -> Device:
        """The card as it is offered to vGPUs: the node config's scaling and split applied (a MIG
        device whole, as it is)."""
        cfg = self.config
        m = self._mig.get(c.uuid)
        if m is not None:
            return Device(
                uuid=c.uuid,
                index=c.index,
                model=c.model,
                memory_mib=c.memory_mib,
                cores=100,
                split=1,
                numa=c.numa,
                healthy=c.healthy,
                resource=resource_for(m.profile) if cfg.mig_strategy == "mixed" else GPU_RESOURCE,
                mig=MigSlice(m.parent, m.profile, m.placement.start, m.placement.size),
            )
        dynamic = self.mig_dynamic(c.uuid)
        return Device(
            uuid=c.uuid,
            index=c.index,
            model=c.model,
            memory_mib=int(c.memory_mib * cfg.device_memory_scaling),
            cores=int(100 * cfg.device_core_scaling),
            split=cfg.split if dynamic is None else min(cfg.split, MAX_INSTANCES),
            numa=c.numa,
            healthy=c.healthy,
            links=dict(c.links),
            mig_dynamic=dynamic,
            sharing=SHARING_MPS if cfg.sharing_mode == "mps" and dynamic is None else SHARING_TIMESLICE,
        )

    def inventory(self) -> NodeInventory:
        return NodeInventory(devices=tuple(self.offered(c) for c in self.cards() if self.withheld is None))


def watch_health(discovery: Discovery, state: DeviceState, stop: threading.Event) -> None:
    """Until ``stop`` is set, apply discovery's health events to ``state`` (a thread's body)."""
    while not stop.is_set():
        for event in discovery.wait_health_events(1.0):
            if state.set_health(event.uuid, event.healthy):
                log.warning(
                    "card %s is now %s: %s",
                    event.uuid,
                    "healthy" if event.healthy else "unhealthy",
                    event.reason,
                )
