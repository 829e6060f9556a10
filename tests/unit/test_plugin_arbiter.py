"""The arbiter: per card, priority-1 containers yield to an active priority-0 one; alone means alone."""

from __future__ import annotations

import argparse
import logging
import os
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.region import format_region
from vgpu.core.errors import ConfigError
from vgpu.hookabi import layout, region
from vgpu.hookabi.grant import Grant, grant_path, write_grant
from vgpu.monitor.arbiter import Activity, Arbiter, decide
from vgpu.node.flags import add_arbiter_arguments as add_arguments
from vgpu.node.flags import arbiter_settings as settings
from vgpu.node.paths import REGION_FILE_NAME

Y, A, G = layout.FLAG_YIELD, layout.FLAG_ALONE, layout.FLAG_GUARD
MS = 1_000_000


def test_a_normal_container_yields_on_the_card_where_a_high_one_is_active() -> None:
    flags = decide(
        {
            "GPU-a": [Activity("hi", 0, 0, True), Activity("lo", 0, 1, True)],
            "GPU-b": [Activity("lo", 1, 1, True)],
        }
    )
    assert flags == {("hi", 0): G, ("lo", 0): Y | G, ("lo", 1): A}


def test_an_idle_high_container_holds_no_one_back_but_keeps_their_queues_short() -> None:
    flags = decide({"GPU-a": [Activity("hi", 0, 0, False), Activity("lo", 0, 1, True)]})
    assert flags == {("hi", 0): G, ("lo", 0): A | G}


def test_a_normal_container_yields_even_while_idle_so_its_next_launch_waits() -> None:
    assert decide({"GPU-a": [Activity("hi", 0, 0, True), Activity("lo", 0, 1, False)]})[("lo", 0)] == Y | G


def test_high_containers_never_yield_and_busy_peers_are_never_alone() -> None:
    flags = decide(
        {"GPU-a": [Activity("h1", 0, 0, True), Activity("h2", 0, 0, True), Activity("n", 0, 1, True)]}
    )
    assert flags == {("h1", 0): G, ("h2", 0): G, ("n", 0): Y | G}
    assert decide({"GPU-a": [Activity("n1", 0, 1, True), Activity("n2", 0, 1, True)]}) == {
        ("n1", 0): 0,
        ("n2", 0): 0,
    }


def test_a_card_without_a_uuid_gets_no_flags() -> None:
    assert decide({"": [Activity("x", 0, 1, True), Activity("y", 0, 0, True)]}) == {("x", 0): 0, ("y", 0): 0}


entries = st.lists(
    st.tuples(st.sampled_from(["c1", "c2", "c3", "c4"]), st.sampled_from([0, 1]), st.booleans()),
    unique_by=lambda e: e[0],
    max_size=4,
)


@given(st.dictionaries(st.sampled_from(["GPU-a", "GPU-b"]), entries))
def test_flags_follow_the_rules_for_any_mix(cards: dict[str, list[tuple[str, int, bool]]]) -> None:
    # a container's device index tells its cards apart: GPU-a is its index 0, GPU-b its index 1
    acts = {
        uuid: [Activity(c, int(uuid == "GPU-b"), p, act) for c, p, act in es] for uuid, es in cards.items()
    }
    flags = decide(acts)
    for es in acts.values():
        for e in es:
            word = flags[(e.container, e.index)]
            others = [o for o in es if o.container != e.container]
            assert bool(word & Y) == (e.priority == 1 and any(o.active and o.priority == 0 for o in others))
            assert bool(word & A) == (not any(o.active for o in others))
            # both kinds on the card: everyone keeps a short queue (each one's own length)
            assert bool(word & G) == any((o.priority == 0) != (e.priority == 0) for o in others)
            assert word != Y | A


class Clock:
    def __init__(self) -> None:
        self.ns = 10_000 * MS

    def __call__(self) -> int:
        return self.ns


def container(root: Path, name: str, uuids: list[str], priority: int) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    format_region(folder / REGION_FILE_NAME, uuids, priority=priority)
    return folder / REGION_FILE_NAME


def poke(path: Path, field: str, index: int, value: int) -> None:
    """What the hook does on a launch: one word of the mapped file."""
    with region.Region(path, writable=True) as r:
        at = layout.HEADER_LAYOUT.offsets[field] // 8 + index
        r._u64[at] = value


def word(path: Path, field: str, index: int = 0) -> int:
    with region.Region(path) as r:
        return r.word(field, index)


