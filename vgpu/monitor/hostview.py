"""The host's view of every container on the node's cards: the driver's word, not the hook's.

The hook's region is written by the container's own processes, so what it says a container
holds can be lied about or simply bypassed (a process that reaches the driver without the
dynamic linker). The driver cannot be: per card it lists each process and the device memory it
holds (NVML's running compute processes, ``Discovery.processes``). This module maps each of
those processes to its pod and container and puts the container's grant beside it:

0. PID -> grant: the host file bind-mounted at ``/etc/vgpu/limits`` in the process's
   ``/proc/<pid>/mountinfo`` (``vgpu.monitor.mounts``), made by the runtime and out of
   the tenant's reach, whichever path made the container: the device plugin's
   ``<pod-uid>_<container>`` or the DRA driver's ``dra_<claim-uid>_<request>``. Steps 1-3 then
   only name the pod and container; where mountinfo names no grant (an older runtime's file of
   another device, say) they find the device plugin's grant as before.
1. PID -> container: the process's cgroup path (``vgpu.monitor.cgroup``), set by the
   kubelet and the runtime, out of the tenant's reach. It gives the runtime's container id and
   the pod's UID. Kept per (PID, start time), so a reused PID is read again.
2. container id -> container name: the pod's ``status.containerStatuses[].containerID``, which
   the kubelet reports from the runtime (the node's pods from the API server, listed again at
   most every ``relist_s`` when an unknown id shows up). Where the API server cannot say yet
   (a container started a moment ago, the API server away), a pod with a single grant on the
   node is unambiguous: the cgroup's pod UID and that grant name the container.
3. container -> grant: ``/var/lib/vgpu/grants/<pod-uid>_<container>.limits``, which the device
   plugin wrote at Allocate and only root on the host can change.

Memory of processes that map to no granted container (the host's, a pod without a vGPU, a
container whose grant is gone) is the card's *unattributed* memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpu.core.errors import KubeError
from vgpu.hookabi.grant import GRANT_SUFFIX, Grant, GrantError, read_grant
from vgpu.hookabi.layout import SHARING_MPS
from vgpu.monitor.cgroup import ContainerRef, container_of, start_time
from vgpu.monitor.mounts import claim_of, device_of, process_grant
from vgpu.node.discovery import Codec, ProcessSource
from vgpu.node.paths import HostPaths

log = logging.getLogger(__name__)

PodLister = Callable[[str], list[dict[str, Any]]]


@dataclass(frozen=True)
class Owner:
    """A vGPU container: its pod and name, as the grant's folder name and the API server give them."""

    pod_uid: str
    container: str  # "" while the API server has not said which of a DRA pod's containers
    namespace: str = ""  # "" until the API server said
    pod: str = ""
    grant: str = ""  # the grant's name as mountinfo gave it; "": the device plugin's, by name

    @property
    def folder(self) -> str:
        """The grant's name (its file without ``.limits``)."""
        return self.grant or f"{self.pod_uid}_{self.container}"

    @property
    def claim(self) -> str:
        """The DRA claim's UID the container runs under; "" for a device-plugin container."""
        found = claim_of(self.folder)
        return found[0] if found else ""


@dataclass
class Held:
    """What one container's processes hold on one card, by the driver, and what it was granted."""

    owner: Owner
    uuid: str
    granted: int  # device bytes granted on this card; 0: no limit
    pids: dict[int, int] = field(default_factory=dict)  # host PID -> bytes
    sm_percent: int = 0  # the processes' SM shares in the driver's latest samples, summed
    codec: Codec | None = None  # their media engines' shares, summed; None: no process sampled
    # under an MPS grant (docs/mps.md): its processes the driver lists outside the card's MPS
    # daemon (they left MPS: unset the pipe, or reached the driver past the hook)
    left_mps: set[int] = field(default_factory=set)

    @property
    def total(self) -> int:
        return sum(self.pids.values())


@dataclass
class View:
    held: list[Held]
    unattributed: dict[str, int]  # card UUID -> bytes of processes of no vGPU container
    seconds: float = 0.0  # how long reading it took


