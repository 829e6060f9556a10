"""The hook's binary ABI: the one definition of the region's and the grant's layouts.

One definition, here: ``HEADER`` and ``SLOT`` (the region file of contract 5 in docs/contracts.md, one per
container, mapped by every CUDA process in it) and ``GRANT`` (what the device plugin granted a
container, vgpu/hookabi/grant.py). ``python -m vgpu.hookabi.layout --c-header`` emits
``native/hook/region_layout.h`` from them (the C side includes that header and
``_Static_assert``s every offset), and a test checks that the committed header matches this
module and that a C program built against it reports the same offsets. Reading and writing a
region is ``vgpu.hookabi.region``; a grant, ``vgpu.hookabi.grant``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = int.from_bytes(b"VGPUREGN", "little")
LAYOUT_VERSION = 3
MAX_DEVICES = 16
MAX_PROCS = 1024  # process slots: CUDA processes of one container at once (layout 2 had 256)
UUID_BYTES = 64
LOCK_BYTES = 64  # holds a glibc pthread_mutex_t (40 bytes on x86-64 and aarch64)

# C type -> (struct code, size); alignment equals size for these scalars.
CTYPES: dict[str, tuple[str, int]] = {
    "uint8_t": ("B", 1),
    "char": ("c", 1),
    "int32_t": ("i", 4),
    "int64_t": ("q", 8),
    "uint32_t": ("I", 4),
    "uint64_t": ("Q", 8),
}


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str
    count: int = 1  # array length; 1 means a scalar
    count2: int = 1  # second dimension (uuid strings)
    align: int = 0  # extra alignment (the mutex); 0 means natural
    doc: str = ""


# The one definition of the layout. Append fields only at the end of a struct and bump
# LAYOUT_VERSION whenever an offset or the number of slots changes.
HEADER: tuple[Field, ...] = (
    Field("magic", "uint64_t", doc="MAGIC: the bytes 'VGPUREGN'"),
    Field("version", "uint32_t", doc="LAYOUT_VERSION"),
    Field("header_size", "uint32_t", doc="bytes of this header; slots follow"),
    Field("slot_size", "uint32_t", doc="bytes of one process slot"),
    Field("max_devices", "uint32_t"),
    Field("max_procs", "uint32_t"),
    Field("num_devices", "uint32_t", doc="devices the container sees (entries used below)"),
    Field("seq", "uint64_t", doc="odd while a writer changes usage, even otherwise"),
    Field("lock", "uint8_t", LOCK_BYTES, align=64, doc="process-shared robust pthread mutex"),
    Field("limit", "uint64_t", MAX_DEVICES, doc="bytes per device; 0 = no limit; live-resizable"),
    Field("sm_limit", "uint32_t", MAX_DEVICES, doc="percent of SMs per device; 0 = no cap"),
    Field("used", "uint64_t", MAX_DEVICES, doc="bytes in use per device, the sum of the slots"),
    Field("uuid", "char", MAX_DEVICES, UUID_BYTES, doc="device UUID per index, NUL-terminated"),
    # layout 2: compute limits, priority, virtual device memory, the monitor's arbitration
    Field("priority", "uint32_t", doc="CUDA_TASK_PRIORITY: 0 high, 1 normal (the hook writes it)"),
    Field("sm_policy", "uint32_t", doc="0 = hold to the cap; 1 = work-conserving when alone on the card"),
    Field("arbiter_ns", "uint64_t", doc="monotonic ns of the monitor's last flags write; stale: ignored"),
    Field("budget", "uint64_t", MAX_DEVICES, doc="device bytes before spilling; 0 = card's free memory"),
    Field("spilled", "uint64_t", MAX_DEVICES, doc="bytes served from mapped host memory, sum of slots"),
    Field("tokens", "int64_t", MAX_DEVICES, doc="SM bucket: ns of GPU time the container may still use"),
    Field("refill_ns", "uint64_t", MAX_DEVICES, doc="monotonic ns the bucket was last refilled"),
    Field("busy_ns", "uint64_t", MAX_DEVICES, doc="GPU time the container's work took (counter)"),
    Field("throttled_ns", "uint64_t", MAX_DEVICES, doc="time launches waited: SM cap or priority (counter)"),
    Field("last_launch_ns", "uint64_t", MAX_DEVICES, doc="monotonic ns of the newest launch"),
    Field("flags", "uint32_t", MAX_DEVICES, doc="monitor-written: bit 0 yield, bit 1 alone on card"),
)

SLOT: tuple[Field, ...] = (
    Field("pid", "int32_t", doc="0 = free slot"),
    Field("active", "uint32_t"),
    Field("start_time", "uint64_t", doc="process start (clock ticks since boot), tells pid reuse apart"),
    Field("used", "uint64_t", MAX_DEVICES, doc="bytes this process holds per device"),
    Field("spilled", "uint64_t", MAX_DEVICES, doc="of those, bytes served from mapped host memory"),
)

# The grant (layout 3): what the device plugin granted one container, written on the host and
# mounted read-only into the container at GRANT_PATH_IN_CONTAINER, so no process there can raise
# its own limits. The region's limit words are only a mirror of it (see vgpu/hookabi/grant.py).
GRANT_MAGIC = int.from_bytes(b"VGPUGRNT", "little")
GRANT_VERSION = 4  # 2: hold_until_ns, the node's compute gate; 3: share_scale, one measure of a share;
# 4: sharing and mps_pipe, MPS mode (docs/mps.md)
SHARE_SCALE_ONE = 1 << 16  # share_scale's 1.0
PATH_BYTES = 256
GRANT_PATH_IN_CONTAINER = "/etc/vgpu/limits"
# MPS mode: the card's MPS pipe folder as a container sees it (mounted read-only beside the grant)
MPS_PIPE_IN_CONTAINER = "/var/run/vgpu/mps"
SHARING_TIMESLICE = 0  # the grant's sharing word: the card is time-sliced, the hook holds SMs by time
SHARING_MPS = 1  # the card runs an MPS daemon: the hook makes the process its client, SMs by threads
GRANT: tuple[Field, ...] = (
    Field("magic", "uint64_t", doc="GRANT_MAGIC: the bytes 'VGPUGRNT'"),
    Field("version", "uint32_t", doc="GRANT_VERSION"),
    Field("size", "uint32_t", doc="bytes of this struct"),
    Field("seq", "uint64_t", doc="odd while the host changes the grant, even otherwise"),
    Field("checksum", "uint64_t", doc="FNV-1a 64 of every byte from num_devices to the end"),
    Field("num_devices", "uint32_t", doc="devices granted (entries used below)"),
    Field("priority", "uint32_t", doc="0 high, 1 normal"),
    Field("sm_policy", "uint32_t", doc="0 = hold to the cap; 1 = work-conserving when alone on the card"),
    Field("oversubscribe", "uint32_t", doc="1 = spill past the budget to mapped host memory"),
    Field("context_reserve", "uint64_t", doc="bytes charged per CUDA context (the environment may raise it)"),
    Field("limit", "uint64_t", MAX_DEVICES, doc="bytes per device (device plus host); 0 = no limit"),
    Field("sm_limit", "uint32_t", MAX_DEVICES, doc="percent of SMs per device; 0 = no cap"),
    Field("budget", "uint64_t", MAX_DEVICES, doc="device bytes before spilling; 0 = card's free memory"),
    Field("uuid", "char", MAX_DEVICES, UUID_BYTES, doc="device UUID per index, NUL-terminated"),
    Field("region_path", "char", PATH_BYTES, doc="the container's region file, NUL-terminated"),
    # grant layout 2: the node's compute gate (vgpu/monitor/compute.py)
    Field(
        "hold_until_ns",
        "uint64_t",
        MAX_DEVICES,
        doc="the node's gate: no launch on the device before this CLOCK_MONOTONIC ns; 0 = open",
    ),
    # grant layout 3: one measure of a compute share (vgpu/monitor/sharescale.py)
    Field(
        "share_scale",
        "uint32_t",
        MAX_DEVICES,
        doc="the driver's measure of the container's GPU time over the hook's, x 65536: the hook "
        "charges its measure times this; 0 = 65536 (1.0)",
    ),
    # grant layout 4: MPS mode (docs/mps.md)
    Field(
        "sharing",
        "uint32_t",
        doc="SHARING_TIMESLICE (0) or SHARING_MPS (1): the hook makes every process an MPS client "
        "of mps_pipe with sm_limit as its active thread percentage and limit as its pinned memory",
    ),
    Field("mps_pipe", "char", PATH_BYTES, doc="the MPS pipe folder as the container sees it (sharing 1)"),
)

# bits of the header's flags[] word, written only by the node monitor
FLAG_YIELD = 1  # a priority-0 container is busy on this card: priority-1 launches wait
FLAG_ALONE = 2  # no other container is busy on this card: a work-conserving container may pass its cap
FLAG_GUARD = 4  # a priority-0 container is on this card: priority-1 launches keep the queue short
ARBITER_STALE_NS = 1_000_000_000  # flags older than this are ignored (the monitor is gone)


@dataclass(frozen=True)
class Layout:
    offsets: dict[str, int]
    size: int


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def compute_layout(fields: Sequence[Field]) -> Layout:
    """Offsets by the C rules for these scalar types (natural alignment, tail padding)."""
    offset = 0
    biggest = 1
    offsets: dict[str, int] = {}
    for field in fields:
        size = CTYPES[field.ctype][1]
        align = max(size, field.align)
        biggest = max(biggest, align)
        offset = _align(offset, align)
        offsets[field.name] = offset
        offset += size * field.count * field.count2
    return Layout(offsets, _align(offset, biggest))


HEADER_LAYOUT = compute_layout(HEADER)
SLOT_LAYOUT = compute_layout(SLOT)
GRANT_LAYOUT = compute_layout(GRANT)


def region_size(max_procs: int) -> int:
    """Bytes of a region with ``max_procs`` process slots."""
    return HEADER_LAYOUT.size + max_procs * SLOT_LAYOUT.size


REGION_SIZE = region_size(MAX_PROCS)
# The layouts a reader opens, by version: their process slots. Layout 3 changed only the number of
# slots, so the node monitor keeps reading the regions of containers started before an upgrade
# (their hook stays the version they were given). The hook attaches to its own layout only.
SLOTS_BY_VERSION = {2: 256, LAYOUT_VERSION: MAX_PROCS}
GRANT_PAYLOAD = GRANT_LAYOUT.offsets["num_devices"]  # the checksum covers [GRANT_PAYLOAD, size)

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def fnv1a64(data: bytes) -> int:
    """FNV-1a, 64 bits: the grant's checksum (the hook computes the same in C)."""
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def c_header() -> str:
    """The C header the hook includes, generated from HEADER and SLOT."""
    lines = [
        "/* Generated by `python -m vgpu.hookabi.layout --c-header`: do not edit. */",
        "#ifndef VGPU_REGION_LAYOUT_H",
        "#define VGPU_REGION_LAYOUT_H",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
        f"#define VGPU_REGION_MAGIC 0x{MAGIC:016x}ULL",
        f"#define VGPU_REGION_VERSION {LAYOUT_VERSION}u",
        f"#define VGPU_MAX_DEVICES {MAX_DEVICES}",
        f"#define VGPU_MAX_PROCS {MAX_PROCS}",
        f"#define VGPU_UUID_BYTES {UUID_BYTES}",
        f"#define VGPU_LOCK_BYTES {LOCK_BYTES}",
        f"#define VGPU_FLAG_YIELD {FLAG_YIELD}u",
        f"#define VGPU_FLAG_ALONE {FLAG_ALONE}u",
        f"#define VGPU_FLAG_GUARD {FLAG_GUARD}u",
        f"#define VGPU_ARBITER_STALE_NS {ARBITER_STALE_NS}ULL",
        f"#define VGPU_GRANT_MAGIC 0x{GRANT_MAGIC:016x}ULL",
        f"#define VGPU_GRANT_VERSION {GRANT_VERSION}u",
        f"#define VGPU_PATH_BYTES {PATH_BYTES}",
        f'#define VGPU_GRANT_PATH "{GRANT_PATH_IN_CONTAINER}"',
        f'#define VGPU_MPS_PIPE "{MPS_PIPE_IN_CONTAINER}"',
        f"#define VGPU_SHARING_MPS {SHARING_MPS}u",
        f"#define VGPU_GRANT_PAYLOAD {GRANT_PAYLOAD}u",
        "",
    ]
    for cname, fields, layout in (
        ("vgpu_region_header", HEADER, HEADER_LAYOUT),
        ("vgpu_region_slot", SLOT, SLOT_LAYOUT),
        ("vgpu_grant", GRANT, GRANT_LAYOUT),
    ):
        lines.append(f"struct {cname} {{")
        for field in fields:
            dims = ""
            if field.count > 1:
                dims += f"[{field.count}]"
            if field.count2 > 1:
                dims += f"[{field.count2}]"
            attr = f" __attribute__((aligned({field.align})))" if field.align else ""
            doc = f" /* {field.doc} */" if field.doc else ""
            lines.append(f"    {field.ctype} {field.name}{dims}{attr};{doc}")
        lines.append("};")
        for field in fields:
            lines.append(
                f"_Static_assert(offsetof(struct {cname}, {field.name}) == {layout.offsets[field.name]}, "
                f'"{cname}.{field.name} moved: regenerate from vgpu/hookabi/layout.py");'
            )
        lines.append(f'_Static_assert(sizeof(struct {cname}) == {layout.size}, "{cname} size changed");')
        names = " ".join(f"X({field.name})" for field in fields)
        lines.append(f"#define {cname.upper()}_FIELDS(X) {names}")
        lines.append("")
    lines.append(f"#define VGPU_REGION_SIZE {REGION_SIZE}u")
    lines.append("#endif")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the vgpu region layout")
    parser.add_argument("--c-header", action="store_true", help="print the C header for native/hook")
    args = parser.parse_args(argv)
    if args.c_header:
        sys.stdout.write(c_header())
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
