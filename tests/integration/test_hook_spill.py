"""libvgpu's virtual device memory over the stub driver: past the device budget (or when the card
is full) cuMemAlloc is served from pinned host memory mapped into the device, the limit still
counts it, frees and dead processes give it back, and limits changed at run time take effect at
the next allocation without touching memory already held."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hook_harness import Built, build, env

from vgpu.hookabi.region import Region

MIB = 1 << 20
GIB = 1 << 30
OUT_OF_MEMORY = 2
DEVICE, HOST = 1, 2  # where the stub says a pointer lives
MODES = ["link", "dlsym", "procaddr"]


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


class Spiller:
    """t_spill: one command per line on stdin, one line of key=value pairs back."""

    def __init__(self, built: Built, environ: dict[str, str], mode: str = "procaddr") -> None:
        self.proc = subprocess.Popen(
            [built.prog("t_spill"), mode],
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first = self._line()
        assert first.get("ready") == 1, first

    def _line(self) -> dict[str, int]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            assert self.proc.stderr is not None
            raise AssertionError(f"t_spill ended (rc {self.proc.returncode}): {self.proc.stderr.read()}")
        return {k: int(v) for k, v in (part.split("=", 1) for part in line.split())}

    def __call__(self, command: str) -> dict[str, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def allocs(self, count: int, mib: int = 1024, how: str = "alloc") -> list[dict[str, int]]:
        return [self(f"{how} {mib}") for _ in range(count)]

    def close(self) -> str:
        assert self.proc.stdin is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        return self.proc.stderr.read()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def region_path(tmp_path: Path) -> Path:
    return tmp_path / "region"


def vmem(
    built: Built,
    region_path: Path,
    limit: str = "8g",
    budget: str | None = "4g",
    over: bool = True,
    **extra: str,
) -> dict[str, str]:
    settings = {"CUDA_DEVICE_MEMORY_LIMIT": limit, "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region_path)}
    if budget is not None:
        settings["CUDA_DEVICE_MEMORY_BUDGET"] = budget
    if over:
        settings["CUDA_OVERSUBSCRIBE"] = "true"
    return env(built, **settings, **extra)


@pytest.fixture
def spillers() -> Iterator[list[Spiller]]:
    started: list[Spiller] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.kill()


def start(spillers: list[Spiller], built: Built, environ: dict[str, str], mode: str = "procaddr") -> Spiller:
    s = Spiller(built, environ, mode)
    spillers.append(s)
    return s


def device(region_path: Path) -> tuple[int, int]:
    with Region(region_path) as r:
        d = r.snapshot().devices[0]
    return d.used_bytes, d.spilled_bytes


@pytest.mark.parametrize("mode", MODES)
def test_past_the_budget_allocations_spill_and_everything_comes_back_on_free(
    built: Built, region_path: Path, spillers: list[Spiller], mode: str
) -> None:
    s = start(spillers, built, vmem(built, region_path), mode)
    got = s.allocs(6)
    assert [a["rc"] for a in got] == [0] * 6
    assert [a["kind"] for a in got] == [DEVICE] * 4 + [HOST] * 2
    assert all(a["write"] == 0 for a in got)
    with Region(region_path) as r:
        snap = r.snapshot()
    assert (snap.devices[0].used_bytes, snap.devices[0].spilled_bytes) == (6 * GIB, 2 * GIB)
    (proc,) = snap.processes
    assert proc.pid == s.proc.pid and proc.used_bytes[0] == 6 * GIB and proc.spilled_bytes[0] == 2 * GIB
    info = s("info")
    assert info["driver_used"] == 4 * GIB and info["host_used"] == 2 * GIB and info["host_allocs"] == 2
    assert (info["free"], info["total"]) == (2 * GIB, 8 * GIB)  # the vGPU: limit, limit - used
    assert s("check") == {"ok": 6, "bad": 0}
    for i in (5, 0, 4, 1, 2, 3):  # spilled and device chunks interleaved
        assert s(f"free {i}")["rc"] == 0
    assert device(region_path) == (0, 0)
    info = s("info")
    assert (info["driver_used"], info["host_used"], info["host_allocs"]) == (0, 0, 0)
    assert s("alloc 1024")["kind"] == DEVICE  # the spill point moved back
    assert "spilling to mapped host memory (the device memory budget is reached)" in s.close()


def test_a_pitched_allocation_spills_too_with_a_usable_pitch(
    built: Built, region_path: Path, spillers: list[Spiller]
) -> None:
    s = start(spillers, built, vmem(built, region_path, budget="2g"))
    got = s.allocs(3, how="pitch")
    assert [a["kind"] for a in got] == [DEVICE, DEVICE, HOST]
    assert all(a["rc"] == 0 and a["pitch"] >= MIB and a["write"] == 0 for a in got)
    assert device(region_path) == (3 * GIB, GIB)
    assert s("check") == {"ok": 3, "bad": 0}
    assert [s(f"free {i}")["rc"] for i in range(3)] == [0, 0, 0]
    assert device(region_path) == (0, 0) and s("info")["host_allocs"] == 0


def test_a_stream_ordered_free_of_a_spilled_pointer_gives_the_host_memory_back(
    built: Built, region_path: Path, spillers: list[Spiller]
) -> None:
    s = start(spillers, built, vmem(built, region_path, budget="1g"))
    assert [a["kind"] for a in s.allocs(2)] == [DEVICE, HOST]
    assert s("freeasync 1")["rc"] == 0 and s("freeasync 0")["rc"] == 0
    assert device(region_path) == (0, 0)
    info = s("info")
    assert (info["driver_used"], info["host_allocs"]) == (0, 0)


@pytest.mark.parametrize("budget", ["4g", None])
def test_the_drivers_out_of_memory_turns_into_a_spill(
    built: Built, region_path: Path, spillers: list[Spiller], budget: str | None
) -> None:
    # a 3 GiB card (another tenant, or a smaller GPU) under a 4 GiB budget, or no budget at all
    s = start(spillers, built, vmem(built, region_path, budget=budget, STUB_CUDA_MEMORY_MIB="3072"))
    got = s.allocs(6)
    assert [a["rc"] for a in got] == [0] * 6
    assert [a["kind"] for a in got] == [DEVICE] * 3 + [HOST] * 3
    assert device(region_path) == (6 * GIB, 3 * GIB)
    assert s("check") == {"ok": 6, "bad": 0}
    info = s("info")
    assert (info["free"], info["total"]) == (2 * GIB, 8 * GIB)  # the limit, although the card is smaller
    assert "(the card is out of free memory)" in s.close()


def test_without_oversubscribe_the_budget_is_a_device_cap_and_nothing_stays_charged(
    built: Built, region_path: Path, spillers: list[Spiller]
) -> None:
    s = start(spillers, built, vmem(built, region_path, over=False))
    got = s.allocs(6)
    assert [a["rc"] for a in got] == [0] * 4 + [OUT_OF_MEMORY] * 2
    assert device(region_path) == (4 * GIB, 0)
    info = s("info")
    assert (info["driver_used"], info["host_allocs"]) == (4 * GIB, 0)
    assert s("check") == {"ok": 4, "bad": 0}
    log = s.close()
    assert "device memory budget of 4294967296 bytes is reached" in log and "CUDA_OVERSUBSCRIBE=true" in log


def test_without_oversubscribe_the_drivers_own_out_of_memory_is_returned_and_rolled_back(
    built: Built, region_path: Path, spillers: list[Spiller]
) -> None:
    s = start(spillers, built, vmem(built, region_path, budget=None, over=False, STUB_CUDA_MEMORY_MIB="3072"))
    assert [a["rc"] for a in s.allocs(4)] == [0, 0, 0, OUT_OF_MEMORY]
    assert device(region_path) == (3 * GIB, 0)
    assert s("info")["host_allocs"] == 0


def test_past_the_limit_is_refused_even_with_oversubscribe(
    built: Built, region_path: Path, spillers: list[Spiller]
) -> None:
    s = start(spillers, built, vmem(built, region_path))
    got = s.allocs(9)
    assert [a["rc"] for a in got] == [0] * 8 + [OUT_OF_MEMORY]
    assert device(region_path) == (8 * GIB, 4 * GIB)
    assert s("info")["host_allocs"] == 4
    assert s("alloc 1")["rc"] == OUT_OF_MEMORY


def test_when_pinned_host_memory_runs_out_the_allocation_fails_cleanly_and_says_why(
    built: Built, region_path: Path, spillers: list[Spiller]
) -> None:
    s = start(spillers, built, vmem(built, region_path, STUB_CUDA_HOST_MIB="1024"))
    got = s.allocs(6)
    assert [a["rc"] for a in got] == [0] * 5 + [OUT_OF_MEMORY]
    assert [a["kind"] for a in got[:5]] == [DEVICE] * 4 + [HOST]
    assert device(region_path) == (5 * GIB, GIB)
    assert "cannot spill 1073741824 bytes to host memory" in s.close()


def test_a_process_killed_holding_spilled_memory_is_reaped_by_the_next(
    built: Built, region_path: Path, spillers: list[Spiller]
) -> None:
    environ = vmem(built, region_path)
    victim = start(spillers, built, environ)
    assert [a["kind"] for a in victim.allocs(6)] == [DEVICE] * 4 + [HOST] * 2
    assert device(region_path) == (6 * GIB, 2 * GIB)
    victim.kill()
    assert device(region_path) == (6 * GIB, 2 * GIB)  # nobody has looked yet
    nxt = start(spillers, built, environ)
    # the dead process's device bytes no longer count: the new one lands on the device
    assert nxt("alloc 1024")["kind"] == DEVICE
    assert device(region_path) == (GIB, 0)
    with Region(region_path) as r:
        assert [p.pid for p in r.snapshot().processes] == [nxt.proc.pid]


def test_a_lowered_limit_refuses_new_allocations_keeps_old_ones_and_a_raised_one_lets_them_through(
    built: Built, region_path: Path, spillers: list[Spiller]
) -> None:
    s = start(spillers, built, vmem(built, region_path))
    assert [a["rc"] for a in s.allocs(6)] == [0] * 6  # 4 on the device, 2 spilled
    with Region(region_path, writable=True) as r:
        r.set_limit(0, 4 * GIB)  # as the monitor does: the process is not told
    assert s("alloc 1024")["rc"] == OUT_OF_MEMORY
    assert s("alloc 1")["rc"] == OUT_OF_MEMORY
    assert s("check") == {"ok": 6, "bad": 0}  # nothing held was freed or moved
    info = s("info")
    assert (info["free"], info["total"]) == (0, 4 * GIB)
    assert s("free 0")["rc"] == 0 and s("free 5")["rc"] == 0  # a device and a spilled chunk
    assert device(region_path) == (4 * GIB, GIB)
    assert s("alloc 1")["rc"] == OUT_OF_MEMORY  # 4 GiB held, 4 GiB limit
    assert s("check") == {"ok": 4, "bad": 0}
    with Region(region_path, writable=True) as r:
        r.set_limit(0, 8 * GIB)
    got = s.allocs(4)
    assert [a["rc"] for a in got] == [0] * 4
    assert device(region_path) == (8 * GIB, 4 * GIB)
    assert s("alloc 1")["rc"] == OUT_OF_MEMORY
    assert s("check") == {"ok": 8, "bad": 0}
    assert "lowered while this container ran" in s.close()


def test_a_budget_changed_at_run_time_moves_the_spill_point(
    built: Built, region_path: Path, spillers: list[Spiller]
) -> None:
    s = start(spillers, built, vmem(built, region_path))
    assert [a["kind"] for a in s.allocs(5)] == [DEVICE] * 4 + [HOST]
    with Region(region_path, writable=True) as r:
        r.set_budget(0, 6 * GIB)
    assert [a["kind"] for a in s.allocs(2)] == [DEVICE, DEVICE]  # 6 GiB on the device now
    with Region(region_path, writable=True) as r:
        r.set_budget(0, 2 * GIB)  # below what the device holds: only new allocations move
    assert s("alloc 512")["kind"] == HOST
    assert device(region_path) == (7 * GIB + 512 * MIB, GIB + 512 * MIB)
    assert s("check") == {"ok": 8, "bad": 0}
    with Region(region_path, writable=True) as r:
        r.set_budget(0, 0)  # no budget: the card's free memory decides (8 GiB card, 6 held)
    assert s("alloc 256")["kind"] == DEVICE
    for i in range(9):
        assert s(f"free {i}")["rc"] == 0
    assert device(region_path) == (0, 0)
    assert s("info")["host_allocs"] == 0


@pytest.mark.parametrize("mode", ["procaddr", "link"])
def test_threads_allocating_at_once_keep_the_books_straight(
    built: Built, region_path: Path, spillers: list[Spiller], mode: str
) -> None:
    # 8 threads of 1 GiB chunks under a 3 GiB budget and a 6 GiB limit: some land on the device,
    # some spill, some are refused; every one that was handed out reads back what was written
    s = start(spillers, built, vmem(built, region_path, limit="6g", budget="3g"), mode)
    r = s("storm 8 400 1024")
    assert r["done"] == 3200 and r["failed"] == 0
    assert r["device"] > 0 and r["spilled"] > 0
    assert r["device"] + r["spilled"] + r["refused"] == 3200
    assert device(region_path) == (0, 0)
    info = s("info")
    assert (info["driver_used"], info["host_used"], info["host_allocs"]) == (0, 0, 0)
