"""A narrow interface to a card's MIG state, and its implementation through NVML (pynvml).

:class:`MigControl` is what the node's parts ask of MIG: a card's mode, its GPU instances and
compute instances, its MIG devices, creating a GI at a placement with its one full CI, destroying
one, and the processes on a MIG device. Two backends satisfy it: :class:`NvmlMig` here (the real
cards) and :class:`vgpu.node.fake_mig.FakeMig` (cards of the fake GPU file, whose instances
persist in a state file as a card's do across a plugin restart).

Refusals are :class:`MigRefused` carrying NVML's own return code (``NVML_ERROR_*``, the numbers
of nvml.h, which pynvml mirrors), so callers tell a busy card from a full one without pynvml:

- ``IN_USE`` (19): a GI with processes on it, or a card whose processes forbid the change;
- ``INSUFFICIENT_RESOURCES`` (23): the placement overlaps a GI, or the profile's count is reached;
- ``INVALID_ARGUMENT`` (2): a placement the profile does not allow, an unknown profile;
- ``NOT_SUPPORTED`` (3): the card is not in MIG mode, or its mode waits for a reset;
- ``NOT_FOUND`` (6): no GI with that id.

Each GI and CI has a capability file under ``/dev/nvidia-caps`` that a container needs to use
the MIG device: its minor is in ``/proc/driver/nvidia-caps/mig-minors``
(``gpu<N>/gi<G>/access <minor>``, ``gpu<N>/gi<G>/ci<C>/access <minor>``); ``cap_minors`` reads it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vgpu.core.mig import MigError, MigTable, Placement, table_for_model
from vgpu.node.discovery import GpuProcess

log = logging.getLogger(__name__)

SUCCESS = 0
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NOT_FOUND = 6
IN_USE = 19
INSUFFICIENT_RESOURCES = 23
CODE_NAMES = {
    INVALID_ARGUMENT: "INVALID_ARGUMENT",
    NOT_SUPPORTED: "NOT_SUPPORTED",
    NOT_FOUND: "NOT_FOUND",
    IN_USE: "IN_USE",
    INSUFFICIENT_RESOURCES: "INSUFFICIENT_RESOURCES",
}
MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")


class MigRefused(Exception):
    """NVML refused a MIG call; ``code`` is its ``NVML_ERROR_*`` number."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{CODE_NAMES.get(code, f'NVML error {code}')}: {message}")


@dataclass(frozen=True)
class MigMode:
    """A card's MIG mode now and after its next reset."""

    current: bool
    pending: bool

    @property
    def enabled(self) -> bool:
        """In MIG mode with no change waiting: instances can be made."""
        return self.current and self.pending

    @property
    def pending_reset(self) -> bool:
        return self.current != self.pending

    def describe(self) -> str:
        now = "enabled" if self.current else "disabled"
        return now + (
            f" (pending {'enable' if self.pending else 'disable'} at the next reset)"
            if self.pending_reset
            else ""
        )


@dataclass(frozen=True)
class GpuInstance:
    """One GI of a card, with the ids of its CIs."""

    parent: str  # the card's uuid
    id: int
    profile: str  # "1g.10gb"
    profile_id: int
    placement: Placement
    compute_instances: tuple[int, ...] = ()


@dataclass(frozen=True)
class MigDevice:
    """A GI with one CI as CUDA sees it."""

    uuid: str  # "MIG-..."
    parent: str  # the card's uuid
    parent_index: int  # the card's NVML index (its minor where known)
    index: int  # nvmlDeviceGetMigDeviceHandleByIndex's index on the parent
    gpu_instance: int
    compute_instance: int
    profile: str
    memory_mib: int
    placement: Placement
    gi_minor: int = -1  # /dev/nvidia-caps/nvidia-cap<minor> of the GI's access file; -1: unknown
    ci_minor: int = -1  # ... of the CI's


class MigControl(Protocol):
    def mode(self, parent: str) -> MigMode:
        """The card's MIG mode; MigRefused(NOT_SUPPORTED) for a card without MIG."""
        ...

    def table(self, parent: str) -> MigTable:
        """The card's profile table; MigError for a card without one."""
        ...

    def gpu_instances(self, parent: str) -> list[GpuInstance]:
        """The card's GIs, by id."""
        ...

    def devices(self, parent: str) -> list[MigDevice]:
        """The card's MIG devices (GIs with a CI), by index."""
        ...

    def create(self, parent: str, profile: str, start: int) -> MigDevice:
        """A GI of ``profile`` at memory slice ``start`` and its one full CI; MigRefused."""
        ...

    def destroy(self, parent: str, gpu_instance: int) -> None:
        """The GI's CIs, then the GI; MigRefused(IN_USE) while a process is on it."""
        ...

    def processes(self, device_uuid: str) -> list[GpuProcess] | None:
        """The processes on one MIG device; None when it cannot be read."""
        ...


