"""libvgpu over the stub driver: every way device memory is taken is held to the limit."""

from __future__ import annotations

import pytest
from hook_harness import STUB_MIB, Built, build, env, run

MIB = 1 << 20
PATHS = ["alloc", "pitch", "managed", "async", "pool", "vmm", "array", "array3d", "mipmap"]
MODES = ["link", "dlsym", "procaddr", "procaddr_ptds"]
OUT_OF_MEMORY = 2


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
def test_an_allocation_past_the_limit_is_refused_and_the_process_lives_on(
    built: Built, path: str, mode: str
) -> None:
    r = run(built, "t_alloc", mode, path, "256", environ=env(built, CUDA_DEVICE_MEMORY_LIMIT="1g"))
    assert r.returncode == 0, r.stderr
    chunk = r.int("chunk_bytes")
    assert r.int("chunks") == (1 << 30) // chunk
    assert r.int("refused") == OUT_OF_MEMORY
    assert r.int("driver_used") <= 1 << 30
    # freeing one makes room for one more: frees are uncharged
    assert r.int("free") == 0 and r.int("again") == 0
    assert r.int("driver_used_end") == 0
    assert r.values["alive"] == "1"


def test_without_the_hook_the_stub_driver_hands_out_the_whole_card(built: Built) -> None:
    r = run(
        built,
        "t_alloc",
        "procaddr",
        "alloc",
        "256",
        environ=env(built, hook=False, CUDA_DEVICE_MEMORY_LIMIT="1g"),
    )
    assert r.int("chunks") == STUB_MIB // 256


def test_with_the_hook_but_no_limit_everything_passes_through(built: Built) -> None:
    r = run(built, "t_alloc", "procaddr", "alloc", "256", environ=env(built))
    assert r.int("chunks") == STUB_MIB // 256


@pytest.mark.parametrize("path", ["alloc", "async", "vmm"])
def test_a_driver_that_hands_out_internal_addresses_is_still_policed(built: Built, path: str) -> None:
    environ = env(built, CUDA_DEVICE_MEMORY_LIMIT="1g", STUB_CUDA_PROC_TRAMPOLINES="1")
    r = run(built, "t_alloc", "procaddr_ptds", path, "256", environ=environ)
    assert r.int("chunks") == 4 and r.int("refused") == OUT_OF_MEMORY


def test_a_free_of_memory_the_hook_never_saw_reaches_the_driver(built: Built) -> None:
    r = run(built, "t_free_unseen", "procaddr", environ=env(built, CUDA_DEVICE_MEMORY_LIMIT="1g"))
    assert r.int("untracked") == 0
    assert r.int("driver_used_before") == 64 * MIB
    assert r.int("free_unseen") == 0
    assert r.int("driver_used_after") == 0
    assert r.int("free_bogus") == 1  # the driver's CUDA_ERROR_INVALID_VALUE, passed back unchanged


def test_indexed_limits_apply_per_device_and_the_rest_is_unlimited(built: Built) -> None:
    environ = env(built, STUB_CUDA_DEVICES="2", CUDA_DEVICE_MEMORY_LIMIT_1="512m")
    assert run(built, "t_alloc", "procaddr", "alloc", "256", "1", environ=environ).int("chunks") == 2
    assert (
        run(built, "t_alloc", "procaddr", "alloc", "256", "0", environ=environ).int("chunks")
        == STUB_MIB // 256
    )


def test_limits_follow_the_visible_device_uuids_not_the_cuda_ordinals(built: Built) -> None:
    # the stub's device N has a UUID made of bytes 0x10+N; list device 1 first
    uuid1 = "GPU-11111111-1111-1111-1111-111111111111"
    uuid0 = "GPU-10101010-1010-1010-1010-101010101010"
    environ = env(
        built,
        STUB_CUDA_DEVICES="2",
        NVIDIA_VISIBLE_DEVICES=f"{uuid1},{uuid0}",
        CUDA_DEVICE_MEMORY_LIMIT_0="512m",
        CUDA_DEVICE_MEMORY_LIMIT_1="768m",
    )
    assert run(built, "t_alloc", "procaddr", "alloc", "256", "1", environ=environ).int("chunks") == 2
    assert run(built, "t_alloc", "procaddr", "alloc", "256", "0", environ=environ).int("chunks") == 3


def test_a_limit_that_is_not_a_size_is_named_in_the_log_and_nothing_is_handed_out(built: Built) -> None:
    r = run(built, "t_alloc", "procaddr", "alloc", "256", environ=env(built, CUDA_DEVICE_MEMORY_LIMIT="4x"))
    assert "CUDA_DEVICE_MEMORY_LIMIT='4x' is not a size" in r.stderr
    assert r.int("chunks") == 0 and r.int("refused") == OUT_OF_MEMORY


def test_a_limit_past_64_bits_is_refused_rather_than_wrapped_to_no_limit(built: Built) -> None:
    """2^34 GiB is 2^64 bytes: multiplied out unchecked it wrapped to 0, no limit (fuzz: config_env)."""
    r = run(
        built,
        "t_alloc",
        "procaddr",
        "alloc",
        "256",
        environ=env(built, CUDA_DEVICE_MEMORY_LIMIT="17179869184g"),
    )
    assert "CUDA_DEVICE_MEMORY_LIMIT='17179869184g' is not a size" in r.stderr
    assert r.int("chunks") == 0 and r.int("refused") == OUT_OF_MEMORY


def test_each_process_is_charged_its_context_footprint_once_per_device(built: Built) -> None:
    environ = env(built, CUDA_DEVICE_MEMORY_LIMIT="1g", VGPU_CONTEXT_RESERVE="256m")
    r = run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ)
    assert r.int("chunks") == 3  # 256 MiB of the 1 GiB went to the context
    info = run(built, "t_info", "procaddr", "0", environ=environ)
    assert info.int("cu_free") == 768 * MIB and info.int("nvml2_used") == 256 * MIB


@pytest.mark.parametrize("create", ["v2", "v3", "v4"])
@pytest.mark.parametrize("mode", ["dlsym", "procaddr"])
def test_a_context_made_with_any_cuCtxCreate_version_is_charged_too(
    built: Built, create: str, mode: str
) -> None:
    environ = env(built, CUDA_DEVICE_MEMORY_LIMIT="1g", VGPU_CONTEXT_RESERVE="256m", TEST_CTX_CREATE=create)
    r = run(built, "t_alloc", mode, "alloc", "256", environ=environ)
    assert r.int("chunks") == 3, r.values


def test_the_default_context_reserve_is_charged_when_none_is_configured(built: Built) -> None:
    environ = env(built, CUDA_DEVICE_MEMORY_LIMIT="1g")
    del environ["VGPU_CONTEXT_RESERVE"]
    info = run(built, "t_info", "procaddr", "0", environ=environ)
    assert info.int("nvml2_used") == 640 * MIB
