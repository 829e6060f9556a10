"""300 processes of one container starting CUDA at the same moment under one grant (issue 23, item 5).

Each is native/hook's b_many over the stub driver, in a container's position (the grant naming a
region file no process has made yet, the hook preloaded), released from a barrier together
(tests/support/many.py): cuInit, the devices, cuDeviceTotalMem, the primary context (the hook
charges the grant's 640 MiB for it), 1 MiB, cuMemGetInfo; then each holds until told to finish.
No timing here: bench/bench_many.py measures it.
"""

from __future__ import annotations

import fcntl
import os
import signal
import struct
from pathlib import Path

import pytest
from hook_harness import Built, Holder, build, env, run

from tests.support.many import (
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_SUCCESS,
    MIB,
    Container,
    Round,
    Start,
    base_env,
    bounded_start,
    held_on_stub,
    start_together,
)
from vgpu.hookabi import layout
from vgpu.hookabi.region import Snapshot

PROCS = 300
RESERVE = 640 * MIB  # the grant's context charge (Container's default)
ALLOC = MIB
EACH = RESERVE + ALLOC


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


def _start_300(tmp_path: Path, fit: int) -> tuple[Container, Round[Snapshot]]:
    """PROCS processes started together under a grant of ``fit`` contexts and their 1 MiB, the
    region read while they hold; every one must have run to its end without a crash."""
    box = Container(tmp_path / "container", limit_bytes=fit * EACH)
    got = start_together(
        PROCS,
        box.env(base_env(stub=True)),
        tmp_path / "run",
        alloc_bytes=ALLOC,
        while_held=lambda s: box.snapshot(),
    )
    assert len(got.starts) == PROCS and got.returncodes == [0] * PROCS, got.errors[-2000:]
    assert [s.failed for s in got.starts if s.failed] == []
    assert isinstance(got.seen, Snapshot)
    return box, got


def test_300_processes_started_together_all_start_each_in_a_slot_of_one_region_within_the_grant(
    built: Built, tmp_path: Path
) -> None:
    box, got = _start_300(tmp_path, PROCS)
    assert all((s.ctx_rc, s.alloc_rc) == (CUDA_SUCCESS, CUDA_SUCCESS) for s in got.starts)
    assert {s.total for s in got.starts} == {box.limit_bytes}  # every one sees the grant as the card
    seen = got.seen
    # every process attached to the one region (none fell back to enforcing alone) and has a slot
    assert sorted(p.pid for p in seen.processes) == sorted(s.pid for s in got.starts)
    assert {p.used_bytes[0] for p in seen.processes} == {EACH}
    assert seen.devices[0].used_bytes == sum(p.used_bytes[0] for p in seen.processes) == PROCS * EACH
    assert seen.devices[0].used_bytes <= box.limit_bytes
    assert "alone" not in got.errors and "slots" not in got.errors, got.errors[-2000:]
    after = box.snapshot()
    assert (after.devices[0].used_bytes, after.processes) == (0, ())


FIT = 100  # contexts (and their 1 MiB) the grant holds: 100 * 641 MiB; a 101st context does not fit


def test_a_grant_that_fits_fewer_contexts_refuses_the_rest_at_their_context_and_the_others_run(
    built: Built, tmp_path: Path
) -> None:
    box, got = _start_300(tmp_path, FIT)
    ran = [s for s in got.starts if s.ctx_rc == CUDA_SUCCESS]
    refused = [s for s in got.starts if s.ctx_rc != CUDA_SUCCESS]
    assert len(ran) == FIT
    assert {s.ctx_rc for s in refused} == {CUDA_ERROR_OUT_OF_MEMORY}
    assert {s.alloc_rc for s in ran} == {CUDA_SUCCESS} and {s.alloc_rc for s in refused} == {-1}
    assert "a CUDA context refused (CUDA_ERROR_OUT_OF_MEMORY)" in got.errors
    seen = got.seen
    charged = {p.pid: p.used_bytes[0] for p in seen.processes}
    assert {charged[s.pid] for s in ran} == {EACH}
    assert all(charged.get(s.pid, 0) == 0 for s in refused)  # refused before anything was charged
    assert seen.devices[0].used_bytes == sum(charged.values()) == FIT * EACH <= box.limit_bytes
    after = box.snapshot()
    assert (after.devices[0].used_bytes, after.processes) == (0, ())


