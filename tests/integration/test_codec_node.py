"""A container's media engines, end to end on the stub driver: a process in a real cgroup named as
the kubelet names a container's holds memory through the stub driver; the driver's per-process
media samples for it (the fake NVML's ``<pid>@<start>.codec`` beside the stub's record) reach the
node's host view, ``/metrics`` (``vgpu_container_decoder_utilization_ratio`` and the rest) and the
Lease's ``vgpu.openaios.io/codec`` under that container. Needs root (cgroups); skipped otherwise."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hook_harness import Built, build, env
from prometheus_client import CollectorRegistry, generate_latest

from tests.support import wait_for
from tests.support.cgroups import StubNode, granted_container, stub_node
from vgpu.core.annotations import CODEC_ANNOTATION
from vgpu.monitor.collector import NodeCollector
from vgpu.monitor.enforce import Enforcer
from vgpu.monitor.hostview import HostView
from vgpu.monitor.lines import LinesCollector, lease_annotations
from vgpu.node.config import NodeConfig
from vgpu.node.devices import DeviceState

MIB = 1 << 20
CARD = "GPU-3f1c0d6e-0000-4000-8000-0000000c0dec"


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StubNode]:
    with stub_node(StubNode, tmp_path, CARD) as made:
        yield made


def test_a_decoding_containers_engine_figures_reach_the_metrics_and_the_lease(
    built: Built, node: StubNode
) -> None:
    pod_uid, cgroup = granted_container(node.paths, node.cgroups, "decode", CARD, 1000 * MIB)
    environ = env(built, STUB_CUDA_PROCESS_DIR=str(node.procs), NVIDIA_VISIBLE_DEVICES=CARD)
    child = node.spawn(cgroup, [built.prog("t_bypass"), "200", "300"], environ)
    assert child.stdout is not None and "rc=0" in child.stdout.readline()
    [record] = [p for p in node.procs.iterdir() if "@" in p.name and "." not in p.name]  # the stub's
    # what the driver would sample for a decode: NVDEC 35 %, no NVENC on an H100, NVJPG 10 %
    (node.procs / f"{record.name}.codec").write_text(f"{CARD} 35 0 10 0\n")
    view = HostView("n1", node.paths, node.discovery, lambda: [CARD])
    enforcer = Enforcer("n1", view, "report", 256 * MIB)
    wait_for(lambda: enforcer.run_pass() is not None and enforcer.stats.view and enforcer.stats.view.held,
             "the container on the card", 5)  # fmt: skip
    codec = json.loads(lease_annotations(node.paths, None, enforcer)[CODEC_ANNOTATION])
    assert codec == {f"{pod_uid}_decode": {CARD: {"dec": 35, "enc": 0, "jpg": 10, "ofa": 0}}}
    collector = NodeCollector(
        "n1", DeviceState(node.discovery.cards(), NodeConfig()), node.discovery, node.paths
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LinesCollector(collector, None, enforcer))
    text = generate_latest(registry).decode()
    labels = f'container="decode",namespace="",node="n1",pod="",pod_uid="{pod_uid}",uuid="{CARD}"'
    assert f"vgpu_container_decoder_utilization_ratio{{{labels}}} 0.35" in text
    assert f"vgpu_container_jpeg_utilization_ratio{{{labels}}} 0.1" in text
    assert f"vgpu_container_encoder_utilization_ratio{{{labels}}} 0.0" in text
