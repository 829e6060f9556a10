"""vgpu_container_sm_busy_ratio over a region the real hook writes (libvgpu over the stub driver).

The hook's limiter adds each container's measured GPU time to ``busy_ns``; the collector turns
the counter's growth between its readings into the ratio. The collector's clock is the test's,
so the expected ratio is exact: busy time the hook counted, over the wall time the test says
passed (no timed assertion)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hook_harness import Built, build, env, run
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vgpu.hookabi.region import Region
from vgpu.monitor.collector import NodeCollector, make_registry
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState
from vgpu.node.discovery import Card, CardUsage, HealthEvent
from vgpu.node.paths import REGION_FILE_NAME, HostPaths

S = 1_000_000_000


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


class OneCard:
    def cards(self) -> list[Card]:
        return [Card("GPU-stub", 0, "stub", 8192)]

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        return []

    def usage(self, uuid: str) -> CardUsage | None:
        return None

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.ns = 5_000 * S

    def __call__(self) -> int:
        return self.ns


def scrape(collector: NodeCollector) -> dict[str, float]:
    text = generate_latest(make_registry(collector)).decode()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.labels.get("pod_uid") == "uid-1" and s.name.startswith("vgpu_container_sm_busy")
    }


def busy(path: Path) -> int:
    with Region(path, mapped=False) as r:
        return r.snapshot().devices[0].busy_ns


def test_the_ratio_is_the_busy_time_the_hook_counted_between_two_scrapes(
    built: Built, tmp_path: Path
) -> None:
    paths = HostPaths(tmp_path)
    path = paths.container_dir("uid-1", "train") / REGION_FILE_NAME
    path.parent.mkdir(parents=True)
    environ = env(built, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(path), CUDA_DEVICE_SM_LIMIT="40")
    first = run(built, "t_sm", "link", "rate", "kernel", "0.4", environ=environ)
    assert first.returncode == 0, first.stderr
    clock = Clock()
    discovery = OneCard()
    collector = NodeCollector(
        "n1", DeviceState(discovery.cards(), NodeConfig()), discovery, paths, clock=clock
    )
    got = scrape(collector)
    before = busy(path)
    assert before > 0 and got["vgpu_container_sm_busy_seconds_total"] == before / 1e9
    assert "vgpu_container_sm_busy_ratio" not in got  # one reading: nothing to compare yet

    second = run(built, "t_sm", "link", "rate", "kernel", "0.4", environ=environ)
    assert second.returncode == 0, second.stderr
    clock.ns += 4 * S
    after = busy(path)
    assert after > before  # the second process added its GPU time to the same counter
    assert scrape(collector)["vgpu_container_sm_busy_ratio"] == pytest.approx((after - before) / (4 * S))

    clock.ns += 12 * S  # nothing ran since; the window (10 s) now starts at the second scrape
    assert scrape(collector)["vgpu_container_sm_busy_ratio"] == 0.0
