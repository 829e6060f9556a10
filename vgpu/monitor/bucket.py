"""One container on one card as the node's compute gate keeps it: the host bucket that the
driver's samples of its GPU time drain (``Account.charge``, ``settle``), its gate's closed
intervals and what ran behind them, and its crossing (``vgpu.monitor.compute`` decides and
acts on them)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vgpu.hookabi.region import Region
from vgpu.monitor.freezer import Freezer
from vgpu.monitor.hostview import Owner
from vgpu.monitor.sharescale import ShareScale

MARGIN = 2  # points past the grant's SM limit the node tolerates (the samples' rounding)
DEPTH_NS = 100_000_000  # the host bucket: 100 ms of GPU time (a 10 s run: 1 point) ...
# ... or one sample's period where that is longer (one sample at full must not put a container
# within its grant in debt): 200 ms on an H200
DEPTH_SHARED_NS = 1_000_000_000  # ... or this on a card where another container's kernels ran in
# the last SHARED_S: the driver's samples of containers sharing a card in time slices come sparse
# and nearly full, in an order of their own (on an H200 the one at 25 % got one 200 ms sample in
# four, at 84-91 %), so a container's measured time strays from its mean by several lumps; a
# bucket this deep takes those runs, and a container that idled first may run this long past its
# grant once (a token bucket's burst), held to the grant after it
START_NS = 50_000_000  # a new container's bucket: the hook's own first burst (at most 20 ms) and
# its first sample's rounding, with room (each 10 ms of it is a tenth of a point over 10 s)
LAG_NS = 1_000_000_000  # time with no sample yet is granted ahead this long (the samples come late)
WINDOW_S = 1.0  # the share reported and checked for an escape; an elastic container with no other busy
# on its card for this long is alone
SHARED_S = 10.0  # a card another container was busy on this recently is shared (a sparse one's
# samples may be a second apart: the bucket's depth must not fall and rise with them)
HOLD_MAX_NS = 1_000_000_000  # one gate is at most this long; the next pass may extend it
DRAIN_NS = 100_000_000  # work queued before the gate closed may run this long into it
ESCAPE_S = 2.0  # the window over which GPU time measured behind a closed gate is summed


@dataclass
class Account:
    """One container on one card: its host bucket, gate and crossing."""

    owner: Owner
    uuid: str
    index: int  # the card's index in the container's grant
    grant: str  # the grant file's path
    limit: int  # granted SM percent
    elastic: bool
    credit: float = START_NS  # ns of GPU time it may still use, as of ``covered``
    covered: int = 0  # the end of the newest sample charged: the bucket is kept in the samples' time
    longest: int = 0  # the longest sample period seen (at most HOLD_MAX_NS)
    shared: bool = False  # another container's kernels ran on the card in the last SHARED_S
    was_shared: bool = False  # its card has been shared once: the deeper bucket's room was given
    rate_now: float = field(init=False)  # percent of wall time it fills at, as the last pass saw the card
    balance: float = START_NS  # the credit at the last pass, with the time not yet sampled settled
    samples: deque[tuple[int, int, int]] = field(default_factory=deque)  # (end ns, pid, busy ns), 2 s
    hold_until: int = 0  # as written into the grant; 0 = open
    closures: deque[list[int]] = field(default_factory=deque)  # [start, end] ns the gate was closed
    held: deque[tuple[int, int, int]] = field(default_factory=deque)  # (end, period, busy) behind it
    clear_since: int | None = None
    escaping: bool = False
    acted_at: int = 0  # when the last action was taken for this crossing (0: none yet)
    freezer: Freezer | None = None
    frozen: bool = False
    no_gate: bool = False  # its grant cannot take the gate (layout 1: a container from an older plugin)
    seen: int = 0
    scale: ShareScale = field(default_factory=ShareScale)  # the driver's measure over the hook's
    region: Region | None = None  # the container's region, open for its busy_ns
    no_scale: bool = False  # its grant cannot take a scale (layout 1 or 2: a container from an older plugin)
    region_index: int = 0  # the card's index in its region
    region_told: bool = False  # its region could not be read once (said in the log)

    def __post_init__(self) -> None:
        self.rate_now = self.rate(False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.owner.folder, self.uuid)

    @property
    def depth(self) -> float:
        """The bucket's depth: DEPTH_NS or the longest sample period seen, DEPTH_SHARED_NS while
        the card is shared."""
        return float(max(DEPTH_NS, self.longest, DEPTH_SHARED_NS if self.shared else 0))

    def share(self, now: int) -> float:
        """Percent of the last WINDOW_S the container's kernels ran, by the driver's samples."""
        start = now - int(WINDOW_S * 1e9)
        return 100.0 * sum(b for end, _, b in self.samples if end > start) / (WINDOW_S * 1e9)

    def behind_gate(self, end: int, period: int) -> bool:
        """The sample ``(end - period, end]`` lies wholly behind a closed gate, past its drain."""
        return any(c[0] + DRAIN_NS <= end - period and end <= c[1] for c in self.closures)

    def held_share(self, now: int) -> tuple[float, float]:
        """(seconds of samples behind the closed gate in the last ESCAPE_S, their GPU share in %)."""
        start = now - int(ESCAPE_S * 1e9)
        held = [(p, b) for end, p, b in self.held if end > start]
        time_ns = sum(p for p, _ in held)
        return time_ns / 1e9, (100.0 * sum(b for _, b in held) / time_ns if time_ns else 0.0)

    def charge(self, end: int, period: int, busy: int) -> None:
        """One sample: the bucket fills over the time since the newest sample charged (in the
        samples' own time, so samples that come late or two in one pass cost nothing), up to its
        depth, and the sample's GPU time drains it. The first sample finds START_NS in it; the
        first time its card is shared the room the deeper bucket adds comes full, once in the
        account's life (the first lumps of a container sharing a card are its mean's too, and a
        card that is shared, then not, then shared again gives no second burst)."""
        self.longest = max(self.longest, min(period, HOLD_MAX_NS))
        if not self.covered:
            self.covered = end - period
        if self.shared and not self.was_shared:
            self.was_shared = True
            self.credit += DEPTH_SHARED_NS - max(DEPTH_NS, self.longest)
        if end > self.covered:
            self.credit = min(self.depth, self.credit + (end - self.covered) * self.rate_now / 100)
            self.covered = end
        self.credit -= busy

    def settle(self, now: int, rate: float) -> float:
        """The credit now: time with no sample for over LAG_NS is idle (the driver samples no
        process that runs nothing) and fills the bucket; the newer time not sampled yet is granted
        ahead at ``rate``, the samples to come charging it. A container its gate held in the last
        ESCAPE_S is presumed to use that time's open part as it used its open time lately
        (``used_open``), charged ahead too: one that runs whenever its gate opens is held again
        within a pass, not a sample's lag later, and a container within its grant, held once by
        a stray lump, is presumed to run at its own share, below the grant, so no hold feeds
        the next."""
        self.rate_now = rate
        idle_to = now - LAG_NS
        if self.covered < idle_to:
            self.credit = min(self.depth, self.credit + (idle_to - self.covered) * rate / 100)
            self.covered = idle_to
        ahead = now - self.covered
        self.balance = self.credit + ahead * rate / 100
        if self.closures:
            self.balance -= (ahead - self.closed_between(self.covered, now)) * self.used_open()
        return self.balance

    def closed_between(self, start: int, end: int) -> int:
        """How long its gate was closed within ``(start, end]``."""
        return sum(max(0, min(end, c[1]) - max(start, c[0])) for c in self.closures)

    def used_open(self) -> float:
        """The part of its gate's open time its kernels ran over the last WINDOW_S its samples
        cover (a container that ran behind a closed gate: 1)."""
        end = self.covered
        start = end - int(WINDOW_S * 1e9)
        busy = sum(b for e, _, b in self.samples if start < e <= end)
        opened = end - start - self.closed_between(start, end)
        return min(1.0, busy / opened) if opened > 0 else float(busy > 0)

    def rate(self, alone: bool) -> float:
        return 100.0 if self.elastic and alone else float(min(100, self.limit + MARGIN))
