"""libvgpu under an MPS grant (docs/mps.md, docs/hook.md "Under MPS") over the stub driver, which
behaves as the real one does under MPS (tests/integration/test_stub_mps.py): a process whose pipe
folder's control socket takes a connection at cuInit is an MPS client, held to the active thread
percentage and the pinned memory limit it had in its environment then. The hook sets those from
the grant before the driver's cuInit, whatever the process's environment says, refuses cuInit
when no daemon answers, and keeps its own compute limiter out of the launch path."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hook_harness import Built, MpsPipe, build, env, process_file, run

from vgpu.hookabi.grant import Grant, write_grant
from vgpu.hookabi.layout import GRANT_LAYOUT, SHARING_MPS

MIB = 1 << 20
GIB = 1 << 30
OUT_OF_MEMORY = 2
MPS_CONNECTION_FAILED = 805
MODES = ["link", "dlsym", "procaddr", "procaddr_ptds"]


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


@pytest.fixture
def pipe() -> Iterator[MpsPipe]:
    with MpsPipe() as p:
        yield p


def mps_grant(path: Path, pipe: Path, region: Path, *, sm: int = 30, limit: int = GIB, **kw: object) -> Path:
    grant = Grant(
        ("GPU-stub-0",),
        (limit,),
        (sm,),
        region_path=str(region),
        context_reserve=0,
        sharing=SHARING_MPS,
        mps_pipe=str(pipe),
        **kw,  # type: ignore[arg-type]
    )
    write_grant(path, grant)
    return path


def mps_env(built: Built, grant: Path, procs: Path, **extra: str) -> dict[str, str]:
    procs.mkdir(exist_ok=True)
    return env(built, VGPU_GRANT_FILE=str(grant), STUB_CUDA_PROCESS_DIR=str(procs), **extra)


@pytest.mark.parametrize("mode", MODES)
def test_a_process_under_an_mps_grant_is_an_mps_client_with_the_grants_limits(
    built: Built, pipe: MpsPipe, tmp_path: Path, mode: str
) -> None:
    grant = mps_grant(tmp_path / "grant", pipe.path, tmp_path / "region")
    r = run(built, "t_alloc", mode, "alloc", "256", environ=mps_env(built, grant, tmp_path / "procs"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (r.int("chunks"), r.int("refused")) == (4, OUT_OF_MEMORY)
    seen = process_file(tmp_path / "procs")
    assert (seen["mps"], seen["mps_threads"], seen["mps_pinned"]) == (1, 30, GIB)


@pytest.mark.parametrize(
    "environ",
    [
        {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=64G"},
        {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "3=512M"},  # a device it cannot see: device 0 unpinned
        {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "many", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "rubbish"},
        {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/t-mps-elsewhere"},
        {"T_MPS_ENV": "unset"},  # after the hook's constructor, before cuInit
        {"T_MPS_ENV": "raise"},
    ],
    ids=["raised", "unseen-device", "rubbish", "other-pipe", "unset-after-start", "raised-after-start"],
)
def test_the_grant_holds_whatever_the_environment_says_or_changes(
    built: Built, pipe: MpsPipe, tmp_path: Path, environ: dict[str, str]
) -> None:
    grant = mps_grant(tmp_path / "grant", pipe.path, tmp_path / "region", sm=25, limit=512 * MIB)
    r = run(
        built,
        "t_alloc",
        "procaddr",
        "alloc",
        "128",
        environ=mps_env(built, grant, tmp_path / "procs", **environ),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (r.int("chunks"), r.int("refused")) == (4, OUT_OF_MEMORY)
    seen = process_file(tmp_path / "procs")
    assert (seen["mps"], seen["mps_threads"], seen["mps_pinned"]) == (1, 25, 512 * MIB)


def test_a_lower_thread_percentage_the_process_asks_for_itself_is_kept(
    built: Built, pipe: MpsPipe, tmp_path: Path
) -> None:
    grant = mps_grant(tmp_path / "grant", pipe.path, tmp_path / "region", sm=50)
    environ = mps_env(built, grant, tmp_path / "procs", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="10")
    r = run(built, "t_alloc", "link", "alloc", "512", environ=environ)
    assert r.returncode == 0, r.stdout + r.stderr
    assert process_file(tmp_path / "procs")["mps_threads"] == 10


def test_without_a_compute_or_memory_limit_nothing_is_pinned_or_capped(
    built: Built, pipe: MpsPipe, tmp_path: Path
) -> None:
    grant = mps_grant(tmp_path / "grant", pipe.path, tmp_path / "region", sm=0, limit=0)
    environ = mps_env(built, grant, tmp_path / "procs", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=256M")
    r = run(built, "t_alloc", "link", "alloc", "1024", environ=environ)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.int("chunks") == 8  # the whole stub device: the tenant's own pinned limit was dropped too
    seen = process_file(tmp_path / "procs")
    assert (seen["mps"], seen["mps_threads"], seen["mps_pinned"]) == (1, 100, 0)


def test_the_hooks_memory_accounting_still_holds_under_mps(
    built: Built, pipe: MpsPipe, tmp_path: Path
) -> None:
    """The grant's context reserve is charged by the hook, not by MPS: three 256 MiB chunks fit a
    1 GiB grant with 256 MiB reserved, where MPS's pinned limit alone would take four."""
    grant = mps_grant(tmp_path / "grant", pipe.path, tmp_path / "region")
    environ = mps_env(built, grant, tmp_path / "procs", VGPU_CONTEXT_RESERVE="256m")
    r = run(built, "t_alloc", "link", "alloc", "256", environ=environ)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (r.int("chunks"), r.int("refused"), r.int("again")) == (3, OUT_OF_MEMORY, 0)
    assert process_file(tmp_path / "procs")["mps_pinned"] == GIB


