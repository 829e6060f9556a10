"""The grant: what the device plugin granted one container, where the container cannot write it.

The region file (:mod:`vgpu.hookabi.region`) lives in a folder mounted writable into its container: the
processes there must update usage and their slots. So a word in it is only a claim. The grant
holds the limits themselves (memory, budget, SM percent, priority, SM policy, spilling, the
card UUIDs and the region's path), in a file the device plugin writes on the host under
``/var/lib/vgpu/grants/<pod-uid>_<container>.limits`` and mounts read-only into the container at
``/etc/vgpu/limits`` (``GRANT_PATH_IN_CONTAINER``). The hook finds it there whatever the
process's environment says, reads every limit from it, and keeps the region's limit words as a
mirror: a region whose words differ from the grant is logged and put back, and the grant holds.

Layout: ``vgpu.hookabi.layout.GRANT`` (one definition; the C struct ``vgpu_grant`` is generated from it).
A ``checksum`` (FNV-1a 64 over every byte from ``num_devices`` on) tells a whole grant from a
damaged one; the hook refuses every allocation under a damaged grant rather than guess.

Writers (the device plugin at Allocate; live resize, ``vgpu.hookabi.resize.apply_limits``, from
``vgpu limits set``; the node monitor's compute gate) change a grant in place, never by renaming a
new file over it (only a new grant is written whole, by ``vgpu.hookabi.files.write_atomic``): the
container's bind mount holds the inode, so a renamed file would never reach it. A
change bumps ``seq`` to odd, stores each changed word with one aligned store through the map
(the hook reads single words without a lock, as it did from the region), stores the new
checksum, and bumps ``seq`` to even.
Writers serialise on ``flock``. The file is root's, mode 0644: the container's processes may
read it through their read-only mount, nobody but root may write it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from vgpu.hookabi.files import write_atomic
from vgpu.hookabi.layout import (
    CTYPES,
    GRANT,
    GRANT_LAYOUT,
    GRANT_MAGIC,
    GRANT_PAYLOAD,
    GRANT_VERSION,
    MAX_DEVICES,
    PATH_BYTES,
    SHARING_MPS,
    SHARING_TIMESLICE,
    UUID_BYTES,
    fnv1a64,
)
from vgpu.hookabi.region import DeviceState, RegionError, Snapshot

# The grant's host path, defined here alone (contract 5; vgpu/node/paths.py builds on it): the
# grant of the container whose region folder is <vgpu dir>/containers/<folder> is
# <vgpu dir>/grants/<folder>.limits, the vgpu dir being /var/lib/vgpu under the node's root.
CONTAINERS_FOLDER = "containers"
GRANTS_FOLDER = "grants"
GRANT_SUFFIX = ".limits"
# What one CUDA context costs on the card, charged once per process and device (the hook's
# VGPU_CONTEXT_RESERVE default; measured on an H200 with CUDA 13, see docs/hook.md).
DEFAULT_CONTEXT_RESERVE = 640 << 20
GRANT_SIZE = GRANT_LAYOUT.size
# Grant layouts 1 (before the node's compute gate), 2 (before one measure of a share) and 3 (before
# MPS mode): the same words without hold_until_ns, share_scale, or sharing and mps_pipe, at the end.
# A container started by an older plugin keeps its grant's layout (and the hook that reads it) for
# its life: read and changed in place as such, never given a gate (1), a scale (1, 2) or MPS (1-3).
_SIZES = {
    GRANT_VERSION: GRANT_SIZE,
    3: GRANT_LAYOUT.offsets["sharing"],
    2: GRANT_LAYOUT.offsets["share_scale"],
    1: GRANT_LAYOUT.offsets["hold_until_ns"],
}
_G = GRANT_LAYOUT.offsets
_TYPES = {f.name: f.ctype for f in GRANT}
_FRAME = ("magic", "version", "size", "seq", "checksum")  # not payload: written by _change itself


_PLURAL = {
    "limit": "limits",
    "sm_limit": "sm_limits",
    "budget": "budgets",
    "hold_until_ns": "hold_until",
    "share_scale": "share_scales",
}
_PER_DEVICE = tuple(_PLURAL)


class GrantError(RegionError):
    """A grant file that cannot be read or written; the message names the file and the fix."""


@dataclass(frozen=True)
class Grant:
    """One container's granted limits, per device in the order of its ``NVIDIA_VISIBLE_DEVICES``."""

    uuids: tuple[str, ...]
    limits: tuple[int, ...]  # bytes, device plus host; 0 = no limit
    sm_limits: tuple[int, ...] = ()  # percent; 0 = no cap
    budgets: tuple[int, ...] = ()  # device bytes before spilling; 0 = the card's free memory
    priority: int = 1
    sm_policy: int = 0
    oversubscribe: bool = False
    region_path: str = ""
    context_reserve: int = DEFAULT_CONTEXT_RESERVE
    # the node's compute gate per device: no launch before this CLOCK_MONOTONIC ns (0 = open);
    # written only by the node monitor (vgpu.monitor.compute), never at Allocate
    hold_until: tuple[int, ...] = ()
    # the driver's measure of the container's GPU time over the hook's, x SHARE_SCALE_ONE (0 = 1.0);
    # written only by the node monitor (vgpu.monitor.sharescale), never at Allocate
    share_scales: tuple[int, ...] = ()
    # MPS mode (docs/mps.md): SHARING_MPS makes every process of the container a client of the
    # card's MPS daemon through mps_pipe (the pipe folder as the container sees it)
    sharing: int = SHARING_TIMESLICE
    mps_pipe: str = ""
    seq: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        n = len(self.uuids)
        if not 1 <= n <= MAX_DEVICES:
            raise GrantError(f"a grant holds 1..{MAX_DEVICES} devices, not {n}")
        for name in _PLURAL.values():
            values = getattr(self, name)
            if len(values) > n:
                raise GrantError(f"{name} has {len(values)} entries for {n} devices")
            object.__setattr__(self, name, tuple(values) + (0,) * (n - len(values)))  # one entry per device
        if any(not 0 <= p <= 100 for p in self.sm_limits):
            raise GrantError(f"sm_limits {self.sm_limits} must be percents 0..100")
        if any(v < 0 for v in (*self.limits, *self.budgets, *self.hold_until, self.context_reserve)):
            raise GrantError("limits and budgets must be bytes >= 0")
        if any(not 0 <= v < 1 << 32 for v in self.share_scales):
            raise GrantError(f"share_scales {self.share_scales} must be 32-bit words")
        if self.sharing not in (SHARING_TIMESLICE, SHARING_MPS):
            raise GrantError(f"sharing {self.sharing} must be {SHARING_TIMESLICE} or {SHARING_MPS}")
        if (self.sharing == SHARING_MPS) != bool(self.mps_pipe):
            raise GrantError("an MPS grant (sharing 1) names its mps_pipe, and only such a grant does")
        if self.priority not in (0, 1) or self.sm_policy not in (0, 1):
            raise GrantError(f"priority {self.priority} / sm_policy {self.sm_policy} must be 0 or 1")
        if not all(t.isascii() and t.isprintable() for t in (*self.uuids, self.region_path, self.mps_pipe)):
            raise GrantError("device UUIDs, region_path and mps_pipe must be printable ASCII")
        if any(len(u.encode()) >= UUID_BYTES for u in self.uuids):
            raise GrantError(f"a device UUID is {UUID_BYTES} bytes or longer")
        if max(len(self.region_path.encode()), len(self.mps_pipe.encode())) >= PATH_BYTES:
            raise GrantError(f"region_path or mps_pipe is {PATH_BYTES} bytes or longer")

    def value(self, name: str, index: int) -> int:
        """Device ``index``'s word ``name``: ``limit``, ``sm_limit``, ``budget``, ``hold_until_ns``
        or ``share_scale``."""
        values: tuple[int, ...] = getattr(self, _PLURAL[name])
        return values[index]


