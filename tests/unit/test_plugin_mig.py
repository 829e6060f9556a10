"""Static MIG on the device-plugin path: the node config's migStrategy, what the node offers
(kubelet's devices per resource, the inventory of contract 2), what pods ask for, where the
scheduler's fit puts them, and what Allocate hands a container."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from vgpu.core.annotations import (
    Allocation,
    ContainerAllocation,
    DeviceAllocation,
    NodeInventory,
    decode_devices,
    encode_devices,
)
from vgpu.core.config import SchedulerConfig
from vgpu.core.errors import AnnotationError, ConfigError, RequestError
from vgpu.core.fit import Plan, Rejection, fit_node
from vgpu.core.ledger import vgpu_usage
from vgpu.core.placementcheck import placement_problems
from vgpu.core.requests import asks_for_vgpu, parse_pod
from vgpu.deviceplugin.answer import container_response
from vgpu.deviceplugin.server import socket_name
from vgpu.node.config import parse_node_config
from vgpu.node.devices import DeviceState
from vgpu.node.driver import DriverFiles
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.mig import mig_layout
from vgpu.node.paths import HostPaths

A = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
B = "GPU-bbbbbbbb-0000-4000-8000-000000000000"
PLAIN = "GPU-cccccccc-0000-4000-8000-000000000000"


def node(tmp_path: Path, strategy: str, a: str, b: str, plain: bool = False) -> DeviceState:
    f = tmp_path / "gpus.yaml"
    f.write_text(
        textwrap.dedent(f"""\
        gpus:
          - {{uuid: {A}, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, mig: {a}}}
          - {{uuid: {B}, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, mig: {b}}}
        """)
        + (f"  - {{uuid: {PLAIN}, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}}\n" if plain else "")
    )
    d = FakeDiscovery(f)
    assert d.mig is not None
    config = parse_node_config(f"migStrategy: {strategy}\n", "n", "cfg")
    cards = d.cards()
    return DeviceState(cards, config, mig_layout(d.mig, [c.uuid for c in cards]))


MIXED_A = (
    "{instances: [{profile: 1g.10gb, start: 0}, {profile: 1g.10gb, start: 1}, {profile: 3g.40gb, start: 4}]}"
)
MIXED_B = "{instances: [{profile: 4g.40gb, start: 0}]}"
ALL_1G = "{instances: [{profile: 1g.10gb, start: 0}, {profile: 1g.10gb, start: 1}]}"


def pod(resources: dict[str, str], name: str = "main") -> dict[str, object]:
    return {
        "metadata": {"name": "p", "uid": "u1"},
        "spec": {"containers": [{"name": name, "resources": {"limits": resources}}]},
    }


def test_mig_strategy_is_checked() -> None:
    assert parse_node_config("migStrategy: mixed\n", "n", "cfg").mig_strategy == "mixed"
    assert parse_node_config("", "n", "cfg").mig_strategy == "none"
    with pytest.raises(ConfigError) as err:
        parse_node_config("nodes: {n: {migStrategy: dynamc}}\n", "n", "cfg")
    assert err.value.field == "nodes.n.migStrategy" and "single" in err.value.message


def test_mixed_offers_one_resource_per_profile(tmp_path: Path) -> None:
    state = node(tmp_path, "mixed", MIXED_A, MIXED_B, plain=True)
    assert state.resources() == [
        "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb", "nvidia.com/mig-4g.40gb",
    ]  # fmt: skip
    ones = [d.ID for d in state.kubelet_devices("nvidia.com/mig-1g.10gb")]
    assert len(ones) == 2 and all(i.startswith("MIG-") and i.endswith("::0") for i in ones)
    # the card not in MIG mode is still split into vGPUs under nvidia.com/gpu
    assert len(state.kubelet_devices()) == 10 and all(d.ID.startswith(PLAIN) for d in state.kubelet_devices())
    assert socket_name("nvidia.com/mig-1g.10gb", "nvidia.com/gpu") == "vgpu-mig-1g.10gb.sock"
    inv = state.inventory()
    slices = [d for d in inv.devices if d.mig is not None]
    assert len(slices) == 4 and {d.split for d in slices} == {1} and {d.cores for d in slices} == {100}
    three = next(d for d in slices if d.mig and d.mig.profile == "3g.40gb")
    assert three.memory_mib == 40448 and three.resource == "nvidia.com/mig-3g.40gb" and three.mig
    assert (three.mig.parent, three.mig.start, three.mig.size) == (A, 4, 4)
    # version 2 on the wire, read back whole; an older reader (version 1 only) refuses it by name
    text = encode_devices(inv)
    assert '"version":2' in text and decode_devices(text).devices == inv.devices
    with pytest.raises(AnnotationError, match="unsupported version 3"):
        decode_devices(text.replace('"version":2', '"version":3'))


def test_single_offers_slices_as_gpus_and_refuses_two_profiles(tmp_path: Path) -> None:
    state = node(tmp_path, "single", ALL_1G, ALL_1G)
    assert state.resources() == ["nvidia.com/gpu"] and state.withheld is None
    assert len(state.kubelet_devices()) == 4
    assert {d.resource for d in state.inventory().devices} == {"nvidia.com/gpu"}
    (tmp_path / "x").mkdir()
    bad = node(tmp_path / "x", "single", ALL_1G, MIXED_B)
    assert bad.withheld is not None
    assert "profiles 1g.10gb, 4g.40gb" in bad.withheld and "migStrategy: mixed" in bad.withheld
    assert bad.kubelet_devices() == [] and bad.inventory().devices == ()
    assert bad.withhold(None) is False  # lifting another reason does not offer them


def test_a_cards_health_reaches_its_slices(tmp_path: Path) -> None:
    state = node(tmp_path, "mixed", MIXED_A, MIXED_B)
    assert state.set_health(A, False)
    assert {d.healthy for d in state.inventory().devices if d.mig and d.mig.parent == A} == {False}
    assert {d.healthy for d in state.inventory().devices if d.mig and d.mig.parent == B} == {True}


def test_mig_requests() -> None:
    cfg = SchedulerConfig()
    p = pod({"nvidia.com/mig-1g.10gb.me": "1"})
    assert asks_for_vgpu(p)
    req = parse_pod(p, cfg)
    (c,) = req.containers
    assert (c.count, c.resource, c.cores, c.memory_percent) == (1, "nvidia.com/mig-1g.10gb.me", 100, 100)
    assert req.resource == "nvidia.com/mig-1g.10gb.me"
    with pytest.raises(RequestError) as err:
        parse_pod(pod({"nvidia.com/mig-9g.90gb": "1"}), cfg)
    assert err.value.field == "spec.containers[0].resources.limits[nvidia.com/mig-9g.90gb]"
    assert "no MIG profile '9g.90gb'" in err.value.message and "nvidia.com/mig-1g.10gb" in err.value.message
    with pytest.raises(RequestError, match="a MIG device is whole"):
        parse_pod(pod({"nvidia.com/mig-1g.10gb": "1", "nvidia.com/gpumem": "1000"}), cfg)
    two = pod({"nvidia.com/mig-1g.10gb": "1"})
    two["spec"]["containers"].append({"name": "b", "resources": {"limits": {"nvidia.com/gpu": "1"}}})  # type: ignore[index]
    with pytest.raises(RequestError, match="a pod's vGPUs come from one resource"):
        parse_pod(two, cfg)


def test_fit_places_whole_slices_of_the_asked_profile(tmp_path: Path) -> None:
    inv = node(tmp_path, "mixed", MIXED_A, MIXED_B, plain=True).inventory()
    cfg = SchedulerConfig()
    one = parse_pod(pod({"nvidia.com/mig-1g.10gb": "1"}), cfg)
    plan = fit_node("n", inv.offering(one.resource), {}, one)
    assert isinstance(plan, Plan)
    (given,) = plan.allocation.containers[0].devices
    slice_ = next(d for d in inv.devices if d.uuid == given.uuid)
    assert slice_.mig is not None and slice_.mig.profile == "1g.10gb"
    assert placement_problems(one, plan.allocation, {d.uuid: d for d in inv.devices}) == []
    # both 1g slices held: a third 1g pod has no room, never a second pod on a slice
    ones = [d.uuid for d in inv.devices if d.mig and d.mig.profile == "1g.10gb"]
    usage = {u: vgpu_usage(9984, 100) for u in ones}
    assert isinstance(fit_node("n", inv.offering(one.resource), usage, one), Rejection)
    # two slices for one container: two different slices
    two = parse_pod(pod({"nvidia.com/mig-1g.10gb": "2"}), cfg)
    plan2 = fit_node("n", inv.offering(two.resource), {}, two)
    assert isinstance(plan2, Plan) and len({d.uuid for d in plan2.allocation.containers[0].devices}) == 2
    # a plain vGPU pod goes to the card not in MIG mode, never to a slice
    plain = parse_pod(pod({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}), cfg)
    plan3 = fit_node("n", inv.offering(plain.resource), {}, plain)
    assert isinstance(plan3, Plan) and plan3.allocation.containers[0].devices[0].uuid == PLAIN
    # a placement naming a slice of another profile is refused by the node
    wrong = Allocation("n", (ContainerAllocation("main", (DeviceAllocation(ones[0], 40448, 100),)),))
    three = parse_pod(pod({"nvidia.com/mig-3g.40gb": "1"}), cfg)
    (problem,) = [
        p for p in placement_problems(three, wrong, {d.uuid: d for d in inv.devices}) if "offered" in p
    ]
    assert "offered as nvidia.com/mig-1g.10gb, but asks for nvidia.com/mig-3g.40gb" in problem


def test_allocate_hands_the_slice(tmp_path: Path) -> None:
    state = node(tmp_path, "mixed", MIXED_A, MIXED_B)
    state.config = replace(state.config, driver_inject="plugin")
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    three = next(d for d in state.inventory().devices if d.mig and d.mig.profile == "3g.40gb")
    mig = state.mig_device(three.uuid)
    assert mig is not None
    for name in (
        "nvidiactl",
        "nvidia-uvm",
        "nvidia0",
        f"nvidia-caps/nvidia-cap{mig.gi_minor}",
        f"nvidia-caps/nvidia-cap{mig.ci_minor}",
    ):
        (dev / name).touch()
    driver = DriverFiles((), (), dev)
    paths = HostPaths(tmp_path / "root")
    given = ContainerAllocation("main", (DeviceAllocation(three.uuid, 40448, 100),))
    r = container_response(state, state.config, paths, None, "n", "uid-1", given, "1", driver)
    assert r.envs["NVIDIA_VISIBLE_DEVICES"] == three.uuid
    assert r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40448m"  # the slice's memory
    nodes = {d.host_path for d in r.devices}
    assert {
        "/dev/nvidia0",
        f"/dev/nvidia-caps/nvidia-cap{mig.gi_minor}",
        f"/dev/nvidia-caps/nvidia-cap{mig.ci_minor}",
    } <= nodes
    (dev / f"nvidia-caps/nvidia-cap{mig.ci_minor}").unlink()
    with pytest.raises(Exception, match="nvidia-cap"):
        container_response(state, state.config, paths, None, "n", "uid-2", given, "1", driver)


def test_an_older_inventory_still_reads(tmp_path: Path) -> None:
    inv = NodeInventory(node(tmp_path, "none", MIXED_A, MIXED_B).inventory().devices)
    assert '"version":1' in encode_devices(inv) and all(d.mig is None for d in inv.devices)


def test_the_charts_managed_resources_name_every_mig_profile() -> None:
    """kube-scheduler calls the extender only for pods asking a managed resource: a pod asking
    for a MIG device alone must reach it, so the chart lists every profile the tables give."""
    import re

    from vgpu.core.mig import mig_resources

    text = (Path(__file__).parents[2] / "charts/vgpu/templates/scheduler-config.yaml").read_text()
    listed = re.search(r'range list ((?:"[^"]+" ?)+)', text)
    assert listed is not None
    assert (
        tuple(sorted("nvidia.com/mig-" + n for n in re.findall(r'"([^"]+)"', listed.group(1))))
        == mig_resources()
    )


def test_the_webhook_routes_mig_pods_and_adds_no_gpu_count() -> None:
    """A pod asking for MIG devices (and a priority) goes to the vgpu scheduler as it is: the
    mutating webhook adds no nvidia.com/gpu, which the validating one would then refuse."""
    from vgpu.extender.webhook import mutate, validate

    p = pod({"nvidia.com/mig-1g.10gb": "1", "nvidia.com/priority": "0"})
    review = {"request": {"uid": "r", "object": p, "operation": "CREATE"}}
    patch = mutate(review, SchedulerConfig())["response"]["patch"]
    import base64
    import json

    ops = json.loads(base64.b64decode(patch))
    assert [o["path"] for o in ops] == ["/spec/schedulerName"]
    bad = {"request": {"uid": "r", "object": pod({"nvidia.com/mig-9g.90gb": "1"}), "operation": "CREATE"}}
    answer = validate(bad, SchedulerConfig())["response"]
    assert answer["allowed"] is False and "no MIG profile '9g.90gb'" in answer["status"]["message"]


def test_the_host_view_reads_processes_on_each_slice(tmp_path: Path) -> None:
    """The node monitor's memory check goes over what the node offers: each MIG device, whose
    processes the driver lists on the MIG device itself (the fake's processDir, by its uuid)."""
    import os

    from vgpu.monitor.hostview import HostView

    procs = tmp_path / "procs"
    procs.mkdir()
    f = tmp_path / "gpus.yaml"
    f.write_text(
        f"gpus: [{{uuid: {A}, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, mig: {MIXED_A}}}]\n"
        f"processDir: {procs}\n"
    )
    d = FakeDiscovery(f)
    assert d.mig is not None
    state = DeviceState(
        d.cards(), parse_node_config("migStrategy: mixed\n", "n", "c"), mig_layout(d.mig, [A])
    )
    three = next(c.uuid for c in state.cards() if c.model.endswith("3g.40gb"))
    stat = Path("/proc/self/stat").read_text()
    started = stat[stat.rindex(")") + 2 :].split()[19]
    (procs / f"{os.getpid()}@{started}").write_text(f"{three} 5242880\n")
    view = HostView("n", HostPaths(tmp_path / "root"), d, lambda: [c.uuid for c in state.cards()])
    got = view.read().unattributed
    assert got[three] == 5242880 and sum(got.values()) == 5242880 and A not in got


def test_under_none_a_card_in_mig_mode_is_not_offered_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("ERROR", logger="vgpu.node.devices"):
        state = node(tmp_path, "none", MIXED_A, MIXED_B, plain=True)
    assert state.unoffered == [A, B]
    assert [c.uuid for c in state.cards()] == [PLAIN]
    assert [d.uuid for d in state.inventory().devices] == [PLAIN]
    assert "migStrategy single or mixed" in caplog.text and A in caplog.text
    other = tmp_path / "mixed"
    other.mkdir()
    assert node(other, "mixed", MIXED_A, MIXED_B, plain=True).unoffered == []


def test_the_plugin_under_none_reads_the_mig_mode_and_leaves_such_cards_out(tmp_path: Path) -> None:
    from tests.support import FakeKube
    from vgpu.deviceplugin.daemon import Daemon
    from vgpu.node.config import NodeConfig

    node(tmp_path, "none", MIXED_A, MIXED_B, plain=True)  # writes gpus.yaml
    d = FakeDiscovery(tmp_path / "gpus.yaml")
    paths = HostPaths(tmp_path / "root")
    daemon = Daemon("n1", "kube-system", paths, NodeConfig(), d, FakeKube(), None, mig=d.mig)
    assert daemon.state.unoffered == [A, B]
    assert [dev.uuid for dev in daemon.state.inventory().devices] == [PLAIN]