@pytest.mark.parametrize("how", ["stale", "stop"])
def test_with_no_daemon_answering_cuinit_fails_and_says_why(
    built: Built, pipe: MpsPipe, tmp_path: Path, how: str
) -> None:
    getattr(pipe, how)()
    grant = mps_grant(tmp_path / "grant", pipe.path, tmp_path / "region")
    r = run(built, "t_alloc", "link", "alloc", "256", environ=mps_env(built, grant, tmp_path / "procs"))
    assert r.returncode == 3 and r.values["fatal"] == f"cuInit rc={MPS_CONNECTION_FAILED}", r.stdout
    assert f"does not answer at {pipe.path}/control" in r.stderr
    assert "rather than run outside MPS" in r.stderr and "docs/mps.md" in r.stderr
    assert not list((tmp_path / "procs").iterdir())  # the driver never started


def test_a_process_that_never_starts_cuda_needs_no_daemon(
    built: Built, pipe: MpsPipe, tmp_path: Path
) -> None:
    pipe.stop()
    grant = mps_grant(tmp_path / "grant", pipe.path, tmp_path / "region")
    out = subprocess.run(
        ["sh", "-c", "echo $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"],
        env=mps_env(built, grant, tmp_path / "procs"),
        capture_output=True,
        text=True,
        check=True,
    )
    # the constructor set the variables for the shell (and what it runs); nothing failed
    assert out.stdout.split() == [str(pipe.path), "30"] and out.stderr == ""


def test_launches_under_mps_are_never_held(built: Built, pipe: MpsPipe, tmp_path: Path) -> None:
    """A 25 % grant: the time-slice limiter would hold 1 ms kernels to a quarter of the stub's
    time; under MPS the threads hold compute, and nothing waits, is debited or measured."""
    region = tmp_path / "region"
    grant = mps_grant(tmp_path / "grant", pipe.path, region, sm=25)
    environ = mps_env(built, grant, tmp_path / "procs", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region))
    r = run(built, "t_sm", "link", "rate", "kernel", "1", environ=environ)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.int("throttled_ns") == 0 and r.int("region_busy_ns") == 0 and r.int("tokens") == 0
    assert r.int("last_launch_ns") >= r.int("start_ns")  # the monitor still sees it launching


def test_neither_the_yield_flag_nor_the_nodes_gate_holds_an_mps_container(
    built: Built, pipe: MpsPipe, tmp_path: Path
) -> None:
    region = tmp_path / "region"
    hold = time.monotonic_ns() + 3_000_000_000  # the node's gate closed for the whole run
    grant = mps_grant(tmp_path / "grant", pipe.path, region, sm=25, hold_until=(hold,))
    environ = mps_env(
        built, grant, tmp_path / "procs", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region), CUDA_TASK_PRIORITY="1"
    )
    r = run(built, "t_sm", "link", "phases", "kernel", "0.4,0.5:flags=1+fresh=1,0.4", environ=environ)
    assert r.returncode == 0, r.stdout + r.stderr
    # a closed gate would hold every launch of the run (3 s): each phase launches all the same
    assert min(r.int(f"step{i}_launches") for i in range(3)) >= 20, r.values
    assert r.int("throttled_ns") == 0


