"""A host's NVIDIA driver installation laid out in a folder, for driverInject: plugin without a
driver (the layout a driver install leaves: versioned libraries with their soname links, an
absolute link among them, nvidia-smi, device nodes)."""

from __future__ import annotations

from pathlib import Path

VERSION = "580.95.05"
LIBDIR = "usr/lib/x86_64-linux-gnu"


def fake_driver(root: Path, *, libcuda: bool = True) -> Path:
    """A host's driver files under ``root``: what the plugin must find, and decoys it must leave."""
    lib = root / LIBDIR
    lib.mkdir(parents=True)
    families = ["libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-gpucomp", "libfoo"]
    if libcuda:
        families.append("libcuda")
    for family in families:
        (lib / f"{family}.so.{VERSION}").write_bytes(b"\x7fELF" + family.encode())
        if family != "libnvidia-gpucomp":  # it has no soname link: its soname is the versioned name
            (lib / f"{family}.so.1").symlink_to(f"{family}.so.{VERSION}")
    if libcuda:
        (lib / "libcuda.so").symlink_to("libcuda.so.1")  # the development link: not handed out
    # An absolute link, as some distributions make: it must resolve inside the root, not the host.
    (lib / "libnvidia-ml.so.1").unlink()
    (lib / "libnvidia-ml.so.1").symlink_to(f"/{LIBDIR}/libnvidia-ml.so.{VERSION}")
    (root / "usr/bin").mkdir(parents=True)
    # A wrapper script in /usr/bin (some images have one) is passed over for the driver's ELF tool.
    (root / "usr/bin/nvidia-smi").write_bytes(b"#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-smi")
    (root / "usr/local/nvidia/bin").mkdir(parents=True)
    (root / "usr/local/nvidia/bin/nvidia-smi").write_bytes(b"\x7fELF-smi")
    (root / "dev").mkdir()
    for node in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"):
        (root / "dev" / node).write_bytes(b"")
    return root
