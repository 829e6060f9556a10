"""The busy share over a sliding window: what vgpu_container_sm_busy_ratio reports."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu.monitor.timeshare import TimeShare

S = 1_000_000_000
KEY = ("uid-1_train", 0, "GPU-a")


def test_no_ratio_before_two_readings_a_step_apart() -> None:
    share = TimeShare(window_s=10, step_s=1)
    assert share.ratio(KEY) is None
    share.record(KEY, 100 * S, 7 * S)
    assert share.ratio(KEY) is None  # a first reading alone says nothing
    share.record(KEY, 100 * S + S // 2, 7 * S + S // 4)
    assert share.ratio(KEY) is None  # half a second: too short to tell
    share.record(KEY, 101 * S, 7 * S + S // 2)
    assert share.ratio(KEY) == 0.5


def test_the_ratio_follows_the_counter_over_the_window_not_since_the_start() -> None:
    share = TimeShare(window_s=10, step_s=1)
    busy = 0
    for t in range(0, 31):  # 30 s at 25 % busy, sampled every second
        share.record(KEY, t * S, busy)
        busy += S // 4
    assert share.ratio(KEY) == pytest.approx(0.25)
    for t in range(31, 46):  # then 15 s at 75 %
        busy += 3 * S // 4
        share.record(KEY, t * S, busy)
    # the window (10 s, starting from the newest checkpoint that old) holds only the 75 % part
    assert share.ratio(KEY) == pytest.approx(0.75)
    for t in range(46, 60):  # idle
        share.record(KEY, t * S, busy)
    assert share.ratio(KEY) == 0.0


def test_sparse_readings_give_the_share_since_the_previous_one() -> None:
    share = TimeShare(window_s=10, step_s=1)
    share.record(KEY, 0, 0)
    share.record(KEY, 30 * S, 6 * S)  # one scrape every 30 s, no arbiter
    assert share.ratio(KEY) == pytest.approx(0.2)
    share.record(KEY, 60 * S, 6 * S + 27 * S)
    assert share.ratio(KEY) == pytest.approx(0.9)


def test_a_counter_that_goes_back_starts_anew_and_a_late_reading_is_ignored() -> None:
    share = TimeShare(window_s=10, step_s=1)
    share.record(KEY, 0, 50 * S)
    share.record(KEY, 2 * S, 51 * S)
    assert share.ratio(KEY) == 0.5
    share.record(KEY, S, 50 * S + S // 2)  # an older reading from a racing reader: not a reset
    assert share.ratio(KEY) == 0.5
    share.record(KEY, 3 * S, S // 10)  # the region was replaced: its counter restarted
    assert share.ratio(KEY) is None
    share.record(KEY, 5 * S, S // 10 + S)
    assert share.ratio(KEY) == 0.5


def test_forgotten_keys_lose_their_history() -> None:
    share = TimeShare()
    other = ("uid-2_c", 1, "GPU-b")
    for key in (KEY, other):
        share.record(key, 0, 0)
        share.record(key, 2 * S, S)
    share.keep_only([other])
    assert share.ratio(KEY) is None and share.ratio(other) == 0.5


def test_a_step_longer_than_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="step_s <= window_s"):
        TimeShare(window_s=1, step_s=2)


@given(
    st.lists(st.tuples(st.integers(1, 3 * S), st.integers(0, 3 * S)), min_size=2, max_size=80),
)
def test_the_window_is_exact_over_any_reading_pattern(steps: list[tuple[int, int]]) -> None:
    """Whatever the spacing, the ratio is the counter's growth since the reference checkpoint:
    the newest kept checkpoint at least a window old, else the first reading."""
    share = TimeShare(window_s=10, step_s=1)
    t = busy = 0
    readings = [(0, 0)]
    share.record(KEY, 0, 0)
    for dt, db in steps:
        t, busy = t + dt, busy + db
        readings.append((t, busy))
        share.record(KEY, t, busy)
    kept = [readings[0]]  # the checkpoints the rule keeps, recomputed from scratch
    for r in readings[1:]:
        if r[0] - kept[-1][0] >= S:
            kept.append(r)
    old = [c for c in kept if c[0] <= t - 10 * S]
    ref = old[-1] if old else kept[0]
    want = None if t - ref[0] < S else (busy - ref[1]) / (t - ref[0])
    assert share.ratio(KEY) == want
