"""The monitor's arbiter: which container on a card must yield and which is alone there.

Each container's hook knows only its own region, so nothing inside a container can tell that a
high-priority neighbour is busy on the same card. The arbiter, a thread of the node monitor
(the device plugin's and ``vgpu monitor``'s), looks at every region on the node every
``interval_s`` (default 25 ms) and writes one word per container and device, ``flags``:

- ``FLAG_YIELD`` on a priority-1 container's entry for a card where a priority-0 container is
  active: the hook holds that container's launches until the flag clears;
- ``FLAG_ALONE`` on an entry for a card where no other container is active: a container with
  ``sm_policy`` elastic may then run past its SM cap (work-conserving);
- ``FLAG_GUARD`` on every entry for a card that both a priority-0 and a priority-1 container
  are on, busy or not: the hook then keeps the queue of launched work short, 8 ms for a normal
  container (so that a yield takes hold at once) and 40 ms for a high one (so that it keeps
  launching while its work runs, which is how it is seen active). Without it a loop that syncs
  rarely has seconds of work queued in the driver: a normal one's runs, yield or not, and a high
  one waits in a long sync without launching, looking idle while its work still runs;

and ``arbiter_ns`` (CLOCK_MONOTONIC ns, the hook's clock) after each pass. The ``busy_ns`` it
reads on each pass also goes into ``timeshare`` (``vgpu.monitor.timeshare``), from which the
collector reports each container's busy share of the last 10 s. The hook ignores
flags older than ``ARBITER_STALE_NS`` (1 s), so a stopped monitor never leaves a container
held. A container is *active* on a card when its newest launch there (``last_launch_ns``) is
within ``window_s`` (default 100 ms) or its ``busy_ns`` grew since the previous pass.

A container's priority is the one the device plugin granted it, in its grant under
``/var/lib/vgpu/grants/`` (mounted read-only into the container; vgpu/hookabi/grant.py), or the
priority record plugins before the grant wrote there; the region's ``priority`` word, which the
container can write, counts only where there is neither (a container run by hand).

The region files stay open between passes, never mapped (``Region(..., mapped=False)``): the
container can cut its file short at any moment, and a mapped page past the end of the file
would kill the whole device plugin with SIGBUS. A pass costs one ``pread`` of each region's
header, a ``pwrite`` of each flags word that changed and one of ``arbiter_ns``. The folder is
listed again every ``rescan_s`` (new containers, removed ones, a file replaced). A file that is
not a readable layout-2 region, or that comes back short from a read, is dropped, logged once
and counted (``BadRegions``), and taken back at a later rescan once it is whole again; the
arbiter writes nothing but ``flags`` and ``arbiter_ns``, each at its aligned offset.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vgpu.core.service import Service
from vgpu.hookabi.grant import GrantError, grant_path, read_grant
from vgpu.hookabi.layout import FLAG_ALONE, FLAG_GUARD, FLAG_YIELD
from vgpu.hookabi.region import Header, Region, RegionError
from vgpu.monitor.timeshare import TimeShare
from vgpu.node.flags import DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S
from vgpu.node.paths import REGION_FILE_NAME, priority_record

log = logging.getLogger(__name__)

DEFAULT_RESCAN_S = 1.0


@dataclass(frozen=True)
class Activity:
    """One container's entry for one card, as the decision sees it."""

    container: str  # anything that tells containers apart (the region's folder name)
    index: int  # the card's device index inside that container
    priority: int  # 0 high, anything else normal
    active: bool