def grants_dir_of(vgpu_dir: Path) -> Path:
    """The grants' folder of the node whose vgpu dir (``/var/lib/vgpu`` under its root) this is."""
    return vgpu_dir / GRANTS_FOLDER


def grant_path(grants_dir: Path, folder_name: str) -> Path:
    """The grant of the container whose folder is ``containers/<folder_name>``."""
    return grants_dir / f"{folder_name}{GRANT_SUFFIX}"


def grant_of_container_dir(container_dir: Path) -> Path:
    """``/var/lib/vgpu/containers/<f>`` -> ``/var/lib/vgpu/grants/<f>.limits`` (the plugin's layout)."""
    return grant_path(grants_dir_of(container_dir.parent.parent), container_dir.name)


def _pack(buf: bytearray | memoryview, name: str, value: int, index: int = 0) -> None:
    code, size = CTYPES[_TYPES[name]]
    struct.pack_into("<" + code, buf, _G[name] + index * size, value)


def _put_str(buf: bytearray, name: str, text: str, index: int = 0, width: int = 0) -> None:
    raw = text.encode()
    start = _G[name] + index * width
    buf[start : start + len(raw)] = raw


def encode(grant: Grant, seq: int = 0, version: int = GRANT_VERSION) -> bytes:
    """The file's bytes, checksum included (``version`` 1 or 2: an older container's layout, with
    no gate or no scale)."""
    size = _SIZES[version]
    if size <= _G["hold_until_ns"] and any(grant.hold_until):
        raise GrantError(
            f"grant layout {version} has no compute gate (hold_until_ns); the container predates it"
        )
    if size <= _G["share_scale"] and any(grant.share_scales):
        raise GrantError(f"grant layout {version} has no share_scale; the container predates it")
    if size <= _G["sharing"] and grant.sharing != SHARING_TIMESLICE:
        raise GrantError(f"grant layout {version} has no MPS mode; the container predates it")
    buf = bytearray(GRANT_SIZE)
    _pack(buf, "magic", GRANT_MAGIC)
    _pack(buf, "version", version)
    _pack(buf, "size", size)
    _pack(buf, "seq", seq)
    _pack(buf, "num_devices", len(grant.uuids))
    _pack(buf, "priority", grant.priority)
    _pack(buf, "sm_policy", grant.sm_policy)
    _pack(buf, "oversubscribe", int(grant.oversubscribe))
    _pack(buf, "context_reserve", grant.context_reserve)
    for i, uuid in enumerate(grant.uuids):
        _put_str(buf, "uuid", uuid, i, UUID_BYTES)
        for name in _PER_DEVICE:
            _pack(buf, name, grant.value(name, i), i)
    _put_str(buf, "region_path", grant.region_path)
    _pack(buf, "sharing", grant.sharing)
    _put_str(buf, "mps_pipe", grant.mps_pipe)
    del buf[size:]
    _pack(buf, "checksum", fnv1a64(bytes(buf[GRANT_PAYLOAD:])))
    return bytes(buf)


