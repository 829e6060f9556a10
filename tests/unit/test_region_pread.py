"""The node monitor's way to read a region: pread, never a map, so a cut file is an error, not SIGBUS."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import pytest

from tests.support.region import format_region
from vgpu.hookabi import layout, region

H = layout.HEADER_LAYOUT.offsets


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "vgpu.region"
    format_region(p, ["GPU-a", "GPU-b"], limits=[1 << 30, 0], sm_limits=[50, 0], priority=0)
    return p


def put(path: Path, field: str, value: int, code: str = "Q", index: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(H[field] + index * struct.calcsize(code))
        f.write(struct.pack("=" + code, value))


def test_it_reads_what_the_map_reads_and_maps_nothing(path: Path) -> None:
    put(path, "busy_ns", 7, index=1)
    with region.Region(path) as mapped:
        expected = mapped.snapshot()
    with region.Region(path, mapped=False) as r:
        maps = Path("/proc/self/maps").read_text()
        assert str(path) not in maps
        assert r.snapshot() == expected
        header = r.read_header()
        assert (header.num_devices, header.uuid(1), header.word("busy_ns", 1)) == (2, "GPU-b", 7)
        assert (r.num_devices, r.uuid(0), r.word("limit"), r.word("priority")) == (2, "GPU-a", 1 << 30, 0)
    assert expected.devices[0].sm_limit == 50


@pytest.mark.parametrize("size", [0, 100, layout.HEADER_LAYOUT.size // 2, layout.REGION_SIZE // 2])
def test_a_file_cut_short_after_it_was_opened_is_an_error_not_a_signal(path: Path, size: int) -> None:
    with region.Region(path, writable=True, mapped=False) as r:
        os.truncate(path, size)
        with pytest.raises(region.RegionError, match="cut short"):
            r.snapshot()
        if size < layout.HEADER_LAYOUT.size:
            with pytest.raises(region.RegionError, match="cut short"):
                r.read_header()
            with pytest.raises(region.RegionError, match="cut short"):
                r.word("flags", 1)
        assert not r.intact()


def test_a_short_file_is_refused_at_open(tmp_path: Path) -> None:
    short = tmp_path / "vgpu.region"
    short.write_bytes(b"\0" * 100)
    with pytest.raises(region.RegionError, match="holds 100 bytes"):
        region.Region(short, mapped=False)


def test_a_wrong_magic_is_refused_at_open_and_when_rewritten_later(path: Path) -> None:
    with region.Region(path, mapped=False) as r:
        put(path, "magic", 0)  # cut to nothing and grown back: zeros where the region was
        with pytest.raises(region.RegionError, match="no longer a vgpu region"):
            r.read_header()
        with pytest.raises(region.RegionError, match="no longer a vgpu region"):
            r.snapshot()
    with pytest.raises(region.RegionError, match="not a vgpu region"):
        region.Region(path, mapped=False)


def test_a_seq_held_odd_too_long_gives_up_and_an_odd_seq_that_ends_is_waited_for(path: Path) -> None:
    put(path, "seq", 3)
    with region.Region(path, mapped=False) as r:
        with pytest.raises(region.RegionError, match="mid-update for too long"):
            r.snapshot(attempts=20)
        done = threading.Timer(0.02, put, (path, "seq", 4))
        done.start()
        assert r.snapshot().devices[0].limit_bytes == 1 << 30  # about 0.1 s of retries by default
        done.join()


def test_the_arbiter_words_are_written_with_pwrite_and_limits_are_refused(path: Path) -> None:
    with region.Region(path, writable=True, mapped=False) as r:
        r.set_flags(1, layout.FLAG_YIELD)
        r.set_arbiter_ns(0x0102030405060708)
        for setter in (r.set_limit, r.set_sm_limit, r.set_budget):
            with pytest.raises(region.RegionError, match="only through the map"):
                setter(0, 1)
    with region.Region(path) as mapped:
        assert mapped.word("flags", 1) == layout.FLAG_YIELD and mapped.word("flags", 0) == 0
        assert mapped.word("arbiter_ns") == 0x0102030405060708
        assert mapped.word("limit") == 1 << 30
    assert os.path.getsize(path) == layout.REGION_SIZE


def test_a_read_only_reader_cannot_write(path: Path) -> None:
    with region.Region(path, mapped=False) as r, pytest.raises(region.RegionError, match="cannot write"):
        r.set_flags(0, 1)


def test_a_link_or_a_fifo_is_refused_without_blocking(path: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(region.RegionError, match="symbolic link"):
        region.Region(link, mapped=False)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(region.RegionError, match="not a regular file"):
        region.Region(fifo, writable=True, mapped=False)
