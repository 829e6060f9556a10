"""Live resize: the one code path that changes a running container's limits.

``validate_limits`` is pure: from what the container has now (its device count, the memory in
use, the budget in force) it returns the change, with what the operator should know, or raises
``LimitError``. ``apply_limits`` reads the grant and the region, validates, then writes: the
grant where there is one (the region's copy follows), else the region's own words.

A ``LimitError`` names the value at fault in plain words (``field``: one of ``FIELDS``), never
a command's flag: ``vgpu limits set`` (vgpu/commands/limits.py) maps fields to its flags; any
other caller can pass the message on as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vgpu.hookabi.grant import grant_beside, read_grant, update_grant
from vgpu.hookabi.region import MAX_BYTES, Region, RegionError

DEVICE = "device"
MEMORY = "memory limit"
SM = "SM limit"
BUDGET = "budget"
ANY = "limits"  # none of the three was given
FIELDS = (DEVICE, MEMORY, SM, BUDGET, ANY)


@dataclass(frozen=True)
class LimitChange:
    """One device's new limits (None: left as it is), and what the operator should know about it."""

    device: int
    notes: tuple[str, ...] = ()
    memory_bytes: int | None = None
    sm_percent: int | None = None
    budget_bytes: int | None = None


class LimitError(RegionError):
    """A refused limit change: ``field`` (one of ``FIELDS``) is the value at fault, ``reason`` why
    and what to give instead."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def _mib(value: int) -> str:
    return f"{value / (1 << 20):.0f} MiB"


def check_values(
    memory_bytes: int | None = None, sm_percent: int | None = None, budget_bytes: int | None = None
) -> None:
    """The new values alone, before any file is read; raises ``LimitError``."""
    if memory_bytes is None and sm_percent is None and budget_bytes is None:
        raise LimitError(ANY, "nothing to change; give a memory limit, an SM limit or a budget")
    if memory_bytes is not None and memory_bytes < 0:
        raise LimitError(MEMORY, f"{memory_bytes} bytes is negative; give bytes >= 0 (0 = no limit)")
    if budget_bytes is not None and budget_bytes < 0:
        raise LimitError(
            BUDGET, f"{budget_bytes} bytes is negative; give bytes >= 0 (0 = the card's free memory)"
        )
    for name, size in ((MEMORY, memory_bytes), (BUDGET, budget_bytes)):
        if size is not None and size > MAX_BYTES:
            raise LimitError(name, f"{size} bytes is more than 2^64-1, the most a limit can hold; give less")
    if sm_percent is not None and not 0 <= sm_percent <= 100:
        raise LimitError(SM, f"{sm_percent} is not a percent; give 0..100 (0 = no cap)")


def validate_limits(
    device: int,
    *,
    devices: int,
    memory_bytes: int | None = None,
    sm_percent: int | None = None,
    budget_bytes: int | None = None,
    used_bytes: int = 0,
    budget_now: int = 0,
) -> LimitChange:
    """The change to one device of a container with ``devices`` devices, ``used_bytes`` in use on
    it and ``budget_now`` its budget in force; raises ``LimitError``. Reads and writes nothing."""
    check_values(memory_bytes, sm_percent, budget_bytes)
    if not 0 <= device < devices:
        have = f"devices 0..{devices - 1}" if devices else "no devices"
        raise LimitError(DEVICE, f"{device} is out of range: the container has {have}; give one of those")
    notes: list[str] = []
    if memory_bytes:
        if memory_bytes < used_bytes:
            below = f"the new limit {_mib(memory_bytes)} is below the {_mib(used_bytes)} in use"
            notes.append(
                f"device {device}: {below}; "
                "nothing is taken back, new allocations are refused until usage falls under it"
            )
        budget = budget_bytes if budget_bytes is not None else budget_now
        if budget and budget > memory_bytes:
            notes.append(f"device {device}: the budget {_mib(budget)} is above the limit: nothing will spill")
    return LimitChange(device, tuple(notes), memory_bytes, sm_percent, budget_bytes)


def apply_limits(
    path: str | os.PathLike[str],
    device: int,
    *,
    memory_bytes: int | None = None,
    sm_percent: int | None = None,
    budget_bytes: int | None = None,
    grant: str | os.PathLike[str] | None = None,
) -> LimitChange:
    """Validate, then write one device's new limits.

    ``path`` is the container's region file; ``grant`` its grant (by default the plugin's, found
    beside the container's folder). Where there is a grant, it is what changes, and the region's
    copy follows when the region exists (no CUDA process may have started yet); without one (a
    process run by hand) the region's words are the limits. Everything is checked before
    anything is written, so a refused change leaves both files as they were. The hook reads the
    words on every call: a new memory limit or budget holds from the next allocation, a new SM
    limit from the next launch. Memory already taken is never taken back: a limit below usage
    refuses new allocations until usage falls under it.
    """
    check_values(memory_bytes, sm_percent, budget_bytes)  # before any file is opened
    grant_file = Path(grant) if grant is not None else grant_beside(path)
    granted = read_grant(grant_file) if grant_file is not None else None
    region: Region | None = None
    try:
        if granted is None or Path(path).exists():
            region = Region(path, writable=True)
        count = len(granted.uuids) if granted is not None else region.num_devices if region else 0
        known = 0 <= device < count
        if not known:
            budget_now = 0
        elif granted is not None:
            budget_now = granted.value("budget", device)
        else:
            budget_now = region.word("budget", device) if region is not None else 0
        change = validate_limits(
            device,
            devices=count,
            memory_bytes=memory_bytes,
            sm_percent=sm_percent,
            budget_bytes=budget_bytes,
            used_bytes=region.word("used", device) if region is not None and known else 0,
            budget_now=budget_now,
        )
        if grant_file is not None:
            update_grant(grant_file, device, limit=memory_bytes, sm_limit=sm_percent, budget=budget_bytes)
        if region is not None:  # the region's copy (the limits themselves where there is no grant)
            if memory_bytes is not None:
                region.set_limit(device, memory_bytes)
            if budget_bytes is not None:
                region.set_budget(device, budget_bytes)
            if sm_percent is not None:
                region.set_sm_limit(device, sm_percent)
        return change
    finally:
        if region is not None:
            region.close()