def test_the_gpu_runs_shape_under_a_driver_that_makes_only_31_contexts_at_once(
    built: Built, tmp_path: Path
) -> None:
    """tests/gpu/test_many_gpu.py's whole run over the stub driver bounded as the H200's was (31
    contexts at once, the next refused with CUDA_ERROR_OUT_OF_MEMORY): the bare run finds the
    bound, the grant fits two thirds of it, the hook refuses the rest before the driver."""
    (tmp_path / "slots").mkdir()
    (tmp_path / "procs").mkdir()
    base = base_env(stub=True) | {
        "STUB_CUDA_CONTEXTS_MAX": "31",
        "STUB_CUDA_CONTEXT_DIR": str(tmp_path / "slots"),
        "STUB_CUDA_PROCESS_DIR": str(tmp_path / "procs"),
    }

    def driver(starts: list[Start]) -> dict[str, object]:
        return dict(held_on_stub(tmp_path / "procs", {s.pid for s in starts}))

    run = bounded_start(
        tmp_path, base, {"attempts": 200, "fit": 150}, driver, procs=PROCS, alloc_mib=2, timeout=300
    )
    run.check()
    assert (run.bare.contexts, run.bare.refused, run.fit) == (31, 169, 20)
    assert run.figures()["hooked"]["driver_mib"] == 20 * 2  # type: ignore[index]
    assert "a CUDA context refused (CUDA_ERROR_OUT_OF_MEMORY)" in run.hooked.errors


def test_processes_killed_while_they_hold_give_back_their_slots_and_charges_to_the_next_one(
    built: Built, tmp_path: Path
) -> None:
    box = Container(tmp_path / "container", limit_bytes=PROCS * EACH)
    killed: list[int] = []

    def kill_some(starts: list[Start]) -> Snapshot:
        for s in starts[::6]:  # 50 of them, SIGKILL: no exit handler runs
            os.kill(s.pid, signal.SIGKILL)
            killed.append(s.pid)
        return box.snapshot()

    environ = box.env(base_env(stub=True))
    got = start_together(PROCS, environ, tmp_path / "run", alloc_bytes=ALLOC, while_held=kill_some)
    assert sorted(got.returncodes) == sorted([-signal.SIGKILL] * len(killed) + [0] * (PROCS - len(killed)))
    left = box.snapshot()  # the dead ones' slots stay until a process joins
    assert sorted(p.pid for p in left.processes) == sorted(killed)
    assert left.devices[0].used_bytes == len(killed) * EACH
    nxt = start_together(
        1, environ, tmp_path / "next", alloc_bytes=ALLOC, while_held=lambda s: box.snapshot()
    )
    assert nxt.returncodes == [0] and nxt.starts[0].ctx_rc == CUDA_SUCCESS
    seen = nxt.seen
    assert isinstance(seen, Snapshot)
    assert [p.pid for p in seen.processes] == [nxt.starts[0].pid] and seen.devices[0].used_bytes == EACH
    after = box.snapshot()
    assert (after.devices[0].used_bytes, after.processes) == (0, ())


