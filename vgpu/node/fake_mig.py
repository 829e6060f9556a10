"""MIG on the fake GPU file's cards: :class:`FakeMig` answers every :class:`MigControl` call as
NVML on a real H100 80GB or H200 141GB would, from the profile tables (``vgpu/core/mig.py``),
refusals and their NVML codes included.

A card takes part with a ``mig:`` section in the fake GPU file (docs/device-plugin.md)::

    gpus:
      - uuid: GPU-...
        model: NVIDIA H100 80GB HBM3       # the table comes from the model (and memoryMiB)
        memoryMiB: 81559
        mig:
          mode: enabled                    # enabled | disabled | pending-enable | pending-disable
          instances:                       # the GIs (each with its one full CI) at first start
            - {profile: 1g.10gb, start: 0}
            - {profile: 3g.40gb, start: 4}
    migState: /var/lib/vgpu-fake/node-1.mig.json   # optional; default: <this file>.mig.json

The instances are the card's hardware state, so they live in the state file, not in the
plugin: a card absent from it is seeded from its ``mig:`` section, and from then on the file is
the truth (a restart of the plugin, or the DRA driver of the same node, sees what was made and
destroyed). Every read and change holds an exclusive ``flock`` on ``<state>.lock`` and every
change is written to a temporary file renamed into place, so two processes never see half a
change. Deleting the state file while nothing runs is the fake's GPU reset: the cards go back
to their ``mig:`` sections.

Refusals (``MigRefused`` with NVML's code): a card not in MIG mode or with a mode change
pending a reset (NOT_SUPPORTED); a placement start the profile does not allow (INVALID_ARGUMENT);
an occupied or overlapping placement, or the profile's instance count reached
(INSUFFICIENT_RESOURCES); creating on a card whose processes hold the card itself, outside any
MIG device (IN_USE; NVML allows making a GI beside busy ones, and so does the fake); destroying
a GI a process is on (IN_USE); a GI id the card does not have (NOT_FOUND).

Processes come from the fake file's ``processDir`` (the stub driver's per-process files, keyed
by the MIG device's uuid for a process on a slice, by the card's uuid or index otherwise).

GI ids follow the memory slices a GI takes (the whole card 0, a half 1 or 2, a quarter 3 to 6,
an eighth 7 to 14), capability minors follow ``mig-minors``' numbering
(:func:`vgpu.node.mig.formula_minor`), and a MIG device's uuid is new at each creation.
"""

from __future__ import annotations

import fcntl
import json
import uuid as uuidlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu.core.errors import ConfigError
from vgpu.core.mig import MigError, MigTable, Placement, free_placements, table_for_model
from vgpu.hookabi.files import write_atomic
from vgpu.node.discovery import Card, GpuProcess
from vgpu.node.mig import (
    IN_USE,
    INSUFFICIENT_RESOURCES,
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    GpuInstance,
    MigDevice,
    MigMode,
    MigRefused,
    formula_minor,
)

MODES = {
    "enabled": (True, True),
    "disabled": (False, False),
    "pending-enable": (False, True),
    "pending-disable": (True, False),
}
_NAMESPACE = uuidlib.UUID("6b1e0c0e-8a8f-4d0e-9a57-6d6967000000")


@dataclass(frozen=True)
class FakeMigSpec:
    """A card's ``mig:`` section: its mode and GIs at first start."""

    mode: str
    instances: tuple[tuple[str, int], ...]  # (profile, start)


def gi_id(placement: Placement) -> int:
    """The GI id of the memory slices a GI takes (the fake's numbering)."""
    first = {8: 0, 4: 1, 2: 3, 1: 7}.get(placement.size, 15)
    return first + placement.start // max(placement.size, 1)


