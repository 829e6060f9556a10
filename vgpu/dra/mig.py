"""MIG on the DRA path at run time (``vgpu dra-plugin --mig dynamic``): the cards offered as
partitionable devices (vgpu/dra/migslices.py), their GPU instances made when a claim is prepared,
destroyed when it is unprepared, and reclaimed when no prepared claim names them.

A card in MIG mode on such a node belongs to the driver: every GPU instance on it is either held
by a prepared claim (the checkpoint names it, :class:`Held`) or reclaimed. The card itself keeps
the instances across a restart of the plugin, so the state is the card's and the checkpoint's,
never the plugin's memory:

- prepare finds the claim's placement on the card: an instance of that profile already there that
  no other claim holds (one made before a crash, before the checkpoint was written) is used, else
  one is made; a claim's instances are made all or none;
- unprepare destroys the claim's instances first and forgets the claim after: an instance a
  process is still on (NVML's IN_USE) fails the call, and the kubelet calls again;
- :meth:`MigNode.reconcile` (at start, and before each look at the slices) destroys every
  instance no prepared claim holds; one still in use is left, and the placements it overlaps are
  not offered until it is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vgpu.core.errors import VgpuError
from vgpu.core.mig import MigError, MigTable
from vgpu.dra.claims import ClaimError
from vgpu.dra.migslices import MigSlot, slots
from vgpu.node.discovery import Card
from vgpu.node.mig import IN_USE, NOT_FOUND, NOT_SUPPORTED, MigControl, MigDevice, MigRefused, mig_layout

log = logging.getLogger(__name__)

MIG_MODES = ("off", "dynamic")


@dataclass(frozen=True)
class Held:
    """A GPU instance a prepared claim holds, as its checkpoint entry keeps it."""

    parent: str
    gpu_instance: int
    uuid: str
    device: str
    profile: str
    start: int

    def as_json(self) -> dict[str, Any]:
        return {
            "parent": self.parent,
            "gpuInstance": self.gpu_instance,
            "uuid": self.uuid,
            "device": self.device,
            "profile": self.profile,
            "start": self.start,
        }

    @staticmethod
    def from_json(doc: Any) -> Held | None:
        try:
            return Held(
                str(doc["parent"]),
                int(doc["gpuInstance"]),
                str(doc["uuid"]),
                str(doc["device"]),
                str(doc["profile"]),
                int(doc["start"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


def held_of(entries: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int], str]:
    """{(card uuid, GI id): claim uid} of checkpoint entries (each with its ``uid``)."""
    out: dict[tuple[str, int], str] = {}
    for entry in entries:
        for doc in entry.get("mig") or []:
            h = Held.from_json(doc)
            if h is not None:
                out[(h.parent, h.gpu_instance)] = str(entry.get("uid", ""))
    return out


@dataclass(frozen=True)
class MigView:
    """The node's MIG cards now: which cards are partitioned, what each offers, every slot."""

    partitioned: frozenset[str]  # uuids of the cards in MIG mode (not offered as shared cards)
    offered: tuple[tuple[Card, list[MigSlot]], ...]
    slots: Mapping[str, MigSlot]  # device name -> slot, every placement of every MIG card


def _why(err: MigRefused, slot: MigSlot) -> str:
    fix = {
        IN_USE: "a process holds the card outside MIG; the kubelet retries",
        NOT_FOUND: "the card is gone from the node",
    }.get(err.code, "the scheduler's allocation and the card disagree; the kubelet retries")
    where = f"{slot.profile.name} at slice {slot.placement.start} of {slot.card.uuid}"
    return f"cannot create MIG {where}: {err} ({fix})"


