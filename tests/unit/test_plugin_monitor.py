"""The node monitor reports per-card totals and, from the hook's region files, per-container usage."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import FakeKube
from vgpu.core.drarecord import claims_dir
from vgpu.hookabi import layout, region
from vgpu.hookabi.grant import Grant, write_grant
from vgpu.monitor.arbiter import Arbiter
from vgpu.monitor.collector import NodeCollector, make_registry
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState
from vgpu.node.discovery import Card, CardUsage, HealthEvent
from vgpu.node.paths import REGION_FILE_NAME, HostPaths

MIB = 1 << 20


class Cards:
    def __init__(self) -> None:
        self.list = [Card("GPU-a", 0, "H200", 1000), Card("GPU-b", 1, "H200", 1000)]

    def cards(self) -> list[Card]:
        return self.list

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        return []

    def usage(self, uuid: str) -> CardUsage | None:
        return CardUsage(250, 1000, 40) if uuid == "GPU-a" else None

    def close(self) -> None:
        pass


def write_region(path: Path, devices: list[tuple[str, int, int]], procs: list[tuple[int, list[int]]]) -> None:
    """A region file as the hook lays it out (offsets from vgpu.hookabi.region), then limits set."""
    h, s = layout.HEADER_LAYOUT.offsets, layout.SLOT_LAYOUT.offsets
    buf = bytearray(layout.REGION_SIZE)
    struct.pack_into("<Q", buf, h["magic"], layout.MAGIC)
    for name, value in (
        ("version", layout.LAYOUT_VERSION),
        ("header_size", layout.HEADER_LAYOUT.size),
        ("slot_size", layout.SLOT_LAYOUT.size),
        ("max_devices", layout.MAX_DEVICES),
        ("max_procs", layout.MAX_PROCS),
        ("num_devices", len(devices)),
    ):
        struct.pack_into("<I", buf, h[name], value)
    for i, (uuid, _, _) in enumerate(devices):
        raw = uuid.encode()
        buf[h["uuid"] + i * layout.UUID_BYTES : h["uuid"] + i * layout.UUID_BYTES + len(raw)] = raw
    for k, (pid, used) in enumerate(procs):
        base = layout.HEADER_LAYOUT.size + k * layout.SLOT_LAYOUT.size
        struct.pack_into("<iI", buf, base + s["pid"], pid, 1)
        for i, u in enumerate(used):
            struct.pack_into("<Q", buf, base + s["used"] + 8 * i, u)
    for i in range(len(devices)):
        struct.pack_into("<Q", buf, h["used"] + 8 * i, sum(p[1][i] for p in procs))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(buf))
    with region.Region(path, writable=True) as r:
        for i, (_, limit, sm) in enumerate(devices):
            r.set_limit(i, limit)
            r.set_sm_limit(i, sm)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(
    tmp_path: Path, pods: list[dict[str, Any]] | None = None, config: NodeConfig | None = None
) -> Samples:
    paths = HostPaths(tmp_path)
    discovery = Cards()
    state = DeviceState(discovery.cards(), config or NodeConfig(split=4))
    state.set_health("GPU-b", False)
    collector = NodeCollector("n1", state, discovery, paths, list_pods=(lambda node: pods) if pods else None)
    text = generate_latest(make_registry(collector)).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def test_per_card_totals_and_health_are_reported(tmp_path: Path) -> None:
    got = scrape(tmp_path)
    a = {"index": "0", "model": "H200", "node": "n1", "uuid": "GPU-a"}
    b = {"index": "1", "model": "H200", "node": "n1", "uuid": "GPU-b"}
    assert got[key("vgpu_card_memory_total_bytes", **a)] == 1000 * MIB
    assert got[key("vgpu_card_memory_used_bytes", **a)] == 250 * MIB
    assert got[key("vgpu_card_utilization_ratio", **a)] == 0.4
    assert got[key("vgpu_card_healthy", **a)] == 1.0
    assert got[key("vgpu_card_healthy", **b)] == 0.0
    assert got[key("vgpu_card_vgpus_capacity", **b)] == 4.0
    assert got[key("vgpu_card_memory_capacity_bytes", **b)] == 1000 * MIB  # from the node config, not NVML
    assert key("vgpu_card_memory_total_bytes", **b) not in got  # NVML could not read it: no made-up value


def test_the_card_capacity_series_have_the_schedulers_names_and_values_and_the_old_names_stay_deprecated(
    tmp_path: Path,
) -> None:
    """The node and the scheduler named the same things differently (memory_total against
    memory_capacity, split against vgpus_capacity): one name now, one value for one card."""
    from vgpu.core.annotations import DEVICES_ANNOTATION, encode_devices
    from vgpu.core.config import SchedulerConfig
    from vgpu.extender import metrics
    from vgpu.extender.state import SchedulerState
    from vgpu.extender.sync import refresh_gauges

    config = NodeConfig(split=3, device_memory_scaling=1.5, oversubscribe=True)
    got = scrape(tmp_path, config=config)
    inventory = DeviceState(Cards().cards(), config).inventory()  # what the device plugin publishes
    extender = SchedulerState(SchedulerConfig(), clock=lambda: 0.0)
    extender.apply_node(
        {"metadata": {"name": "n1", "annotations": {DEVICES_ANNOTATION: encode_devices(inventory)}}}
    )
    refresh_gauges(extender, metrics, {})
    for uuid, index in (("GPU-a", "0"), ("GPU-b", "1")):
        card = {"index": index, "model": "H200", "node": "n1", "uuid": uuid}
        assert got[key("vgpu_card_memory_capacity_bytes", **card)] == 1500 * MIB
        assert (
            got[key("vgpu_card_memory_capacity_bytes", **card)]
            == metrics.CARD_MEMORY_CAPACITY.labels("n1", uuid)._value.get()
        )
        assert got[key("vgpu_card_vgpus_capacity", **card)] == 3
        assert (
            got[key("vgpu_card_vgpus_capacity", **card)]
            == metrics.CARD_VGPUS_CAPACITY.labels("n1", uuid)._value.get()
        )
    a = {"index": "0", "model": "H200", "node": "n1", "uuid": "GPU-a"}
    assert got[key("vgpu_card_memory_total_bytes", **a)] == 1000 * MIB  # the old name: the driver's figure
    assert got[key("vgpu_card_split", **a)] == 3
    paths = HostPaths(tmp_path)
    discovery = Cards()
    collector = NodeCollector("n1", DeviceState(discovery.cards(), config), discovery, paths)
    helps = {
        f.name: f.documentation
        for f in text_string_to_metric_families(generate_latest(make_registry(collector)).decode())
    }
    for old, new in (
        ("vgpu_card_memory_total_bytes", "vgpu_card_memory_capacity_bytes"),
        ("vgpu_card_split", "vgpu_card_vgpus_capacity"),
    ):
        assert helps[old].startswith(f"DEPRECATED, removed in the next release: use {new}.")
        assert "DEPRECATED" not in helps[new]


def test_container_usage_and_limits_come_from_the_region_files(tmp_path: Path) -> None:
    folder = HostPaths(tmp_path).container_dir("uid-1", "train")
    write_region(
        folder / REGION_FILE_NAME,
        [("GPU-a", 3000 * MIB, 30), ("GPU-b", 0, 0)],
        [(101, [100 * MIB, 0]), (102, [50 * MIB, 7 * MIB])],
    )
    pods = [{"metadata": {"uid": "uid-1", "namespace": "ml", "name": "job"}}]
    got = scrape(tmp_path, pods)
    c = {"container": "train", "namespace": "ml", "node": "n1", "pod": "job", "pod_uid": "uid-1"}
    assert got[key("vgpu_container_memory_used_bytes", uuid="GPU-a", **c)] == 150 * MIB
    assert got[key("vgpu_container_memory_limit_bytes", uuid="GPU-a", **c)] == 3000 * MIB
    assert got[key("vgpu_container_sm_limit_ratio", uuid="GPU-a", **c)] == 0.3
    assert got[key("vgpu_container_memory_used_bytes", uuid="GPU-b", **c)] == 7 * MIB
    assert got[key("vgpu_container_memory_limit_bytes", uuid="GPU-b", **c)] == 0
    assert got[key("vgpu_container_processes", **c)] == 2


def test_a_file_that_is_not_a_region_is_skipped_not_fatal(tmp_path: Path) -> None:
    bad = HostPaths(tmp_path).container_dir("uid-2", "c") / REGION_FILE_NAME
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"\0" * layout.REGION_SIZE)
    got = scrape(tmp_path)
    assert not any(dict(labels).get("pod_uid") == "uid-2" for _, labels in got)
    assert any(name == "vgpu_card_healthy" for name, _ in got)


def test_spill_budget_compute_time_priority_and_yield_are_reported(tmp_path: Path) -> None:
    path = HostPaths(tmp_path).container_dir("uid-1", "train") / REGION_FILE_NAME
    write_region(path, [("GPU-a", 3000 * MIB, 30)], [(101, [100 * MIB]), (102, [50 * MIB])])
    h, s = layout.HEADER_LAYOUT.offsets, layout.SLOT_LAYOUT.offsets
    data = bytearray(path.read_bytes())
    for name, value in (("budget", 2000 * MIB), ("spilled", 40 * MIB), ("busy_ns", 1_500_000_000)):
        struct.pack_into("=Q", data, h[name], value)
    struct.pack_into("=Q", data, h["throttled_ns"], 250_000_000)
    struct.pack_into("=I", data, h["flags"], layout.FLAG_YIELD | layout.FLAG_ALONE)
    struct.pack_into("=I", data, h["priority"], 1)
    struct.pack_into("=Q", data, layout.HEADER_LAYOUT.size + s["spilled"], 40 * MIB)  # process 101's share
    path.write_bytes(bytes(data))
    got = scrape(tmp_path, [{"metadata": {"uid": "uid-1", "namespace": "ml", "name": "job"}}])
    c = {"container": "train", "namespace": "ml", "node": "n1", "pod": "job", "pod_uid": "uid-1"}
    assert got[key("vgpu_container_memory_budget_bytes", uuid="GPU-a", **c)] == 2000 * MIB
    assert got[key("vgpu_container_memory_spilled_bytes", uuid="GPU-a", **c)] == 40 * MIB
    assert got[key("vgpu_container_sm_busy_seconds_total", uuid="GPU-a", **c)] == 1.5
    assert got[key("vgpu_container_sm_throttled_seconds_total", uuid="GPU-a", **c)] == 0.25
    assert got[key("vgpu_container_yielding", uuid="GPU-a", **c)] == 1.0
    assert got[key("vgpu_container_priority", **c)] == 1.0
    assert got[key("vgpu_process_memory_spilled_bytes", uuid="GPU-a", pid="101", **c)] == 40 * MIB
    assert got[key("vgpu_process_memory_spilled_bytes", uuid="GPU-a", pid="102", **c)] == 0


def test_bad_regions_are_counted_once_and_the_arbiter_reports_its_passes(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    bad = paths.container_dir("uid-2", "c") / REGION_FILE_NAME
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"\0" * 10)
    write_region(paths.container_dir("uid-1", "a") / REGION_FILE_NAME, [("GPU-a", 0, 0)], [])
    arbiter = Arbiter(paths.containers_dir)
    arbiter.rescan()
    arbiter.run_pass()
    discovery = Cards()
    collector = NodeCollector(
        "n1", DeviceState(discovery.cards(), NodeConfig()), discovery, paths, arbiter=arbiter
    )
    for _ in range(2):
        text = generate_latest(make_registry(collector)).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["vgpu_monitor_bad_regions_total"] == 1
    assert samples["vgpu_arbiter_passes_total"] == 1 and samples["vgpu_arbiter_regions"] == 1
    assert "vgpu_arbiter_pass_seconds" in samples
    arbiter.stop()


def test_the_collector_never_maps_a_region_and_skips_one_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container can cut its file between any two reads: mapped, that would be SIGBUS."""
    paths = HostPaths(tmp_path)
    write_region(paths.container_dir("uid-1", "a") / REGION_FILE_NAME, [("GPU-a", 5 * MIB, 0)], [])
    cut = paths.container_dir("uid-2", "b") / REGION_FILE_NAME
    write_region(cut, [("GPU-a", 0, 0)], [])
    real_pread = os.pread

    def pread(fd: int, size: int, offset: int) -> bytes:  # the file shrinks after the open
        data = real_pread(fd, size, offset)
        return data[: layout.REGION_SIZE // 2] if os.readlink(f"/proc/self/fd/{fd}") == str(cut) else data

    def no_map(*args: object, **kwargs: object) -> None:
        raise AssertionError("the collector mapped a region")

    monkeypatch.setattr(region.mmap, "mmap", no_map)
    monkeypatch.setattr(region.os, "pread", pread)
    got = scrape(tmp_path)
    monkeypatch.undo()
    assert got[key("vgpu_container_memory_limit_bytes", uuid="GPU-a", **labels("uid-1", "a"))] == 5 * MIB
    assert not any(dict(ls).get("pod_uid") == "uid-2" for _, ls in got)
    assert got[key("vgpu_monitor_bad_regions_total", node="n1")] == 1


def labels(pod_uid: str, container: str) -> dict[str, str]:
    return {"container": container, "namespace": "", "node": "n1", "pod": "", "pod_uid": pod_uid}


def test_limits_come_from_the_grant_and_a_region_that_differs_is_flagged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = HostPaths(tmp_path)
    folder = paths.container_dir("uid-1", "train")
    # the container rewrote its region's copy: 64 GiB and no SM cap, where it was granted 3000 MiB and 30 %
    write_region(folder / REGION_FILE_NAME, [("GPU-a", 64 << 30, 0)], [(101, [100 * MIB])])
    write_grant(paths.grant(folder.name), Grant(("GPU-a",), (3000 * MIB,), (30,), priority=0))
    c = {"container": "train", "namespace": "", "node": "n1", "pod": "", "pod_uid": "uid-1"}
    with caplog.at_level(logging.WARNING):
        got = scrape(tmp_path)
    assert got[key("vgpu_container_memory_limit_bytes", uuid="GPU-a", **c)] == 3000 * MIB
    assert got[key("vgpu_container_sm_limit_ratio", uuid="GPU-a", **c)] == 0.3
    assert got[key("vgpu_container_memory_used_bytes", uuid="GPU-a", **c)] == 100 * MIB
    assert got[key("vgpu_container_region_limits_differ", **c)] == 1.0
    assert "wrote limits into its region that differ from its grant" in caplog.text
    with region.Region(folder / REGION_FILE_NAME, writable=True) as r:  # the hook put it back
        r.set_limit(0, 3000 * MIB)
        r.set_sm_limit(0, 30)
    assert scrape(tmp_path)[key("vgpu_container_region_limits_differ", **c)] == 0.0


def test_a_dra_claims_region_is_labelled_with_its_claim_and_the_pod_it_serves(tmp_path: Path) -> None:
    import json

    paths = HostPaths(tmp_path)
    claim = "7d0e4c51-93a4-4f0e-b1d6-2c3e4f5a6b7c"
    shared = "0a0e4c51-93a4-4f0e-b1d6-2c3e4f5a6b7c"
    for uid in (claim, shared, "no-record"):
        folder = paths.containers_dir / f"dra_{uid}_gpu"
        write_region(folder / REGION_FILE_NAME, [("GPU-a", 3000 * MIB, 30)], [(101, [100 * MIB])])
        write_grant(paths.grant(folder.name), Grant(("GPU-a",), (3000 * MIB,), (30,), priority=0))
    records = claims_dir(paths.vgpu_dir)
    records.mkdir(parents=True)
    pod = {"name": "trainer", "uid": "uid-9"}
    (records / f"{claim}.json").write_text(
        json.dumps({"version": 1, "namespace": "ml", "name": "trainer-gpu-x7", "uid": claim, "pods": [pod]})
    )
    two = [pod, {"name": "other", "uid": "uid-8"}]
    (records / f"{shared}.json").write_text(json.dumps({"namespace": "ml", "name": "shared", "pods": two}))
    got = scrape(tmp_path)
    one = {"namespace": "ml", "pod": "trainer", "pod_uid": "uid-9", "container": "claim:trainer-gpu-x7/gpu"}
    assert got[key("vgpu_container_memory_used_bytes", node="n1", uuid="GPU-a", **one)] == 100 * MIB
    assert got[key("vgpu_container_memory_limit_bytes", node="n1", uuid="GPU-a", **one)] == 3000 * MIB
    both = {"namespace": "ml", "pod": "", "pod_uid": "", "container": "claim:shared/gpu"}
    assert got[key("vgpu_container_processes", node="n1", **both)] == 1
    bare = {"namespace": "", "pod": "", "pod_uid": "", "container": "claim:no-record/gpu"}
    assert got[key("vgpu_container_processes", node="n1", **bare)] == 1
    assert not any(dict(ls).get("pod_uid") == "dra" for _, ls in got)


class Clock:
    """CLOCK_MONOTONIC as the collector and the arbiter read it, moved by the test."""

    def __init__(self) -> None:
        self.ns = 1_000 * S

    def __call__(self) -> int:
        return self.ns


S = 1_000_000_000


def set_busy(path: Path, index: int, busy_ns: int) -> None:
    """What the hook's limiter does as intervals complete: one word of the file grows."""
    with path.open("r+b") as f:
        f.seek(layout.HEADER_LAYOUT.offsets["busy_ns"] + 8 * index)
        f.write(struct.pack("=Q", busy_ns))


def ratios(collector: NodeCollector) -> dict[str, float]:
    """vgpu_container_sm_busy_ratio by card UUID, from one real scrape."""
    text = generate_latest(make_registry(collector)).decode()
    return {
        s.labels["uuid"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vgpu_container_sm_busy_ratio"
    }


def test_the_busy_ratio_follows_busy_ns_between_scrapes(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    path = paths.container_dir("uid-1", "train") / REGION_FILE_NAME
    write_region(path, [("GPU-a", 0, 30), ("GPU-b", 0, 0)], [(101, [0, 0])])
    set_busy(path, 0, 40 * S)  # the container ran before the monitor started
    clock = Clock()
    discovery = Cards()
    collector = NodeCollector(
        "n1", DeviceState(discovery.cards(), NodeConfig()), discovery, paths, clock=clock
    )
    assert ratios(collector) == {}  # nothing earlier to compare with: no series, not 40 s / 0
    clock.ns += 5 * S
    set_busy(path, 0, 40 * S + 3 * S // 2)  # 1.5 s of GPU time in 5 s
    assert ratios(collector) == {"GPU-a": 0.3, "GPU-b": 0.0}
    for _ in range(4):  # scrapes every 5 s; the card 80 % busy meanwhile
        clock.ns += 5 * S
        set_busy(path, 0, collector_busy(path) + 4 * S)
    # the window is the last 10 s (from the newest scrape at least that old): only the 80 % part
    assert ratios(collector)["GPU-a"] == pytest.approx(0.8)
    clock.ns += 10 * S  # idle since
    assert ratios(collector)["GPU-a"] == 0.0


def collector_busy(path: Path) -> int:
    with region.Region(path) as r:
        return r.word("busy_ns", 0)


def test_with_an_arbiter_the_ratio_covers_its_passes_and_a_first_scrape_has_one(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    path = paths.container_dir("uid-1", "train") / REGION_FILE_NAME
    write_region(path, [("GPU-a", 0, 50)], [])
    clock = Clock()
    arbiter = Arbiter(paths.containers_dir, clock=clock)
    arbiter.rescan()
    busy = 0
    for step in range(120):  # 30 s of passes every 250 ms: 20 s at 25 %, then 10 s at 50 %
        clock.ns += S // 4
        busy += S // 16 if step < 80 else S // 8
        set_busy(path, 0, busy)
        arbiter.run_pass()
    discovery = Cards()
    collector = NodeCollector(
        "n1", DeviceState(discovery.cards(), NodeConfig()), discovery, paths, arbiter=arbiter
    )
    assert collector.clock is clock and collector.timeshare is arbiter.timeshare
    # the first scrape already has a ratio from the arbiter's samples: checkpoints a second apart
    # (the first pass, 0.25 s in, then 1.25 s ...), the reference the newest one at least 10 s
    # old (19.25 s in), so 10.75 s: 0.75 s of the 25 % part and the 10 s at 50 %
    assert ratios(collector)["GPU-a"] == pytest.approx((0.75 * 0.25 + 10 * 0.5) / 10.75)
    arbiter.stop()


def test_a_replaced_region_starts_its_ratio_anew_and_a_removed_one_is_forgotten(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    path = paths.container_dir("uid-1", "train") / REGION_FILE_NAME
    write_region(path, [("GPU-a", 0, 50)], [])
    set_busy(path, 0, 100 * S)
    clock = Clock()
    discovery = Cards()
    collector = NodeCollector(
        "n1", DeviceState(discovery.cards(), NodeConfig()), discovery, paths, clock=clock
    )
    ratios(collector)
    clock.ns += 2 * S
    set_busy(path, 0, 101 * S)
    assert ratios(collector) == {"GPU-a": 0.5}
    write_region(path, [("GPU-a", 0, 50)], [])  # the container restarted: a fresh file, busy_ns 0
    clock.ns += 2 * S
    assert ratios(collector) == {}  # not (0 - 101 s) / 2 s
    clock.ns += 2 * S
    set_busy(path, 0, S // 2)
    assert ratios(collector) == {"GPU-a": 0.25}
    path.unlink()
    assert ratios(collector) == {}
    assert collector.timeshare.ratio(("uid-1_train", 0, "GPU-a")) is None  # nothing kept for it


def test_region_usage_reports_each_containers_memory_per_card_and_skips_what_it_cannot_read(
    tmp_path: Path,
) -> None:
    from vgpu.node.regions import region_usage

    containers = tmp_path / "containers"
    write_region(
        containers / "uid1_main" / REGION_FILE_NAME, [("GPU-a", 0, 0), ("GPU-b", 0, 0)], [(7, [5 * MIB, 0])]
    )
    write_region(containers / "uid2_side" / REGION_FILE_NAME, [("GPU-b", 0, 0)], [(8, [3 * MIB]), (9, [MIB])])
    (containers / "uid3_broken").mkdir()
    (containers / "uid3_broken" / REGION_FILE_NAME).write_bytes(b"not a region")
    (containers / "uid4_empty").mkdir()
    assert region_usage(containers) == {
        "uid1_main": {"GPU-a": 5 * MIB, "GPU-b": 0},
        "uid2_side": {"GPU-b": 4 * MIB},
    }
    assert region_usage(tmp_path / "absent") == {}


def test_the_reporter_renews_the_lease_with_the_usage_report() -> None:
    import json as _json

    from vgpu.core.annotations import USAGE_ANNOTATION
    from vgpu.deviceplugin.report import NodeReporter

    api = FakeKube()
    state = DeviceState(Cards().cards(), NodeConfig())
    NodeReporter("n1", "ns", state, api, usage=lambda: {"uid_c": {"GPU-a": 42}}).renew()
    NodeReporter("n1", "ns", state, api).renew()
    calls = [annotations for _, _, annotations in api.renewals]
    assert calls[0] is not None and _json.loads(calls[0][USAGE_ANNOTATION]) == {"uid_c": {"GPU-a": 42}}
    assert calls[1] is None
