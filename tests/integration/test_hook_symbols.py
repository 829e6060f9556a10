"""libvgpu exports exactly what it interposes and answers every lookup the driver answers."""

from __future__ import annotations

import re
import subprocess

import pytest
from hook_harness import HOOK_DIR, Built, build, env

HOOKED = re.compile(r"^(?:CU|NVML)_HOOK\((\w+),", re.M)


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


def test_the_library_exports_only_the_interposed_symbols(built: Built) -> None:
    nm = subprocess.run(
        ["nm", "-D", "--defined-only", str(built.lib)], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1].split("@")[0] for line in nm.splitlines() if line.split()[1] in "TtWi"}
    expected = set(HOOKED.findall((HOOK_DIR / "api.def").read_text())) | {"dlsym"}
    assert exported == expected


def lookups(built: Built, **extra: str) -> dict[tuple[str, str, str, str], tuple[str, str, str]]:
    out = subprocess.run(
        [built.prog("t_procaddr")], env=env(built) | extra, capture_output=True, text=True, check=True
    ).stdout
    table = {}
    for line in out.splitlines():
        how, name, version, flags, rc, lib, sym = line.split()
        table[(how, name, version, flags)] = (rc, lib, sym)
    return table


@pytest.mark.parametrize("trampolines", ["0", "1"])
def test_cuGetProcAddress_answers_policed_names_with_the_hook_per_version_and_flags(
    built: Built, trampolines: str
) -> None:
    t = lookups(built, STUB_CUDA_PROC_TRAMPOLINES=trampolines)
    assert t[("procaddr", "cuMemAlloc", "12080", "0")] == ("0", "libvgpu.so", "cuMemAlloc_v2")
    assert t[("procaddr", "cuMemAllocAsync", "12080", "0")] == ("0", "libvgpu.so", "cuMemAllocAsync")
    assert t[("procaddr", "cuMemAllocAsync", "12080", "2")] == ("0", "libvgpu.so", "cuMemAllocAsync_ptsz")
    assert t[("procaddr", "cuMemFreeAsync", "12080", "2")] == ("0", "libvgpu.so", "cuMemFreeAsync_ptsz")
    assert t[("procaddr", "cuGetProcAddress", "12080", "0")] == ("0", "libvgpu.so", "cuGetProcAddress_v2")
    assert t[("procaddr", "cuGetProcAddress", "11080", "0")] == ("0", "libvgpu.so", "cuGetProcAddress")


def test_cuinit_is_the_hooks_so_an_mps_grant_sets_the_driver_up_first(built: Built) -> None:
    assert lookups(built)[("procaddr", "cuInit", "12080", "0")] == ("0", "libvgpu.so", "cuInit")


def test_names_the_hook_does_not_police_come_straight_from_the_driver_never_null(built: Built) -> None:
    t = lookups(built)
    assert t[("procaddr", "cuCtxGetDevice", "12080", "0")] == ("0", "libcuda.so.1", "cuCtxGetDevice")
    assert t[("dlsym", "cuDeviceGet", "0", "0")][1] == "libcuda.so.1"
    # what the driver refuses stays refused, with its own error code
    assert t[("procaddr", "cuNoSuchFunction", "12080", "0")][:2] == ("500", "NULL")
    assert t[("procaddr", "cuMemAlloc", "3000", "0")][:2] == ("500", "NULL")


def test_dlsym_on_the_driver_handle_answers_policed_names_with_the_hook(built: Built) -> None:
    t = lookups(built)
    assert t[("dlsym", "cuMemAlloc_v2", "0", "0")][1:] == ("libvgpu.so", "cuMemAlloc_v2")
    assert t[("dlsym", "cuMemCreate", "0", "0")][1:] == ("libvgpu.so", "cuMemCreate")
    assert t[("dlsym", "cuGetProcAddress_v2", "0", "0")][1:] == ("libvgpu.so", "cuGetProcAddress_v2")
    assert t[("dlsym", "cuNoSuchFunction", "0", "0")][1] == "NULL"