class MigNode:
    def __init__(self, control: MigControl) -> None:
        self.control = control

    def _in_mig_mode(self, parent: str) -> bool:
        try:
            return self.control.mode(parent).current
        except MigRefused:
            return False

    def _table(self, card: Card) -> MigTable | None:
        """The card's table when it is in MIG mode now; None for a card used whole."""
        try:
            mode = self.control.mode(card.uuid)
        except MigRefused:
            return None  # no MIG on this card
        if not mode.current:
            return None
        try:
            return self.control.table(card.uuid)
        except (MigRefused, MigError) as err:
            log.warning("card %s is in MIG mode but has no profile table here: %s", card.uuid, err)
            return None

    def view(self, cards: Iterable[Card], held: Collection[tuple[str, int]]) -> MigView:
        partitioned: set[str] = set()
        offered: list[tuple[Card, list[MigSlot]]] = []
        every: dict[str, MigSlot] = {}
        for card in cards:
            table = self._table(card)
            if table is None:
                continue
            partitioned.add(card.uuid)
            every.update((s.device, s) for s in slots(card, table))
            if not self.control.mode(card.uuid).enabled:
                offered.append((card, []))  # a mode change waits for a reset: nothing can be made
                continue
            try:
                instances = self.control.gpu_instances(card.uuid)
            except MigRefused as err:
                log.warning("cannot list the MIG instances of %s (%s): offering none of it", card.uuid, err)
                offered.append((card, []))
                continue
            foreign = [g.placement for g in instances if (card.uuid, g.id) not in held]
            offered.append((card, slots(card, table, foreign)))
        return MigView(frozenset(partitioned), tuple(offered), every)

    def take(
        self, wanted: list[MigSlot], held: Mapping[tuple[str, int], str], uid: str
    ) -> list[tuple[MigSlot, MigDevice]]:
        """The claim's instances, found or made, all or none; ClaimError naming the cause."""
        got: list[tuple[MigSlot, MigDevice]] = []
        made: list[MigDevice] = []
        try:
            for slot in wanted:
                try:
                    on_card = self.control.devices(slot.card.uuid)
                except MigRefused as err:
                    raise ClaimError(
                        f"node card {slot.card.uuid}", "", f"cannot list its MIG devices: {err}"
                    ) from err
                found = next(
                    (d for d in on_card if d.placement == slot.placement and d.profile == slot.profile.name),
                    None,
                )
                if found is not None:
                    owner = held.get((found.parent, found.gpu_instance))
                    if owner and owner != uid:
                        raise ClaimError(
                            f"node card {slot.card.uuid}",
                            "",
                            f"MIG {slot.profile.name} at {slot.placement.start} is held by claim {owner}",
                        )
                    if not owner and self.control.processes(found.uuid):
                        raise ClaimError(
                            f"node card {slot.card.uuid}",
                            "",
                            f"MIG {slot.profile.name} at {slot.placement.start} ({found.uuid}) has processes "
                            "no claim accounts for; the kubelet retries once they end",
                        )
                    got.append((slot, found))
                    continue
                try:
                    device = self.control.create(slot.card.uuid, slot.profile.name, slot.placement.start)
                except MigRefused as err:
                    raise ClaimError(f"node card {slot.card.uuid}", "", _why(err, slot)) from err
                made.append(device)
                got.append((slot, device))
                log.info(
                    "created MIG %s %s on %s for claim %s", slot.device, device.uuid, slot.card.uuid, uid
                )
        except BaseException:
            for device in made:
                self._destroy(device.parent, device.gpu_instance, quiet=True)
            raise
        return got

    def _destroy(self, parent: str, gpu_instance: int, quiet: bool = False) -> bool:
        """True when the GI is gone (or was); False when a process is on it."""
        try:
            self.control.destroy(parent, gpu_instance)
        except MigRefused as err:
            if err.code == NOT_FOUND or (err.code == NOT_SUPPORTED and not self._in_mig_mode(parent)):
                return True  # gone; or the card left MIG mode (a reset), which took its instances
            if quiet:
                log.warning("cannot destroy GPU instance %d of %s: %s", gpu_instance, parent, err)
                return False
            if err.code == IN_USE:
                return False
            raise
        return True

    def release(self, held: Iterable[Held], claim: str) -> None:
        """Destroy a claim's instances; ClaimError while a process is on one (the kubelet retries)."""
        try:
            busy = [h for h in held if not self._destroy(h.parent, h.gpu_instance)]
        except MigRefused as err:
            raise ClaimError(
                claim, "", f"cannot destroy its MIG instance: {err}; the kubelet retries"
            ) from err
        if busy:
            raise ClaimError(
                claim,
                "",
                "MIG device(s) "
                + ", ".join(f"{h.uuid} ({h.profile})" for h in busy)
                + " still have processes on them; unprepare is retried until they end",
            )

    def reconcile(self, cards: Iterable[Card], held: Collection[tuple[str, int]]) -> list[str]:
        """Destroy the instances no prepared claim holds on the node's MIG cards; what was reclaimed."""
        reclaimed: list[str] = []
        for card in cards:
            if self._table(card) is None:
                continue
            try:
                instances = self.control.gpu_instances(card.uuid)
            except MigRefused as err:
                log.warning("cannot list the MIG instances of %s: %s", card.uuid, err)
                continue
            for gi in instances:
                if (card.uuid, gi.id) in held:
                    continue
                if self._destroy(card.uuid, gi.id, quiet=True):
                    reclaimed.append(f"{card.uuid}/gi{gi.id} {gi.profile}@{gi.placement.start}")
                else:
                    log.warning(
                        "GPU instance %d (%s) of %s has processes but no claim: kept, not offered",
                        gi.id,
                        gi.profile,
                        card.uuid,
                    )
        if reclaimed:
            log.info("reclaimed MIG instances no prepared claim holds: %s", ", ".join(reclaimed))
        return reclaimed


def open_mig(discovery: object) -> MigControl:
    """The MIG interface of the node's discovery: the fake file's when it has one, else NVML's."""
    fake = getattr(discovery, "mig", None)
    if fake is not None:
        return fake  # type: ignore[no-any-return]
    if hasattr(discovery, "mig"):
        raise VgpuError("--mig dynamic: no card of the fake GPU file has a mig: section")
    from vgpu.node.mig import NvmlMig

    return NvmlMig()


def in_mig_mode(discovery: object, cards: list[str]) -> list[str]:
    """The cards in MIG mode now, which ``--mig off`` must not offer as shares (CUDA cannot use a
    card in MIG mode whole); logged once with the fix. None where MIG cannot be read."""
    try:
        control = getattr(discovery, "mig", None)
        if control is None and not hasattr(discovery, "mig"):  # real NVML; the fake without mig: has none
            from vgpu.node.mig import NvmlMig

            control = NvmlMig()
    except MigError as err:
        log.warning("cannot tell which cards are in MIG mode (%s); every card is offered", err)
        return []
    found = sorted(mig_layout(control, cards)) if control is not None else []
    if found:
        log.error(
            "card(s) %s in MIG mode are not offered: --mig off offers whole cards as shares, which CUDA "
            "cannot use in MIG mode. Run the plugin with --mig dynamic (the chart's dra.mig), or turn MIG "
            "off on them (nvidia-smi -i <index> -mig 0, then a GPU reset); docs/mig.md",
            ", ".join(found),
        )
    return found