def decide(cards: Mapping[str, Sequence[Activity]]) -> dict[tuple[str, int], int]:
    """The flags word of every (container, device index), from the activity per card UUID.

    An entry whose card is unknown (empty UUID) is left with no flags: it neither yields nor
    counts as alone, so it simply holds to its own cap.
    """
    flags: dict[tuple[str, int], int] = {}
    for uuid, entries in cards.items():
        if not uuid:
            for e in entries:
                flags[(e.container, e.index)] = 0
            continue
        active = {e.container for e in entries if e.active}
        present_high = {e.container for e in entries if e.priority == 0}
        present_normal = {e.container for e in entries if e.priority != 0}
        high = {e.container for e in entries if e.active and e.priority == 0}
        for e in entries:
            word = 0
            if (present_normal if e.priority == 0 else present_high) - {e.container}:
                word |= FLAG_GUARD
            if e.priority != 0 and high - {e.container}:
                word |= FLAG_YIELD
            if not active - {e.container}:
                word |= FLAG_ALONE
            flags[(e.container, e.index)] = word
    return flags


class BadRegions:
    """Region files the monitor could not use: each logged once (per file and reason) and counted."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.total = 0

    def report(self, path: Path, err: object) -> None:
        key = (str(path), str(err))
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
            self.total += 1
        log.warning("skipping region %s: %s", path, err)

    def forget(self, path: Path) -> None:
        """The file is gone or readable again: a later problem with it is logged anew."""
        with self._lock:
            self._seen = {k for k in self._seen if k[0] != str(path)}


@dataclass
class _Tracked:
    region: Region
    uuids: tuple[str, ...]
    busy: list[int] = field(default_factory=list)
    granted: int | None = None  # the device plugin's record of the priority, if there is one
    told: bool = False  # a region claiming another priority than granted was logged


@dataclass
class ArbiterStats:
    passes: int = 0
    regions: int = 0
    last_pass_s: float = 0.0
    flag_writes: int = 0


class Arbiter:
    """Runs ``run_pass`` every ``interval_s`` on a thread; ``run_pass`` alone for tests."""

    def __init__(
        self,
        containers_dir: Path,
        interval_s: float = DEFAULT_INTERVAL_S,
        window_s: float = DEFAULT_WINDOW_S,
        rescan_s: float = DEFAULT_RESCAN_S,
        bad: BadRegions | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        grants_dir: Path | None = None,
        timeshare: TimeShare | None = None,
    ) -> None:
        self.containers_dir = Path(containers_dir)
        self.grants_dir = grants_dir
        self.interval_s = interval_s
        self.window_ns = int(window_s * 1e9)
        self.rescan_s = rescan_s
        self.bad = bad if bad is not None else BadRegions()
        self.clock = clock
        # every pass samples busy_ns for the collector's vgpu_container_sm_busy_ratio
        self.timeshare = timeshare if timeshare is not None else TimeShare()
        self.stats = ArbiterStats()
        self._tracked: dict[Path, _Tracked] = {}
        self._service = Service("arbiter", lambda _stop: self._loop())
        self._stop = self._service.stopping
        self._rescanned_at = -1e18

    # -- the folder ---------------------------------------------------------------------------

    def rescan(self) -> None:
        """Open new region files, drop removed or replaced ones."""
        seen: dict[Path, int] = {}
        try:
            folders = list(self.containers_dir.iterdir())
        except OSError:
            folders = []
        for folder in folders:
            path = folder / REGION_FILE_NAME
            try:
                seen[path] = os.lstat(path).st_ino
            except OSError:
                continue
        for path in list(self._tracked):
            t = self._tracked[path]
            if seen.get(path) != t.region.inode or not t.region.intact():
                self._drop(path)
        for path in seen:
            if path in self._tracked:
                t = self._tracked[path]
                if t.granted is None:
                    t.granted = self._granted(path)
                continue
            try:
                region = Region(path, writable=True, mapped=False)
            except RegionError as err:
                self.bad.report(path, err)
                continue
            try:
                header = region.read_header()
                count = header.num_devices
                uuids = tuple(header.uuid(i) for i in range(count))
                busy = [header.word("busy_ns", i) for i in range(count)]
            except (RegionError, ValueError, IndexError, OSError) as err:
                region.close()
                self.bad.report(path, err)
                continue
            self.bad.forget(path)
            self._tracked[path] = _Tracked(region, uuids, busy, self._granted(path))
        self.stats.regions = len(self._tracked)

    def _granted(self, path: Path) -> int | None:
        """The priority the device plugin granted the container of this region (its record under
        ``grants_dir``, out of the container's reach), or None where there is no record."""
        if self.grants_dir is None:
            return None
        try:
            return read_grant(grant_path(self.grants_dir, path.parent.name)).priority
        except GrantError as err:
            if isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOENT:
                pass  # no grant: a container started by an older plugin has a priority record
            else:
                self.bad.report(path, f"unreadable grant: {err}; the region's own word is used")
                return None
        try:
            text = priority_record(self.grants_dir, path.parent.name).read_text().strip()
        except OSError:
            return None
        try:
            return int(text)
        except ValueError:
            self.bad.report(path, f"unreadable priority record {text!r}: the region's own word is used")
            return None

    def _drop(self, path: Path) -> None:
        t = self._tracked.pop(path, None)
        if t is not None:
            try:
                t.region.close()
            except (BufferError, OSError):
                pass

    # -- one pass -----------------------------------------------------------------------------

    def run_pass(self) -> dict[tuple[str, int], int]:
        """Read activity, decide, write flags and arbiter_ns; returns the decision by (folder, index)."""
        started = time.monotonic()
        now = self.clock()
        cards: dict[str, list[Activity]] = defaultdict(list)
        live: dict[str, tuple[Path, _Tracked, Header]] = {}
        for path, t in list(self._tracked.items()):
            name = path.parent.name
            try:
                h = t.region.read_header()  # one pread; a file cut short raises, never a signal
                read_at = self.clock()
                priority = h.word("priority")
                if t.granted is not None and priority != t.granted:
                    # the container wrote its own region: the grant holds (a container that made
                    # itself priority 0 would hold every neighbour on its card)
                    if not t.told:
                        t.told = True
                        log.warning(
                            "container %s claims priority %d in its region, granted %d: using %d",
                            name,
                            priority,
                            t.granted,
                            t.granted,
                        )
                    priority = t.granted
                for i, uuid in enumerate(t.uuids):
                    last = h.word("last_launch_ns", i)
                    busy = h.word("busy_ns", i)
                    active = (last != 0 and now - last <= self.window_ns) or busy > t.busy[i]
                    t.busy[i] = busy
                    self.timeshare.record((name, i, uuid), read_at, busy)
                    cards[uuid].append(Activity(name, i, priority, active))
            except (RegionError, ValueError, IndexError, OSError) as err:
                self.bad.report(path, err)
                self._drop(path)
                continue
            live[name] = (path, t, h)
        decision = decide(cards)
        now = self.clock()
        for name, (path, t, h) in live.items():
            r = t.region
            try:
                for i in range(len(t.uuids)):
                    word = decision.get((name, i), 0)
                    if h.word("flags", i) != word:  # as read at the top of this pass
                        r.set_flags(i, word)
                        self.stats.flag_writes += 1
                r.set_arbiter_ns(now)
            except (RegionError, ValueError, IndexError, OSError) as err:
                self.bad.report(path, err)
                self._drop(path)
        self.stats.passes += 1
        self.stats.regions = len(self._tracked)
        self.stats.last_pass_s = time.monotonic() - started
        return decision

    # -- the thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if time.monotonic() - self._rescanned_at >= self.rescan_s:
                    self.rescan()
                    self._rescanned_at = time.monotonic()
                if self._tracked:
                    self.run_pass()
            except Exception:  # the arbiter must outlive any one bad pass
                log.exception("arbiter pass failed; continuing")
            # With no region on the node there is nothing to arbitrate until the next rescan.
            self._stop.wait(self.interval_s if self._tracked else self.rescan_s)

    def start(self) -> None:
        self._service.start()

    def stop(self) -> None:
        self._service.stop()
        for path in list(self._tracked):
            self._drop(path)
