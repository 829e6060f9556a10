"""`vgpu monitor`'s arbiter on region files the hook created: flags per card, fresh, and in /metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hook_harness import Built, Holder, build, env

from tests.support import VGPU, wait_for
from tests.support.region import format_region
from vgpu.hookabi import layout, region
from vgpu.node.paths import REGION_FILE_NAME, HostPaths

# the stub's device N has a UUID made of bytes 0x10+N
UUID0 = "GPU-10101010-1010-1010-1010-101010101010"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"
Y, A, G = layout.FLAG_YIELD, layout.FLAG_ALONE, layout.FLAG_GUARD


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def containers(built: Built, tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Three containers whose CUDA processes made their regions: hi (priority 0) on card 0, lo
    (priority 1) on cards 0 and 1, and peer (priority 1) on card 1."""
    paths = HostPaths(tmp_path)
    spec = {
        "uid-1_hi": (UUID0, "0"),
        "uid-2_lo": (f"{UUID0},{UUID1}", "1"),
        "uid-3_peer": (UUID1, "1"),
    }
    holders, regions = [], {}
    try:
        for name, (visible, priority) in spec.items():
            folder = paths.containers_dir / name
            folder.mkdir(parents=True)
            environ = env(
                built,
                STUB_CUDA_DEVICES="2",
                NVIDIA_VISIBLE_DEVICES=visible,
                CUDA_TASK_PRIORITY=priority,
                CUDA_DEVICE_MEMORY_LIMIT="1g",
                CUDA_DEVICE_MEMORY_SHARED_CACHE=str(folder / REGION_FILE_NAME),
            )
            holders.append(Holder(built, 0, environ))
            regions[name.partition("_")[2]] = folder / REGION_FILE_NAME
        yield regions
    finally:
        for holder in holders:
            holder.release()


