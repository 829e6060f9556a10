"""A region file made in Python, as the hook's ``init_header`` lays it out (contract 5), for tests
that need one without a CUDA process: the monitor's reader, the arbiter, ``vgpu limits``.

The hook creates the real ones (it alone can set up the process-shared robust mutex; here its
bytes stay zero), so a CUDA process should never attach to a file made by this. It lived in
``vgpu.hookabi.region`` until issue 38: nothing in the product calls it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

from vgpu.hookabi.layout import (
    HEADER_LAYOUT,
    LAYOUT_VERSION,
    MAGIC,
    MAX_DEVICES,
    MAX_PROCS,
    REGION_SIZE,
    SLOT_LAYOUT,
    UUID_BYTES,
)

_H = HEADER_LAYOUT.offsets


def format_region(
    path: str | os.PathLike[str],
    uuids: Sequence[str],
    *,
    limits: Sequence[int] = (),
    sm_limits: Sequence[int] = (),
    budgets: Sequence[int] = (),
    priority: int = 1,
    sm_policy: int = 0,
) -> None:
    """Write a fresh region file as the hook's ``init_header`` lays it out."""
    buf = bytearray(REGION_SIZE)
    struct.pack_into("=Q", buf, _H["magic"], MAGIC)
    for name, value in (
        ("version", LAYOUT_VERSION),
        ("header_size", HEADER_LAYOUT.size),
        ("slot_size", SLOT_LAYOUT.size),
        ("max_devices", MAX_DEVICES),
        ("max_procs", MAX_PROCS),
        ("num_devices", len(uuids)),
        ("priority", priority),
        ("sm_policy", sm_policy),
    ):
        struct.pack_into("=I", buf, _H[name], value)
    for i, uuid in enumerate(uuids):
        raw = uuid.encode()[: UUID_BYTES - 1]
        buf[_H["uuid"] + i * UUID_BYTES : _H["uuid"] + i * UUID_BYTES + len(raw)] = raw
    for name, values, code in (
        ("limit", limits, "Q"),
        ("sm_limit", sm_limits, "I"),
        ("budget", budgets, "Q"),
    ):
        for i, value in enumerate(values):
            struct.pack_into("=" + code, buf, _H[name] + struct.calcsize(code) * i, value)
    Path(path).write_bytes(bytes(buf))
