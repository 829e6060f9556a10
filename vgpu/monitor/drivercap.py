"""The third line of defence for device memory: the driver's own cap on each container's cgroup.

The hook (first line) refuses allocations past the grant inside the container; the node's
enforcer (second, ``enforce.py``) reads the driver's per-process memory and acts after the fact.
Neither stops a process that reaches the driver without the hook before the enforcer's next
pass. A driver of r615 or later caps a cgroup v2's device memory itself
(``nvmlDeviceSetMemoryLimits_v1``, ``vgpu.node.memcap``): an allocation past the hard limit
fails in the driver, whatever the process did to the dynamic linker.

``enforcement.driverCap`` (``auto``, the default; ``off``; ``required``) says whether the node
sets it. Every ``interval_s`` (0.5 s) a pass:

1. finds the vGPU containers' cgroup folders (``cgroupscan.py``) and reads each one's grant;
2. per card of the grant with a memory limit, sets the hard limit to the memory that counts on
   the card (``device_grant``: the limit, or the budget where spilling keeps the rest in host
   memory) and the soft limit to 0, when the container is first seen and again whenever its
   grant changes (a live resize);
3. clears the limits (soft 0, hard ``LIMIT_MAX``) of a container whose processes have all ended
   (``populated 0``: the runtime removes its cgroup next), whose grant is gone, or whose grant no
   longer names the card; a cgroup already gone is no error (removing it cleared the limits);
4. with ``required``, refuses a container that no line holds on a card where the driver shows its
   processes: no hook region in its folder and no cap set there (a driver without the call, an
   error, or its cgroup not found within ``UNKNOWN_GRACE_S``). It kills the container's
   processes on that card (SIGKILL) every pass while they stay, or evicts its pod once where
   ``enforcement.memory`` is ``evict``; each refusal is a log line, an Event on the pod
   (``reason: VgpuNoMemoryLine``) and ``vgpu_driver_cap_refusals_total``.

Errors are logged once per container, card and error word (``vgpu.node.memcap.CODES``), and
counted in ``vgpu_driver_cap_errors_total``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vgpu.core.errors import KubeError
from vgpu.core.service import Service
from vgpu.hookabi.grant import Grant, GrantError, read_grant
from vgpu.monitor.cgroupscan import CgroupScan
from vgpu.monitor.enforce import PodActions
from vgpu.monitor.hostview import Held, View, device_grant
from vgpu.node.memcap import LIMIT_MAX, CapError, MemoryCaps
from vgpu.node.paths import REGION_FILE_NAME, HostPaths

log = logging.getLogger(__name__)

MODES = ("auto", "off", "required")
REFUSED_REASON = "VgpuNoMemoryLine"
UNKNOWN_GRACE_S = 2.0  # a container on a card, its cgroup not found yet: refused after this long


@dataclass
class CapStats:
    applied: dict[tuple[str, str], int] = field(default_factory=dict)  # (cgroup, uuid) -> hard bytes
    grants: dict[str, str] = field(default_factory=dict)  # cgroup -> grant name
    failed: dict[tuple[str, str], str] = field(default_factory=dict)  # (grant, uuid) -> error word
    running: set[str] = field(default_factory=set)  # grants whose cgroup holds a process (last scan)
    errors: dict[str, int] = field(default_factory=dict)  # error word -> count
    refusals: dict[str, int] = field(default_factory=dict)  # action -> count
    sets: int = 0
    clears: int = 0
    passes: int = 0


def wanted(grant: Grant) -> dict[str, int]:
    """The hard limit per card the driver should hold a container to (cards without a limit left out)."""
    out = {}
    for i, uuid in enumerate(grant.uuids):
        hard = device_grant(grant, i)
        if hard > 0:
            out[uuid] = hard
    return out


class DriverCap:
    """``run_pass`` every ``interval_s`` on a thread (``start``/``stop``); alone in tests."""

    def __init__(
        self,
        node: str,
        paths: HostPaths,
        caps: MemoryCaps,
        scan: CgroupScan,
        mode: str = "auto",
        interval_s: float = 0.5,
        view: Callable[[], View | None] | None = None,
        refuse_with: str = "kill",
        actions: PodActions | None = None,
        kill: Callable[[int, int], None] = os.kill,
    ) -> None:
        self.node = node
        self.paths = paths
        self.caps = caps
        self.scan = scan
        self.mode = mode
        self.interval_s = interval_s
        self.view = view
        self.refuse_with = refuse_with
        self.actions = actions
        self._kill = kill
        self.stats = CapStats()
        self.lock = threading.Lock()
        self._told: set[tuple[str, str, str]] = set()
        self._refused: dict[tuple[str, str], int] = {}  # (cgroup, uuid) -> the limit the driver refused
        self._first_seen: dict[tuple[str, str], float] = {}  # (grant, uuid) on a card, no line yet
        self._evicted: set[str] = set()
        self._service = Service.every("driver-cap", interval_s, self.run_pass, logger=log)

    # -- the cap --------------------------------------------------------------------------------

    def _error(self, grant: str, uuid: str, cgroup: str, err: CapError) -> None:
        with self.lock:
            self.stats.errors[err.code] = self.stats.errors.get(err.code, 0) + 1
            self.stats.failed[(grant, uuid)] = err.code
        if (cgroup, uuid, err.code) not in self._told:
            self._told.add((cgroup, uuid, err.code))
            log.warning("driver cap: container %s on %s not capped (%s): %s", grant, uuid, err.code, err)

    def _set(self, cgroup: str, grant: str, uuid: str, hard: int) -> None:
        try:
            self.caps.set_memory_limits(uuid, cgroup, 0, hard)
        except CapError as err:
            self._error(grant, uuid, cgroup, err)
            self._refused[(cgroup, uuid)] = hard  # not asked again for the same limit
            return
        log.info("driver cap: container %s held to %d MiB on %s (%s)", grant, hard >> 20, uuid, cgroup)
        with self.lock:
            self.stats.applied[(cgroup, uuid)] = hard
            self.stats.grants[cgroup] = grant
            self.stats.failed.pop((grant, uuid), None)
            self.stats.sets += 1

    def _clear(self, cgroup: str, uuid: str, why: str) -> None:
        grant = self.stats.grants.get(cgroup, "")
        try:
            self.caps.set_memory_limits(uuid, cgroup, 0, LIMIT_MAX)
            log.info("driver cap: cleared container %s's limit on %s (%s)", grant, uuid, why)
        except CapError as err:
            if err.code != "not-found" and os.path.isdir(cgroup):
                self._error(grant, uuid, cgroup, err)
                return
            # the cgroup is gone already: removing it cleared the driver's limits
        with self.lock:
            self.stats.applied.pop((cgroup, uuid), None)
            self.stats.clears += 1
            if not any(c == cgroup for c, _ in self.stats.applied):
                self.stats.grants.pop(cgroup, None)

    def run_pass(self) -> None:
        want: dict[tuple[str, str], int] = {}
        scanned = self.scan.scan()
        for found in scanned:
            if not found.populated:
                continue  # its processes ended: cleared below, before its cgroup goes
            try:
                grant = read_grant(self.paths.grant(found.grant))
            except GrantError:
                continue  # no grant (any more): not ours to cap
            for uuid, hard in wanted(grant).items():
                want[(found.folder, uuid)] = hard
                with self.lock:
                    self.stats.grants.setdefault(found.folder, found.grant)
                if hard in (
                    self.stats.applied.get((found.folder, uuid)),
                    self._refused.get((found.folder, uuid)),
                ):
                    continue
                if not self.caps.memory_caps(uuid):
                    with self.lock:
                        self.stats.failed[(found.grant, uuid)] = "missing"
                    continue
                self._set(found.folder, found.grant, uuid, hard)
        for cgroup, uuid in sorted(set(self.stats.applied) - set(want)):
            gone = not os.path.isdir(cgroup)
            self._clear(
                cgroup, uuid, "its cgroup is gone" if gone else "its processes ended or its grant changed"
            )
        self._forget({c.folder for c in scanned}, {c.grant for c in scanned})
        with self.lock:
            self.stats.running = {c.grant for c in scanned if c.populated}
        if self.mode == "required" and self.view is not None:
            latest = self.view()
            if latest is not None:
                self._refuse(latest)
        with self.lock:
            self.stats.passes += 1

    def _forget(self, folders: set[str], grants: set[str]) -> None:
        """Drop what is kept of containers whose cgroup is gone (nothing applied on it any more)."""
        self._refused = {k: v for k, v in self._refused.items() if k[0] in folders}
        self._told = {t for t in self._told if t[0] in folders}
        with self.lock:
            kept = folders | {c for c, _ in self.stats.applied}
            self.stats.grants = {c: g for c, g in self.stats.grants.items() if c in kept}
            self.stats.failed = {k: v for k, v in self.stats.failed.items() if k[0] in grants}

    # -- what holds each container ----------------------------------------------------------------

    def capped(self, grant: str, uuid: str) -> bool:
        """The driver holds the container to its grant on this card now."""
        with self.lock:
            return any(
                self.stats.grants.get(cgroup) == grant and u == uuid for cgroup, u in self.stats.applied
            )

    def capped_grants(self) -> dict[str, set[str]]:
        """Per grant, the cards the driver caps it on."""
        with self.lock:
            out: dict[str, set[str]] = {}
            for cgroup, uuid in self.stats.applied:
                out.setdefault(self.stats.grants.get(cgroup, ""), set()).add(uuid)
            return out

    def _hooked(self, grant: str) -> bool:
        return (self.paths.containers_dir / grant / REGION_FILE_NAME).is_file()

    def _refuse(self, view: View) -> None:
        now = time.monotonic()
        on_card: set[tuple[str, str]] = set()
        for held in view.held:
            grant = held.owner.folder
            key = (grant, held.uuid)
            on_card.add(key)
            if held.granted <= 0 or self._hooked(grant) or self.capped(grant, held.uuid):
                continue
            with self.lock:
                failed = self.stats.failed.get(key)
            if failed is None and not self.caps.memory_caps(held.uuid):
                failed = "missing"  # a driver without the call (or a MIG device): nothing to wait for
            first = self._first_seen.setdefault(key, now)
            if failed is None and now - first < UNKNOWN_GRACE_S:
                continue  # its cgroup not found yet: the next passes may cap it
            self._act(held, failed or "its cgroup was not found")
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in on_card}

    def _act(self, held: Held, why: str) -> None:
        o = held.owner
        where = f"{o.namespace}/{o.pod}" if o.pod else f"pod {o.pod_uid or '(unknown)'}"
        what = (
            f"container {o.container or o.folder} of {where} holds {held.total >> 20} MiB on {held.uuid} "
            f"with no line to hold it to its grant: no hook region, and the driver's cap is not set ({why}); "
            "enforcement.driverCap is required"
        )
        action = "evict" if self.refuse_with == "evict" else "kill"
        if action == "evict" and o.folder in self._evicted:
            return
        if action == "kill":
            killed = []
            for pid in sorted(held.pids):
                try:
                    self._kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass  # gone already (killed by an earlier pass, the driver's list not yet updated)
                except OSError as err:
                    log.warning("driver cap: could not kill PID %d (%s)", pid, err.strerror)
            if not killed:
                return  # nothing was running to refuse: neither said nor counted again
            message = f"killed PID(s) {', '.join(map(str, killed))}: {what}"
        else:
            self._evicted.add(o.folder)
            message = f"evicting the pod: {what}"
        log.warning("driver cap: refused: %s", message)
        with self.lock:
            self.stats.refusals[action] = self.stats.refusals.get(action, 0) + 1
        if self.actions is None or not o.pod:
            return
        try:
            if action == "evict":
                self.actions.evict_pod(o.namespace, o.pod)
            self.actions.pod_event(o.namespace, o.pod, o.pod_uid, REFUSED_REASON, message, self.node)
        except KubeError as err:
            log.warning("driver cap: %s", err)

    def start(self) -> None:
        try:  # a container already running is capped at once, not after an interval
            self.run_pass()
        except Exception:  # the node starts anyway: the next pass tries again
            log.exception("driver-cap failed; continuing")
        self._service.start()

    def stop(self) -> None:
        self._service.stop()