def parse_mig_sections(doc: dict[str, Any], cards: list[Card], source: str) -> dict[str, FakeMigSpec]:
    """Each card's ``mig:`` section (by uuid), checked against its table; ConfigError naming
    the field. ``cards`` are in the file's order."""
    specs: dict[str, FakeMigSpec] = {}
    for i, item in enumerate(doc.get("gpus") or []):
        if not isinstance(item, dict) or "mig" not in item:
            continue
        path = f"gpus[{i}].mig"
        card = next(c for c in cards if c.uuid == item.get("uuid"))
        section = item["mig"]
        if not isinstance(section, dict):
            raise ConfigError(source, path, "must be a mapping with mode and instances")
        unknown = sorted(set(section) - {"mode", "instances"})
        if unknown:
            raise ConfigError(source, f"{path}.{unknown[0]}", "unknown key; known: instances, mode")
        try:
            table = table_for_model(card.model, card.memory_mib)
        except MigError as err:
            raise ConfigError(source, path, f"{err}; set gpus[{i}].model to such a card") from err
        mode = section.get("mode", "enabled")
        if mode not in MODES:
            raise ConfigError(source, f"{path}.mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
        raw = section.get("instances", []) or []
        if not isinstance(raw, list):
            raise ConfigError(source, f"{path}.instances", "must be a list of {profile, start}")
        held: list[tuple[str, Placement]] = []
        for j, inst in enumerate(raw):
            where = f"{path}.instances[{j}]"
            if not isinstance(inst, dict) or set(inst) - {"profile", "start"}:
                raise ConfigError(source, where, "must be a mapping {profile: NAME, start: SLICE}")
            name, start = inst.get("profile"), inst.get("start")
            if not isinstance(name, str) or not table.has(name):
                known = ", ".join(p.name for p in table.profiles)
                raise ConfigError(
                    source, f"{where}.profile", f"{table.product} profiles: {known}; got {name!r}"
                )
            profile = table.profile(name)
            if isinstance(start, bool) or not isinstance(start, int) or start not in profile.starts:
                raise ConfigError(
                    source, f"{where}.start", f"{name} starts at one of {list(profile.starts)}, got {start!r}"
                )
            place = Placement(start, profile.memory_slices)
            if place not in free_placements(table, profile, held):
                raise ConfigError(
                    source, where, f"{name} at {start} overlaps an instance above or exceeds its count"
                )
            held.append((name, place))
        if held and mode != "enabled" and mode != "pending-disable":
            raise ConfigError(source, f"{path}.instances", f"a card in mode {mode!r} has no instances")
        specs[card.uuid] = FakeMigSpec(mode, tuple((n, p.start) for n, p in held))
    return specs


def parse_state_path(doc: dict[str, Any], gpus_file: Path, source: str) -> Path:
    value = doc.get("migState")
    if value is None:
        return gpus_file.with_name(gpus_file.name + ".mig.json")
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(source, "migState", f"must be an absolute path, got {value!r}")
    return Path(value)


class FakeMig:
    """MigControl over the fake file's cards, state in ``state_path`` (see the module)."""

    def __init__(
        self,
        cards: list[Card],
        specs: dict[str, FakeMigSpec],
        state_path: Path,
        processes: Callable[[str], list[GpuProcess] | None] = lambda _: [],
    ) -> None:
        self._cards = {c.uuid: c for c in cards}
        self._specs = specs
        self.state_path = state_path
        self._processes = processes
        with self._state() as _:
            pass  # seed the state file now, so every process on the node sees one truth

    # --- the state file ------------------------------------------------------------------

    @contextmanager
    def _state(self) -> Iterator[dict[str, Any]]:
        """The cards' state under the lock; written back (atomically) when it changed."""
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.state_path.with_name(self.state_path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = json.loads(self.state_path.read_text())
                if not isinstance(state, dict) or not isinstance(state.get("cards"), dict):
                    raise ValueError("no cards")
            except (OSError, ValueError):
                state = {"version": 1, "cards": {}}
            before = json.dumps(state, sort_keys=True)
            for uuid, spec in self._specs.items():
                if uuid not in state["cards"]:
                    state["cards"][uuid] = self._seed(uuid, spec)
            yield state
            if json.dumps(state, sort_keys=True) != before:
                write_atomic(self.state_path, json.dumps(state, indent=1, sort_keys=True).encode(), 0o644)

    def _seed(self, uuid: str, spec: FakeMigSpec) -> dict[str, Any]:
        current, pending = MODES[spec.mode]
        card: dict[str, Any] = {"current": current, "pending": pending, "serial": 0, "instances": []}
        table = self.table(uuid)
        for name, start in spec.instances:
            self._add(
                card, uuid, table.profile(name).name, Placement(start, table.profile(name).memory_slices)
            )
        return card

    def _add(self, card: dict[str, Any], parent: str, profile: str, place: Placement) -> dict[str, Any]:
        card["serial"] = int(card.get("serial", 0)) + 1
        gi = gi_id(place)
        inst = {
            "gi": gi,
            "ci": 0,
            "profile": profile,
            "start": place.start,
            "size": place.size,
            "uuid": "MIG-" + str(uuidlib.uuid5(_NAMESPACE, f"{parent}/{gi}/0/{card['serial']}")),
        }
        card["instances"] = sorted([*card["instances"], inst], key=lambda x: x["gi"])
        return inst

    def _card(self, state: dict[str, Any], parent: str) -> dict[str, Any]:
        if parent not in self._cards:
            raise MigRefused(NOT_FOUND, f"no card {parent} in the fake GPU file")
        card = state["cards"].get(parent)
        if card is None:
            self.table(parent)  # a card without a table: NOT_SUPPORTED below
            return {"current": False, "pending": False, "serial": 0, "instances": []}
        return dict(card)

    # --- MigControl ----------------------------------------------------------------------

    def table(self, parent: str) -> MigTable:
        card = self._cards.get(parent)
        if card is None:
            raise MigRefused(NOT_FOUND, f"no card {parent} in the fake GPU file")
        try:
            return table_for_model(card.model, card.memory_mib)
        except MigError as err:
            raise MigRefused(NOT_SUPPORTED, str(err)) from err

    def mode(self, parent: str) -> MigMode:
        with self._state() as state:
            card = self._card(state, parent)
        return MigMode(bool(card["current"]), bool(card["pending"]))

    def _devices(self, parent: str, card: dict[str, Any]) -> list[MigDevice]:
        table = self.table(parent)
        index = self._cards[parent].minor if self._cards[parent].minor >= 0 else self._cards[parent].index
        return [
            MigDevice(
                uuid=inst["uuid"],
                parent=parent,
                parent_index=index,
                index=i,
                gpu_instance=inst["gi"],
                compute_instance=inst["ci"],
                profile=inst["profile"],
                memory_mib=table.profile(inst["profile"]).memory_mib,
                placement=Placement(inst["start"], inst["size"]),
                gi_minor=formula_minor(index, inst["gi"]),
                ci_minor=formula_minor(index, inst["gi"], inst["ci"]),
            )
            for i, inst in enumerate(card["instances"])
        ]

    def gpu_instances(self, parent: str) -> list[GpuInstance]:
        with self._state() as state:
            card = self._card(state, parent)
        table = self.table(parent)
        return [
            GpuInstance(
                parent,
                inst["gi"],
                inst["profile"],
                table.profile(inst["profile"]).profile_id,
                Placement(inst["start"], inst["size"]),
                (inst["ci"],),
            )
            for inst in card["instances"]
        ]

    def devices(self, parent: str) -> list[MigDevice]:
        with self._state() as state:
            card = self._card(state, parent)
        if not card["current"]:
            return []
        return self._devices(parent, card)

    def create(self, parent: str, profile: str, start: int) -> MigDevice:
        table = self.table(parent)
        with self._state() as state:
            card = self._card(state, parent)
            mode = MigMode(bool(card["current"]), bool(card["pending"]))
            if not mode.enabled:
                raise MigRefused(NOT_SUPPORTED, f"card {parent} MIG mode is {mode.describe()}")
            if not table.has(profile):
                raise MigRefused(INVALID_ARGUMENT, f"{table.product} has no profile {profile!r}")
            p = table.profile(profile)
            if start not in p.starts:
                raise MigRefused(
                    INVALID_ARGUMENT, f"{profile} cannot start at {start}; placements {list(p.starts)}"
                )
            busy = self._processes(parent)
            if busy:
                raise MigRefused(IN_USE, f"card {parent} has {len(busy)} process(es) on it")
            place = Placement(start, p.memory_slices)
            held = [(i["profile"], Placement(i["start"], i["size"])) for i in card["instances"]]
            if place not in free_placements(table, p, held):
                raise MigRefused(
                    INSUFFICIENT_RESOURCES,
                    f"{profile} at {start} overlaps a GPU instance or its count is reached",
                )
            inst = self._add(card, parent, p.name, place)
            state["cards"][parent] = card
            return next(d for d in self._devices(parent, card) if d.uuid == inst["uuid"])

    def destroy(self, parent: str, gpu_instance: int) -> None:
        with self._state() as state:
            card = self._card(state, parent)
            mode = MigMode(bool(card["current"]), bool(card["pending"]))
            if not mode.current:
                raise MigRefused(NOT_SUPPORTED, f"card {parent} MIG mode is {mode.describe()}")
            inst = next((i for i in card["instances"] if i["gi"] == gpu_instance), None)
            if inst is None:
                raise MigRefused(NOT_FOUND, f"card {parent} has no GPU instance {gpu_instance}")
            busy = self._processes(inst["uuid"])
            if busy:
                raise MigRefused(
                    IN_USE, f"GPU instance {gpu_instance} ({inst['uuid']}) has {len(busy)} process(es) on it"
                )
            card["instances"] = [i for i in card["instances"] if i["gi"] != gpu_instance]
            state["cards"][parent] = card

    def processes(self, device_uuid: str) -> list[GpuProcess] | None:
        return self._processes(device_uuid)
