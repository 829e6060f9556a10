"""The region layout has one definition (vgpu/hookabi/layout.py); the C header is generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.region import format_region
from vgpu.hookabi import layout, region

HEADER = Path(__file__).resolve().parents[2] / "native" / "hook" / "region_layout.h"


def test_the_committed_c_header_is_generated_from_the_python_layout() -> None:
    assert HEADER.read_text() == layout.c_header(), (
        "run: python -m vgpu.hookabi.layout --c-header > native/hook/region_layout.h"
    )


def test_offsets_follow_c_alignment_rules() -> None:
    off = layout.HEADER_LAYOUT.offsets
    assert off["magic"] == 0
    assert off["seq"] % 8 == 0
    assert off["lock"] % 64 == 0
    assert off["limit"] % 8 == 0 and off["used"] % 8 == 0
    assert layout.HEADER_LAYOUT.size % 64 == 0
    assert layout.REGION_SIZE == layout.HEADER_LAYOUT.size + layout.MAX_PROCS * layout.SLOT_LAYOUT.size


def test_a_file_that_is_not_a_region_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    bogus = tmp_path / "region"
    bogus.write_bytes(b"x" * layout.REGION_SIZE)
    with pytest.raises(region.RegionError, match="not a vgpu region"):
        region.Region(bogus)


def test_a_short_file_is_refused_with_its_size(tmp_path: Path) -> None:
    short = tmp_path / "region"
    short.write_bytes(b"\0" * 100)
    with pytest.raises(region.RegionError, match="holds 100 bytes"):
        region.Region(short)


def _with_process(path: Path, version: int, slot: int, pid: int) -> None:
    """A region of layout ``version`` (its number of slots) with one process in ``slot``."""
    procs = layout.SLOTS_BY_VERSION[version]
    format_region(path, ["GPU-a"], limits=[1 << 30])
    data = bytearray(path.read_bytes()[: layout.HEADER_LAYOUT.size]) + bytearray(
        procs * layout.SLOT_LAYOUT.size
    )
    h, s = layout.HEADER_LAYOUT.offsets, layout.SLOT_LAYOUT.offsets
    data[h["version"] : h["version"] + 4] = version.to_bytes(4, "little")
    data[h["max_procs"] : h["max_procs"] + 4] = procs.to_bytes(4, "little")
    base = layout.HEADER_LAYOUT.size + slot * layout.SLOT_LAYOUT.size
    data[base + s["pid"] : base + s["pid"] + 4] = pid.to_bytes(4, "little")
    data[base + s["active"] : base + s["active"] + 4] = (1).to_bytes(4, "little")
    data[base + s["used"] : base + s["used"] + 8] = (640 << 20).to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("mapped", [True, False])
def test_layout_3_holds_1024_process_slots_and_reads_its_last(tmp_path: Path, mapped: bool) -> None:
    assert (layout.LAYOUT_VERSION, layout.MAX_PROCS) == (3, 1024)
    _with_process(tmp_path / "region", 3, 1023, 4242)
    with region.Region(tmp_path / "region", mapped=mapped) as r:
        (proc,) = r.snapshot().processes
    assert (proc.pid, proc.used_bytes) == (4242, (640 << 20,))


@pytest.mark.parametrize("mapped", [True, False])
def test_a_layout_2_region_of_a_container_started_before_an_upgrade_still_reads(
    tmp_path: Path, mapped: bool
) -> None:
    """Layout 3 changed only the number of slots (256 -> 1024): the monitor keeps reading the older."""
    _with_process(tmp_path / "region", 2, 255, 4243)
    assert (tmp_path / "region").stat().st_size == layout.region_size(256) < layout.REGION_SIZE
    with region.Region(tmp_path / "region", mapped=mapped) as r:
        assert r.intact()
        (proc,) = r.snapshot().processes
    assert proc.pid == 4243


def test_a_layout_2_header_on_a_file_cut_short_is_refused_with_its_size(tmp_path: Path) -> None:
    _with_process(tmp_path / "region", 2, 0, 4244)
    path = tmp_path / "region"
    path.write_bytes(path.read_bytes()[: layout.region_size(256) - 1])
    with pytest.raises(region.RegionError, match=f"a layout-2 region needs {layout.region_size(256)}"):
        region.Region(path)
