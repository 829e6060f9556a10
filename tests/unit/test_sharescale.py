"""One measure of a share: the node's scale of the hook's measure (vgpu.monitor.sharescale),
over a simulated container whose hook counts ``over`` times the driver's GPU time."""

from __future__ import annotations

import pytest

from vgpu.hookabi.layout import SHARE_SCALE_ONE
from vgpu.monitor.sharescale import DOWN_MARGIN, MIN_SPAN_NS, SCALE_MAX, SCALE_MIN, ShareScale

MS = 1_000_000
PERIOD = 200 * MS  # the H200's sample period


def _run(
    scale: ShareScale, seconds: float, share: float, over: float, lag: int = 300 * MS, start: int = 0
) -> list[int]:
    """A container that keeps the driver's ``share`` of the card and whose hook counts ``over``
    times that before the scale: the hook is read every 100 ms, the samples come ``lag`` late.
    Returns the words written, applying each to the hook's count from then on."""
    written: list[int] = []
    hook = 0.0
    t = start
    next_sample = start + PERIOD
    while t < start + int(seconds * 1e9):
        t += 100 * MS
        hook += 100 * MS * share * over * scale.scale
        scale.read_hook(t, int(hook))
        while next_sample + lag <= t:
            scale.add_sample(next_sample, PERIOD, int(PERIOD * share))
            next_sample += PERIOD
        word = scale.step(t)
        if word is not None:
            written.append(word)
    return written


@pytest.mark.parametrize("over", [0.5, 1.6, 3.0])
def test_the_scale_brings_the_hooks_count_to_the_drivers(over: float) -> None:
    scale = ShareScale()
    written = _run(scale, 30, 0.3, over)
    assert written, "no scale was written"
    # up at once; down by halves, toward DOWN_MARGIN short (the container a little under its
    # grant), stopping when half a step is under REWRITE: at most about 4 % short
    want = 1 / over * (DOWN_MARGIN if over > 1 else 1)
    assert want * 0.99 <= scale.scale <= want * 1.045, (scale.scale, want)
    assert written[-1] == round(scale.scale * SHARE_SCALE_ONE)
    # once there, it stays: no further writes
    assert _run(scale, 10, 0.3, over, start=30 * 10**9) == []


def test_a_step_down_never_goes_past_the_ratio() -> None:
    scale = ShareScale()
    written = _run(scale, 30, 0.3, 3.0)
    assert [w / SHARE_SCALE_ONE for w in written] == sorted(
        (w / SHARE_SCALE_ONE for w in written), reverse=True
    )
    assert min(written) / SHARE_SCALE_ONE >= 1 / 3.0


def test_agreeing_measures_write_nothing() -> None:
    scale = ShareScale()
    assert _run(scale, 10, 0.3, 1.0) == []
    assert scale.scale == 1.0


def test_an_idle_container_or_a_short_span_gives_no_ratio() -> None:
    scale = ShareScale()
    assert _run(scale, MIN_SPAN_NS / 1e9 - 0.5, 0.3, 2.0) == []  # not enough samples yet
    idle = ShareScale()
    assert _run(idle, 10, 0.001, 2.0) == []  # the hook counted under 50 ms


def test_the_scale_stays_within_its_bounds() -> None:
    low, high = ShareScale(), ShareScale()
    _run(low, 20, 0.3, 40.0)
    _run(high, 20, 0.3, 0.1)
    assert SCALE_MIN <= low.scale <= SCALE_MIN * DOWN_MARGIN * 1.045
    assert high.scale == pytest.approx(SCALE_MAX)


def test_a_restarted_container_starts_its_hook_count_over() -> None:
    scale = ShareScale()
    scale.read_hook(1 * 10**9, 5 * 10**9)
    scale.read_hook(2 * 10**9, 10)  # a new region: its counter starts again
    assert list(scale.hook) == [(2 * 10**9, 10)]