def mig_layout(control: MigControl, cards: list[str]) -> dict[str, list[MigDevice]]:
    """The MIG devices of each card in MIG mode now (by the card's uuid); cards without MIG, or
    whose MIG state cannot be read, are left out (and offered whole). A mode change waiting for
    a reset is logged: the card is offered as it is now."""
    found: dict[str, list[MigDevice]] = {}
    for uuid in cards:
        try:
            mode = control.mode(uuid)
        except (MigRefused, MigError):
            continue  # no MIG on this card
        if mode.pending_reset:
            log.warning("card %s: MIG mode is %s; offered as it is now", uuid, mode.describe())
        if not mode.current:
            continue
        try:
            found[uuid] = control.devices(uuid)
        except (MigRefused, MigError) as err:
            log.error(
                "card %s is in MIG mode but its MIG devices cannot be read (%s): not offered", uuid, err
            )
            found[uuid] = []
    return found


def parse_mig_minors(text: str) -> dict[tuple[int, int, int], int]:
    """``mig-minors`` as {(gpu, gi, ci): minor}; ci -1 for a GI's own access file."""
    found: dict[tuple[int, int, int], int] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) != 2 or not words[1].isdigit():
            continue
        parts = words[0].split("/")
        try:
            if len(parts) == 3 and parts[2] == "access":
                found[(int(parts[0].removeprefix("gpu")), int(parts[1].removeprefix("gi")), -1)] = int(
                    words[1]
                )
            elif len(parts) == 4 and parts[3] == "access":
                key = (
                    int(parts[0].removeprefix("gpu")),
                    int(parts[1].removeprefix("gi")),
                    int(parts[2].removeprefix("ci")),
                )
                found[key] = int(words[1])
        except ValueError:
            continue
    return found


def formula_minor(gpu: int, gpu_instance: int, compute_instance: int = -1) -> int:
    """The minor the driver gives a GI's (``compute_instance`` -1) or CI's access file: after
    ``config`` (1) and ``monitor`` (2), per card 15 GIs of one GI file and 8 CI files each, as
    ``mig-minors`` lists them. The fake uses it; the real one reads the file."""
    return 3 + gpu * 135 + gpu_instance * 9 + (compute_instance + 1)