@pytest.mark.parametrize(("unset", "client"), [("1", False), ("0", True)])
def test_a_process_past_the_hook_is_an_mps_client_only_while_it_keeps_the_pipe(
    built: Built, pipe: MpsPipe, tmp_path: Path, unset: str, client: bool
) -> None:
    """t_bypass reaches the driver past the hook (dlmopen): the hook's cuInit never runs. With the
    pipe the constructor set it is still an MPS client, held by the driver to the pinned limit; once
    it unsets it, it is a plain process past every MPS limit, which only the node's second line
    can see (docs/mps.md)."""
    grant = mps_grant(tmp_path / "grant", pipe.path, tmp_path / "region", limit=512 * MIB)
    environ = mps_env(built, grant, tmp_path / "procs", T_BYPASS_UNSET_MPS=unset)
    proc = subprocess.Popen(
        [built.prog("t_bypass"), "256", "1024"],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        seen = process_file(tmp_path / "procs")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert ("mps" in seen) is client, (lines, seen)
    if client:  # the driver refused it past its pinned 512 MiB
        assert seen["0"] == 256 * MIB and f"rc={OUT_OF_MEMORY} " in lines[1], lines
    else:
        assert seen["0"] == 1024 * MIB and "rc=0 " in lines[1], lines


def paused_before_cuinit(built: Built, environ: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [built.prog("t_alloc"), "link", "alloc", "256"],
        env=environ | {"T_PAUSE_BEFORE_INIT": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "before_init=1"
    return proc


def poke(path: Path, offset: int, data: bytes) -> None:
    """Changes the grant in place, as the host's writer does (the same inode, the hook's fd)."""
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_grant_damaged_after_start_fails_cuinit_rather_than_leave_the_tenants_variables(
    built: Built, pipe: MpsPipe, tmp_path: Path
) -> None:
    grant = mps_grant(tmp_path / "grant", pipe.path, tmp_path / "region")
    proc = paused_before_cuinit(built, mps_env(built, grant, tmp_path / "procs", T_MPS_ENV="raise"))
    limit = GRANT_LAYOUT.offsets["limit"]
    poke(grant, limit, (8 * GIB).to_bytes(8, "little"))  # a limit the checksum does not cover
    out, err = proc.communicate("\n", timeout=30)
    assert proc.returncode == 3 and f"fatal=cuInit rc={MPS_CONNECTION_FAILED}" in out, out + err
    assert "cannot be read whole now" in err


def test_a_grant_the_host_is_changing_at_cuinit_is_read_again_once_whole(
    built: Built, pipe: MpsPipe, tmp_path: Path
) -> None:
    grant = mps_grant(tmp_path / "grant", pipe.path, tmp_path / "region")
    proc = paused_before_cuinit(built, mps_env(built, grant, tmp_path / "procs", T_MPS_ENV="raise"))
    seq = GRANT_LAYOUT.offsets["seq"]
    poke(grant, seq, (1).to_bytes(8, "little"))  # a change under way
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    time.sleep(0.01)
    poke(grant, seq, (2).to_bytes(8, "little"))  # done, within the hook's 100 ms of patience
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, out + err
    seen = process_file(tmp_path / "procs")
    assert (seen["mps"], seen["mps_threads"], seen["mps_pinned"]) == (1, 30, GIB)


def test_a_time_sliced_grant_leaves_mps_alone(built: Built, tmp_path: Path) -> None:
    """No MPS grant: the hook sets no MPS variable and asks no socket; the driver runs it outside MPS."""
    grant = tmp_path / "grant"
    write_grant(
        grant, Grant(("GPU-stub-0",), (GIB,), (30,), region_path=str(tmp_path / "region"), context_reserve=0)
    )
    out = subprocess.run(
        ["sh", "-c", 'echo "${CUDA_MPS_PIPE_DIRECTORY-unset} ${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE-unset}"'],
        env=mps_env(built, grant, tmp_path / "procs"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["unset", "unset"]
    r = run(built, "t_alloc", "link", "alloc", "256", environ=mps_env(built, grant, tmp_path / "procs"))
    assert r.returncode == 0 and r.int("chunks") == 4, r.stdout + r.stderr
    assert "mps" not in process_file(tmp_path / "procs")
