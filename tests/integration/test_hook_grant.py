"""libvgpu over the stub driver under a grant: limits the container's processes cannot lift.

The grant (vgpu/hookabi/grant.py) is what the device plugin mounts read-only at /etc/vgpu/limits. Most
tests name it with VGPU_GRANT_FILE, which the hook honours only where /etc/vgpu/limits does not
exist (a process run by hand). The last test puts the processes where a container's are: in a
mount namespace of their own, /etc/ld.so.preload naming the hook, the grant mounted read-only
at /etc/vgpu/limits, running as an unprivileged user with LD_PRELOAD and every limit variable
gone or lying.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hook_harness import Built, Holder, build, env, parse, run

from vgpu.hookabi.grant import Grant, encode, read_grant, write_grant
from vgpu.hookabi.layout import GRANT_LAYOUT, GRANT_PAYLOAD, HEADER_LAYOUT
from vgpu.hookabi.region import Region
from vgpu.hookabi.resize import apply_limits

MIB = 1 << 20
OUT_OF_MEMORY = 2
TAMPERED = "its limits were changed on disk"


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


@pytest.fixture
def container(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(grant, region) laid out as the device plugin lays them out under its root."""
    folder = tmp_path / "var/lib/vgpu/containers/uid-1_main"
    folder.mkdir(parents=True)
    grant = tmp_path / "var/lib/vgpu/grants/uid-1_main.limits"
    region = folder / "vgpu.region"
    write_grant(
        grant,
        Grant(("GPU-stub-0",), (1 << 30,), (30,), region_path=str(region), context_reserve=0),
    )
    yield grant, region


def granted_env(built: Built, grant: Path, **extra: str) -> dict[str, str]:
    return env(built, VGPU_GRANT_FILE=str(grant), VGPU_LOG_LEVEL="info", **extra)


def test_the_grant_holds_over_a_larger_limit_in_the_environment(
    built: Built, container: tuple[Path, Path]
) -> None:
    grant, _ = container
    r = run(
        built,
        "t_alloc",
        "procaddr",
        "alloc",
        "256",
        environ=granted_env(built, grant, CUDA_DEVICE_MEMORY_LIMIT="4g"),
    )
    assert r.returncode == 0, r.stderr
    assert (r.int("chunks"), r.int("refused")) == (4, OUT_OF_MEMORY)
    assert "the grant holds" in r.stderr and str(grant) in r.stderr


def test_a_process_with_no_limit_and_no_region_in_its_environment_is_held_by_the_grant(
    built: Built, container: tuple[Path, Path]
) -> None:
    grant, region = container
    environ = granted_env(built, grant)
    assert not any(k.startswith("CUDA_") for k in environ)
    with Holder(built, 256, environ) as holder:
        assert holder.held == "held=0"
        # the region the grant names is where the usage went: processes still share one limit
        with Region(region) as r:
            assert r.snapshot().devices[0].used_bytes == 256 * MIB
        r2 = run(built, "t_alloc", "link", "alloc", "256", environ=environ)
        assert r2.int("chunks") == 3


def test_limits_written_into_the_region_are_put_back_logged_and_do_not_hold(
    built: Built, container: tuple[Path, Path]
) -> None:
    grant, region = container
    environ = granted_env(built, grant)
    with Holder(built, 256, environ):
        with Region(region, writable=True) as r:  # what any process in the container can do
            r.set_limit(0, 64 << 30)
            r.set_sm_limit(0, 100)
        r2 = run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ)
        assert r2.int("chunks") == 3 and r2.int("refused") == OUT_OF_MEMORY
        assert TAMPERED in r2.stderr
        assert "device 0 memory limit 68719476736 there, 1073741824 granted" in r2.stderr
        with Region(region) as r:
            assert (r.word("limit", 0), r.word("sm_limit", 0)) == (1 << 30, 30)


