"""One measure of a compute share, held by both lines: the driver's.

``gpucores: 30`` means that the container's kernels run 30 % of the card's time **as the driver
samples it** (``nvmlDeviceGetProcessUtilization``'s ``smUtil`` x the sample's period: what
``nvidia-smi pmon`` and DCGM show per process, and what the node's gate reads). Chosen because it
is the measure nothing in the container can touch, so it is the one the node can hold a tenant
to; a measure the hook alone keeps would be a promise the node cannot check.

The hook meters the limit in the process, fast, with CUDA events: the time its streams were busy.
For long kernels that is the driver's measure. It is not for the rest: a launch-bound loop's
stream counts the host's launch time between its kernels, a memory-bound kernel reads lower in
the driver's samples than its stream's time, and on a card shared in time slices the stream
counts the time its work waited for its slice. Measured on an H100 with the node running, a
tenant that rewrote its bucket (held by the samples) ran small kernels at 0.41 of the bare rate
under a 30 % grant while an honest one, held by the hook's events, ran at 0.29: the cheat paid.

So the node closes the loop. Per container and card, over the last ``WINDOW_NS`` of samples
(since its last change), it compares the driver's GPU time with the hook's own count of the same
span (the region's ``busy_ns``, read every pass and interpolated at the samples' ends) and writes
the ratio into the grant's ``share_scale`` (x ``SHARE_SCALE_ONE``); the hook charges its measure
times that, into its bucket and into ``busy_ns``. A multiplicative step (the hook's count already
carries the scale in force), up whole the first time or where over 25 % off and else half, down
always half way (in log terms) to 2 % short, so that a step down never takes an honest container
past its grant into the gate; within
``SCALE_MIN``..``SCALE_MAX``. An honest container then holds to its grant by the driver's samples,
so the gate (grant + 2 points by the same samples) stays open on it; one that rewrites its bucket
is held by the gate to the same share: no more than an honest one gets. The region is the
container's to write: a forged ``busy_ns`` moves only its own hook's charges, which it could
bypass anyway; the gate is unmoved.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from vgpu.hookabi.layout import SHARE_SCALE_ONE

WINDOW_NS = 5_000_000_000  # samples compared over at most this span ...
MIN_SPAN_NS = 1_500_000_000  # ... and at least this (a card shared in slices gives lumps of 200 ms)
MIN_HOOK_NS = 50_000_000  # the hook's count over the span: below this the container is idle
SCALE_MIN, SCALE_MAX = 1 / 8, 4.0
REWRITE = 0.02  # a scale is written when it moves by more than this fraction
FAR = 1.25  # a scale up by more than this is taken whole; any other step half
DOWN_MARGIN = 1.02  # later steps down aim this far short (at 75 %, 1.5 points under)
HISTORY_NS = WINDOW_NS + 2_000_000_000  # hook readings kept (the samples come up to 1 s late)


def to_word(scale: float) -> int:
    return max(1, round(scale * SHARE_SCALE_ONE))


@dataclass
class ShareScale:
    """One container on one card: the driver's time over the hook's, and the scale written."""

    scale: float = 1.0  # in force in the hook (as written; 1.0 until the first write)
    since: int = 0  # monotonic ns of the last change: spans start after it
    calibrated: bool = False  # a step was taken (the first one up is whole)
    hook: deque[tuple[int, int]] = field(default_factory=deque)  # (monotonic ns, busy_ns) per pass
    samples: deque[tuple[int, int, int]] = field(default_factory=deque)  # (end ns, period ns, busy ns)

    def read_hook(self, now: int, busy_ns: int) -> None:
        if self.hook and busy_ns < self.hook[-1][1]:
            self.hook.clear()  # a new region (the container restarted): start over
        self.hook.append((now, busy_ns))
        while self.hook and self.hook[0][0] < now - HISTORY_NS:
            self.hook.popleft()

    def add_sample(self, end_ns: int, period_ns: int, busy_ns: int) -> None:
        self.samples.append((end_ns, period_ns, busy_ns))
        while self.samples and self.samples[0][0] < end_ns - HISTORY_NS:
            self.samples.popleft()

    def _hook_at(self, t: int) -> float | None:
        """The hook's count at ``t``, interpolated between the passes' readings."""
        if not self.hook or t < self.hook[0][0] or t > self.hook[-1][0]:
            return None
        before = max((r for r in self.hook if r[0] <= t), key=lambda r: r[0])
        after = min((r for r in self.hook if r[0] >= t), key=lambda r: r[0])
        if after[0] == before[0]:
            return float(before[1])
        return before[1] + (after[1] - before[1]) * (t - before[0]) / (after[0] - before[0])

    def ratio(self) -> float | None:
        """The driver's GPU time over the hook's over the newest span of samples (those wholly
        after the last change, the hook read after them), or None where the span is too short or
        idle."""
        if not self.hook:
            return None
        last = self.samples[-1][0] if self.samples else 0
        first = max(self.since, last - WINDOW_NS, self.hook[0][0])
        counted = [(t, p, b) for t, p, b in self.samples if t - p >= first and t <= self.hook[-1][0]]
        if not counted:
            return None
        start, end = counted[0][0] - counted[0][1], counted[-1][0]
        if end - start < MIN_SPAN_NS:
            return None
        h0, h1 = self._hook_at(start), self._hook_at(end)
        if h0 is None or h1 is None or h1 - h0 < MIN_HOOK_NS:
            return None
        return sum(b for _, _, b in counted) / (h1 - h0)

    def step(self, now: int) -> int | None:
        """The new scale's grant word where it moved by more than REWRITE, else None."""
        r = self.ratio()
        if r is None:
            return None
        target = min(SCALE_MAX, max(SCALE_MIN, self.scale * max(r, 1e-6)))
        if target < self.scale:
            # Down (the hook charges less: the container gets more), half way in log terms to
            # DOWN_MARGIN short: the hook's measure per launch falls as the loop it holds speeds
            # up, so a ratio measured before a step down is low for after it (on the stub, 0.16
            # where 0.35 held), and a whole step would take an honest container past its grant
            # into the gate.
            new = math.sqrt(self.scale * min(self.scale, target * DOWN_MARGIN))
        else:
            # up (it charges more: the container gets less): whole the first time or where far
            # off, else half
            new = (
                target if not self.calibrated or target > self.scale * FAR else math.sqrt(self.scale * target)
            )
        self.calibrated = True
        if abs(new / self.scale - 1) <= REWRITE:
            return None
        self.scale = new
        self.since = now
        return to_word(new)
