"""The grant (vgpu/hookabi/grant.py): its codec, damage detection, and changes made in place."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.region import format_region
from vgpu.hookabi.grant import (
    Grant,
    GrantError,
    as_granted,
    decode,
    encode,
    grant_of_container_dir,
    read_grant,
    update_grant,
    write_grant,
)
from vgpu.hookabi.layout import GRANT_LAYOUT, GRANT_PAYLOAD, fnv1a64
from vgpu.hookabi.region import Region
from vgpu.hookabi.resize import LimitError, apply_limits, validate_limits

GIB = 1 << 30

grants = st.builds(
    lambda n, data: Grant(
        uuids=tuple(f"GPU-{i:04d}" for i in range(n)),
        limits=tuple(data.draw(st.integers(0, 1 << 50)) for _ in range(n)),
        sm_limits=tuple(data.draw(st.integers(0, 100)) for _ in range(n)),
        budgets=tuple(data.draw(st.integers(0, 1 << 50)) for _ in range(n)),
        priority=data.draw(st.integers(0, 1)),
        sm_policy=data.draw(st.integers(0, 1)),
        oversubscribe=data.draw(st.booleans()),
        region_path=data.draw(st.text("abc/_-", max_size=200)),
        context_reserve=data.draw(st.integers(0, 1 << 40)),
    ),
    st.integers(1, 16),
    st.data(),
)


@given(grants)
def test_every_grant_reads_back_as_written(grant: Grant) -> None:
    assert decode(encode(grant)) == grant


@given(grants, st.integers(GRANT_PAYLOAD, GRANT_LAYOUT.size - 1), st.integers(1, 255))
def test_any_changed_byte_of_the_payload_is_refused_as_damage(grant: Grant, at: int, flip: int) -> None:
    data = bytearray(encode(grant))
    data[at] ^= flip
    with pytest.raises(GrantError, match="damaged"):
        decode(bytes(data))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"uuids": ()}, "1..16 devices"),
        ({"sm_limits": (101,)}, "percents"),
        ({"limits": (-1,)}, ">= 0"),
        ({"priority": 2}, "must be 0 or 1"),
        ({"limits": (1, 2)}, "2 entries for 1 devices"),
    ],
)
def test_a_grant_that_cannot_be_is_refused_when_made(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"uuids": ("GPU-a",), "limits": (GIB,)} | kwargs
    with pytest.raises(GrantError, match=message):
        Grant(**fields)  # type: ignore[arg-type]


def test_a_file_that_is_not_a_grant_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.limits"
    path.write_bytes(b"\0" * GRANT_LAYOUT.size)
    with pytest.raises(GrantError, match=f"{path} is not a vgpu grant"):
        read_grant(path)
    path.write_bytes(b"short")
    with pytest.raises(GrantError, match="holds 5 bytes"):
        read_grant(path)
    with pytest.raises(GrantError, match="cannot open grant"):
        read_grant(tmp_path / "missing.limits")


def test_a_change_is_made_in_place_so_a_mount_of_the_file_sees_it(tmp_path: Path) -> None:
    path = tmp_path / "grants" / "u_c.limits"
    write_grant(path, Grant(("GPU-a", "GPU-b"), (GIB, 2 * GIB), (10, 20)))
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    inode = path.stat().st_ino
    changed = update_grant(path, 1, limit=3 * GIB, sm_limit=50)
    assert path.stat().st_ino == inode
    assert read_grant(path) == changed
    assert (changed.limits, changed.sm_limits, changed.seq) == ((GIB, 3 * GIB), (10, 50), 2)
    # a second write_grant of a valid grant also changes it in place
    write_grant(path, Grant(("GPU-a",), (5 * GIB,)))
    assert path.stat().st_ino == inode and read_grant(path).limits == (5 * GIB,)
    with pytest.raises(GrantError, match="device 1 is not granted"):
        update_grant(path, 1, limit=GIB)


def test_a_reader_never_sees_a_grant_mid_change(tmp_path: Path) -> None:
    path = tmp_path / "u_c.limits"
    write_grant(path, Grant(("GPU-a",), (GIB,)))
    stop = threading.Event()
    seen: list[int] = []
    errors: list[Exception] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.append(read_grant(path).limits[0])
            except GrantError as err:  # a damaged-looking copy would land here
                errors.append(err)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(300):
            update_grant(path, 0, limit=(i % 7 + 1) * GIB)
    finally:
        stop.set()
        thread.join()
    assert errors == [] and seen and set(seen) <= {(k + 1) * GIB for k in range(7)}


def test_the_grant_of_a_container_folder_is_the_plugins_layout() -> None:
    assert grant_of_container_dir(Path("/r/var/lib/vgpu/containers/uid_main")) == Path(
        "/r/var/lib/vgpu/grants/uid_main.limits"
    )


def _container(tmp_path: Path, with_region: bool = True) -> tuple[Path, Path]:
    folder = tmp_path / "var/lib/vgpu/containers/u_main"
    folder.mkdir(parents=True)
    region = folder / "vgpu.region"
    if with_region:
        format_region(region, ["GPU-a"], limits=[GIB], sm_limits=[30])
    grant = tmp_path / "var/lib/vgpu/grants/u_main.limits"
    write_grant(grant, Grant(("GPU-a",), (GIB,), (30,)))
    return region, grant


def test_live_resize_changes_the_grant_and_the_regions_copy(tmp_path: Path) -> None:
    region, grant = _container(tmp_path)
    apply_limits(region, 0, memory_bytes=2 * GIB, sm_percent=50)
    assert (read_grant(grant).limits, read_grant(grant).sm_limits) == ((2 * GIB,), (50,))
    with Region(region) as r:
        assert (r.word("limit", 0), r.word("sm_limit", 0)) == (2 * GIB, 50)


def test_live_resize_of_a_granted_container_works_before_its_first_cuda_process(tmp_path: Path) -> None:
    region, grant = _container(tmp_path, with_region=False)
    apply_limits(region, 0, memory_bytes=512 << 20)
    assert read_grant(grant).limits == (512 << 20,)
    assert not region.exists()
    with pytest.raises(LimitError, match="device: 3 is out of range"):
        apply_limits(region, 3, memory_bytes=GIB)


def test_a_refused_resize_writes_neither_file(tmp_path: Path) -> None:
    region, grant = _container(tmp_path)
    before = (region.read_bytes(), grant.read_bytes())
    for kwargs in ({"sm_percent": 101}, {"memory_bytes": -1}, {}):
        with pytest.raises(LimitError):
            apply_limits(region, 0, **kwargs)  # type: ignore[arg-type]
    assert (region.read_bytes(), grant.read_bytes()) == before


@pytest.mark.parametrize(
    ("kwargs", "field", "reason"),
    [
        ({}, "limits", "nothing to change"),
        ({"memory_bytes": -1}, "memory limit", "-1 bytes is negative"),
        ({"budget_bytes": -1}, "budget", "-1 bytes is negative"),
        ({"sm_percent": 101}, "SM limit", "101 is not a percent"),
        ({"memory_bytes": GIB, "device": 2}, "device", "2 is out of range: the container has devices 0..1"),
    ],
)
def test_validation_names_the_field_in_plain_words_never_a_flag(
    kwargs: dict[str, int], field: str, reason: str
) -> None:
    device = kwargs.pop("device", 0)
    with pytest.raises(LimitError) as refused:
        validate_limits(device, devices=2, **kwargs)  # type: ignore[arg-type]
    assert refused.value.field == field and refused.value.reason.startswith(reason)
    assert str(refused.value).startswith(f"{field}: {reason}") and "--" not in str(refused.value)


def test_validation_returns_the_change_and_what_to_know_without_touching_a_file() -> None:
    change = validate_limits(
        1, devices=2, memory_bytes=GIB, sm_percent=40, used_bytes=2 * GIB, budget_now=3 * GIB
    )
    assert (change.device, change.memory_bytes, change.sm_percent, change.budget_bytes) == (1, GIB, 40, None)
    assert change.notes == (
        "device 1: the new limit 1024 MiB is below the 2048 MiB in use; nothing is taken back, new "
        "allocations are refused until usage falls under it",
        "device 1: the budget 3072 MiB is above the limit: nothing will spill",
    )
    assert validate_limits(0, devices=1, budget_bytes=0, budget_now=3 * GIB).notes == ()


def test_the_snapshot_shows_the_granted_limits_and_where_the_region_differs(tmp_path: Path) -> None:
    region, grant = _container(tmp_path)
    with Region(region, writable=True) as r:
        r.set_limit(0, 64 * GIB)
        snap = r.snapshot()
    granted, differ = as_granted(snap, read_grant(grant))
    assert granted.devices[0].limit_bytes == GIB
    assert differ == [f"device 0 memory limit {64 * GIB} in the region, {GIB} granted"]


def test_a_grant_whose_names_are_not_printable_ascii_is_refused(tmp_path: Path) -> None:
    data = bytearray(encode(Grant(("GPU-a",), (GIB,), region_path="/r")))
    data[GRANT_LAYOUT.offsets["region_path"] + 1] = 0xE9  # a byte that would not read back the same
    at = GRANT_LAYOUT.offsets["checksum"]
    data[at : at + 8] = fnv1a64(bytes(data[GRANT_PAYLOAD:])).to_bytes(8, "little")
    path = tmp_path / "g.limits"
    path.write_bytes(bytes(data))
    with pytest.raises(GrantError, match="not printable ASCII"):
        read_grant(path)
    with pytest.raises(GrantError, match="printable ASCII"):
        Grant(("GPU-\u00e9",), (GIB,))
