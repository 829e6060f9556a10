"""The MIG tables (vgpu/core/mig.py) against a real H100 or H200's driver, read-only: nothing
here changes the card's MIG mode or makes an instance (run with `pytest -m gpu`).

NVML answers profile and placement queries whatever the card's MIG mode on drivers that can
(``NVML_FI_DEV_IS_MIG_MODE_INDEPENDENT_MIG_QUERY_CAPABLE``); where it refuses, the test says so
and skips."""

from __future__ import annotations

import ctypes

import pytest

from vgpu.core.mig import MigError, table_for_model
from vgpu.node.mig import NvmlMig

pytestmark = pytest.mark.gpu


def test_the_cards_mode_and_table_read_through_nvml() -> None:
    mig = NvmlMig()
    try:
        for uuid in mig.cards():
            mode = mig.mode(uuid)  # read-only: nvmlDeviceGetMigMode
            assert isinstance(mode.current, bool) and isinstance(mode.pending, bool)
            try:
                mig.table(uuid)
            except MigError as err:
                pytest.skip(f"card {uuid}: {err}")
            if mode.current:
                for d in mig.devices(uuid):
                    assert d.uuid.startswith("MIG-") and d.parent == uuid
    finally:
        mig.close()


def test_profile_ids_slices_and_placements_match_the_driver() -> None:
    import pynvml as nv

    nv.nvmlInit()
    try:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        name = nv.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        try:
            table = table_for_model(name, int(nv.nvmlDeviceGetMemoryInfo(h).total) >> 20)
        except MigError as err:
            pytest.skip(str(err))
        for p in table.profiles:
            try:
                info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, p.nvml_profile)
            except nv.NVMLError as err:
                pytest.skip(f"the driver answers no profile query in this MIG mode ({err})")
            assert info.id == p.profile_id, p.name
            assert info.sliceCount == p.compute_slices, p.name
            assert info.instanceCount == p.instances, p.name
            assert info.multiprocessorCount == p.sms, p.name
            assert (info.decoderCount, info.jpegCount, info.ofaCount) == (p.decoders, p.jpegs, p.ofas), p.name
            print(f"{p.name}: driver {info.memorySizeMB} MiB, table {p.memory_mib} MiB")
            assert abs(info.memorySizeMB - p.memory_mib) <= p.memory_mib // 20, p.name  # within 5 %
            refs = (nv.c_nvmlGpuInstancePlacement_t * 8)()
            count = ctypes.c_uint(8)
            nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, refs, ctypes.byref(count))
            got = [(refs[i].start, refs[i].size) for i in range(count.value)]
            assert got == [(pl.start, pl.size) for pl in p.placements], p.name
    finally:
        nv.nvmlShutdown()
