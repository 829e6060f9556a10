"""The hook library on the host: one folder per build, kept while any container of the node may use it.

A ``helm upgrade`` that ships a new ``libvgpu.so`` must never rewrite a file a running container
has mapped: the container's processes would read the new bytes through their old mappings and
crash. So every build gets a folder of its own under ``/var/lib/vgpu/lib``, named by its content,
written to a temporary file and renamed into place, never changed after::

    lib/<version>/libvgpu.so       <version>: the first 16 hex digits of the library's SHA-256
    lib/<version>/ld.so.preload    names /usr/local/vgpu/libvgpu.so, where Allocate mounts it
    hook.lock                      flock: recording a hand-out (shared) against collecting (exclusive)
    grants/<pod-uid>_<container>.hook   the version Allocate gave the container ("" for none)

Allocate mounts the folder's two files into the container and records the version beside the
container's grant, where the container cannot reach it. The record, not ``/proc/*/maps``, says
what is in use: kubelet keeps Allocate's answer for the pod's whole life and mounts the same host
paths again at every container restart, so a version is needed from Allocate until the pod
leaves the node, including while no process maps it (before the container starts, between
restarts, a statically linked program); and the plugin sees no host PIDs. The records go with
the pod's folder and grant (``paths.sweep_container_dirs``); then ``collect`` removes versions
that no record names, never this plugin's own and never while a served container has no record
(one started by a plugin from before the records: its version is unknown, so all stay).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vgpu.hookabi.files import TMP_SUFFIX, write_atomic
from vgpu.node.paths import CONTAINER_HOOK_PATH, HOOK_LIBRARY_NAME, HostPaths

log = logging.getLogger(__name__)

PRELOAD_NAME = "ld.so.preload"
RECORD_SUFFIX = ".hook"
VERSION_RE = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class HookInstall:
    version: str
    library: Path  # host path of the versioned library
    preload: Path  # host path of the file mounted over /etc/ld.so.preload
    source: Path | None = None  # where it was installed from (to put it back if removed)


def version_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def record_path(paths: HostPaths, folder_name: str) -> Path:
    """The version handed to the container whose folder is ``containers/<folder_name>``."""
    return paths.grants_dir / f"{folder_name}{RECORD_SUFFIX}"


@contextlib.contextmanager
def _locked(paths: HostPaths, exclusive: bool) -> Iterator[None]:
    """Held across processes (the lock is on the host): a second plugin on the node, as a
    DaemonSet with surge would start, never removes a version the other one is handing out."""
    paths.lib_dir.mkdir(parents=True, exist_ok=True)  # lib/ holds the version folders alone
    fd = os.open(paths.vgpu_dir / "hook.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _put(target: Path, data: bytes, mode: int) -> None:
    """``target`` holds ``data``: unchanged if it already does, else a new file renamed over it.

    The rename replaces the name, never the bytes of a file someone maps (that inode lives on
    as long as it is mapped); a crash leaves a ``.tmp`` file nobody mounts, never a partial
    ``target``.
    """
    try:
        if target.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    write_atomic(target, data, mode)


def _install(data: bytes, source: Path | None, paths: HostPaths) -> HookInstall:
    version = version_of(data)
    folder = paths.lib_dir / version
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    library, preload = folder / HOOK_LIBRARY_NAME, folder / PRELOAD_NAME
    _put(library, data, 0o755)
    _put(preload, (CONTAINER_HOOK_PATH + "\n").encode(), 0o644)
    return HookInstall(version, library, preload, source)


def install_hook(source: Path, paths: HostPaths) -> HookInstall:
    """Install ``source`` as ``lib/<content hash>/`` unless that version is there intact.

    A present version whose bytes differ from its name (a copy cut short by a power loss, an
    edit by hand) is replaced by renaming a good copy over it, never written in place.
    """
    data = Path(source).read_bytes()
    with _locked(paths, exclusive=True):
        return _install(data, Path(source), paths)


def hand_out(paths: HostPaths, folder_name: str, hook: HookInstall | None) -> None:
    """Record that the container ``folder_name`` gets ``hook`` (None: no hook), before Allocate
    answers; the version is put back first if something removed it since the start."""
    with _locked(paths, exclusive=False):
        if hook is not None and not (hook.library.is_file() and hook.preload.is_file()):
            if hook.source is None:
                raise FileNotFoundError(2, "the hook library is gone from the host", str(hook.library))
            log.warning("%s was removed: installing it again", hook.library)
            _install(hook.source.read_bytes(), hook.source, paths)
        record = record_path(paths, folder_name)
        record.parent.mkdir(parents=True, exist_ok=True)
        _put(record, ((hook.version if hook else "") + "\n").encode(), 0o644)


def handed_out(paths: HostPaths) -> tuple[set[str], list[str]]:
    """The versions the records name, and the served containers that have no record."""
    versions: set[str] = set()
    recorded: set[str] = set()
    try:
        entries = list(paths.grants_dir.iterdir())
    except FileNotFoundError:
        entries = []
    for entry in entries:
        if entry.name.endswith(RECORD_SUFFIX) and not entry.name.startswith("."):
            try:
                version = entry.read_text().strip()
            except FileNotFoundError:
                continue  # swept since the listing: its pod is gone
            recorded.add(entry.name[: -len(RECORD_SUFFIX)])
            if version:
                versions.add(version)
    try:
        served = sorted(p.name for p in paths.containers_dir.iterdir() if p.is_dir())
    except FileNotFoundError:
        served = []
    return versions, [name for name in served if name not in recorded]


def collect(paths: HostPaths, keep: str | None, min_age_s: float, now: float) -> list[str]:
    """Remove the hook versions no container of the node was handed; returns those removed.

    Kept: ``keep`` (the plugin's own, the one new containers get), every version a record
    names, every version younger than ``min_age_s`` (another plugin may have just installed it)
    and, while any served container has no record, all of them. Leftover temporary files older
    than ``min_age_s`` go too. Raises OSError when the folders cannot be read.
    """
    removed: list[str] = []
    with _locked(paths, exclusive=True):
        in_use, unrecorded = handed_out(paths)
        for folder in sorted(paths.lib_dir.iterdir()):
            if not folder.is_dir() or not VERSION_RE.match(folder.name):
                continue  # nothing this module made: left alone
            for tmp in folder.glob(f".*{TMP_SUFFIX}"):
                with contextlib.suppress(OSError):
                    if now - tmp.lstat().st_mtime >= min_age_s:
                        tmp.unlink()
            if folder.name == keep or folder.name in in_use or unrecorded:
                continue
            if now - folder.stat().st_mtime < min_age_s:
                continue
            shutil.rmtree(folder)
            removed.append(folder.name)
    if unrecorded:
        log.debug(
            "keeping every hook version: %d container(s), e.g. %s, have no record of theirs "
            "(an older plugin started them)",
            len(unrecorded),
            unrecorded[0],
        )
    return removed
