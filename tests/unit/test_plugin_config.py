"""The node config and the fake GPU file are validated at start, with errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu.core.errors import ConfigError
from vgpu.node.config import NodeConfig, load_node_config, parse_node_config
from vgpu.node.fake_nvml import FakeDiscovery, parse_fake_gpus


def test_an_empty_config_gives_the_defaults() -> None:
    assert parse_node_config("", "n", "cfg.yaml") == NodeConfig()
    assert load_node_config(None, "n") == NodeConfig()


def test_per_node_overrides_apply_only_to_their_node() -> None:
    text = "split: 4\ndeviceCoreScaling: 2\nnodes:\n  gpu-7: {split: 2, oversubscribe: true}\n"
    assert parse_node_config(text, "gpu-7", "c").split == 2
    assert parse_node_config(text, "gpu-7", "c").oversubscribe is True
    other = parse_node_config(text, "gpu-8", "c")
    assert (other.split, other.device_core_scaling, other.oversubscribe) == (4, 2.0, False)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("split: 0", "split"),
        ("split: ten", "split"),
        ("deviceMemoryScaling: -1", "deviceMemoryScaling"),
        ("deviceCoreScaling: true", "deviceCoreScaling"),
        ("oversubscribe: yes please", "oversubscribe"),
        ("resourceName: gpu", "resourceName"),
        ("splitt: 3", "splitt"),
        ("nodes:\n  n: {split: -2}", "nodes.n.split"),
        ("deviceMemoryScaling: 2", "deviceMemoryScaling"),
        ("smPolicy: greedy", "smPolicy"),
        ("smPolicy: 1", "smPolicy"),
        ("nodes:\n  n: {smPolicy: Elastic}", "nodes.n.smPolicy"),
    ],
)
def test_a_bad_setting_is_reported_with_its_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_node_config(text, "n", "cfg.yaml")
    assert info.value.field == field
    assert info.value.source == "cfg.yaml"


def test_sm_policy_is_cap_unless_set_and_may_differ_per_node() -> None:
    assert NodeConfig().sm_policy == "cap"
    text = "smPolicy: elastic\nnodes:\n  strict: {smPolicy: cap}\n"
    assert parse_node_config(text, "any", "c").sm_policy == "elastic"
    assert parse_node_config(text, "strict", "c").sm_policy == "cap"


def test_a_bad_sm_policy_names_both_choices() -> None:
    with pytest.raises(ConfigError, match="cap .*elastic"):
        parse_node_config("smPolicy: fair", "n", "c")


def test_memory_scaling_above_one_needs_oversubscription() -> None:
    with pytest.raises(ConfigError, match="oversubscribe: true"):
        parse_node_config("deviceMemoryScaling: 1.5", "n", "c")
    assert (
        parse_node_config("deviceMemoryScaling: 1.5\noversubscribe: true", "n", "c").device_memory_scaling
        == 1.5
    )


def test_an_unreadable_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_node_config(tmp_path / "missing.yaml", "n")


GPUS = """
gpus:
  - {uuid: GPU-a, model: NVIDIA H200, memoryMiB: 1000, numa: 1, links: {GPU-b: nvlink}}
  - {uuid: GPU-b, memoryMiB: 2000, healthy: false}
"""


def test_the_fake_gpu_file_describes_cards_in_index_order() -> None:
    cards, usage = parse_fake_gpus(GPUS, "g.yaml")
    assert [(c.uuid, c.index, c.model, c.memory_mib, c.numa, c.healthy) for c in cards] == [
        ("GPU-a", 0, "NVIDIA H200", 1000, 1, True),
        ("GPU-b", 1, "Fake GPU", 2000, -1, False),
    ]
    assert cards[0].links == {"GPU-b": "nvlink"}
    assert usage["GPU-b"].memory_total_mib == 2000


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("gpus: 3", "gpus"),
        ("gpus: [{uuid: GPU-a}]", "gpus[0].memoryMiB"),
        ("gpus: [{uuid: GPU-a, memoryMiB: 1}, {uuid: GPU-a, memoryMiB: 1}]", "gpus[1].uuid"),
        ("gpus: [{uuid: GPU-a, memoryMiB: 1, colour: red}]", "gpus[0].colour"),
        ("gpus: [{uuid: GPU-a, memoryMiB: 1, links: [1]}]", "gpus[0].links"),
    ],
)
def test_a_bad_fake_gpu_file_names_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_fake_gpus(text, "g.yaml")
    assert info.value.field == field


def test_editing_health_in_the_fake_file_yields_a_health_event(tmp_path: Path) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(GPUS)
    fake = FakeDiscovery(path, poll_s=0.01)
    assert fake.wait_health_events(0.05) == []
    path.write_text(GPUS.replace("links: {GPU-b: nvlink}}", "links: {GPU-b: nvlink}, healthy: false}"))
    events = fake.wait_health_events(2.0)
    assert [(e.uuid, e.healthy) for e in events] == [("GPU-a", False)]
    assert [c.healthy for c in fake.cards()] == [False, False]
    path.write_text("gpus: [broken")  # a half-written edit keeps the last good view
    assert fake.wait_health_events(0.05) == []
    assert len(fake.cards()) == 2
