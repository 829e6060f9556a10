"""The node's compute gate: each container's GPU time as the driver measures it, against its grant.

The hook meters a container's SM limit with a token bucket its processes share through the
region file, which the container can write: a process that keeps the bucket full runs its
neighbours' launches unmetered. So the node decides too, from what no container writes:

1. **Measure.** Every pass (``interval_s``, the memory enforcer's ``enforcement.intervalMs``)
   the driver's per-process utilization samples of each card (``nvmlDeviceGetProcessUtilization``,
   ``vgpu.node.discovery.SmSource``) are read, each process mapped to its container through its
   cgroup and to its grant (``vgpu.monitor.hostview``), and its GPU time (``smUtil`` x the
   sample's period) summed per container and card.
2. **Hold through the grant.** Per container and card a bucket on the host: it fills at the
   grant's SM limit plus ``MARGIN`` points of the samples' time, up to ``DEPTH_NS`` of GPU time (or
   one sample period; ``DEPTH_SHARED_NS`` on a card another container is busy on), and the
   measured GPU time drains it (``vgpu.monitor.bucket``: ``Account.charge``, ``settle``;
   a container held lately is presumed to run while its gate is open until its samples say).
   While it is in debt the node writes ``hold_until_ns`` into the container's grant (read-only to
   the container; in place, under the grant's seq and checksum), the time at which the debt is
   paid back at the granted rate; the hook starts no launch before
   it (one load per launch, native/hook/limiter.c). A closed loop: the integral of measured minus
   granted time, so the share converges to the grant whatever the container wrote. A container
   within its grant does not go into debt (the bucket's depth takes the hook's own 20 ms bursts,
   the samples' rounding and their lumps), so its gate stays open; on a shared card, whose
   samples stray widely, the 1 s bucket makes a brief hold of one rare (1 run of 10 s in 40 in
   bench/bench_gate.py's pessimistic model, where the one-sample bucket held in 39).
3. **Launches that do not pass the hook.** A sample that lies wholly behind a closed gate (past
   ``DRAIN_NS`` of it, the work queued before it closed) should show no GPU time. When such
   samples cover ``ESCAPE_HELD_S`` of the last ``ESCAPE_S`` and their share is still above grant
   + margin, the container's launches do not go through the hook (a static program, ``dlmopen``,
   ioctls).
   ``enforcement.compute`` says what then: ``throttle`` (default) freezes the container's cgroup
   while it is in debt and thaws it when the debt is paid (a duty cycle that leaves it its share
   of wall time; ``vgpu.monitor.freezer``), ``evict`` (the Eviction API, once per
   crossing), ``kill`` (SIGKILL its process with the most GPU time, at most once per
   ``ESCAPE_S``), ``report``. Each: a log line naming the pod, container, measured and granted
   share; a Kubernetes Event (``VgpuComputeOverGrant``); ``vgpu_compute_enforcement_actions_total``.
   A crossing ends after ``RELEASE_S`` out of debt; a throttled container is thawed then, and on
   ``stop``.

An elastic container (``sm_policy`` 1) with no other process busy on its card in the window is
not held: it may use the idle card, as the hook lets it while the arbiter says it is alone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from vgpu.core.service import Service
from vgpu.hookabi.grant import GrantError, update_grant
from vgpu.hookabi.region import Region, RegionError
from vgpu.monitor.bucket import ESCAPE_S, HOLD_MAX_NS, LAG_NS, MARGIN, SHARED_S, WINDOW_S, Account
from vgpu.monitor.enforce import PodActions
from vgpu.monitor.freezer import FreezerError, freezer_of
from vgpu.monitor.hostview import HostView, Owner
from vgpu.node.discovery import SmSample, SmSource
from vgpu.node.paths import REGION_FILE_NAME

log = logging.getLogger(__name__)

REWRITE_NS = 5_000_000  # a gate is rewritten only when it moves by more than this
ESCAPE_HELD_S = 0.5  # the gate closed this long in the last ESCAPE_S: what ran behind it counts
RELEASE_S = 5.0  # out of debt this long: the crossing is over
FORGET_S = 10.0  # a container with no sample for this long is dropped (thawed, gate opened)
REASON = "VgpuComputeOverGrant"
ACTIONS = ("throttle", "evict", "kill", "report")


class ComputeEnforcer:
    """``run_pass`` every ``interval_s`` on a thread (``start``/``stop``); ``run_pass`` alone in tests."""

    def __init__(
        self,
        node: str,
        view: HostView,
        source: SmSource,
        uuids: Callable[[], list[str]],
        action: str = "throttle",
        interval_s: float = 0.1,
        actions: PodActions | None = None,
        kill: Callable[[int, int], None] = os.kill,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if action not in ACTIONS:
            raise ValueError(f"enforcement.compute must be one of {', '.join(ACTIONS)}, not {action!r}")
        self.node = node
        self.view = view
        self.source = source
        self.uuids = uuids
        self.action = action
        self.interval_s = interval_s
        self.actions = actions
        self._kill = kill
        self.clock = clock
        self.accounts: dict[tuple[str, str], Account] = {}
        self.counts: dict[tuple[str, str, str, str], int] = {}  # (action, namespace, pod, container)
        self.gate_writes = 0
        self.scale_writes = 0
        self.passes = 0
        self._card_busy: dict[str, dict[str, int]] = {}  # card -> folder ("" = no container) -> last busy ns
        self.unsampled: set[str] = set()  # cards whose driver gives no per-process samples now
        self._lock = threading.Lock()
        self._service = Service("compute-enforcer", self._loop)

    # ---- one pass ----

    def run_pass(self) -> None:
        now = self.clock()
        self.view.new_pass()
        for uuid in self.uuids():
            busy_on = self._card_busy.setdefault(uuid, {})
            samples = self.source.sm_samples(uuid)
            self._sampled(uuid, samples is not None)
            charges: list[tuple[Account, SmSample, int]] = []
            for s in samples or []:
                busy = s.period_ns * s.sm_percent // 100
                found = self.view.resolve(s.pid)
                if found is None:
                    if busy:
                        busy_on[""] = now  # work of no vGPU container on the card
                    continue
                owner, grant = found
                if uuid not in grant.uuids:
                    continue
                index = grant.uuids.index(uuid)
                key = (owner.folder, uuid)
                acct = self.accounts.get(key)
                limit = grant.sm_limits[index]
                if acct is None:
                    path = str(self.view.paths.grant(owner.folder))
                    acct = Account(owner, uuid, index, path, limit, grant.sm_policy == 1)
                    self.accounts[key] = acct
                acct.limit, acct.elastic, acct.owner = limit, grant.sm_policy == 1, owner
                acct.seen = now
                if busy:
                    busy_on[owner.folder] = now
                charges.append((acct, s, busy))
            for acct in {id(a): a for a, _, _ in charges}.values():  # once per account, from all
                acct.rate_now = acct.rate(alone=self._see_card(acct, now))  # of this pass's samples
            for acct, s, busy in charges:
                acct.samples.append((s.end_ns, s.pid, busy))
                acct.scale.add_sample(s.end_ns, s.period_ns, busy)
                if acct.behind_gate(s.end_ns, s.period_ns):
                    acct.held.append((s.end_ns, s.period_ns, busy))
                acct.charge(s.end_ns, s.period_ns, busy)
        for key, acct in list(self.accounts.items()):
            if now - acct.seen > FORGET_S * 1e9:
                self._release(acct, "its processes left the card")
                self._unscale(acct)
                del self.accounts[key]
                continue
            while acct.samples and acct.samples[0][0] <= now - int(WINDOW_S * 1e9) - LAG_NS:
                acct.samples.popleft()
            while acct.held and acct.held[0][0] <= now - int(ESCAPE_S * 1e9):
                acct.held.popleft()
            while acct.closures and acct.closures[0][1] <= now - int(ESCAPE_S * 1e9):
                acct.closures.popleft()
            self._settle(acct, now, alone=self._see_card(acct, now))
            self._calibrate(acct, now)
        for busy_on in self._card_busy.values():
            for folder in [f for f, at in busy_on.items() if at <= now - int(max(FORGET_S, SHARED_S) * 1e9)]:
                del busy_on[folder]
        self.view.keep_only({pid for a in self.accounts.values() for _, pid, _ in a.samples})
        with self._lock:
            self.passes += 1

    def _see_card(self, acct: Account, now: int) -> bool:
        """Sets ``acct.shared`` (another container's kernels, or work of no vGPU container, ran
        on its card in the last SHARED_S, by the driver's samples) and says whether it is alone
        (none in the last WINDOW_S)."""
        others = [at for f, at in self._card_busy.get(acct.uuid, {}).items() if f != acct.owner.folder]
        last = max(others, default=0)
        acct.shared = last > now - int(SHARED_S * 1e9)
        return last <= now - int(WINDOW_S * 1e9)

    def _sampled(self, uuid: str, ok: bool) -> None:
        """Say once when a card's per-process samples stop (and come back): without them the gate
        cannot see the card, and only the hook's in-process limit holds its containers."""
        if ok and uuid in self.unsampled:
            self.unsampled.discard(uuid)
            log.info("compute gate: card %s gives per-process utilization samples again", uuid)
        elif not ok and uuid not in self.unsampled:
            self.unsampled.add(uuid)
            log.warning(
                "compute gate: the driver gives no per-process utilization samples for card %s "
                "(nvmlDeviceGetProcessUtilization failed); the node cannot check its containers' "
                "compute share, and the hook's in-process limit alone holds them. Check that the "
                "monitor runs with hostPID and the driver supports it (not on MIG instances)",
                uuid,
            )

    def _settle(self, acct: Account, now: int, alone: bool) -> None:
        if not 0 < acct.limit < 100:
            self._gate(acct, 0, now)  # no cap granted: nothing to hold
            return
        rate = acct.rate(alone)
        credit = acct.settle(now, rate)
        if credit < 0:
            acct.clear_since = None
            self._gate(acct, now + min(HOLD_MAX_NS, int(-credit * 100 / rate)), now)
        else:
            acct.clear_since = acct.clear_since or now
            self._gate(acct, 0, now)
        share = acct.share(now)
        held_s, held_share = acct.held_share(now)
        if not acct.escaping and held_s >= ESCAPE_HELD_S and held_share > acct.limit + MARGIN:
            acct.escaping = True
            acct.acted_at = 0
            share = held_share
        if acct.escaping:
            if acct.clear_since is not None and now - acct.clear_since >= RELEASE_S * 1e9:
                self._release(acct, f"its share is back within its grant ({share:.1f} %)")
            else:
                self._escape(acct, now, share)
        if acct.freezer is not None:
            self._duty(acct, freeze=acct.escaping and credit < 0)

    def _calibrate(self, acct: Account, now: int) -> None:
        """One measure of a share (vgpu.monitor.sharescale): the hook's count of the
        container's GPU time read from its region every pass, and the driver's over the hook's
        written into the grant when it moves."""
        if acct.no_scale or not 0 < acct.limit < 100:
            return
        try:
            if acct.region is None:
                path = self.view.paths.containers_dir / acct.owner.folder / REGION_FILE_NAME
                acct.region = Region(path, mapped=False)
                header = acct.region.read_header()
                acct.region_index = [header.uuid(i) for i in range(header.num_devices)].index(acct.uuid)
            acct.scale.read_hook(self.clock(), acct.region.word("busy_ns", acct.region_index))
        except (RegionError, OSError, ValueError, IndexError) as err:
            # not there yet, or being made: tried again next pass, told once
            if acct.region is not None:
                acct.region.close()
                acct.region = None
            if not acct.region_told:
                acct.region_told = True
                log.info(
                    "compute gate: cannot read the region of %s (%s): its hook keeps its own measure "
                    "until it can",
                    acct.owner.folder,
                    err,
                )
            return
        word = acct.scale.step(now)
        if word is None:
            return
        if not self._update(
            acct,
            logging.INFO,
            "cannot give it a share scale: the hook keeps its own measure",
            share_scale=word,
        ):
            acct.no_scale = True
            return
        with self._lock:
            self.scale_writes += 1

    def _unscale(self, acct: Account) -> None:
        """The hook back on its own measure (a scale is the node's word only while it watches)."""
        if acct.region is not None:
            acct.region.close()
            acct.region = None
        if not acct.no_scale and acct.scale.calibrated:
            self._update(acct, logging.INFO, "cannot reset its share scale", share_scale=0)

    @staticmethod
    def _update(acct: Account, level: int, failure: str, **words: int) -> bool:
        """One of the node's words into the container's grant, in place; False (logged) where the
        grant cannot take it."""
        try:
            update_grant(acct.grant, acct.index, **words)
        except GrantError as err:
            log.log(level, "compute gate: %s: %s (%s: %s)", acct.owner.folder, failure, acct.grant, err)
            return False
        return True

    def _gate(self, acct: Account, hold: int, now: int) -> None:
        last = acct.closures[-1] if acct.closures else None
        if hold:
            if last is not None and last[1] >= now:
                last[1] = hold  # still closed: moved
            else:
                acct.closures.append([now, hold])
        elif last is not None and last[1] > now:
            last[1] = now  # opened early
        if acct.no_gate or (
            (hold == 0) == (acct.hold_until == 0) and abs(hold - acct.hold_until) <= REWRITE_NS
        ):
            return
        if not self._update(
            acct, logging.WARNING, "cannot hold it; only the second line holds it", hold_until=hold
        ):
            acct.no_gate = True
            return
        acct.hold_until = hold
        with self._lock:
            self.gate_writes += 1

    # ---- the second line ----

    def _escape(self, acct: Account, now: int, share: float) -> None:
        if self.action == "kill":
            if acct.acted_at and now - acct.acted_at < ESCAPE_S * 1e9:
                return
        elif acct.acted_at:
            return  # once per crossing; the throttle's duty cycle goes on in _duty
        acct.acted_at = now
        o = acct.owner
        where = f"{o.namespace}/{o.pod}" if o.pod else f"pod {o.pod_uid}"
        what = (
            f"container {o.container} of {where} ran {share:.1f} % of {acct.uuid} over the last "
            f"{ESCAPE_S:.0f} s while the node's gate held its launches, granted {acct.limit} % (+{MARGIN} "
            f"tolerated): they do not pass through the hook"
        )
        if self.action == "throttle":
            try:
                acct.freezer = freezer_of(self._top_pid(acct), self.view.proc)
                message = f"throttling with the cgroup freezer ({acct.freezer.file}): {what}"
            except FreezerError as err:
                message = f"could not throttle ({err}): {what}"
        elif self.action == "kill":
            pid = self._top_pid(acct)
            try:
                if pid <= 0 or not self.view.same_process(pid):
                    raise ProcessLookupError(3, "the process is gone")
                self._kill(pid, signal.SIGKILL)
                message = f"killed PID {pid}: {what}"
            except OSError as err:
                message = f"could not kill PID {pid} ({err.strerror}): {what}"
        elif self.action == "evict":
            message = f"evicting the pod: {what}"
        else:
            message = f"reported only (enforcement.compute: report): {what}"
        log.warning("compute over grant: %s", message)
        with self._lock:
            key = (self.action, o.namespace, o.pod, o.container)
            self.counts[key] = self.counts.get(key, 0) + 1
        self._tell(o, message)

    def _tell(self, o: Owner, message: str) -> None:
        if self.actions is None or not o.pod:
            return
        actions, node, evict = self.actions, self.node, self.action == "evict"

        def call() -> None:
            said = message
            if evict:
                try:
                    actions.evict_pod(o.namespace, o.pod)
                except Exception as err:  # a disruption budget, say: the Event tells it
                    said = f"could not evict the pod ({err}): {message}"
            actions.pod_event(o.namespace, o.pod, o.pod_uid, REASON, said, node)

        threading.Thread(target=self._call, args=(call,), name="compute-api", daemon=True).start()

    @staticmethod
    def _call(call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as err:  # the API server's trouble never stops the gate
            log.warning("compute enforcer: an API call failed: %s", err)

    def _top_pid(self, acct: Account) -> int:
        per: dict[int, int] = {}
        for _, pid, busy in acct.samples:
            per[pid] = per.get(pid, 0) + busy
        return max(per, key=lambda p: (per[p], p)) if per else 0

    def _duty(self, acct: Account, freeze: bool) -> None:
        if acct.freezer is None or freeze == acct.frozen:
            return
        try:
            acct.freezer.freeze() if freeze else acct.freezer.thaw()
            acct.frozen = freeze
        except OSError as err:
            log.warning("compute throttle: cannot write %s: %s", acct.freezer.file, err)
            acct.freezer, acct.frozen = None, False
            if isinstance(err, FileNotFoundError):
                acct.acted_at = 0  # its cgroup is gone (the container restarted): found again next pass

    def _release(self, acct: Account, why: str) -> None:
        if acct.escaping:
            log.info("compute: container %s on %s released: %s", acct.owner.folder, acct.uuid, why)
        self._duty(acct, freeze=False)
        acct.freezer = None
        acct.escaping = False
        acct.acted_at = 0
        self._gate(acct, 0, self.clock())

    # ---- the thread ----

    def next_wake_ns(self, now: int) -> int:
        """When the next pass is due: the interval, or sooner where a frozen container's debt is paid."""
        wake = now + int(self.interval_s * 1e9)
        for acct in self.accounts.values():
            if acct.frozen and acct.balance < 0:
                paid = now + int(-acct.balance * 100 / max(1.0, acct.rate(False)))
                wake = min(wake, max(now + 1_000_000, paid))
        return wake

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_pass()
            except Exception:  # the gate must outlive any one bad pass
                log.exception("compute enforcer pass failed; continuing")
            now = self.clock()
            stop.wait(max(0.001, (self.next_wake_ns(now) - now) / 1e9))

    def start(self) -> None:
        self._service.start()

    def stop(self) -> None:
        self._service.stop()
        for acct in self.accounts.values():  # never leave a container frozen or held, or scaled
            self._duty(acct, freeze=False)
            self._gate(acct, 0, self.clock())
            self._unscale(acct)
