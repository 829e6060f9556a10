"""The node's second line of defence for device memory: the driver's word against the grant.

The hook refuses an allocation past the grant inside the container, but a process can bypass
the hook (find the driver's functions without the dynamic linker, link statically, speak the
driver's ioctls) or lie through the region its container shares. The enforcer reads the host's
view (``vgpu.monitor.hostview``: per card, each process's memory by the driver, mapped to
its container through its cgroup) every ``interval_s`` (default 100 ms) and, for a container
whose processes hold more on a card than its grant plus ``tolerance`` per process (the memory
the driver keeps for each context beyond what the hook charges), acts as ``action`` says:

- ``kill`` (default): SIGKILL the container's process holding the most on that card, as the
  kernel's OOM killer would; again on the next pass if the container is still over without it;
- ``evict``: the Eviction API on the pod (once per crossing), so its controller replaces it;
- ``report``: nothing is stopped.

Every action, whatever it is: a log line naming the pod, container, PID, the bytes held and
granted; a Kubernetes Event on the pod (``reason: VgpuMemoryOverGrant``); and the counter
``vgpu_memory_enforcement_actions_total``. A container within its grant (plus tolerance) is
never acted on: ``decide`` is the pure rule, tested on its own. The API server's calls (Events,
evictions) go through a queue on a thread of their own, so a slow API server never delays a
kill.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vgpu.core.errors import KubeError
from vgpu.core.service import Service
from vgpu.monitor.hostview import Held, HostView, Owner, View

log = logging.getLogger(__name__)

MIB = 1 << 20
REASON = "VgpuMemoryOverGrant"
REASON_LEFT_MPS = "VgpuLeftMps"  # a process of an MPS container outside the card's MPS daemon
KILLED_KEEP_S = 10.0  # a killed process the driver still lists is not counted, nor picked, again


@runtime_checkable
class PodActions(Protocol):
    """The API calls the enforcer makes (vgpu.kube.agent.NodeAgentClient)."""

    def pod_event(
        self, namespace: str, name: str, uid: str, reason: str, message: str, node: str
    ) -> None: ...

    def evict_pod(self, namespace: str, name: str) -> None: ...


@dataclass(frozen=True)
class Decision:
    """Act on one container's card: ``pid`` holds ``pid_bytes`` of the ``total`` its container
    holds there, over ``allowed`` (its grant plus the tolerance)."""

    held: Held
    pid: int
    pid_bytes: int
    total: int
    allowed: int


def decide(view: View, tolerance: int, spared: set[int], over: set[tuple[str, str]]) -> list[Decision]:
    """The containers over their grant on a card, and the process of each holding the most.

    ``spared``: PIDs already killed (neither counted nor picked); ``over``: the (folder, card)
    already over at the last pass, updated in place (the caller acts once per crossing where
    the action does not remove the memory). A container without a limit on the card (granted
    0) is never over."""
    now_over: set[tuple[str, str]] = set()
    found: list[Decision] = []
    for held in view.held:
        if held.granted <= 0:
            continue
        pids = {pid: b for pid, b in held.pids.items() if pid not in spared}
        allowed = held.granted + tolerance * len(held.pids)
        total = sum(pids.values())
        if total <= allowed or not pids:
            continue
        now_over.add((held.owner.folder, held.uuid))
        pid = max(pids, key=lambda p: (pids[p], p))
        found.append(Decision(held, pid, pids[pid], total, allowed))
    over.intersection_update(now_over)
    return found


def left_mps(view: View, spared: set[int], seen: set[tuple[str, str, int]]) -> list[tuple[Held, int]]:
    """The processes of MPS containers the driver lists outside the card's MPS daemon (docs/mps.md),
    but those in ``spared``; ``seen`` (updated in place) keeps the (folder, card, PID) still found."""
    found = [(held, pid) for held in view.held for pid in sorted(held.left_mps) if pid not in spared]
    seen.intersection_update((h.owner.folder, h.uuid, pid) for h, pid in found)
    return found


def _who(o: Owner) -> str:
    where = f"{o.namespace}/{o.pod}" if o.pod else f"pod {o.pod_uid or '(unknown)'}"
    if o.claim:
        where += f" under ResourceClaim UID {o.claim}"
    return f"{o.container or '(not yet named)'} of {where}"


@dataclass
class EnforcementStats:
    passes: int = 0
    last_pass_s: float = 0.0
    actions: dict[tuple[str, str, str, str], int] | None = None  # (action, namespace, pod, container)
    view: View | None = None


class Enforcer:
    """``run_pass`` every ``interval_s`` on a thread (``start``/``stop``); ``run_pass`` alone in tests."""

    def __init__(
        self,
        node: str,
        view: HostView,
        action: str = "kill",
        tolerance_bytes: int = 256 * MIB,
        interval_s: float = 0.1,
        actions: PodActions | None = None,
        kill: Callable[[int, int], None] = os.kill,
    ) -> None:
        self.node = node
        self.view = view
        self.action = action
        self.tolerance = tolerance_bytes
        self.interval_s = interval_s
        self.actions = actions
        self._kill = kill
        self.killed: dict[int, float] = {}  # pid -> when
        self.over: set[tuple[str, str]] = set()
        self.left: set[tuple[str, str, int]] = set()  # MPS containers' processes outside MPS, acted on
        self.stats = EnforcementStats(actions={})
        self._lock = threading.Lock()
        self._calls: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=1000)
        self._service = Service("enforcer", self._loop)
        self._caller = threading.Thread(target=self._call_loop, name="enforcer-api", daemon=True)

    def run_pass(self) -> list[Decision]:
        started = time.monotonic()
        view = self.view.read()
        now = time.monotonic()
        self.killed = {pid: at for pid, at in self.killed.items() if now - at < KILLED_KEEP_S}
        before = set(self.over)
        decisions = decide(view, self.tolerance, set(self.killed), self.over)
        for held, pid in left_mps(view, set(self.killed), self.left):
            key3 = (held.owner.folder, held.uuid, pid)
            if self.action == "kill" or key3 not in self.left:
                self.left.add(key3)
                self._act_left_mps(held, pid)
        done = []
        for d in decisions:
            key = (d.held.owner.folder, d.held.uuid)
            self.over.add(key)
            if self.action != "kill" and key in before:
                continue  # evicted or reported already for this crossing
            self._act(d)
            done.append(d)
        with self._lock:
            self.stats.passes += 1
            self.stats.last_pass_s = time.monotonic() - started
            self.stats.view = view
        return done

    def _act(self, d: Decision) -> None:
        o = d.held.owner
        what = (
            f"container {_who(o)} holds {d.total} bytes ({d.total // MIB} MiB) "
            f"on {d.held.uuid}, "
            f"granted {d.held.granted} bytes ({d.held.granted // MIB} MiB; {d.allowed // MIB} MiB with the "
            f"tolerance for {len(d.held.pids)} process(es)); PID {d.pid} holds {d.pid_bytes} bytes"
        )
        message = self._stop_process(d.pid, what)
        log.warning("memory over grant: %s [at monotonic %.6f s]", message, time.monotonic())
        self._record(o, message, what, REASON)

    def _act_left_mps(self, held: Held, pid: int) -> None:
        """A process of an MPS container outside the card's MPS daemon: no thread cap, no pinned
        memory limit holds it, so it is acted on as a bypass (enforcement.memory's action)."""
        what = (
            f"PID {pid} of container {_who(held.owner)} on {held.uuid} is not a client of the card's MPS "
            f"daemon: it left MPS (unset CUDA_MPS_PIPE_DIRECTORY or reached the driver past the hook)"
        )
        message = self._stop_process(pid, what)
        log.warning("MPS bypass: %s", message)
        self._record(held.owner, message, what, REASON_LEFT_MPS)

    def _stop_process(self, pid: int, what: str) -> str:
        """Kill ``pid`` under the kill action; the message saying what was done."""
        if self.action == "kill":
            try:
                if not self.view.same_process(pid):  # gone since the read, its number maybe reused
                    raise ProcessLookupError(3, "the process is gone")
                self._kill(pid, signal.SIGKILL)
                self.killed[pid] = time.monotonic()
                return f"killed PID {pid}: {what}"
            except OSError as err:
                self.killed[pid] = time.monotonic()  # tried: not again every pass
                return f"could not kill PID {pid} ({err.strerror}): {what}"
        if self.action == "evict":
            return f"evicting the pod: {what}"
        return f"reported only (enforcement.memory: report): {what}"

    def _record(self, o: Owner, message: str, what: str, reason: str) -> None:
        where = f"{o.namespace}/{o.pod}" if o.pod else f"pod {o.pod_uid or '(unknown)'}"
        with self._lock:
            assert self.stats.actions is not None
            key = (self.action, o.namespace, o.pod, o.container)
            self.stats.actions[key] = self.stats.actions.get(key, 0) + 1
        if self.actions is None or not o.pod:
            return
        actions, node = self.actions, self.node

        def call() -> None:
            said = message
            if self.action == "evict":
                try:
                    actions.evict_pod(o.namespace, o.pod)
                except KubeError as err:  # a disruption budget, say: the Event tells it
                    log.warning("enforcer: %s", err)
                    said = f"could not evict the pod ({err}): {what}"
            actions.pod_event(o.namespace, o.pod, o.pod_uid, reason, said, node)

        try:
            self._calls.put_nowait(call)
        except queue.Full:
            log.warning("the enforcer's API calls are backed up; no Event for %s", where)

    def _call_loop(self) -> None:
        while self._call_one(self._calls.get()):
            pass

    def drain(self) -> None:
        """Make the queued API calls on this thread (tests; the thread makes them when started)."""
        while not self._calls.empty():
            self._call_one(self._calls.get_nowait())

    @staticmethod
    def _call_one(call: Callable[[], None] | None) -> bool:
        if call is None:
            return False
        try:
            call()
        except KubeError as err:
            log.warning("enforcer: %s", err)
        except Exception:
            log.exception("enforcer: an API call failed")
        return True

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_pass()
            except Exception:  # the enforcer must outlive any one bad pass
                log.exception("enforcer pass failed; continuing")
            stop.wait(self.interval_s)

    def start(self) -> None:
        self._caller.start()
        self._service.start()

    def stop(self) -> None:
        self._service.stop()
        if self._caller.is_alive():
            self._calls.put(None)
            self._caller.join(timeout=5)


class HostCollector(Collector):
    """The host view's and the enforcer's families for ``/metrics`` (docs/monitoring.md)."""

    def __init__(self, enforcer: Enforcer) -> None:
        self.enforcer = enforcer

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        e = self.enforcer
        node = e.node
        with e._lock:
            view = e.stats.view
            actions = dict(e.stats.actions or {})
            passes, last = e.stats.passes, e.stats.last_pass_s
        labels = ["node", "uuid", "namespace", "pod", "pod_uid", "container"]
        used = GaugeMetricFamily(
            "vgpu_container_host_memory_used_bytes",
            "Device memory a container's processes hold on the card, as the driver reports it",
            labels=labels,
        )
        granted = GaugeMetricFamily(
            "vgpu_container_host_memory_granted_bytes",
            "Device memory the container was granted on the card (its grant; 0 = no limit)",
            labels=labels,
        )
        sm = GaugeMetricFamily(
            "vgpu_container_host_sm_ratio",
            "Share of the card's time the container's kernels ran in the driver's latest samples",
            labels=labels,
        )
        other = GaugeMetricFamily(
            "vgpu_card_memory_unattributed_bytes",
            "Device memory held on the card by processes of no vGPU container",
            labels=["node", "uuid"],
        )
        if view is not None:
            for h in view.held:
                o = h.owner
                row = [node, h.uuid, o.namespace, o.pod, o.pod_uid, o.container]
                used.add_metric(row, float(h.total))
                granted.add_metric(row, float(h.granted))
                sm.add_metric(row, h.sm_percent / 100.0)
            for uuid, held in view.unattributed.items():
                other.add_metric([node, uuid], float(held))
        acted = CounterMetricFamily(
            "vgpu_memory_enforcement_actions",
            "Actions on containers holding more device memory than granted (kill, evict, report)",
            labels=["node", "action", "namespace", "pod", "container"],
        )
        for (action, namespace, pod, container), count in actions.items():
            acted.add_metric([node, action, namespace, pod, container], float(count))
        p = CounterMetricFamily("vgpu_enforcer_passes", "Passes of the memory enforcer", labels=["node"])
        p.add_metric([node], float(passes))
        s = GaugeMetricFamily(
            "vgpu_enforcer_pass_seconds", "How long the enforcer's latest pass took", labels=["node"]
        )
        s.add_metric([node], last)
        yield from (used, granted, sm, other, acted, p, s)
