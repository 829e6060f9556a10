"""`vgpu limits set/show --container-dir`: live resize through one checked write, or nothing at all."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.support.region import format_region
from vgpu.commands.cli import main
from vgpu.hookabi import layout, region
from vgpu.hookabi.grant import Grant, read_grant, write_grant
from vgpu.node.paths import REGION_FILE_NAME

MIB = 1 << 20


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A container folder whose region has two devices, 1000 MiB in use on device 0."""
    folder = tmp_path / "uid-1_main"
    folder.mkdir()
    path = folder / REGION_FILE_NAME
    format_region(path, ["GPU-a", "GPU-b"], limits=[3000 * MIB, 0], sm_limits=[30, 0], priority=0)
    data = bytearray(path.read_bytes())
    struct.pack_into("=Q", data, layout.HEADER_LAYOUT.offsets["used"], 1000 * MIB)
    path.write_bytes(bytes(data))
    return folder


def devices(folder: Path) -> tuple[region.DeviceState, ...]:
    with region.Region(folder / REGION_FILE_NAME) as r:
        return r.snapshot().devices


def test_set_takes_mib_percent_and_a_budget_by_container_folder(folder: Path) -> None:
    args = ["--container-dir", str(folder), "--device", "1", "--memory", "4096", "--cores", "50"]
    assert main(["limits", "set", *args, "--budget", "2048"]) == 0
    d = devices(folder)[1]
    assert (d.limit_bytes, d.sm_limit, d.budget_bytes) == (4096 * MIB, 50, 2048 * MIB)
    assert devices(folder)[0].limit_bytes == 3000 * MIB  # the other device is untouched


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096 * MIB), ("4g", 4 << 30), ("512m", 512 * MIB), ("64k", 64 << 10), ("0", 0)],
)
def test_a_plain_number_is_mib_and_a_suffix_names_the_unit(folder: Path, text: str, expected: int) -> None:
    assert main(["limits", "set", "--container-dir", str(folder), "--device", "1", "--memory", text]) == 0
    assert devices(folder)[1].limit_bytes == expected


def test_the_older_form_with_the_region_file_and_sm_still_works(folder: Path) -> None:
    path = folder / REGION_FILE_NAME
    assert main(["limits", "set", str(path), "--device", "0", "--memory", "2g", "--sm", "20"]) == 0
    assert (devices(folder)[0].limit_bytes, devices(folder)[0].sm_limit) == (2 << 30, 20)


def test_shrinking_below_usage_is_done_and_said(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["limits", "set", "--container-dir", str(folder), "--device", "0", "--memory", "500"]) == 0
    out = capsys.readouterr().out
    assert "below the 1000 MiB in use" in out and "refused until usage falls" in out
    assert devices(folder)[0].limit_bytes == 500 * MIB


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--device", "2", "--memory", "100"], "--device"),
        (["--device", "-1", "--memory", "100"], "--device"),
        (["--device", "0", "--cores", "101"], "--cores"),
        (["--device", "0", "--cores", "-5"], "--cores"),
        (["--device", "0", "--memory", "-5"], "--memory"),
        (["--device", "0", "--memory", "4x"], "--memory"),
        (["--device", "0", "--memory", "1.5g"], "--memory"),
        (["--device", "0", "--budget", "-1"], "--budget"),
        (["--device", "0", "--memory", "17179869184g"], "--memory"),  # 2^64 bytes: past a u64 word
        (["--device", "0", "--budget", "99999999999999999999"], "--budget"),
        (["--device", "0", "--memory", "²"], "--memory"),  # a digit to str.isdigit, not to int()
        (["--device", "0", "--memory", "100", "--cores", "200"], "--cores"),
        (["--device", "0"], "--memory/--cores/--budget"),
    ],
)
def test_bad_input_names_the_flag_exits_2_and_changes_nothing(
    folder: Path, capsys: pytest.CaptureFixture[str], args: list[str], flag: str
) -> None:
    before = (folder / REGION_FILE_NAME).read_bytes()
    assert main(["limits", "set", "--container-dir", str(folder), *args]) == 2
    err = capsys.readouterr().err
    assert f"{flag}:" in err and "give" in err
    assert (folder / REGION_FILE_NAME).read_bytes() == before