def test_the_arbiter_writes_flags_and_its_time_into_the_regions(tmp_path: Path) -> None:
    clock = Clock()
    hi = container(tmp_path, "uid-1_hi", ["GPU-a"], 0)
    lo = container(tmp_path, "uid-2_lo", ["GPU-b", "GPU-a"], 1)
    arbiter = Arbiter(tmp_path, window_s=0.1, clock=clock)
    arbiter.rescan()
    assert arbiter.stats.regions == 2
    poke(hi, "last_launch_ns", 0, clock.ns - 50 * MS)
    poke(lo, "last_launch_ns", 1, clock.ns - 10 * MS)
    arbiter.run_pass()
    assert (word(lo, "flags", 0), word(lo, "flags", 1), word(hi, "flags", 0)) == (A, Y | G, G)
    assert word(lo, "arbiter_ns") == word(hi, "arbiter_ns") == clock.ns
    clock.ns += 200 * MS  # both launches left the window: nobody yields, each is alone
    arbiter.run_pass()
    assert (word(lo, "flags", 0), word(lo, "flags", 1), word(hi, "flags", 0)) == (A, A | G, A | G)
    poke(hi, "busy_ns", 0, 5 * MS)  # busy time grew: active again without a fresh launch stamp
    arbiter.run_pass()
    assert (word(lo, "flags", 1), word(hi, "flags", 0)) == (Y | G, A | G)
    arbiter.run_pass()  # busy_ns did not grow since the last pass
    assert word(lo, "flags", 1) == A | G
    arbiter.stop()