def alloc_with_a_pause(built: Built, grant: Path, meanwhile: Callable[[], object]) -> tuple[int, str]:
    """t_alloc attached and one 256 MiB chunk in, then ``meanwhile()``, then on until refused:
    (chunks, the hook's log)."""
    proc = subprocess.Popen(
        [built.prog("t_alloc"), "link", "alloc", "256"],
        env=granted_env(built, grant, T_ALLOC_PAUSE="1"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = [proc.stdout.readline(), proc.stdout.readline()]
    assert "paused=1\n" in lines, lines
    meanwhile()
    out, err = proc.communicate("go\n", timeout=60)
    values, _ = parse("".join(lines) + out)
    return int(values["chunks"]), err


def test_a_running_process_catches_a_limit_changed_under_it_at_its_next_allocation(
    built: Built, container: tuple[Path, Path]
) -> None:
    grant, region = container

    def raise_the_regions_copy() -> None:  # only the allocation path can see this: it attached before
        with Region(region, writable=True) as r:
            r.set_limit(0, 0)  # 0: no limit at all

    chunks, err = alloc_with_a_pause(built, grant, raise_the_regions_copy)
    assert chunks == 4 and TAMPERED in err, err


def test_a_live_resize_through_the_grant_reaches_new_and_running_processes_untold(
    built: Built, container: tuple[Path, Path]
) -> None:
    grant, region = container
    environ = granted_env(built, grant)
    with Holder(built, 256, environ):
        change = apply_limits(region, 0, memory_bytes=2 << 30)
        assert change.notes == ()
        assert read_grant(grant).limits == (2 << 30,)
        with Region(region) as r:
            assert r.word("limit", 0) == 2 << 30  # the region's copy follows
        r2 = run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ)
        assert r2.int("chunks") == 7  # 2 GiB less the 256 MiB the holder keeps
        assert TAMPERED not in r2.stderr


def test_a_live_resize_reaches_a_process_that_is_already_allocating(
    built: Built, container: tuple[Path, Path]
) -> None:
    grant, region = container
    # 1 GiB granted when it started, 2 GiB from the resize on
    chunks, err = alloc_with_a_pause(built, grant, lambda: apply_limits(region, 0, memory_bytes=2 << 30))
    assert chunks == 8, err
    assert TAMPERED not in err


def test_a_damaged_grant_refuses_every_allocation_and_names_the_file(
    built: Built, container: tuple[Path, Path]
) -> None:
    grant, _ = container
    data = bytearray(grant.read_bytes())
    data[GRANT_LAYOUT.offsets["limit"] + 3] ^= 0x40  # a limit changed without its checksum
    grant.write_bytes(bytes(data))
    r = run(built, "t_alloc", "procaddr", "alloc", "256", environ=granted_env(built, grant))
    assert (r.int("chunks"), r.int("refused")) == (0, OUT_OF_MEMORY)
    assert f"the granted limits {grant} is damaged" in r.stderr


def test_a_grant_that_is_not_a_grant_refuses_every_allocation(built: Built, tmp_path: Path) -> None:
    bogus = tmp_path / "limits"
    bogus.write_bytes(b"\0" * GRANT_PAYLOAD)
    r = run(built, "t_alloc", "procaddr", "alloc", "256", environ=granted_env(built, bogus))
    assert r.int("chunks") == 0 and "is not a grant file" in r.stderr


def _can_make_a_container_position() -> str | None:
    """None where this machine lets the test build a container's view; else why not."""
    if os.geteuid() != 0:
        return "needs root to make a mount namespace (the CI machine runs as root)"
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         "d=$(mktemp -d) && mkdir $d/u $d/w && mount -t overlay overlay "
         "-o lowerdir=/etc,upperdir=$d/u,workdir=$d/w /etc"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"a mount namespace with an overlay on /etc is refused here: {probe.stderr.strip()}"
    return None


# Run as root in a fresh mount namespace: the container's view, then the tenant's processes.
SCRIPT = r"""
set -eu
mkdir "$T/up" "$T/work"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$T/up,workdir=$T/work" /etc
echo "$T/libvgpu.so" > /etc/ld.so.preload
mkdir -p /etc/vgpu && : > /etc/vgpu/limits
mount --bind "$GRANT" /etc/vgpu/limits && mount -o remount,bind,ro /etc/vgpu/limits
exec setpriv --reuid 65534 --regid 65534 --clear-groups env -i PATH=/usr/bin:/bin T="$T" REGION="$REGION" \
  LIMIT_AT="$LIMIT_AT" sh -c '
  set -u
  if printf x >> /etc/vgpu/limits 2>/dev/null; then echo grant_writable=1; else echo grant_writable=0; fi
  if [ -n "${LD_PRELOAD:-}" ]; then echo ld_preload_set=1; else echo ld_preload_set=0; fi
  export LD_LIBRARY_PATH="$T/stub" STUB_CUDA_MEMORY_MIB=8192
  "$T/t_alloc" procaddr alloc 256 | sed "s/^/first_/"
  # the region is the container'"'"'s to write: raise its copy of the limit to 64 GiB
  printf "\0\0\0\0\020\0\0\0" | dd of="$REGION" bs=1 seek="$LIMIT_AT" conv=notrunc status=none \
    && echo region_raised=1
  # and ask for 8 GiB and no context charge in the environment, as a tenant would
  CUDA_DEVICE_MEMORY_LIMIT=8g VGPU_CONTEXT_RESERVE=0 "$T/t_alloc" procaddr alloc 256
'
"""


def test_in_a_containers_position_a_process_cannot_lift_its_limit(built: Built) -> None:
    why = _can_make_a_container_position()
    if why:
        pytest.skip(f"cannot put a process in a container's position here: {why}")
    # Everything the unprivileged process touches lives in a folder it can traverse.
    top = Path(tempfile.mkdtemp(prefix="vgpu-ctr-"))
    try:
        top.chmod(0o755)
        shutil.copy2(built.lib, top / "libvgpu.so")
        shutil.copy2(built.tests / "t_alloc", top / "t_alloc")
        shutil.copytree(built.stub_dir, top / "stub", symlinks=True)
        folder = top / "containers" / "uid-1_main"
        folder.mkdir(parents=True)
        folder.chmod(0o777)  # as the device plugin makes it: the container's processes create the region
        (top / "containers").chmod(0o755)
        region = folder / "vgpu.region"
        grant = top / "grants" / "uid-1_main.limits"
        write_grant(grant, Grant(("GPU-stub-0",), (1 << 30,), region_path=str(region), context_reserve=0))
        before = grant.read_bytes()
        assert stat.S_IMODE(grant.stat().st_mode) == 0o644
        proc = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", SCRIPT],
            env={
                "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                "T": str(top),
                "GRANT": str(grant),
                "REGION": str(region),
                "LIMIT_AT": str(HEADER_LAYOUT.offsets["limit"]),
            },
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert out["grant_writable"] == "0" and out["ld_preload_set"] == "0"
        assert (int(out["first_chunks"]), out["region_raised"]) == (4, "1"), proc.stderr
        # loaded through /etc/ld.so.preload alone, the hook held it to the grant's 1 GiB
        assert (int(out["chunks"]), int(out["refused"])) == (4, OUT_OF_MEMORY), proc.stderr
        assert TAMPERED in proc.stderr and "the grant holds" in proc.stderr
        assert grant.read_bytes() == before == encode(read_grant(grant))
        assert (
            not Path("/etc/ld.so.preload").exists() or str(top) not in Path("/etc/ld.so.preload").read_text()
        )
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_granted_sm_limit_holds_when_the_region_raises_it_or_fills_its_bucket(
    built: Built, container: tuple[Path, Path]
) -> None:
    grant, region = container  # SM limit 30 % granted
    environ = granted_env(built, grant, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region))  # t_sm maps it too
    # step 1: the region's SM limit written to 100; step 2: its bucket filled and its refill
    # stamp pushed an hour ahead, as any process of the container could
    r = run(built, "t_sm", "link", "phases", "kernel", "0.8,1.2:limit=100,1.2:steal=1", environ=environ)
    assert r.returncode == 0, r.stderr
    shares = [float(r.values[f"step{i}_share"]) for i in range(3)]
    assert all(0.22 <= s <= 0.38 for s in shares), shares
    assert "the region's compute bucket was changed on disk" in r.stderr


def test_without_a_grant_a_region_raised_to_100_percent_runs_free(built: Built, tmp_path: Path) -> None:
    """The control for the test above: the same writes lift a limit that only the region holds."""
    environ = env(built, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "region"), CUDA_DEVICE_SM_LIMIT="30")
    r = run(built, "t_sm", "link", "phases", "kernel", "0.8,1.2:limit=100", environ=environ)
    assert float(r.values["step1_share"]) >= 0.7, r.values