def test_a_missing_or_foreign_region_exits_2_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["limits", "set", "--container-dir", str(tmp_path), "--device", "0", "--cores", "5"]) == 2
    assert "cannot open region file" in capsys.readouterr().err
    (tmp_path / REGION_FILE_NAME).write_bytes(b"x" * layout.REGION_SIZE)
    assert main(["limits", "show", "--container-dir", str(tmp_path)]) == 2
    assert "not a vgpu region" in capsys.readouterr().err
    assert (tmp_path / REGION_FILE_NAME).read_bytes() == b"x" * layout.REGION_SIZE
    assert main(["limits", "show"]) == 2
    assert "--container-dir" in capsys.readouterr().err


def test_show_has_budget_spill_compute_time_priority_policy_and_flags(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = folder / REGION_FILE_NAME
    data = bytearray(path.read_bytes())
    h = layout.HEADER_LAYOUT.offsets
    struct.pack_into("=Q", data, h["budget"], 2000 * MIB)
    struct.pack_into("=Q", data, h["spilled"], 100 * MIB)
    struct.pack_into("=Q", data, h["busy_ns"], 2_500_000_000)
    struct.pack_into("=Q", data, h["throttled_ns"], 1_000_000_000)
    struct.pack_into("=I", data, h["flags"] + 4, layout.FLAG_YIELD)
    struct.pack_into("=I", data, h["sm_policy"], 1)
    path.write_bytes(bytes(data))
    assert main(["limits", "show", "--container-dir", str(folder)]) == 0
    table = capsys.readouterr().out
    assert "priority 0 (high), sm policy elastic" in table
    row0 = next(line for line in table.splitlines() if line.startswith("0 "))
    for cell in ("3000 MiB", "1000 MiB", "2000 MiB", "100 MiB", "30%", "2.500 s", "1.000 s"):
        assert cell in row0
    assert "yield" in next(line for line in table.splitlines() if line.startswith("1 "))
    assert main(["limits", "show", "--container-dir", str(folder), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["devices"][0]["budget_bytes"] == 2000 * MIB and shown["sm_policy"] == 1


def test_a_limit_is_changed_by_one_store_of_its_own_word(folder: Path) -> None:
    path = folder / REGION_FILE_NAME
    before = path.read_bytes()
    with region.Region(path, writable=True) as r:
        r.set_limit(1, 0x0102030405060708)
    after = path.read_bytes()
    at = layout.HEADER_LAYOUT.offsets["limit"] + 8
    changed = [i for i in range(len(before)) if before[i] != after[i]]
    assert changed and min(changed) >= at and max(changed) < at + 8
    assert struct.unpack_from("=Q", after, at)[0] == 0x0102030405060708


def test_with_a_grant_set_changes_it_and_show_names_a_region_that_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "var/lib/vgpu/containers/uid-1_main"
    folder.mkdir(parents=True)
    path = folder / REGION_FILE_NAME
    # the container raised its region's copy to 64 GiB; it was granted 3000 MiB
    format_region(path, ["GPU-a"], limits=[64 << 30], sm_limits=[30])
    grant = tmp_path / "var/lib/vgpu/grants/uid-1_main.limits"
    write_grant(grant, Grant(("GPU-a",), (3000 * MIB,), (30,)))
    assert main(["limits", "show", "--container-dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "3000 MiB" in next(line for line in out.splitlines() if line.startswith("0 "))
    assert f"limits granted in {grant}" in out
    assert f"device 0 memory limit {64 << 30} in the region, {3000 * MIB} granted" in out
    assert main(["limits", "set", "--container-dir", str(folder), "--device", "0", "--memory", "4096"]) == 0
    assert read_grant(grant).limits == (4096 * MIB,)
    assert devices(folder)[0].limit_bytes == 4096 * MIB  # the copy follows
    assert main(["limits", "show", "--container-dir", str(folder), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["grant"] == str(grant) and shown["region_differs"] == []


def test_the_largest_size_a_word_holds_is_taken_and_one_byte_more_is_refused(folder: Path) -> None:
    where = ["limits", "set", "--container-dir", str(folder), "--device", "1"]
    assert main([*where, "--budget", f"{(1 << 64) - 1}b"]) == 0
    assert devices(folder)[1].budget_bytes == (1 << 64) - 1
    assert main([*where, "--budget", f"{1 << 64}b"]) == 2
