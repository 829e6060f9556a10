"""The share of wall time a container's work kept a card busy, over a sliding window.

The hook adds the GPU time of a container's kernels to ``busy_ns[i]`` of its region (a
counter). The compute limit is a cap on that time share, so the monitor reports it as a ratio:
the counter's growth divided by the wall time it grew in. Raw counters say nothing until two
reads are compared, and two reads a few milliseconds apart are mostly noise, so the ratio spans
a window:

- Samples come from whoever reads ``busy_ns``: the arbiter on every pass (25 ms) and the
  ``/metrics`` collector on every scrape. Every reading updates the newest sample; one is kept
  as a checkpoint at most every ``step_s`` (1 s).
- The ratio runs from the newest checkpoint at least ``window_s`` (10 s) old, or the oldest one
  while there is none that old yet, to the newest reading. With the arbiter running it thus
  covers 10 to 11 s. Without an arbiter only scrapes sample, and with scrapes further apart
  than the window it covers the time since the previous scrape.
- There is no ratio (``None``) before two readings at least ``step_s`` apart: a first scrape
  with nothing earlier reports no series rather than a guess.
- A counter that goes down (the region file was replaced) starts the history of that key anew.
  A reading older than the newest one (two readers racing) is ignored.

Time is the reader's ``CLOCK_MONOTONIC`` at the read, in ns (the arbiter's and the collector's
clock, injectable for tests). The ratio is not clipped to 1: the hook counts overlapping
streams of one container once each, so a multi-stream container may read above 1.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

DEFAULT_WINDOW_S = 10.0
DEFAULT_STEP_S = 1.0


@dataclass
class _History:
    latest: tuple[int, int]  # (t_ns, busy_ns) of the newest reading
    checkpoints: deque[tuple[int, int]] = field(default_factory=deque)


class TimeShare:
    """Per key (a container's region folder, device index and card UUID): the busy share."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, step_s: float = DEFAULT_STEP_S) -> None:
        if not 0 < step_s <= window_s:
            raise ValueError(f"need 0 < step_s <= window_s, got step {step_s} and window {window_s}")
        self.window_ns = int(window_s * 1e9)
        self.step_ns = int(step_s * 1e9)
        self._by_key: dict[Hashable, _History] = {}
        self._lock = threading.Lock()

    def record(self, key: Hashable, t_ns: int, busy_ns: int) -> None:
        """One reading of the counter ``busy_ns`` at ``t_ns``."""
        with self._lock:
            h = self._by_key.get(key)
            if h is not None and t_ns <= h.latest[0]:
                return  # an older reading than one already recorded: a racing reader
            if h is None or busy_ns < h.latest[1]:
                self._by_key[key] = _History((t_ns, busy_ns), deque([(t_ns, busy_ns)]))
                return
            h.latest = (t_ns, busy_ns)
            if t_ns - h.checkpoints[-1][0] >= self.step_ns:
                h.checkpoints.append((t_ns, busy_ns))
            # keep one checkpoint at least a window old (the reference), none older
            while len(h.checkpoints) >= 2 and h.checkpoints[1][0] <= t_ns - self.window_ns:
                h.checkpoints.popleft()

    def ratio(self, key: Hashable) -> float | None:
        """Busy time over wall time from the reference checkpoint to the newest reading; None
        when the readings span less than ``step_s``."""
        with self._lock:
            h = self._by_key.get(key)
            if h is None:
                return None
            t0, b0 = h.checkpoints[0]
            t1, b1 = h.latest
            if t1 - t0 < self.step_ns:
                return None
            return (b1 - b0) / (t1 - t0)

    def keep_only(self, keys: Iterable[Hashable]) -> None:
        """Forget every key not in ``keys`` (containers whose region is gone)."""
        keep = set(keys)
        with self._lock:
            for key in [k for k in self._by_key if k not in keep]:
                del self._by_key[key]
