"""The NVIDIA driver's files handed to containers by the plugin itself (``driverInject: plugin``).

On a node without NVIDIA's container toolkit nothing else puts the driver into a container, so
Allocate's answer carries it (contract 4, docs/contracts.md): the device nodes (``/dev/nvidiactl``,
``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools`` and ``/dev/nvidia<minor>`` of each granted card) as
DeviceSpecs, which also open the container's device cgroup to them, and the driver's user-space
libraries and tools as read-only Mounts.

The files are found as NVIDIA's toolkit finds them: the host's ld.so cache first (``ldconfig -p``
on the driver root's ``etc/ld.so.cache``), then the folders drivers are installed to. Libraries go
to :data:`CONTAINER_LIB_DIR` in the container under each of their names (the versioned file and
its soname links), a folder the dynamic loader of Debian- and Ubuntu-based images searches
without a cache entry; the tools go to ``/usr/bin``.

``driver_root`` is where the plugin reads the host's driver installation (``/`` on the host, the
chart's read-only mount in a pod); ``host_root`` is the same folder as the container runtime on
the host names it (what the Mounts' host paths start with).
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from vgpu.core.errors import ConfigError

log = logging.getLogger(__name__)

# The compute and utility libraries (NVIDIA_DRIVER_CAPABILITIES=compute,utility of the toolkit).
LIBRARIES = (
    "libcuda",
    "libcudadebugger",
    "libnvidia-ml",
    "libnvidia-cfg",
    "libnvidia-ptxjitcompiler",
    "libnvidia-gpucomp",
    "libnvidia-nvvm",
    "libnvidia-opencl",
    "libnvidia-allocator",
    "libnvidia-pkcs11",
    "libnvidia-pkcs11-openssl3",
    "libnvidia-fatbinaryloader",
    "libnvidia-compiler",
)
REQUIRED_LIBRARIES = ("libcuda", "libnvidia-ml")
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
# Where drivers are installed, relative to the driver root, after the ld.so cache.
LIB_DIRS = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/local/nvidia/lib64",
    "usr/local/nvidia/lib",
    "usr/lib",
    "lib64",
    "lib/x86_64-linux-gnu",
    "usr/lib/x86_64-linux-gnu/nvidia/current",
)
BIN_DIRS = ("usr/bin", "usr/local/nvidia/bin", "usr/local/bin", "bin", "usr/sbin")
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
CONTAINER_LIB_DIR = f"/usr/lib/{platform.machine() or 'x86_64'}-linux-gnu"
_ARCH = {"x86_64": "x86-64", "aarch64": "AArch64"}.get(platform.machine(), "x86-64")
_NAME = re.compile(r"^(lib[A-Za-z0-9_+-]+)\.so(\.[0-9]+)+$")


class Mount(NamedTuple):
    """A host path bound into a container (the device plugin's ``Mount``, a CDI spec's mount)."""

    container_path: str
    host_path: str
    read_only: bool


class DeviceNode(NamedTuple):
    """A device node given to a container (the device plugin's ``DeviceSpec``, a CDI device node)."""

    container_path: str
    host_path: str
    permissions: str


@dataclass(frozen=True)
class DriverFiles:
    """What a container gets of the driver: (container path, host path) pairs and the device nodes."""

    libraries: tuple[tuple[str, str], ...]
    binaries: tuple[tuple[str, str], ...]
    dev_dir: Path  # where the plugin sees the host's /dev (existence checks)
    nvml: Path | None = None  # libnvidia-ml as the plugin sees it (loaded before NVML starts)

    def mounts(self) -> list[Mount]:
        return [
            Mount(container_path=inside, host_path=host, read_only=True)
            for inside, host in (*self.libraries, *self.binaries)
        ]

    def devices(self, minors: list[int]) -> list[DeviceNode]:
        """The control nodes that exist and the cards' nodes; ``FileNotFoundError`` for a card's."""
        specs = []
        for name in CONTROL_NODES:
            if (self.dev_dir / name).exists():
                specs.append(_spec(name))
            elif name != "nvidia-uvm-tools":
                log.warning("/dev/%s is missing on this node: CUDA in the containers may fail to start", name)
        for minor in minors:
            name = f"nvidia{minor}"
            if not (self.dev_dir / name).exists():
                raise FileNotFoundError(f"/dev/{name}")
            specs.append(_spec(name))
        return specs

    def caps(self, minors: list[int]) -> list[DeviceNode]:
        """The MIG capability files (``/dev/nvidia-caps/nvidia-cap<minor>``) a MIG device needs,
        its GPU instance's and compute instance's; ``FileNotFoundError`` for one that is missing."""
        specs = []
        for minor in dict.fromkeys(minors):
            name = f"nvidia-caps/nvidia-cap{minor}"
            if not (self.dev_dir / name).exists():
                raise FileNotFoundError(f"/dev/{name}")
            specs.append(_spec(name))
        return specs


def _is_elf(path: Path) -> bool:
    """The driver's own files are ELF; a wrapper script of the same name (some images put one in
    /usr/bin) would need a shell the container may not have."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _spec(name: str) -> DeviceNode:
    return DeviceNode(container_path=f"/dev/{name}", host_path=f"/dev/{name}", permissions="rw")


def _inside(root: Path, path: str) -> Path:
    """``path`` (absolute, as the host names it) under ``root``, symlinks followed within ``root``."""
    current = PurePosixPath("/")
    parts = list(PurePosixPath(path).parts[1:])
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        seen = root / str(candidate).lstrip("/")
        if seen.is_symlink():
            hops += 1
            if hops > 40:
                raise OSError(f"too many symbolic links under {path}")
            target = PurePosixPath(os.readlink(seen))
            parts = list(target.parts[1:] if target.is_absolute() else target.parts) + parts
            if target.is_absolute():
                current = PurePosixPath("/")
            continue
        current = candidate
    return root / str(current).lstrip("/")


def _cache_entries(driver_root: Path) -> list[str]:
    """Library paths (as the host names them) the driver root's ld.so cache lists for this arch."""
    cache = driver_root / "etc" / "ld.so.cache"
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None
    )
    if ldconfig is None or not cache.is_file():
        return []
    try:
        out = subprocess.run(
            [ldconfig, "-p", "-C", str(cache)], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.splitlines():
        left, sep, path = line.partition(" => ")
        if sep and _ARCH in left and path.strip().startswith("/"):
            found.append(path.strip())
    return found


def _candidates(driver_root: Path) -> list[str]:
    listed = _cache_entries(driver_root)
    for folder in LIB_DIRS:
        try:
            names = sorted(os.listdir(driver_root / folder))
        except OSError:
            continue
        listed += [f"/{folder}/{n}" for n in names]
    return listed


def find_driver(driver_root: Path, host_root: str = "/", dev_dir: Path = Path("/dev")) -> DriverFiles:
    """The driver's libraries and tools under ``driver_root``; ``ConfigError`` when libcuda or
    libnvidia-ml is not there (no driver, or the wrong ``--driver-root``)."""
    libraries: dict[str, str] = {}  # container path -> host path
    families: set[str] = set()
    nvml: Path | None = None
    for path in _candidates(driver_root):
        name = PurePosixPath(path).name
        match = _NAME.match(name)
        if not match or match.group(1) not in LIBRARIES:
            continue
        real = _inside(driver_root, path)
        if not real.is_file() or not _is_elf(real):
            continue
        host = _host_path(driver_root, host_root, real)
        if match.group(1) == "libnvidia-ml" and nvml is None:
            nvml = real
        for alias in (name, real.name):
            libraries.setdefault(f"{CONTAINER_LIB_DIR}/{alias}", host)
        families.add(match.group(1))
    missing = [lib for lib in REQUIRED_LIBRARIES if lib not in families]
    if missing:
        raise ConfigError(
            "--driver-root",
            "",
            f"no {' or '.join(m + '.so.*' for m in missing)} under {driver_root} (ld.so cache and "
            f"{', '.join(LIB_DIRS[:4])}, ...): install the NVIDIA driver on the node, or point --driver-root "
            "(chart: driver.root) at the folder it is installed under",
        )
    binaries: dict[str, str] = {}
    for tool in BINARIES:
        for folder in BIN_DIRS:
            candidate = driver_root / folder / tool
            if candidate.exists():
                real = _inside(driver_root, f"/{folder}/{tool}")
                if real.is_file() and _is_elf(real):
                    binaries[f"/usr/bin/{tool}"] = _host_path(driver_root, host_root, real)
                    break
    return DriverFiles(
        libraries=tuple(sorted(libraries.items())),
        binaries=tuple(sorted(binaries.items())),
        dev_dir=dev_dir,
        nvml=nvml,
    )


def _host_path(driver_root: Path, host_root: str, seen: Path) -> str:
    return str(PurePosixPath(host_root) / seen.relative_to(driver_root))