def device_grant(grant: Grant, index: int) -> int:
    """The device memory a grant allows on its ``index``-th card (0: no limit). With spilling, the
    part beyond ``budget`` lives in host memory, which the driver does not count on the card."""
    limit = grant.limits[index] if index < len(grant.limits) else 0
    budget = grant.budgets[index] if index < len(grant.budgets) else 0
    if limit and budget:
        return min(limit, budget)
    return limit


def container_ids(pod: dict[str, Any]) -> Iterable[tuple[str, str]]:
    """(runtime container id, container name) of a pod's started containers."""
    status = pod.get("status") or {}
    for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
        for s in status.get(key) or []:
            cid = str(s.get("containerID") or "")
            if cid:
                yield cid.rpartition("://")[2], str(s.get("name", ""))


class HostView:
    """Reads the host's view of the node's cards on demand (``read``); the enforcer calls it."""

    def __init__(
        self,
        node: str,
        paths: HostPaths,
        source: ProcessSource,
        uuids: Callable[[], list[str]],
        list_pods: PodLister | None = None,
        proc: Path = Path("/proc"),
        relist_s: float = 1.0,
    ) -> None:
        self.node = node
        self.paths = paths
        self.source = source
        self.uuids = uuids
        self.list_pods = list_pods
        self.proc = proc
        self.relist_s = relist_s
        # pid -> (start time, its container, the grant its mountinfo names)
        self._refs: dict[int, tuple[int, ContainerRef | None, str | None]] = {}
        self._grants_device: tuple[int, int] | None = None
        self._by_id: dict[str, tuple[str, str]] = {}  # container id -> (pod uid, container name)
        self._pods: dict[str, tuple[str, str]] = {}  # pod uid -> (namespace, name)
        self._listed_at = -1e9
        self._pass_grants: dict[str, Grant | None] = {}  # resolve's grants read since new_pass()

    def _ref(self, pid: int) -> tuple[ContainerRef | None, str | None]:
        """The process's container (by its cgroup) and grant (by its mounts)."""
        try:
            started = start_time(pid, self.proc)
            cached = self._refs.get(pid)
            if cached is not None and cached[0] == started:
                return cached[1], cached[2]
            ref = container_of(pid, self.proc)
        except OSError:
            return None, None  # gone: its memory goes with it
        if self._grants_device is None:
            self._grants_device = device_of(self.paths.grants_dir)
        try:
            grant = process_grant(pid, self.proc, self._grants_device)
        except OSError:
            grant = None  # gone since, or unreadable: the cgroup's word alone
        self._refs[pid] = (started, ref, grant)
        return ref, grant

    def same_process(self, pid: int) -> bool:
        """``pid`` is still the process this view read (not gone, its number not reused since)."""
        cached = self._refs.get(pid)
        try:
            return cached is not None and start_time(pid, self.proc) == cached[0]
        except OSError:
            return False

    def _relist(self) -> None:
        if self.list_pods is None or time.monotonic() - self._listed_at < self.relist_s:
            return
        self._listed_at = time.monotonic()
        try:
            pods = self.list_pods(self.node)
        except KubeError as err:
            log.warning(
                "host view: cannot list the pods of %s (%s); naming containers by their grant", self.node, err
            )
            return
        self._by_id = {}
        self._pods = {}
        for pod in pods:
            meta = pod.get("metadata") or {}
            uid = str(meta.get("uid", ""))
            self._pods[uid] = (str(meta.get("namespace", "")), str(meta.get("name", "")))
            for cid, name in container_ids(pod):
                self._by_id[cid] = (uid, name)

    def _grants_of(self, pod_uid: str) -> list[str]:
        try:
            return [
                p.name[: -len(GRANT_SUFFIX)] for p in self.paths.grants_dir.glob(f"{pod_uid}_*{GRANT_SUFFIX}")
            ]
        except OSError:
            return []

    def owner(self, ref: ContainerRef | None, grant: str | None = None) -> Owner | None:
        """The vGPU container ``ref`` is, under ``grant`` where its mounts named one, or None
        when it is none (or cannot be told yet)."""
        if grant is not None:
            return self._granted_owner(ref, grant)
        if ref is None:
            return None
        if ref.container_id not in self._by_id:
            self._relist()
        known = self._by_id.get(ref.container_id)
        if known is not None:
            uid, name = known
        elif ref.pod_uid is not None:
            grants = self._grants_of(ref.pod_uid)
            if len(grants) != 1:
                return None
            uid, _, name = grants[0].partition("_")
        else:
            return None
        namespace, pod = self._pods.get(uid, ("", ""))
        return Owner(uid, name, namespace, pod)

    def _granted_owner(self, ref: ContainerRef | None, grant: str) -> Owner:
        """The owner of a process whose mounts name ``grant``: a device-plugin grant names its pod
        and container itself; a DRA grant its claim, and the cgroup and the pod's status the rest."""
        uid, name = "", ""
        if claim_of(grant) is None:
            uid, _, name = grant.partition("_")
        elif ref is not None:
            if ref.container_id not in self._by_id:
                self._relist()
            uid, name = self._by_id.get(ref.container_id, (ref.pod_uid or "", ""))
        if uid not in self._pods:
            self._relist()
        namespace, pod = self._pods.get(uid, ("", ""))
        return Owner(uid, name, namespace, pod, grant)

    def new_pass(self) -> None:
        """Start a pass of ``resolve`` calls: each grant is read once per pass, however many of
        its container's processes the driver sampled (300 processes, 300 reads every 100 ms)."""
        self._pass_grants = {}

    def resolve(self, pid: int) -> tuple[Owner, Grant] | None:
        """The vGPU container of a host PID and its grant (as read once since ``new_pass``);
        None for a process of none."""
        ref, mounted = self._ref(pid)
        owner = self.owner(ref, mounted)
        if owner is None:
            return None
        if owner.folder not in self._pass_grants:
            self._pass_grants[owner.folder] = self._grant(owner.folder)
        grant = self._pass_grants[owner.folder]
        return None if grant is None else (owner, grant)

    def keep_only(self, pids: set[int]) -> None:
        """Forget the cached mapping of every PID but these (the compute gate's, which never reads)."""
        self._refs = {pid: v for pid, v in self._refs.items() if pid in pids}

    def read(self) -> View:
        """Every card's processes, grouped by the container they belong to."""
        started = time.monotonic()
        held: dict[tuple[str, str], Held] = {}
        grants: dict[str, Grant | None] = {}
        unattributed: dict[str, int] = {}
        live: set[int] = set()
        for uuid in self.uuids():
            unattributed[uuid] = 0
            for proc in self.source.processes(uuid) or []:
                live.add(proc.pid)
                ref, mounted = self._ref(proc.pid)
                owner = self.owner(ref, mounted)
                grant = None
                if owner is not None:
                    if owner.folder not in grants:
                        grants[owner.folder] = self._grant(owner.folder)
                    grant = grants[owner.folder]
                # (the card's MPS server is the node's MPS daemon's child, in the plugin's cgroup,
                # which holds no grant: unattributed here, never by its name, which a tenant sets)
                if owner is None or grant is None or uuid not in grant.uuids:
                    unattributed[uuid] += proc.memory_bytes
                    continue
                entry = held.get((owner.folder, uuid))
                if entry is None:
                    granted = device_grant(grant, grant.uuids.index(uuid))
                    entry = held[(owner.folder, uuid)] = Held(owner, uuid, granted)
                entry.pids[proc.pid] = entry.pids.get(proc.pid, 0) + proc.memory_bytes
                if grant.sharing == SHARING_MPS and not proc.mps:
                    entry.left_mps.add(proc.pid)
                entry.sm_percent += proc.sm_percent or 0
                if proc.codec is not None:
                    entry.codec = proc.codec if entry.codec is None else entry.codec + proc.codec
        self._refs = {pid: v for pid, v in self._refs.items() if pid in live}
        return View(list(held.values()), unattributed, time.monotonic() - started)

    def _grant(self, folder: str) -> Grant | None:
        try:
            return read_grant(self.paths.grant(folder))
        except GrantError:
            return None