def launched(path: Path, index: int) -> None:
    """Stamp a launch the way the hook's limiter does: last_launch_ns, CLOCK_MONOTONIC."""
    with region.Region(path, writable=True) as r:
        r._u64[layout.HEADER_LAYOUT.offsets["last_launch_ns"] // 8 + index] = time.monotonic_ns()


def flags(path: Path) -> tuple[int, ...]:
    with region.Region(path) as r:
        snap = r.snapshot()
    return tuple(d.flags for d in snap.devices)


def test_the_monitor_makes_normal_containers_yield_only_where_a_high_one_is_busy(
    containers: dict[str, Path], tmp_path: Path
) -> None:
    hi, lo, peer = containers["hi"], containers["lo"], containers["peer"]
    with region.Region(hi) as r:
        assert (r.word("priority"), r.uuid(0)) == (0, UUID0)  # the hook wrote them from the env
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(
        yaml.safe_dump({"gpus": [{"uuid": UUID0, "memoryMiB": 8192}, {"uuid": UUID1, "memoryMiB": 8192}]})
    )
    port = free_port()
    monitor = subprocess.Popen(
        [*VGPU, "monitor", "--node", "n1", "--no-kube", "--root", str(tmp_path)]
        + ["--fake-nvml", str(gpus), "--listen", f"127.0.0.1:{port}", "--arbiter-interval-ms", "10"]
        # a window wide enough to see a launch's effect on a busy CI machine
        + ["--activity-window-ms", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # nobody launched: every container is alone on each of its cards, nobody yields; lo and hi
        # share card 0, a normal and a high-priority container, so both keep their queues short there
        all_alone = (A | G,), (A | G, A), (A,)
        wait_for(lambda: (flags(hi), flags(lo), flags(peer)) == all_alone, "all alone")
        with region.Region(lo) as r:
            assert time.monotonic_ns() - r.word("arbiter_ns") < layout.ARBITER_STALE_NS

        launched(hi, 0)  # the high-priority container is busy on card 0
        wait_for(lambda: flags(lo)[0] == Y | G, "lo to yield on card 0")
        assert flags(lo)[1] == A and flags(peer) == (A,)  # card 1 is not held back
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert (
            'vgpu_container_yielding{container="lo",namespace="",node="n1",pod="",pod_uid="uid-2",'
            f'uuid="{UUID0}"}} 1.0' in metrics
        )
        assert (
            'vgpu_container_priority{container="hi",namespace="",node="n1",pod="",pod_uid="uid-1"} 0.0'
            in metrics
        )

        launched(peer, 0)  # card 1 now has lo and peer: lo is no longer alone there
        wait_for(lambda: flags(lo)[1] == 0, "lo not alone on card 1")
        # once the launches fall out of the window, the flags go back
        wait_for(lambda: flags(lo) == (A | G, A) and flags(peer) == (A,), "flags to clear", timeout=10)
    finally:
        monitor.terminate()
        out, _ = monitor.communicate(timeout=10)
    assert monitor.returncode == 0, out


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_container_cutting_its_region_short_cannot_kill_the_monitor(tmp_path: Path) -> None:
    """The region file is the container's to truncate at any moment. Mapped, a monitor touching
    a page past the new end would die of SIGBUS (and with it the device plugin); it reads with
    pread instead: it lives, counts the bad region and takes it back once it is whole again."""
    paths = HostPaths(tmp_path)
    regions = {}
    for name, prio in (("uid-1_good", 0), ("uid-2_evil", 1)):
        (paths.containers_dir / name).mkdir(parents=True)
        regions[name] = paths.containers_dir / name / REGION_FILE_NAME
        format_region(regions[name], [UUID0], priority=prio)
    good, evil = regions["uid-1_good"], regions["uid-2_evil"]
    whole = evil.read_bytes()
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(yaml.safe_dump({"gpus": [{"uuid": UUID0, "memoryMiB": 8192}]}))
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    monitor = subprocess.Popen(
        [*VGPU, "monitor", "--node", "n1", "--no-kube", "--root", str(tmp_path)]
        + ["--fake-nvml", str(gpus), "--listen", f"127.0.0.1:{port}", "--arbiter-interval-ms", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def fresh(path: Path) -> bool:
        with region.Region(path) as r:
            return time.monotonic_ns() - r.word("arbiter_ns") < 200_000_000

    try:
        wait_for(lambda: fresh(good) and fresh(evil), "the arbiter to write both regions")

        def serving() -> bool:  # the arbiter starts before /metrics listens
            try:
                urllib.request.urlopen(url, timeout=5).read()
                return True
            except OSError:
                return False

        wait_for(serving, "/metrics to answer", timeout=30)
        stop = time.monotonic() + 4
        scrapes = 0
        errors: list[BaseException] = []

        def scrape() -> None:  # the collector's snapshot() races the cuts as well
            nonlocal scrapes
            while time.monotonic() < stop:
                try:
                    urllib.request.urlopen(url, timeout=5).read()
                    scrapes += 1
                except OSError as err:  # the monitor died
                    errors.append(err)
                    return

        scraper = threading.Thread(target=scrape)
        scraper.start()
        fd = os.open(evil, os.O_RDWR)  # the same inode the monitor holds open
        cuts = 0
        try:
            while time.monotonic() < stop and monitor.poll() is None:
                for size in (0, layout.REGION_SIZE // 2, layout.HEADER_LAYOUT.size // 2):
                    os.ftruncate(fd, size)
                    time.sleep(0.0005)  # long enough for a pass of the 1 ms arbiter to land in it
                    os.pwrite(fd, whole, 0)  # whole again, the same bytes
                    cuts += 1
                    time.sleep(0.0005)
        finally:
            os.close(fd)
        scraper.join()
        assert monitor.poll() is None, f"the monitor died ({monitor.returncode}) after {cuts} cuts"
        assert not errors and scrapes > 0 and cuts > 300, (errors, scrapes, cuts)  # mapped: dead by ~150
        metrics = urllib.request.urlopen(url, timeout=5).read().decode()
        assert metric(metrics, "vgpu_monitor_bad_regions_total") >= 1
        # the neighbour never went stale, and the cut file is taken back at a rescan (every 1 s)
        assert fresh(good)
        wait_for(lambda: fresh(evil), "the arbiter to take the whole file back")
        metrics = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'vgpu_container_processes{container="evil"' in metrics
        assert metric(metrics, "vgpu_arbiter_regions") == 2
    finally:
        monitor.terminate()
        out, _ = monitor.communicate(timeout=10)
    assert monitor.returncode == 0, out
    assert "skipping region" in out and str(evil) in out
