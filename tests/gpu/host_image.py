"""A container image of this machine's own Python, for a pod that runs PyTorch from the host.

The image holds the interpreter, its standard library and the shared libraries that the
interpreter, its extension modules and PyTorch's libraries need (their ``ldd`` closure, copied
from the host); the PyTorch environment itself (``sys.prefix``, gigabytes) is not copied: the pod
mounts it read-only from the host (a hostPath volume at the same path). The NVIDIA driver's
files are left out on purpose: the device plugin hands them to the container (driverInject:
plugin), which is what the test proves. Written as a docker-archive (docker save's layout), which
``ctr images import`` takes, with nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

# Driver files never go into the image: they come from the plugin's Allocate.
DRIVER_LIB = re.compile(r"^lib(cuda|nvidia-|cudadebugger)")
SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}


def _ldd(paths: list[Path]) -> set[Path]:
    found: set[Path] = set()
    for i in range(0, len(paths), 64):
        out = subprocess.run(
            ["ldd", *map(str, paths[i : i + 64])], capture_output=True, text=True, timeout=300
        ).stdout
        found |= {Path(p) for p in re.findall(r"(/\S+) \(0x", out)}
    return found


def _put(rootfs: Path, path: Path) -> None:
    """``path`` of the host into ``rootfs`` at the same place, symlinks along the way kept as links."""
    seen = 0
    while True:
        target = rootfs / str(path).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            link = os.readlink(path)
            if not target.exists() and not target.is_symlink():
                target.symlink_to(link)
            path = (path.parent / link) if not os.path.isabs(link) else Path(link)
            seen += 1
            if seen > 20:
                return
            continue
        if not target.exists():
            shutil.copy2(path, target)
        return


def _shared_objects(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*.so*") if p.is_file() and not p.is_symlink() and ".so" in p.name]


def build_rootfs(rootfs: Path, env_prefix: Path) -> Path:
    """The image's root file system; returns the interpreter to run (the environment's)."""
    for name in ("usr/bin", "usr/lib", "usr/lib64", "etc", "tmp", "proc", "sys", "dev", "root"):
        (rootfs / name).mkdir(parents=True, exist_ok=True)
    for name in ("bin", "lib", "lib64", "sbin"):
        host = Path("/") / name
        if host.is_symlink() and not (rootfs / name).is_symlink():
            # relative, so that it never points into the host while the image is built
            (rootfs / name).symlink_to(os.path.relpath(os.path.join("/", os.readlink(host)), "/"))
    (rootfs / "tmp").chmod(0o1777)
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\n")
    # The interpreter as the environment names it, every link of its chain outside the environment.
    exe = Path(sys.executable)
    chain = exe
    for _ in range(20):
        if not str(chain).startswith(str(env_prefix) + "/"):
            _put(rootfs, chain)
        if not chain.is_symlink():
            break
        link = os.readlink(chain)
        chain = Path(link) if os.path.isabs(link) else chain.parent / link
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    shutil.copytree(
        stdlib,
        rootfs / str(stdlib).lstrip("/"),
        symlinks=True,
        ignore=lambda d, names: (
            [n for n in names if n in SKIP_STDLIB or n == "__pycache__"]
            if d == str(stdlib)
            else [n for n in names if n == "__pycache__"]
        ),
        dirs_exist_ok=True,
    )
    objects = [exe.resolve(), *_shared_objects(stdlib)]
    import importlib.util

    torch = importlib.util.find_spec("torch")
    if torch is not None and torch.origin:
        site = Path(torch.origin).parents[1]
        objects += _shared_objects(site / "torch" / "lib") + _shared_objects(site / "nvidia")
    # What the driver's own files link (the plugin mounts them, the image must carry their needs).
    try:
        from vgpu.node.driver import find_driver

        driver = find_driver(Path("/"))
        objects += sorted({Path(host) for _, host in (*driver.libraries, *driver.binaries)})
    except Exception:  # no driver here: nothing of it to serve
        pass
    for lib in sorted(_ldd(objects)):
        if DRIVER_LIB.match(lib.name) or str(lib).startswith(str(env_prefix) + "/"):
            continue
        _put(rootfs, lib)
    return exe


def docker_archive(rootfs: Path, ref: str, out: Path) -> Path:
    """``rootfs`` as a one-layer docker-archive named ``ref`` (what ``ctr images import`` reads)."""
    layer = out.with_suffix(".layer.tar")
    with tarfile.open(layer, "w") as tar:
        for entry in sorted(rootfs.iterdir()):
            tar.add(entry, arcname=entry.name, filter=_root_owned)
    digest = hashlib.sha256(layer.read_bytes()).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{digest}"]},
        "history": [{"created_by": "tests/gpu/host_image.py: this machine's Python, no driver"}],
    }
    config_bytes = json.dumps(config).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [ref], "Layers": [f"{digest}/layer.tar"]}]
    with tarfile.open(out, "w") as tar:
        _add_bytes(tar, config_name, config_bytes)
        _add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
        tar.add(layer, arcname=f"{digest}/layer.tar")
    layer.unlink()
    return out


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