def _word(data: bytes, name: str, index: int = 0) -> int:
    code, size = CTYPES[_TYPES[name]]
    value: int = struct.unpack_from("<" + code, data, _G[name] + index * size)[0]
    return value


def _cstr(data: bytes, start: int, width: int) -> str:
    raw = data[start : start + width].split(b"\0", 1)[0]
    if not raw.isascii() or not raw.decode("ascii").isprintable():
        raise GrantError(f"a name at byte {start} holds bytes that are not printable ASCII")
    return raw.decode("ascii")


def decode(data: bytes, path: str | os.PathLike[str] = "<grant>") -> Grant:
    """A grant from the file's bytes; ``GrantError`` naming what is wrong otherwise."""
    small = _SIZES[1]
    if len(data) < small:
        raise GrantError(f"{path} holds {len(data)} bytes, a grant needs {GRANT_SIZE}; rewrite it")
    magic = _word(data, "magic")
    if magic != GRANT_MAGIC:
        raise GrantError(f"{path} is not a vgpu grant (magic 0x{magic:016x}, expected 0x{GRANT_MAGIC:016x})")
    version = _word(data, "version")
    size = _SIZES.get(version, -1)
    if _word(data, "size") != size or len(data) < size:
        raise GrantError(
            f"{path} is grant layout {version} of {_word(data, 'size')} bytes, this vgpu reads "
            f"{GRANT_VERSION} of {GRANT_SIZE} (and 3 of {_SIZES[3]}, 2 of {_SIZES[2]}, 1 of {small}); "
            "upgrade the device "
            "plugin and the hook "
            "together"
        )
    want = _word(data, "checksum")
    got = fnv1a64(data[GRANT_PAYLOAD:size])
    if want != got:
        raise GrantError(
            f"{path} is damaged (checksum 0x{got:016x}, the file says 0x{want:016x}); "
            "the hook refuses every allocation under it until the device plugin rewrites it"
        )
    n = _word(data, "num_devices")
    if not 1 <= n <= MAX_DEVICES:
        raise GrantError(f"{path} grants {n} devices; 1..{MAX_DEVICES} expected")

    def words(name: str) -> tuple[int, ...]:  # () where the layout predates the word
        return tuple(_word(data, name, i) for i in range(n)) if size > _G[name] else ()

    try:
        return Grant(
            uuids=tuple(_cstr(data, _G["uuid"] + i * UUID_BYTES, UUID_BYTES) for i in range(n)),
            limits=tuple(_word(data, "limit", i) for i in range(n)),
            sm_limits=tuple(_word(data, "sm_limit", i) for i in range(n)),
            budgets=tuple(_word(data, "budget", i) for i in range(n)),
            priority=_word(data, "priority"),
            sm_policy=_word(data, "sm_policy"),
            oversubscribe=_word(data, "oversubscribe") != 0,
            region_path=_cstr(data, _G["region_path"], PATH_BYTES),
            context_reserve=_word(data, "context_reserve"),
            hold_until=words("hold_until_ns"),
            share_scales=words("share_scale"),
            sharing=_word(data, "sharing") if size > _G["sharing"] else SHARING_TIMESLICE,
            mps_pipe=_cstr(data, _G["mps_pipe"], PATH_BYTES) if size > _G["mps_pipe"] else "",
            seq=_word(data, "seq"),
        )
    except GrantError as err:
        raise GrantError(f"{path}: {err}") from None


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        why = "it is a symbolic link" if err.errno == errno.ELOOP else err.strerror
        raise GrantError(f"cannot open grant {path}: {why}") from err


