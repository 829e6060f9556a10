"""Which container a process belongs to, from its ``/proc/<pid>/cgroup`` as the host sees it.

The cgroup path is set by the kubelet and the container runtime when the container starts, and a
process in the container cannot move itself out of it (the cgroup file system is read-only in a
container, or namespaced under its own root): it is the one fact about a process's owner that
the tenant cannot write. The forms read here, cgroup v1 (one line per hierarchy) and v2 (the
single ``0::`` line):

- containerd, systemd cgroup driver: ``/kubepods.slice/kubepods-burstable.slice/
  kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope``
- containerd (or any CRI runtime), cgroupfs driver: ``/kubepods/burstable/pod<uid>/<id>``
- CRI-O, systemd driver: ``.../kubepods-pod<uid>.slice/crio-<id>.scope`` (``crio-conmon-<id>``
  is the runtime's monitor process, not the container)
- containerd under a kubelet that makes no pod cgroups (``cgroupsPerQOS: false``, the
  sandbox's real node): ``/k8s.io/<id>``, containerd's own default under its CRI namespace; no
  pod UID in it, so only the pod's status names the container
- Docker: ``/system.slice/docker-<id>.scope`` (systemd) and ``/docker/<id>`` (cgroupfs); under
  cri-dockerd the kubepods forms above with a bare or ``docker-`` id.

A reader in its own cgroup namespace (the device plugin's container) sees paths of processes
outside it relative to its own root, with leading ``/..`` parts; only the path's parts count, so
those are skipped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_ID = re.compile(r"^(?:(cri-containerd|crio|docker|containerd)-)?([0-9a-f]{64})(?:\.scope)?$")
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD = re.compile(rf"^(?:kubepods(?:-[a-z]+)?-)?pod({_UID})(?:\.slice)?$")
_BARE_PARENTS = {"docker": "docker", "k8s.io": "containerd"}  # folders that hold bare container ids
_RUNTIME = {"cri-containerd": "containerd", "containerd": "containerd", "crio": "cri-o", "docker": "docker"}


@dataclass(frozen=True)
class ContainerRef:
    """A container as its cgroup names it: the runtime's 64-hex id and, under Kubernetes, the pod's UID."""

    container_id: str
    pod_uid: str | None  # None: not under kubepods (plain Docker)
    runtime: str  # containerd, cri-o, docker; "" when the path does not say (cgroupfs driver)


def parse_path(path: str) -> ContainerRef | None:
    """The container of one cgroup path, or None when it is not a container's."""
    parts = [p for p in path.split("/") if p and p != ".."]
    pod_uid: str | None = None
    for i, part in enumerate(parts):
        pod = _POD.match(part)
        if pod:
            pod_uid = pod.group(1).replace("_", "-")
            continue
        found = _ID.match(part)
        if found is None:
            continue
        prefix = found.group(1)
        parent = parts[i - 1] if i else ""
        if prefix is None and pod_uid is None and parent not in _BARE_PARENTS:
            continue  # a bare 64-hex name outside kubepods, /docker and /k8s.io: not a container we know
        runtime = _RUNTIME.get(prefix or "", _BARE_PARENTS.get(parent, "") if pod_uid is None else "")
        return ContainerRef(found.group(2), pod_uid, runtime)
    return None


def parse_cgroup(text: str) -> ContainerRef | None:
    """The container of a process from the text of its ``/proc/<pid>/cgroup`` (v1 or v2); None
    for a process of no container (the host's, a system service)."""
    for line in text.splitlines():
        hierarchy, sep, rest = line.partition(":")
        _controllers, sep2, path = rest.partition(":")
        if not sep or not sep2 or not hierarchy.isdigit():
            continue
        ref = parse_path(path)
        if ref is not None:
            return ref
    return None


def container_of(pid: int, proc: Path = Path("/proc")) -> ContainerRef | None:
    """The container of ``pid``; None for a process of no container. Raises OSError when the
    process is gone or its file cannot be read."""
    return parse_cgroup((proc / str(pid) / "cgroup").read_text())


def start_time(pid: int, proc: Path = Path("/proc")) -> int:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22): with
    the pid, it tells a process from a later one that reuses its number. Raises OSError."""
    # read with os.open/os.read rather than pathlib: the compute gate asks this of every sampled
    # process every 100 ms (bench/bench_monitor.py)
    fd = os.open(f"{proc}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError) as err:
        raise OSError(f"unreadable {proc}/{pid}/stat") from err
