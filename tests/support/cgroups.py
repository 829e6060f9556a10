"""Processes in cgroups named as the kubelet names a container's, for the node enforcer's tests
(tests/integration/test_enforce_bypass.py on the stub driver, tests/gpu/test_enforce_gpu.py on a
real one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest
import yaml

from vgpu.hookabi.grant import Grant, write_grant
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.paths import HostPaths


def cgroup_root() -> Path | None:
    """A cgroup hierarchy this process may make folders in and move processes into."""
    if os.geteuid() != 0:
        return None
    for candidate in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        root = Path(candidate)
        probe = root / f"vgpu-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
            return root
        except OSError:
            continue
    return None


@contextmanager
def cgroup_folder(folder: Path) -> Iterator[Path]:
    """``folder`` for the test's cgroups; removed, deepest first, at the end (their processes gone)."""
    try:
        yield folder
    finally:
        for sub in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):
            if sub.is_dir():
                sub.rmdir()
        if folder.exists():
            folder.rmdir()


@contextmanager
def kubepods_cgroups(tmp_path: Path, prefix: str = "vgpu-test") -> Iterator[Path]:
    """A folder of kubepods-like cgroups for one test (removed at the end); the test skips, saying
    why, where this process cannot make cgroups."""
    root = cgroup_root()
    if root is None:
        pytest.skip("needs root and a writable cgroup hierarchy to put processes into kubepods-like cgroups")
    with cgroup_folder(root / f"{prefix}-{os.getpid()}-{tmp_path.name}") as folder:
        yield folder


@contextmanager
def driver_records(tmp_path: Path) -> Iterator[Path]:
    """A folder for the stub driver's per-process records (``STUB_CUDA_PROCESS_DIR``) in memory
    (``/dev/shm``, where there is one), as the real driver keeps them. On the disk, a launch that
    rewrites its record waits behind the host's writeback: under CI's load a bypassing process's
    1 ms launches took 3 ms each and it ran at 35 % of the card, not 99 %. Removed at the end."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        folder = shm / f"vgpu-records-{os.getpid()}-{tmp_path.name}"
    else:
        folder = tmp_path / "procs"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def reap(children: Iterable[subprocess.Popen[str]], timeout: float = 10) -> None:
    """Kills the test's processes still running and waits for every one."""
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=timeout)


def granted_container(
    paths: HostPaths, cgroups: Path, name: str, card: str, grant_bytes: int
) -> tuple[str, Path]:
    """A pod with one container granted ``grant_bytes`` of ``card``: its UID and its cgroup folder,
    named as the kubelet's cgroupfs driver names it."""
    pod_uid = str(uuid.uuid4())
    cid = uuid.uuid4().hex * 2
    write_grant(paths.grant(f"{pod_uid}_{name}"), Grant((card,), (grant_bytes,)))
    folder = cgroups / "kubepods" / "burstable" / f"pod{pod_uid}" / cid
    folder.mkdir(parents=True)
    return pod_uid, folder


def reaped_at(child: subprocess.Popen[str]) -> list[int]:
    """The CLOCK_MONOTONIC ns at which ``child`` is reaped, filled in by a waiting thread."""
    when: list[int] = []

    def wait() -> None:
        child.wait()
        when.append(time.clock_gettime_ns(time.CLOCK_MONOTONIC))

    threading.Thread(target=wait, daemon=True).start()
    return when


class StubNode:
    """A node's host side over the stub driver: the host paths, the fake NVML backend of one card
    reading the processes the stub records in ``procs`` (``driver_records``), and children started
    in a container's cgroup."""

    def __init__(self, tmp: Path, cgroups: Path, card: str, procs: Path) -> None:
        self.tmp = tmp
        self.card = card
        self.paths = HostPaths(tmp / "root")
        self.paths.grants_dir.mkdir(parents=True)
        self.procs = procs
        gpus = tmp / "gpus.yaml"
        gpus.write_text(
            yaml.safe_dump({"gpus": [{"uuid": card, "memoryMiB": 8192}], "processDir": str(self.procs)})
        )
        self.discovery = FakeDiscovery(gpus)
        self.cgroups = cgroups
        self.children: list[subprocess.Popen[str]] = []

    def spawn(self, cgroup: Path, argv: list[str], environ: dict[str, str]) -> subprocess.Popen[str]:
        """``argv`` moved into ``cgroup`` before it runs (as the runtime starts a container's
        process), its stdout piped; reaped with the node."""
        script = f'echo $$ > {cgroup}/cgroup.procs && exec "$0" "$@"'
        child = subprocess.Popen(
            ["/bin/sh", "-c", script, *argv], env=environ, stdout=subprocess.PIPE, text=True
        )
        self.children.append(child)
        return child


N = TypeVar("N", bound=StubNode)


@contextmanager
def stub_node(kind: type[N], tmp_path: Path, card: str) -> Iterator[N]:
    """A ``kind`` of StubNode of ``card`` over its own kubepods-like cgroups and in-memory driver
    records; at the end its children are reaped and its cgroups thawed (a test may have frozen one)."""
    with kubepods_cgroups(tmp_path) as cgroups, driver_records(tmp_path) as procs:
        node = kind(tmp_path, cgroups, card, procs)
        try:
            yield node
        finally:
            reap(node.children)
            for freeze in cgroups.rglob("cgroup.freeze"):
                freeze.write_text("0")
