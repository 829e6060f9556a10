"""MIG (Multi-Instance GPU) profile tables as data, and the pure rules over them.

A card in MIG mode is cut into GPU instances (GIs). A GI of a profile takes ``compute_slices`` of
the card's 7 compute slices and ``memory_slices`` of its 8 memory slices, at one of the profile's
allowed placements: a start in memory slices, the size being the profile's memory slices. Two GIs
never overlap, and a profile has at most ``instances`` GIs on a card (one ``+me`` profile: the
card has one set of media extensions). A GI with one compute instance (CI) holding all of it is a
*MIG device*, which CUDA sees as a GPU of its own (``MIG-<uuid>``).

The tables are NVIDIA's published ones, taken as facts:

- names, fractions, media engines (NVDEC/NVJPG/OFA), copy engines, instance counts: the MIG
  user guide, "Supported MIG Profiles", tables "GPU Instance Profiles on H100" (H100 80GB, PCIe
  and SXM5) and "on H200" (H200 141GB)
  (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html, v580);
- profile ids and placements: the same guide's ``nvidia-smi mig -lgipp`` listing (Getting
  Started with MIG) and ``nvidia-smi mig -lgip`` on H100 80GB HBM3 (ID, memory GiB, SMs);
- the NVML profile constants: ``NVML_GPU_INSTANCE_PROFILE_*`` of nvml.h as pynvml mirrors them
  (1_SLICE 0, 2_SLICE 1, 3_SLICE 2, 4_SLICE 3, 7_SLICE 4, 1_SLICE_REV1 7 (``+me``),
  1_SLICE_REV2 9 (``1g.<2 slices>``)).

Two numbers name a profile in NVML: the constant above (``nvml_profile``, what
``nvmlDeviceGetGpuInstanceProfileInfo`` takes) and the id the driver gives back in that info
(``profile_id``, nvidia-smi's ``ID`` column, what ``nvmlDeviceCreateGpuInstanceWithPlacement``,
``nvmlDeviceGetGpuInstancePossiblePlacements`` and ``nvmlGpuInstanceInfo_t.profileId`` use).

Memory: ``memory_mib`` is what ``nvidia-smi mig -lgip`` gives for the H100 80GB (GiB with two
decimals, times 1024). For the H200 141GB the 1-slice, 2-slice and 7-slice figures are from its
``-lgip`` (16.00, 32.50, 140.00 GiB); the 4-slice figure (65.50 GiB) is derived as on the H100
(two 2-slice instances and the gap between them), since the guide gives only fractions. The
scheduler books what the table says; the node reports what the driver says.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vgpu.core.errors import VgpuError

COMPUTE_SLICES = 7  # of a full card (H100, H200)
MEMORY_SLICES = 8
RESOURCE_PREFIX = "nvidia.com/mig-"  # NVIDIA's mixed strategy: one resource per profile


class MigError(VgpuError):
    """A MIG question that has no answer: a card without a table, a profile no table has."""


@dataclass(frozen=True)
class Placement:
    """Where a GI sits: its first memory slice and how many it takes."""

    start: int
    size: int

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.size)

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size


@dataclass(frozen=True)
class Profile:
    """One GPU instance profile of a product."""

    name: str  # as users see it: "1g.10gb", "1g.10gb+me"
    nvml_profile: int  # NVML_GPU_INSTANCE_PROFILE_*
    profile_id: int  # the driver's id for it (nvidia-smi's ID column)
    compute_slices: int  # of COMPUTE_SLICES
    memory_slices: int  # of MEMORY_SLICES
    memory_mib: int
    sms: int
    copy_engines: int
    decoders: int  # NVDEC
    jpegs: int  # NVJPG
    ofas: int  # optical flow accelerators
    instances: int  # at most this many on one card
    starts: tuple[int, ...]  # the allowed placements' starts (size: memory_slices)

    @property
    def media_extensions(self) -> bool:
        return self.name.endswith("+me")

    @property
    def placements(self) -> tuple[Placement, ...]:
        return tuple(Placement(s, self.memory_slices) for s in self.starts)

    @property
    def resource(self) -> str:
        """The mixed strategy's resource name (a ``+`` is not allowed there: ``1g.10gb.me``)."""
        return resource_for(self.name)


@dataclass(frozen=True)
class MigTable:
    """The MIG profiles of one product."""

    product: str  # "H100 80GB"
    profiles: tuple[Profile, ...]

    def profile(self, name: str) -> Profile:
        for p in self.profiles:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.profiles)
        raise MigError(f"{self.product} has no MIG profile {name!r}; its profiles: {known}")

    def by_id(self, profile_id: int) -> Profile:
        for p in self.profiles:
            if p.profile_id == profile_id:
                return p
        raise MigError(f"{self.product} has no MIG profile with id {profile_id}")

    def has(self, name: str) -> bool:
        return any(p.name == name for p in self.profiles)