def test_the_granted_priority_wins_over_what_a_container_writes_into_its_region(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    containers, grants = tmp_path / "containers", tmp_path / "grants"
    grants.mkdir()
    # "sly" was granted priority 1 but wrote 0 into its own region; "hi" really is priority 0
    sly = container(containers, "uid-1_sly", ["GPU-a"], 0)
    lo = container(containers, "uid-2_lo", ["GPU-a"], 1)
    (grants / "uid-1_sly.priority").write_text("1\n")
    (grants / "uid-2_lo.priority").write_text("1\n")
    arbiter = Arbiter(containers, window_s=0.1, clock=clock, grants_dir=grants)
    arbiter.rescan()
    poke(sly, "last_launch_ns", 0, clock.ns - 10 * MS)
    poke(lo, "last_launch_ns", 0, clock.ns - 10 * MS)
    with caplog.at_level(logging.WARNING):
        arbiter.run_pass()
    assert (word(lo, "flags"), word(sly, "flags")) == (0, 0)  # nobody yields to the claim
    assert "claims priority 0 in its region, granted 1" in caplog.text
    # a real grant of priority 0 (the record appears after the region: picked up at rescan)
    hi = container(containers, "uid-3_hi", ["GPU-a"], 0)
    (grants / "uid-3_hi.priority").write_text("0\n")
    arbiter.rescan()
    poke(hi, "last_launch_ns", 0, clock.ns - 10 * MS)
    arbiter.run_pass()
    assert (word(lo, "flags"), word(sly, "flags"), word(hi, "flags")) == (Y | G, Y | G, G)
    arbiter.stop()


def test_the_priority_in_the_grant_wins_and_an_older_plugins_record_still_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    containers, grants = tmp_path / "containers", tmp_path / "grants"
    sly = container(containers, "uid-1_sly", ["GPU-a"], 0)  # granted 1, claims 0 in its region
    hi = container(containers, "uid-2_hi", ["GPU-a"], 1)  # granted 0 by an older plugin's record
    lo = container(containers, "uid-3_lo", ["GPU-a"], 1)
    write_grant(grant_path(grants, "uid-1_sly"), Grant(("GPU-a",), (1 << 30,), priority=1))
    write_grant(grant_path(grants, "uid-3_lo"), Grant(("GPU-a",), (1 << 30,), priority=1))
    (grants / "uid-2_hi.priority").write_text("0\n")
    arbiter = Arbiter(containers, window_s=0.1, clock=clock, grants_dir=grants)
    arbiter.rescan()
    for path in (sly, hi, lo):
        poke(path, "last_launch_ns", 0, clock.ns - 10 * MS)
    with caplog.at_level(logging.WARNING):
        arbiter.run_pass()
    assert (word(sly, "flags"), word(hi, "flags"), word(lo, "flags")) == (Y | G, G, Y | G)
    assert "claims priority 0 in its region, granted 1" in caplog.text
    arbiter.stop()


def test_new_removed_and_replaced_regions_are_picked_up_by_rescan(tmp_path: Path) -> None:
    arbiter = Arbiter(tmp_path, clock=Clock())
    arbiter.rescan()
    assert arbiter.stats.regions == 0
    first = container(tmp_path, "uid-1_a", ["GPU-a"], 1)
    arbiter.rescan()
    assert arbiter.stats.regions == 1
    first.unlink()
    format_region(first, ["GPU-a"], priority=0)  # the same path, a new file
    arbiter.rescan()
    arbiter.run_pass()
    assert word(first, "arbiter_ns") == Clock().ns
    first.unlink()
    arbiter.rescan()
    assert arbiter.stats.regions == 0
    arbiter.stop()


def test_bad_files_are_skipped_logged_once_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = container(tmp_path, "uid-1_ok", ["GPU-a"], 1)
    (tmp_path / "uid-2_junk").mkdir()
    (tmp_path / "uid-2_junk" / REGION_FILE_NAME).write_bytes(b"x" * layout.REGION_SIZE)
    (tmp_path / "uid-3_short").mkdir()
    (tmp_path / "uid-3_short" / REGION_FILE_NAME).write_bytes(b"\0" * 64)
    old = container(tmp_path, "uid-4_old", ["GPU-a"], 1)
    data = bytearray(old.read_bytes())
    struct.pack_into("=I", data, layout.HEADER_LAYOUT.offsets["version"], 1)
    old.write_bytes(bytes(data))
    arbiter = Arbiter(tmp_path, clock=Clock())
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            arbiter.rescan()
            arbiter.run_pass()
    assert arbiter.stats.regions == 1 and arbiter.bad.total == 3
    assert len([r for r in caplog.records if "skipping region" in r.message]) == 3
    assert word(good, "arbiter_ns") == Clock().ns


def test_a_region_cut_short_while_open_is_dropped_not_fatal_and_taken_back_when_whole(
    tmp_path: Path,
) -> None:
    path = container(tmp_path, "uid-1_a", ["GPU-a"], 1)
    other = container(tmp_path, "uid-2_b", ["GPU-a"], 1)
    whole = path.read_bytes()
    arbiter = Arbiter(tmp_path, clock=Clock())
    arbiter.rescan()
    with open(path, "r+b") as f:
        f.truncate(100)  # touching the lost pages through a map would be SIGBUS
    arbiter.run_pass()
    assert arbiter.stats.regions == 1 and arbiter.bad.total == 1
    assert word(other, "flags") == A
    arbiter.rescan()  # still short: refused again, for another reason
    assert arbiter.stats.regions == 1 and arbiter.bad.total == 2
    with open(path, "r+b") as f:
        f.write(whole)  # the same file, whole again
    arbiter.rescan()
    arbiter.run_pass()
    assert arbiter.stats.regions == 2 and word(path, "arbiter_ns") == Clock().ns
    arbiter.stop()


def test_the_arbiter_never_maps_a_region(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The container can cut its file at any time: only reads that fail cleanly are safe."""
    path = container(tmp_path, "uid-1_a", ["GPU-a"], 1)

    def no_map(*args: object, **kwargs: object) -> None:
        raise AssertionError("the arbiter mapped a region")

    arbiter = Arbiter(tmp_path, clock=Clock())
    monkeypatch.setattr(region.mmap, "mmap", no_map)
    arbiter.rescan()
    arbiter.run_pass()
    monkeypatch.undo()
    assert arbiter.stats.regions == 1 and arbiter.bad.total == 0
    assert (word(path, "flags"), word(path, "arbiter_ns")) == (A, Clock().ns)
    arbiter.stop()


def test_the_thread_keeps_the_flags_fresh(tmp_path: Path) -> None:
    path = container(tmp_path, "uid-1_a", ["GPU-a"], 1)
    arbiter = Arbiter(tmp_path, interval_s=0.01, rescan_s=0.05)
    arbiter.start()
    try:
        import time

        deadline = time.monotonic() + 5
        while arbiter.stats.passes < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert arbiter.stats.passes >= 3
        assert time.monotonic_ns() - word(path, "arbiter_ns") < layout.ARBITER_STALE_NS
    finally:
        arbiter.stop()


@pytest.mark.parametrize(
    ("interval", "window", "flag"),
    [
        ("-1", "100", "--arbiter-interval-ms"),
        ("1500", "100", "--arbiter-interval-ms"),
        ("25", "0", "--activity-window-ms"),
    ],
)
def test_bad_arbiter_flags_name_the_flag(interval: str, window: str, flag: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--arbiter-interval-ms", interval, "--activity-window-ms", window])
    with pytest.raises(ConfigError) as info:
        settings(args)
    assert info.value.source == flag


def test_arbiter_flags_default_to_25_ms_passes_and_a_100_ms_window_and_0_turns_it_off() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings(parser.parse_args([])) == (0.025, 0.1)
    assert settings(parser.parse_args(["--arbiter-interval-ms", "0"])) is None


def test_a_link_or_a_fifo_in_place_of_the_region_is_refused_without_blocking(tmp_path: Path) -> None:
    """The folder is the container's: as root on the host, follow no link out of it, open no FIFO."""
    target = container(tmp_path / "elsewhere", "uid-9_x", ["GPU-a"], 0)
    (tmp_path / "c" / "uid-1_link").mkdir(parents=True)
    (tmp_path / "c" / "uid-1_link" / REGION_FILE_NAME).symlink_to(target)
    (tmp_path / "c" / "uid-2_fifo").mkdir()
    os.mkfifo(tmp_path / "c" / "uid-2_fifo" / REGION_FILE_NAME)
    arbiter = Arbiter(tmp_path / "c", clock=Clock())
    arbiter.rescan()
    arbiter.run_pass()
    assert arbiter.stats.regions == 0 and arbiter.bad.total == 2
    assert word(target, "arbiter_ns") == 0