def read_grant(path: str | os.PathLike[str], attempts: int = 1000) -> Grant:
    """The grant as it stands (retries while a writer holds ``seq`` odd, about 0.1 s at most)."""
    path = Path(path)
    fd = _open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise GrantError(f"{path} is not a regular file")
        for _ in range(attempts):
            data = os.pread(fd, GRANT_SIZE, 0)
            seq = _word(data, "seq") if len(data) >= _SIZES[1] else 0
            if seq % 2 == 0 and (len(data) < _SIZES[1] or os.pread(fd, 8, _G["seq"]) == data[16:24]):
                return decode(data, path)
            time.sleep(0.0001)
        raise GrantError(f"{path}: a writer held the grant mid-change for too long; try again")
    finally:
        os.close(fd)


def write_grant(path: str | os.PathLike[str], grant: Grant) -> None:
    """Create the grant, or change a valid one in place (its inode may be mounted in a container)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        read_grant(path)
    except GrantError:
        write_atomic(path, encode(grant), 0o644)
        return
    _change(path, lambda old: grant)


def update_grant(
    path: str | os.PathLike[str],
    device: int,
    *,
    limit: int | None = None,
    sm_limit: int | None = None,
    budget: int | None = None,
    hold_until: int | None = None,
    share_scale: int | None = None,
) -> Grant:
    """Live resize of one device's words (or the node's compute gate, ``hold_until``, and its
    measure's scale, ``share_scale``) in place; returns the grant as written."""

    def changed(old: Grant) -> Grant:
        if not 0 <= device < len(old.uuids):
            last = len(old.uuids) - 1
            raise GrantError(f"device {device} is not granted: the grant holds devices 0..{last}")

        def put(values: tuple[int, ...], new: int | None) -> tuple[int, ...]:
            return values if new is None else values[:device] + (new,) + values[device + 1 :]

        return replace(
            old,
            limits=put(old.limits, limit),
            sm_limits=put(old.sm_limits, sm_limit),
            budgets=put(old.budgets, budget),
            hold_until=put(old.hold_until, hold_until),
            share_scales=put(old.share_scales, share_scale),
        )

    return _change(Path(path), changed)


