# Over 450 lines: Region's two modes (mapped for tools, pread for the monitor) share every method.
"""The hook's shared region (contract 5, docs/contracts.md): reading and writing one container's region file.

One file per container, mapped by every CUDA process in it (through ``libvgpu.so``) and read
by the node monitor from the host. Its layout (``HEADER``, ``SLOT``) is declared once in
``vgpu.hookabi.layout``, from which the C header the hook includes is generated.

The region is created and initialised by the hook (its process-shared robust mutex can only be
set up by pthreads); this module opens an existing file. Readers take no lock: the hook bumps
``seq`` to an odd value before it changes usage and to an even one after, so a reader retries
until it sees the same even ``seq`` on both sides of its copy. Limits are single aligned 8-byte
words, so the monitor may change them while processes run (live resize) without the lock.

Two ways to open one (``Region(path, mapped=...)``):

- ``mapped=False``, for the long-lived node monitor (the ``/metrics`` collector and the
  arbiter, root in the device plugin's process). The file lives in a folder the container can
  write, so the container can truncate it at any moment; a process that then touches a mapped
  page past the new end of file dies of SIGBUS, and no ``fstat`` size check closes that race
  (the file can shrink between the check and the load). So this mode never maps the file: it
  reads with ``os.pread`` (a short read is a ``RegionError`` "cut short", never a signal) and
  writes the arbiter's two words with ``os.pwrite``. Nothing a container does to its file can
  take the monitor down; the worst is that its own region is skipped until it is whole again.
- ``mapped=True`` (the default), for short-lived tools: ``vgpu limits set`` and tests. Limit
  words must never be seen torn by the hook (half old, half new bytes could read as 0, no
  limit), and only a single aligned store through a typed view of the map is one 4- or 8-byte
  store the CPU makes atomically; ``pwrite`` copies bytes and promises no such thing. A
  container that truncates its file under the CLI can at worst kill that one command (the
  operator who runs it sees the signal), not the node's device plugin.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vgpu.hookabi.layout import (
    CTYPES,
    HEADER,
    HEADER_LAYOUT,
    LAYOUT_VERSION,
    MAGIC,
    MAX_DEVICES,
    MAX_PROCS,
    REGION_SIZE,
    SLOT_LAYOUT,
    SLOTS_BY_VERSION,
    UUID_BYTES,
    Field,
    region_size,
)


class RegionError(Exception):
    """The file is not a region this version can read; the message says what to do."""


@dataclass(frozen=True)
class DeviceState:
    index: int
    uuid: str
    limit_bytes: int
    sm_limit: int
    used_bytes: int
    budget_bytes: int = 0
    spilled_bytes: int = 0
    tokens_ns: int = 0
    busy_ns: int = 0
    throttled_ns: int = 0
    last_launch_ns: int = 0
    flags: int = 0


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    start_time: int
    used_bytes: tuple[int, ...]  # per device index
    spilled_bytes: tuple[int, ...] = ()  # per device index, part of used_bytes


@dataclass(frozen=True)
class Snapshot:
    devices: tuple[DeviceState, ...]
    processes: tuple[ProcessUsage, ...]
    priority: int = 1
    sm_policy: int = 0
    arbiter_ns: int = 0


def _u(code: str, buf: bytes | mmap.mmap, offset: int) -> int:
    value: int = struct.unpack_from("<" + code, buf, offset)[0]
    return value


_H = HEADER_LAYOUT.offsets
_HEADER_FIELDS = {f.name: f for f in HEADER}


class _Views(Protocol):
    _u32: memoryview
    _u64: memoryview
    _i64: memoryview


def _word_getter(field: Field) -> Callable[[_Views, int], int]:
    size = CTYPES[field.ctype][1]
    at = HEADER_LAYOUT.offsets[field.name] // size
    if field.ctype == "int64_t":
        return lambda r, i: int(r._i64[at + i])
    if size == 8:
        return lambda r, i: int(r._u64[at + i])
    return lambda r, i: int(r._u32[at + i])


_WORD_GET: dict[str, Callable[[_Views, int], int]] = {
    f.name: _word_getter(f) for f in HEADER if f.ctype in ("uint32_t", "int32_t", "uint64_t", "int64_t")
}


class Header:
    """One copy of a region's header (``Region.read_header``); words are indexed, not unpacked."""

    __slots__ = ("_data", "_u32", "_u64", "_i64")

    def __init__(self, data: bytes) -> None:
        self._data = data
        view = memoryview(data)
        self._u32 = view.cast("I")
        self._u64 = view.cast("Q")
        self._i64 = view.cast("q")

    def word(self, name: str, index: int = 0) -> int:
        return _WORD_GET[name](self, index)

    @property
    def num_devices(self) -> int:
        return min(self._u32[_H["num_devices"] // 4], MAX_DEVICES)

    def uuid(self, index: int) -> str:
        start = _H["uuid"] + index * UUID_BYTES
        return _cstr(self._data[start : start + UUID_BYTES])


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("ascii", "replace")


class Region:
    """An open region file. Use as a context manager or call close().

    ``mapped=True`` (the default) maps the file: for short-lived tools (``vgpu limits set``).
    Every store it makes (limits, budget, flags, arbiter_ns) is one aligned 4- or 8-byte store
    through a typed view of the map, never a byte-wise copy: the hook reads these words without
    the lock, and a torn limit (half old, half new bytes) could read as 0, no limit.

    ``mapped=False`` never maps it: for the node monitor, which must survive whatever a
    container does to its own file (see the module's docstring). Reads are ``os.pread``: a
    whole-region copy for ``snapshot()`` between two reads of ``seq``, one header copy for
    ``read_header()``; a read that comes back short (the file was cut) raises ``RegionError``.
    It writes only the arbiter's words, each with one ``os.pwrite`` at its aligned offset
    (limits are refused: see ``set_limit``). A ``pwrite`` is a kernel copy of bytes, so in
    theory the hook, reading ``arbiter_ns`` at that very moment, may see half old, half new
    bytes; it then judges the flags fresh or stale wrongly for that one read. The word in the
    file is whole once the pwrite returns, and the next pass (25 ms later) writes a new one
    anyway. ``flags`` cannot tear in meaning: its bits live in its lowest byte. A ``pwrite``
    past the end of a file cut short extends it (zeros, a hole); the arbiter writes only after
    a header read of the same pass succeeded, and only inside the 2.5 KB header, so at worst a
    container that keeps cutting its file gets back a few zero bytes it took away; no signal.
    """

    def __init__(self, path: str | os.PathLike[str], writable: bool = False, mapped: bool = True) -> None:
        self.path = Path(path)
        self.mapped = mapped
        # The folder is writable from inside the container, and the monitor opens the file as
        # root on the host: never follow a link out of the folder, never block on a FIFO.
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags)
        except OSError as err:
            why = "it is a symbolic link" if err.errno == errno.ELOOP else err.strerror
            raise RegionError(f"cannot open region file {self.path}: {why}") from err
        self._fd = fd
        self._map: mmap.mmap | None = None
        self._closed = False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RegionError(f"{self.path} is not a regular file; remove it and restart the container")
            self.inode = st.st_ino
            # the header says which layout (and so how many slots) before the whole is sized
            self.layout, self.max_procs, self.size = LAYOUT_VERSION, MAX_PROCS, REGION_SIZE
            if st.st_size >= HEADER_LAYOUT.size:
                self._check(Header(self._copy(0, HEADER_LAYOUT.size)))
            if st.st_size < self.size:
                raise RegionError(
                    f"{self.path} holds {st.st_size} bytes, "
                    f"a layout-{self.layout} region needs {self.size}: "
                    "it is not a vgpu region or was cut short; remove it and restart the container"
                )
            if mapped:
                access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
                self._map = mmap.mmap(fd, self.size, access=access)
                self._u32 = memoryview(self._map).cast("I")
                self._u64 = memoryview(self._map).cast("Q")
                self._i64 = memoryview(self._map).cast("q")
        except BaseException:
            self.close()
            raise

    def _check(self, header: Header) -> None:
        magic = header.word("magic")
        version = header.word("version")
        if magic != MAGIC:
            raise RegionError(
                f"{self.path} is not a vgpu region (magic 0x{magic:016x}, expected 0x{MAGIC:016x}); "
                "remove it and restart the container"
            )
        if version not in SLOTS_BY_VERSION:
            readable = ", ".join(map(str, sorted(SLOTS_BY_VERSION)))
            raise RegionError(
                f"{self.path} has region layout version {version}, this vgpu reads {readable}; "
                "upgrade the node monitor and the hook together"
            )
        for name, want in (
            ("header_size", HEADER_LAYOUT.size),
            ("slot_size", SLOT_LAYOUT.size),
            ("max_devices", MAX_DEVICES),
            ("max_procs", SLOTS_BY_VERSION[version]),
        ):
            got = header.word(name)
            if got != want:
                raise RegionError(f"{self.path}: header field {name} is {got}, expected {want}")
        self.layout, self.max_procs = version, SLOTS_BY_VERSION[version]
        self.size = region_size(self.max_procs)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._map is not None:
            self._u32.release()
            self._u64.release()
            self._i64.release()
            self._map.close()
        os.close(self._fd)

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def intact(self) -> bool:
        """Whether the file still holds a whole region (by ``fstat``; a rescan's check).

        A mapped reader must check this before each pass (touching a mapped page past the end
        of a file cut short is SIGBUS), and even then the file may shrink right after the
        check: that race is why the node monitor opens regions with ``mapped=False``.
        """
        try:
            return os.fstat(self._fd).st_size >= self.size
        except OSError:
            return False

    def _copy(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset``: a slice of the map, or one pread that must not come back short."""
        if self._map is not None:
            return bytes(self._map[offset : offset + size])
        try:
            data = os.pread(self._fd, size, offset)
        except OSError as err:
            raise RegionError(f"{self.path}: cannot read the region: {err.strerror}") from err
        if len(data) != size:
            raise RegionError(
                f"{self.path} was cut short (a read at {offset} got {len(data)} of {size} bytes); "
                "it is skipped until it is whole again"
            )
        return data

    def read_header(self) -> Header:
        """The header, copied at once (one pread unmapped), after a check that it is still a region.

        No ``seq`` retry: the words read from it per arbiter pass (``priority``, ``busy_ns``,
        ``last_launch_ns``, ``flags``) are each written by one store outside the seqlock, so
        ``seq`` guards none of them. A pread copies bytes, so one of those words could in theory
        come back torn if the hook stored it during the copy; the arbiter then misjudges that
        container's activity on that card for one pass (25 ms).
        """
        header = Header(self._copy(0, HEADER_LAYOUT.size))
        magic = header.word("magic")
        if magic != MAGIC:
            raise RegionError(
                f"{self.path} is no longer a vgpu region (magic 0x{magic:016x}): it was cut short "
                "or rewritten; it is skipped until it is whole again"
            )
        return header

    def word(self, name: str, index: int = 0) -> int:
        """One 4- or 8-byte header word (of an array: entry ``index``): one load, or one small pread."""
        if self._map is not None:
            return _WORD_GET[name](self, index)
        code, size = CTYPES[_HEADER_FIELDS[name].ctype]
        value: int = struct.unpack("=" + code, self._copy(_H[name] + index * size, size))[0]
        return value

    @property
    def num_devices(self) -> int:
        return min(self.word("num_devices"), MAX_DEVICES)

    def uuid(self, index: int) -> str:
        return _cstr(self._copy(_H["uuid"] + index * UUID_BYTES, UUID_BYTES))

    def snapshot(self, attempts: int = 1000) -> Snapshot:
        """A consistent copy of limits and usage (retries while a writer is mid-update).

        The seqlock: read ``seq``; if even, copy the whole region (one pread unmapped); read
        ``seq`` again; the copy holds when both reads agree. A ``seq`` held odd for all
        ``attempts`` (about 0.1 s by default) raises ``RegionError``.
        """
        for _ in range(attempts):
            before = self.word("seq")
            if before % 2 == 0:
                data = self._copy(0, self.size)
                if self.word("seq") == before:
                    magic = _u("Q", data, _H["magic"])
                    if magic != MAGIC:
                        raise RegionError(
                            f"{self.path} is no longer a vgpu region (magic 0x{magic:016x}): "
                            "it was cut short or rewritten"
                        )
                    return _decode(data, self.max_procs)
            time.sleep(0.0001)
        raise RegionError(f"{self.path}: a writer held the region mid-update for too long; try again")

    def _device(self, index: int) -> None:
        if not 0 <= index < MAX_DEVICES:
            raise RegionError(f"device index {index} is out of range 0..{MAX_DEVICES - 1}")

    def _store(self, name: str, index: int, value: int) -> None:
        """One aligned store: through the map's typed view, or one pwrite of the word's bytes."""
        ctype = _HEADER_FIELDS[name].ctype
        code, size = CTYPES[ctype]
        if self._map is not None:
            view = self._i64 if ctype == "int64_t" else self._u64 if size == 8 else self._u32
            view[_H[name] // size + index] = value
            return
        try:
            wrote = os.pwrite(self._fd, struct.pack("=" + code, value), _H[name] + index * size)
        except OSError as err:
            raise RegionError(f"{self.path}: cannot write {name}: {err.strerror}") from err
        if wrote != size:
            raise RegionError(f"{self.path}: writing {name} stopped after {wrote} of {size} bytes")

    def _limits_through_the_map(self, what: str) -> None:
        if self._map is None:
            raise RegionError(
                f"{self.path}: {what} is written only through the map (a pwrite could be read torn); "
                "open the region with mapped=True"
            )

    def set_limit(self, index: int, limit_bytes: int) -> None:
        """Change one device's memory limit (0 = none); running processes see it at their next allocation."""
        self._limits_through_the_map("a memory limit")
        self._device(index)
        if limit_bytes < 0:
            raise RegionError(f"limit {limit_bytes} is negative; give bytes >= 0 (0 = no limit)")
        self._store("limit", index, limit_bytes)

    def set_sm_limit(self, index: int, percent: int) -> None:
        self._limits_through_the_map("an SM limit")
        self._device(index)
        if not 0 <= percent <= 100:
            raise RegionError(f"SM limit {percent} must be a percent 0..100 (0 = no cap)")
        self._store("sm_limit", index, percent)

    def set_budget(self, index: int, budget_bytes: int) -> None:
        """Change one device's spill point (0 = the card's free memory); from the next allocation on."""
        self._limits_through_the_map("a budget")
        self._device(index)
        if budget_bytes < 0:
            raise RegionError(
                f"budget {budget_bytes} is negative; give bytes >= 0 (0 = the card's free memory)"
            )
        self._store("budget", index, budget_bytes)

    def set_flags(self, index: int, flags: int) -> None:
        """The monitor's per-card word for device ``index`` (FLAG_YIELD, FLAG_ALONE, FLAG_GUARD)."""
        self._device(index)
        self._store("flags", index, flags)

    def set_arbiter_ns(self, now_ns: int) -> None:
        """When the monitor last wrote the flags (CLOCK_MONOTONIC ns); the hook ignores older than 1 s."""
        self._store("arbiter_ns", 0, now_ns)


def _decode(data: bytes, max_procs: int) -> Snapshot:
    h = HEADER_LAYOUT.offsets
    num = min(_u("I", data, h["num_devices"]), MAX_DEVICES)
    devices = []
    for i in range(num):
        raw = data[h["uuid"] + i * UUID_BYTES : h["uuid"] + (i + 1) * UUID_BYTES]
        devices.append(
            DeviceState(
                index=i,
                uuid=raw.split(b"\0", 1)[0].decode("ascii", "replace"),
                limit_bytes=_u("Q", data, h["limit"] + 8 * i),
                sm_limit=_u("I", data, h["sm_limit"] + 4 * i),
                used_bytes=_u("Q", data, h["used"] + 8 * i),
                budget_bytes=_u("Q", data, h["budget"] + 8 * i),
                spilled_bytes=_u("Q", data, h["spilled"] + 8 * i),
                tokens_ns=_u("q", data, h["tokens"] + 8 * i),
                busy_ns=_u("Q", data, h["busy_ns"] + 8 * i),
                throttled_ns=_u("Q", data, h["throttled_ns"] + 8 * i),
                last_launch_ns=_u("Q", data, h["last_launch_ns"] + 8 * i),
                flags=_u("I", data, h["flags"] + 4 * i),
            )
        )
    s = SLOT_LAYOUT.offsets
    processes = []
    # the pid and active words of every slot, read through one strided view: most slots are free
    words = memoryview(data)[HEADER_LAYOUT.size : HEADER_LAYOUT.size + max_procs * SLOT_LAYOUT.size].cast("i")
    stride = SLOT_LAYOUT.size // 4
    pids, actives = words[s["pid"] // 4 :: stride], words[s["active"] // 4 :: stride]
    for k in range(max_procs):
        if pids[k] == 0 or actives[k] == 0:
            continue
        base = HEADER_LAYOUT.size + k * SLOT_LAYOUT.size
        pid = pids[k]
        used = tuple(_u("Q", data, base + s["used"] + 8 * i) for i in range(num))
        spilled = tuple(_u("Q", data, base + s["spilled"] + 8 * i) for i in range(num))
        processes.append(ProcessUsage(pid, _u("Q", data, base + s["start_time"]), used, spilled))
    return Snapshot(
        tuple(devices),
        tuple(processes),
        priority=_u("I", data, h["priority"]),
        sm_policy=_u("I", data, h["sm_policy"]),
        arbiter_ns=_u("Q", data, h["arbiter_ns"]),
    )


MAX_BYTES = (1 << 64) - 1  # a limit or budget is one uint64_t word of the region and the grant
