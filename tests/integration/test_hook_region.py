"""The shared region: one limit for every process of a container, dead processes reaped, a
process killed holding the lock blocks nobody, and a bad region file never lifts the limit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hook_harness import Built, Holder, build, env, run

from vgpu.hookabi import layout
from vgpu.hookabi.region import Region

MIB = 1 << 20


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


def shared(built: Built, path: Path, limit: str = "1g") -> dict[str, str]:
    return env(built, CUDA_DEVICE_MEMORY_LIMIT=limit, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(path))


def test_c_and_python_lay_the_region_out_identically(built: Built) -> None:
    out = subprocess.run([built.prog("t_layout")], capture_output=True, text=True, check=True).stdout
    c = dict(line.rsplit(" ", 1) for line in out.splitlines())
    for name, offset in layout.HEADER_LAYOUT.offsets.items():
        assert int(c[f"header.{name}"]) == offset, name
    for name, offset in layout.SLOT_LAYOUT.offsets.items():
        assert int(c[f"slot.{name}"]) == offset, name
    assert int(c["header_size"]) == layout.HEADER_LAYOUT.size
    assert int(c["slot_size"]) == layout.SLOT_LAYOUT.size
    assert int(c["region_size"]) == layout.REGION_SIZE
    assert int(c["magic"]) == layout.MAGIC and int(c["version"]) == layout.LAYOUT_VERSION
    for name, offset in layout.GRANT_LAYOUT.offsets.items():
        assert int(c[f"grant.{name}"]) == offset, name
    assert int(c["grant_size"]) == layout.GRANT_LAYOUT.size
    assert (int(c["grant_magic"]), int(c["grant_version"])) == (layout.GRANT_MAGIC, layout.GRANT_VERSION)
    assert int(c["grant_payload"]) == layout.GRANT_PAYLOAD


def test_the_python_reader_sees_what_the_hook_wrote(built: Built, tmp_path: Path) -> None:
    path = tmp_path / "region"
    uuid = "GPU-10101010-1010-1010-1010-101010101010"
    environ = shared(built, path) | {"NVIDIA_VISIBLE_DEVICES": uuid, "CUDA_DEVICE_SM_LIMIT": "30"}
    holder = Holder(built, 300, environ)
    try:
        with Region(path) as r:
            snap = r.snapshot()
    finally:
        holder.release()
    (device,) = snap.devices
    assert device.uuid == uuid and device.limit_bytes == 1 << 30 and device.sm_limit == 30
    assert device.used_bytes == 300 * MIB
    assert [(p.pid, p.used_bytes) for p in snap.processes] == [(holder.pid, (300 * MIB,))]
    with Region(path) as r:
        after = r.snapshot()
    assert after.processes == () and after.devices[0].used_bytes == 0  # a clean exit gives its slot back


def test_two_processes_share_one_limit(built: Built, tmp_path: Path) -> None:
    environ = shared(built, tmp_path / "region")
    first = Holder(built, 600, environ)
    try:
        assert first.held == "held=0"
        second = run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ)
        assert second.int("chunks") == 1  # 424 MiB left of 1 GiB
    finally:
        first.release()
    assert run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ).int("chunks") == 4


def test_two_processes_cannot_each_hold_more_than_half(built: Built, tmp_path: Path) -> None:
    environ = shared(built, tmp_path / "region", "4g")
    first = Holder(built, 3072, environ)
    second = Holder(built, 3072, environ)
    try:
        assert sorted([first.held, second.held]) == ["held=0", "held=2"]
    finally:
        first.release()
        second.release()


def test_a_process_killed_with_sigkill_does_not_leak_its_usage(built: Built, tmp_path: Path) -> None:
    path = tmp_path / "region"
    environ = shared(built, path)
    victim = Holder(built, 600, environ)
    assert victim.held == "held=0"
    victim.kill()
    r = run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ)
    assert r.int("chunks") == 4
    with Region(path) as reg:
        assert victim.pid not in {p.pid for p in reg.snapshot().processes}


def test_a_killed_process_nobody_has_waited_for_yet_is_reaped_too(built: Built, tmp_path: Path) -> None:
    environ = shared(built, tmp_path / "region")
    victim = Holder(built, 600, environ)
    assert victim.held == "held=0"
    victim.kill(wait=False)  # a zombie until its parent waits: kill(pid, 0) still succeeds
    try:
        assert run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ).int("chunks") == 4
    finally:
        victim.proc.wait(timeout=10)


def test_a_process_killed_while_holding_the_lock_blocks_nobody(built: Built, tmp_path: Path) -> None:
    path = tmp_path / "region"
    environ = shared(built, path)
    victim = Holder(built, 600, environ, lock=True)
    assert victim.held == "held=0" and victim.locked == "locked=0"
    victim.kill()
    r = run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ, timeout=20)
    assert r.returncode == 0 and r.int("chunks") == 4
    with Region(path) as reg:
        snap = reg.snapshot()  # the seqlock was left odd by the victim and repaired
    assert snap.devices[0].used_bytes == 0 and snap.processes == ()


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xab" * layout.REGION_SIZE, "is not a vgpu region"),
        (b"\0" * 64, "holds 64 bytes"),
        (
            layout.MAGIC.to_bytes(8, "little")
            + (99).to_bytes(4, "little")
            + b"\0" * (layout.REGION_SIZE - 12),
            "layout version 99",
        ),
    ],
    ids=["garbage", "short", "foreign-version"],
)
def test_a_bad_region_file_is_logged_and_the_limit_still_holds(
    built: Built, tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "region"
    _write(path, content)
    r = run(built, "t_alloc", "procaddr", "alloc", "256", environ=shared(built, path))
    assert message in r.stderr and str(path) in r.stderr
    assert "enforces its own limits alone" in r.stderr
    assert r.int("chunks") == 4 and r.int("refused") == 2
    assert path.read_bytes() == content  # someone else's file is left as it was