def cap_minors(
    gpu: int, gpu_instance: int, compute_instance: int, path: Path = MIG_MINORS
) -> tuple[int, int]:
    """The GI's and CI's capability minors from ``mig-minors``; -1 each where it cannot tell."""
    try:
        table = parse_mig_minors(path.read_text())
    except OSError:
        return -1, -1
    return table.get((gpu, gpu_instance, -1), -1), table.get((gpu, gpu_instance, compute_instance), -1)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlMig:
    """MigControl through pynvml, on the cards NVML lists."""

    def __init__(self) -> None:
        import pynvml

        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise MigError(f"cannot initialise NVML ({err}); MIG needs a GPU node") from err
        self._cards: dict[str, tuple[int, Any]] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                minor = int(pynvml.nvmlDeviceGetMinorNumber(h))
            except pynvml.NVMLError:
                minor = i
            self._cards[_text(pynvml.nvmlDeviceGetUUID(h))] = (minor, h)

    def cards(self) -> list[str]:
        """The uuids of the node's cards, in NVML's order."""
        return list(self._cards)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nv.NVMLError as err:
            raise MigRefused(int(getattr(err, "value", -1)), str(err)) from err

    def _handle(self, parent: str) -> tuple[int, Any]:
        try:
            return self._cards[parent]
        except KeyError:
            raise MigRefused(NOT_FOUND, f"no card {parent} on this node") from None

    def mode(self, parent: str) -> MigMode:
        current, pending = self._call(self._nv.nvmlDeviceGetMigMode, self._handle(parent)[1])
        return MigMode(bool(current), bool(pending))

    def table(self, parent: str) -> MigTable:
        h = self._handle(parent)[1]
        name = _text(self._call(self._nv.nvmlDeviceGetName, h))
        total = int(self._call(self._nv.nvmlDeviceGetMemoryInfo, h).total) >> 20
        return table_for_model(name, total)

    def _gi_handles(self, parent: str) -> list[Any]:
        nv = self._nv
        import ctypes

        h = self._handle(parent)[1]
        found: list[Any] = []
        for p in self.table(parent).profiles:
            refs = (nv.c_nvmlGpuInstance_t * p.instances)()
            count = ctypes.c_uint(0)
            try:
                nv.nvmlDeviceGetGpuInstances(h, p.profile_id, refs, ctypes.byref(count))
            except nv.NVMLError as err:
                if getattr(err, "value", None) == NOT_SUPPORTED:
                    continue  # a profile this driver does not offer
                raise MigRefused(int(getattr(err, "value", -1)), str(err)) from err
            found.extend(refs[i] for i in range(count.value))
        return found

    def _gi(self, parent: str, handle: Any) -> GpuInstance:
        nv = self._nv
        import ctypes

        info = self._call(nv.nvmlGpuInstanceGetInfo, handle)
        table = self.table(parent)
        cis: list[int] = []
        refs = (nv.c_nvmlComputeInstance_t * 8)()
        for ci_profile in range(int(getattr(nv, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9))):
            count = ctypes.c_uint(0)
            try:
                nv.nvmlGpuInstanceGetComputeInstances(handle, ci_profile, refs, ctypes.byref(count))
            except nv.NVMLError:
                continue
            cis.extend(int(self._call(nv.nvmlComputeInstanceGetInfo, refs[i]).id) for i in range(count.value))
        return GpuInstance(
            parent,
            int(info.id),
            table.by_id(int(info.profileId)).name,
            int(info.profileId),
            Placement(int(info.placement.start), int(info.placement.size)),
            tuple(sorted(cis)),
        )

    def gpu_instances(self, parent: str) -> list[GpuInstance]:
        return sorted((self._gi(parent, g) for g in self._gi_handles(parent)), key=lambda g: g.id)

    def devices(self, parent: str) -> list[MigDevice]:
        nv = self._nv
        minor, h = self._handle(parent)
        table = self.table(parent)
        placements = {g.id: g for g in self.gpu_instances(parent)}
        found: list[MigDevice] = []
        for i in range(int(self._call(nv.nvmlDeviceGetMaxMigDeviceCount, h))):
            try:
                m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except nv.NVMLError:
                continue  # NOT_FOUND: no device at this index
            gi = int(self._call(nv.nvmlDeviceGetGpuInstanceId, m))
            ci = int(self._call(nv.nvmlDeviceGetComputeInstanceId, m))
            g = placements.get(gi)
            if g is None:
                continue
            gi_minor, ci_minor = cap_minors(minor, gi, ci)
            found.append(
                MigDevice(
                    uuid=_text(self._call(nv.nvmlDeviceGetUUID, m)),
                    parent=parent,
                    parent_index=minor,
                    index=i,
                    gpu_instance=gi,
                    compute_instance=ci,
                    profile=g.profile,
                    memory_mib=int(self._call(nv.nvmlDeviceGetMemoryInfo, m).total) >> 20
                    or table.profile(g.profile).memory_mib,
                    placement=g.placement,
                    gi_minor=gi_minor,
                    ci_minor=ci_minor,
                )
            )
        return found

    def create(self, parent: str, profile: str, start: int) -> MigDevice:
        nv = self._nv
        h = self._handle(parent)[1]
        p = self.table(parent).profile(profile)
        placement = nv.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, p.memory_slices
        gi = self._call(nv.nvmlDeviceCreateGpuInstanceWithPlacement, h, p.profile_id, placement)
        gi_id = int(self._call(nv.nvmlGpuInstanceGetInfo, gi).id)
        try:
            # the CI profile of the GI's whole compute: its slice count's constant
            ci_profile = _CI_PROFILE[p.compute_slices]
            info = self._call(nv.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, ci_profile, 0)
            self._call(nv.nvmlGpuInstanceCreateComputeInstance, gi, int(info.id))
        except MigRefused:
            self._call(nv.nvmlGpuInstanceDestroy, gi)  # no half-made instance left behind
            raise
        for d in self.devices(parent):
            if d.gpu_instance == gi_id:
                return d
        raise MigRefused(NOT_FOUND, f"GI {gi_id} made on {parent} but no MIG device shows it")

    def destroy(self, parent: str, gpu_instance: int) -> None:
        nv = self._nv
        import ctypes

        h = self._handle(parent)[1]
        gi = self._call(nv.nvmlDeviceGetGpuInstanceById, h, gpu_instance)
        refs = (nv.c_nvmlComputeInstance_t * 8)()
        for ci_profile in range(int(getattr(nv, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9))):
            count = ctypes.c_uint(0)
            try:
                nv.nvmlGpuInstanceGetComputeInstances(gi, ci_profile, refs, ctypes.byref(count))
            except nv.NVMLError:
                continue
            for i in range(count.value):
                self._call(nv.nvmlComputeInstanceDestroy, refs[i])
        self._call(nv.nvmlGpuInstanceDestroy, gi)

    def processes(self, device_uuid: str) -> list[GpuProcess] | None:
        nv = self._nv
        try:
            m = nv.nvmlDeviceGetHandleByUUID(device_uuid)
            listed = nv.nvmlDeviceGetComputeRunningProcesses(m)
        except nv.NVMLError:
            return None
        held: dict[int, int] = {}
        for p in listed:
            held[int(p.pid)] = held.get(int(p.pid), 0) + int(getattr(p, "usedGpuMemory", 0) or 0)
        return [GpuProcess(pid, used) for pid, used in held.items()]

    def close(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass


# NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE by compute slices (nvml.h)
_CI_PROFILE = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}