def _hopper(product: str, mem: tuple[int, int, int, int], names: tuple[str, ...]) -> MigTable:
    """H100 80GB and H200 141GB share SMs, engines, ids and placements; memory and names differ.
    ``mem``: MiB of a 1-, 2-, 4- and 8-memory-slice GI."""
    one, two, four, eight = mem
    rows = (
        # name, nvml constant, id, compute, memory slices, MiB, SMs, CE, dec, jpeg, ofa, count, starts
        (names[0], 0, 19, 1, 1, one, 16, 1, 1, 1, 0, 7, (0, 1, 2, 3, 4, 5, 6)),
        (names[1], 7, 20, 1, 1, one, 16, 1, 1, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        (names[2], 9, 15, 1, 2, two, 26, 1, 1, 1, 0, 4, (0, 2, 4, 6)),
        (names[3], 1, 14, 2, 2, two, 32, 2, 2, 2, 0, 3, (0, 2, 4)),
        (names[4], 2, 9, 3, 4, four, 60, 3, 3, 3, 0, 2, (0, 4)),
        (names[5], 3, 5, 4, 4, four, 64, 4, 4, 4, 0, 1, (0,)),
        (names[6], 4, 0, 7, 8, eight, 132, 8, 7, 7, 1, 1, (0,)),
    )
    return MigTable(product, tuple(Profile(*row) for row in rows))


H100_80GB = _hopper(
    "H100 80GB",
    (9984, 20096, 40448, 81152),  # 9.75, 19.62, 39.50, 79.25 GiB
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
)
H200_141GB = _hopper(
    "H200 141GB",
    (16384, 33280, 67072, 143360),  # 16.00, 32.50, 65.50 (derived), 140.00 GiB
    ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
)
TABLES = (H100_80GB, H200_141GB)


def table_for_model(model: str, memory_mib: int = 0) -> MigTable:
    """The table of a card by NVML's name for it ("NVIDIA H100 80GB HBM3", "NVIDIA H200",
    "NVIDIA H200 NVL"); ``memory_mib`` (when known) tells an H100 80GB from the 94/96 GB ones,
    whose profiles differ. Raises MigError naming the card for one without a table here."""
    upper = model.upper()
    if "H200" in upper:
        return H200_141GB
    if "H100" in upper and "NVL" not in upper and (memory_mib == 0 or memory_mib < 90_000):
        return H100_80GB
    products = ", ".join(t.product for t in TABLES)
    raise MigError(
        f"no MIG profile table for {model!r}"
        + (f" ({memory_mib} MiB)" if memory_mib else "")
        + f"; MIG is supported here on: {products}"
    )


def resource_for(profile: str) -> str:
    """``nvidia.com/mig-<profile>``, a ``+`` turned into ``.`` as NVIDIA's plugin does."""
    return RESOURCE_PREFIX + profile.replace("+", ".")


def profile_of_resource(resource: str) -> str | None:
    """The profile name a mixed-strategy resource asks for; None for another resource.
    The name is not checked against the tables here (``parse_pod`` refuses one no table has)."""
    if not resource.startswith(RESOURCE_PREFIX):
        return None
    rest = resource[len(RESOURCE_PREFIX) :]
    return rest[: -len(".me")] + "+me" if rest.endswith(".me") else rest


def mig_resources() -> tuple[str, ...]:
    """Every mixed-strategy resource a table here gives, sorted: what kube-scheduler must send
    the extender (its ``managedResources``) for a pod asking only for MIG devices."""
    return tuple(sorted({p.resource for t in TABLES for p in t.profiles}))


# --- the scheduler side's rules -------------------------------------------------------------


def occupied(placements: Iterable[Placement]) -> frozenset[int]:
    """The memory slices the given GIs take."""
    return frozenset(s for p in placements for s in p.slices)


def free_placements(
    table: MigTable, profile: str | Profile, existing: Iterable[tuple[str, Placement]]
) -> list[Placement]:
    """The placements of ``profile`` that a card holding ``existing`` GIs (profile name,
    placement) could take now: no overlap, and the profile's instance count not reached."""
    p = profile if isinstance(profile, Profile) else table.profile(profile)
    held = list(existing)
    if sum(1 for name, _ in held if name == p.name) >= p.instances:
        return []
    taken = occupied(pl for _, pl in held)
    return [pl for pl in p.placements if not taken.intersection(pl.slices)]


def room_after(table: MigTable, existing: list[tuple[str, Placement]]) -> tuple[int, ...]:
    """How many GIs of each profile, largest first, could still be placed one at a time on a
    card holding ``existing``: the measure ``best_placement`` keeps as high as it can."""
    order = sorted(table.profiles, key=lambda p: (-p.memory_slices, -p.compute_slices, p.name))
    return tuple(len(free_placements(table, p, existing)) for p in order)


def best_placement(
    table: MigTable, profile: str | Profile, existing: Iterable[tuple[str, Placement]]
) -> Placement | None:
    """Of the free placements of ``profile``, the one that keeps the largest profiles possible:
    the most room for the largest profile afterwards, then the next largest, and so on; a tie
    goes to the higher start (the driver's own habit, which keeps slice 0 for big GIs).
    None when no placement is free."""
    p = profile if isinstance(profile, Profile) else table.profile(profile)
    held = list(existing)
    free = free_placements(table, p, held)
    if not free:
        return None
    return max(free, key=lambda pl: (room_after(table, [*held, (p.name, pl)]), pl.start))