def _change(path: Path, change: Callable[[Grant], Grant]) -> Grant:
    """Under ``flock``: seq odd, every word that differs stored on its own, checksum, seq even."""
    fd = _open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = os.pread(fd, GRANT_SIZE, 0)
        new = change(decode(data, path))
        version = _word(data, "version")
        image = encode(new, version=version)  # an older container's grant keeps its layout
        with mmap.mmap(fd, len(image), access=mmap.ACCESS_WRITE) as m:
            u32 = memoryview(m).cast("I")
            u64 = memoryview(m).cast("Q")
            try:
                seq = u64[_G["seq"] // 8] | 1  # odd: a change is under way
                u64[_G["seq"] // 8] = seq
                for f in GRANT:
                    if f.name in _FRAME:
                        continue
                    size = CTYPES[f.ctype][1]
                    start, total = _G[f.name], size * f.count * f.count2
                    if start >= len(image):  # past an older layout's end
                        continue
                    if f.ctype == "char":  # read once, at attach: bytes suffice
                        if m[start : start + total] != image[start : start + total]:
                            m[start : start + total] = image[start : start + total]
                        continue
                    view = u64 if size == 8 else u32
                    for at in range(start, start + total, size):
                        if m[at : at + size] != image[at : at + size]:
                            view[at // size] = struct.unpack_from("<" + CTYPES[f.ctype][0], image, at)[0]
                u64[_G["checksum"] // 8] = _word(image, "checksum")
                u64[_G["seq"] // 8] = seq + 1
            finally:
                u32.release()
                u64.release()
        return replace(new, seq=seq + 1)
    finally:
        os.close(fd)


def mismatches(
    grant: Grant, limits: Sequence[int], sm_limits: Sequence[int], budgets: Sequence[int]
) -> list[str]:
    """Where a region's mirrored words differ from the grant, as ``device 0 memory limit ...`` lines."""
    out = []
    for i in range(len(grant.uuids)):
        for what, name, values in (
            ("memory limit", "limit", limits),
            ("SM limit", "sm_limit", sm_limits),
            ("budget", "budget", budgets),
        ):
            have = values[i] if i < len(values) else 0
            if have != grant.value(name, i):
                out.append(f"device {i} {what} {have} in the region, {grant.value(name, i)} granted")
    return out


def grant_beside(region_path: str | os.PathLike[str]) -> Path | None:
    """The grant of the container whose region file this is, where the plugin wrote one."""
    path = grant_of_container_dir(Path(region_path).parent)
    return path if path.exists() else None


def as_granted(snapshot: Snapshot, grant: Grant) -> tuple[Snapshot, list[str]]:
    """The region's snapshot with the grant's limits in place of the region's copy, and where the
    copy differed (the container wrote its region: the hook puts such words back)."""
    differ = mismatches(
        grant,
        [d.limit_bytes for d in snapshot.devices],
        [d.sm_limit for d in snapshot.devices],
        [d.budget_bytes for d in snapshot.devices],
    )
    devices = []
    for i, uuid in enumerate(grant.uuids):
        base = snapshot.devices[i] if i < len(snapshot.devices) else DeviceState(i, uuid, 0, 0, 0)
        devices.append(
            replace(
                base,
                uuid=uuid,
                limit_bytes=grant.value("limit", i),
                sm_limit=grant.value("sm_limit", i),
                budget_bytes=grant.value("budget", i),
            )
        )
    if snapshot.priority != grant.priority:
        differ.append(f"priority {snapshot.priority} in the region, {grant.priority} granted")
    granted = replace(snapshot, devices=tuple(devices), priority=grant.priority, sm_policy=grant.sm_policy)
    return granted, differ