def test_past_the_slot_count_a_process_is_refused_naming_the_limit_and_nothing_goes_uncounted(
    built: Built, tmp_path: Path
) -> None:
    box = Container(tmp_path / "container", limit_bytes=4 << 30, context_reserve=0)
    environ = box.env(base_env(stub=True))
    with Holder(built, 256, environ) as holder:
        assert holder.held == "held=0"
        # every other slot taken by a live process (this test's), as 1023 more processes would
        slot, off = layout.SLOT_LAYOUT.size, layout.SLOT_LAYOUT.offsets
        fd = os.open(box.region, os.O_RDWR)
        try:
            taken = 0
            for k in range(layout.MAX_PROCS):
                base = layout.HEADER_LAYOUT.size + k * slot
                if int.from_bytes(os.pread(fd, 4, base + off["active"]), "little"):
                    continue
                os.pwrite(fd, os.getpid().to_bytes(4, "little"), base + off["pid"])
                os.pwrite(fd, (1).to_bytes(4, "little"), base + off["active"])
                taken += 1
            assert taken == layout.MAX_PROCS - 1
            got = start_together(
                1, environ, tmp_path / "run", alloc_bytes=ALLOC, while_held=lambda s: box.snapshot()
            )
        finally:
            for k in range(layout.MAX_PROCS):
                base = layout.HEADER_LAYOUT.size + k * slot
                if int.from_bytes(os.pread(fd, 4, base + off["pid"]), "little") == os.getpid():
                    os.pwrite(fd, bytes(slot), base)
            os.close(fd)
        (refused,) = got.starts
        assert got.returncodes == [0] and refused.ctx_rc == CUDA_SUCCESS  # no context charge in this grant
        assert refused.alloc_rc == CUDA_ERROR_OUT_OF_MEMORY
        assert (
            f"all {layout.MAX_PROCS} process slots of the region {box.region} are held by live processes"
            in (got.errors)
        )
        seen = got.seen
        assert isinstance(seen, Snapshot)
        assert seen.devices[0].used_bytes == 256 * MIB  # the holder's: the refused process charged nothing
        assert refused.pid not in {p.pid for p in seen.processes}
    after = box.snapshot()
    assert (after.devices[0].used_bytes, after.processes) == (0, ())


def test_a_deep_sweep_whose_holder_never_lets_go_wedges_nobody(built: Built, tmp_path: Path) -> None:
    """The deep sweep's turn (an open-file-description lock on the byte past the region) held by a
    process that never lets go, as a stopped one would: a process refused meanwhile waits a
    bounded time, then sweeps itself and finds the zombie holding the room."""
    path = tmp_path / "region"
    environ = env(built, CUDA_DEVICE_MEMORY_LIMIT="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(path))
    victim = Holder(built, 600, environ)
    assert victim.held == "held=0"
    fd = os.open(path, os.O_RDWR)
    try:
        turn = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, layout.REGION_SIZE, 1, 0)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, turn)
        other = os.open(path, os.O_RDWR)  # another open file description sees the turn taken
        try:
            assert struct.unpack("hhqqi4x", fcntl.fcntl(other, fcntl.F_OFD_GETLK, turn))[0] == fcntl.F_WRLCK
        finally:
            os.close(other)
        victim.kill(wait=False)  # a zombie: only the deep sweep (/proc) tells it is gone
        r = run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ, timeout=30)
        assert r.returncode == 0 and r.int("chunks") == 4  # the zombie's 600 MiB came back
    finally:
        os.close(fd)
        victim.proc.wait(timeout=10)


def test_a_region_whose_creator_died_before_its_magic_is_made_again_not_given_up(
    built: Built, tmp_path: Path
) -> None:
    """The first process sizes the file, then writes the header, the magic last; one killed in
    between left a file every later process refused, each then enforcing its limits alone."""
    box = Container(tmp_path / "container", limit_bytes=1 << 30, context_reserve=0)
    unfinished = bytearray(layout.REGION_SIZE)  # sized, some header words written, no magic
    unfinished[layout.HEADER_LAYOUT.offsets["version"]] = layout.LAYOUT_VERSION
    box.region.write_bytes(bytes(unfinished))
    environ = box.env(base_env(stub=True), VGPU_LOG_LEVEL="info")
    with Holder(built, 600, environ) as first:
        assert first.held == "held=0"
        second = run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ)
        assert second.int("chunks") == 1  # 424 MiB left of the one shared 1 GiB
    assert "was left unfinished by a process that died creating it; made again" in first.proc.stderr.read()
    after = box.snapshot()
    assert (after.devices[0].used_bytes, after.processes) == (0, ())
