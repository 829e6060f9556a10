"""What a process under libvgpu sees of its device: the vGPU, through CUDA and NVML alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from hook_harness import STUB_MIB, Built, Holder, build, env, run

from vgpu.hookabi.region import Region

MIB = 1 << 20
GIB = 1 << 30
NVML_ERROR_INSUFFICIENT_SIZE = 7


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


def test_cuda_and_nvml_report_the_limit_as_total_and_the_usage_as_used(built: Built) -> None:
    r = run(built, "t_info", "procaddr", "256", environ=env(built, CUDA_DEVICE_MEMORY_LIMIT="1g"))
    assert r.int("alloc") == 0
    assert r.int("cu_total") == GIB and r.int("cu_free") == GIB - 256 * MIB
    assert r.int("cu_device_total") == GIB
    for prefix in ("nvml", "nvml2"):
        assert r.int(f"{prefix}_rc") == 0
        assert r.int(f"{prefix}_total") == GIB
        assert r.int(f"{prefix}_used") == 256 * MIB
        assert r.int(f"{prefix}_free") == GIB - 256 * MIB


def test_without_a_limit_the_whole_card_is_reported(built: Built) -> None:
    r = run(built, "t_info", "dlsym", "256", environ=env(built))
    assert r.int("cu_total") == STUB_MIB * MIB
    assert r.int("nvml2_total") == STUB_MIB * MIB


def test_the_process_list_holds_the_containers_processes_with_their_usage(
    built: Built, tmp_path: Path
) -> None:
    environ = env(
        built, CUDA_DEVICE_MEMORY_LIMIT="2g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "region")
    )
    other = Holder(built, 512, environ)
    try:
        assert other.held == "held=0"
        r = run(built, "t_info", "procaddr", "256", environ=environ)
    finally:
        other.release()
    me = int(r.values["pid"])
    assert r.int("procs_query_rc") == NVML_ERROR_INSUFFICIENT_SIZE and r.int("procs_needed") == 2
    listed = {line.split("=", 1)[1] for line in r.lines if line.startswith("proc=")}
    assert listed == {f"{me}:{256 * MIB}", f"{other.pid}:{512 * MIB}"}
    listed_v1 = {line.split("=", 1)[1] for line in r.lines if line.startswith("proc_v1=")}
    assert listed_v1 == listed
    assert r.int("nvml_used") == 768 * MIB


def test_a_limit_changed_in_the_region_is_seen_by_the_next_call(built: Built, tmp_path: Path) -> None:
    path = tmp_path / "region"
    environ = env(built, CUDA_DEVICE_MEMORY_LIMIT="2g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(path))
    holder = Holder(built, 0, environ)  # creates the region
    try:
        with Region(path, writable=True) as region:
            region.set_limit(0, 512 * MIB)
        r = run(built, "t_info", "procaddr", "0", environ=environ)
        assert r.int("cu_total") == 512 * MIB and r.int("nvml2_total") == 512 * MIB
        a = run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ)
        assert a.int("chunks") == 2
    finally:
        holder.release()
