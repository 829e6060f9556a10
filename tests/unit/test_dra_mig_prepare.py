"""Prepare and unprepare of MIG devices on the DRA path (vgpu/dra/mig.py, vgpu/dra/prepare.py)
over the fake NVML's H100 in MIG mode: the instance made at the allocated placement and named in
the claim's CDI spec and grant, found again after a restart, destroyed at unprepare (never while a
process is on it), and instances no prepared claim holds reclaimed."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.support.dra import DRIVER
from vgpu.core.mig import Placement
from vgpu.dra import cdi
from vgpu.dra.claims import ClaimError
from vgpu.dra.mig import MigNode
from vgpu.dra.prepare import Preparer, StatePaths
from vgpu.node.config import NodeConfig
from vgpu.node.fake_mig import FakeMig
from vgpu.node.fake_nvml import FakeDiscovery

NODE = "node-a"
H100 = "GPU-11111111-0000-4000-8000-000000000000"
A100 = "GPU-33333333-0000-4000-8000-000000000000"
UID = "11111111-2222-3333-4444-555555555555"
UID2 = "22222222-2222-3333-4444-555555555555"


def gpus(tmp_path: Path, instances: str = "[]") -> Path:
    procs = tmp_path / "procs"
    procs.mkdir(exist_ok=True)
    f = tmp_path / "gpus.yaml"
    f.write_text(
        textwrap.dedent(f"""\
        gpus:
          - uuid: {H100}
            model: NVIDIA H100 80GB HBM3
            memoryMiB: 81559
            mig: {{mode: enabled, instances: {instances}}}
          - uuid: {A100}
            model: NVIDIA H100 80GB HBM3
            memoryMiB: 81559
        processDir: {procs}
        """)
    )
    return f


def mig_claim(devices: dict[str, str], uid: str = UID, name: str = "c") -> dict[str, Any]:
    """A claim whose requests (name -> MIG device) the scheduler allocated whole."""
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid},
        "spec": {
            "devices": {
                "requests": [
                    {"name": r, "exactly": {"deviceClassName": f"mig.{DRIVER}", "count": 1}} for r in devices
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": DRIVER, "pool": NODE, "device": d}
                        for r, d in devices.items()
                    ]
                }
            },
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}],
        },
    }


class Claims:
    def __init__(self, *claims: dict[str, Any]) -> None:
        self.claims = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in claims}

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.claims.get((namespace, name))


def preparer(tmp_path: Path, claims: Claims) -> tuple[Preparer, FakeMig]:
    d = FakeDiscovery(gpus(tmp_path) if not (tmp_path / "gpus.yaml").exists() else tmp_path / "gpus.yaml")
    assert d.mig is not None
    p = Preparer(
        NODE,
        StatePaths(Path("/"), tmp_path / "state"),
        tmp_path / "cdi",
        NodeConfig(),
        claims,
        d.cards,
        mig=MigNode(d.mig),
    )
    return p, d.mig


def busy(tmp_path: Path, key: str) -> Path:
    """A stub-driver process file: this test's own process holding memory on ``key``."""
    stat = Path("/proc/self/stat").read_text()
    started = stat[stat.rindex(")") + 2 :].split()[19]
    f = tmp_path / "procs" / f"{os.getpid()}@{started}"
    f.write_text(f"{key} 1048576\n")
    return f


def test_prepare_makes_the_instance_at_the_allocated_placement_and_hands_it_out(tmp_path: Path) -> None:
    claims = Claims(mig_claim({"small": "gpu-0-mig-1g-10gb-6", "big": "gpu-0-mig-3g-40gb-0"}))
    p, mig = preparer(tmp_path, claims)
    view = p.mig_view()
    assert view is not None and view.partitioned == {H100}  # the other card stays a shared one
    answer = p.prepare("ns", UID, "c")
    made = {(d.profile, d.placement): d for d in mig.devices(H100)}
    assert set(made) == {("1g.10gb", Placement(6, 1)), ("3g.40gb", Placement(0, 4))}
    assert [(a["requestNames"], a["deviceName"]) for a in answer] == [
        (["small"], "gpu-0-mig-1g-10gb-6"),
        (["big"], "gpu-0-mig-3g-40gb-0"),
    ]
    spec = json.loads(cdi.spec_path(tmp_path / "cdi", UID).read_text())
    env = {
        d["name"].rsplit("-", 1)[1]: dict(e.split("=", 1) for e in d["containerEdits"]["env"])
        for d in spec["devices"]
    }
    small = made[("1g.10gb", Placement(6, 1))]
    assert env["small"]["NVIDIA_VISIBLE_DEVICES"] == small.uuid
    assert env["small"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "9984m"  # the slice's memory
    assert env["big"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40448m"
    record = json.loads((tmp_path / "state/dra/claims" / f"{UID}.json").read_text())
    assert {r["uuid"] for r in record["requests"]} == {d.uuid for d in made.values()}
    # again, and from a plugin started again: the same answer, no new instance
    assert p.prepare("ns", UID, "c") == answer
    p2, _ = preparer(tmp_path, claims)
    assert p2.mig_view() is not None
    assert p2.prepare("ns", UID, "c") == answer
    assert {d.uuid for d in mig.devices(H100)} == {d.uuid for d in made.values()}


def test_unprepare_destroys_the_instances_but_never_while_in_use(tmp_path: Path) -> None:
    claims = Claims(mig_claim({"gpu": "gpu-0-mig-2g-20gb-2"}))
    p, mig = preparer(tmp_path, claims)
    p.prepare("ns", UID, "c")
    (dev,) = mig.devices(H100)
    proc = busy(tmp_path, dev.uuid)
    with pytest.raises(ClaimError, match="still have processes"):
        p.unprepare(UID)
    assert mig.devices(H100) == [dev] and cdi.spec_path(tmp_path / "cdi", UID).exists()  # still prepared
    assert p.mig_view() is not None and mig.devices(H100) == [dev]  # held: not reclaimed either
    proc.unlink()
    p.unprepare(UID)
    assert mig.devices(H100) == [] and not cdi.spec_path(tmp_path / "cdi", UID).exists()
    p.unprepare(UID)  # again: nothing to do


def test_instances_no_claim_holds_are_reclaimed_and_busy_ones_kept_off_the_offer(tmp_path: Path) -> None:
    gpus(tmp_path, "[{profile: 3g.40gb, start: 4}, {profile: 1g.10gb, start: 0}]")
    p, mig = preparer(tmp_path, Claims())
    one = next(d for d in mig.devices(H100) if d.profile == "1g.10gb")
    proc = busy(tmp_path, one.uuid)
    view = p.mig_view()
    assert view is not None
    assert [d.uuid for d in mig.devices(H100)] == [one.uuid]  # the 3g reclaimed; the 1g has a process
    (offered,) = [s for c, s in view.offered if c.uuid == H100]
    assert all(s.placement.start >= 1 for s in offered) and len(offered) < 25
    proc.unlink()
    view = p.mig_view()
    assert view is not None and mig.devices(H100) == []
    assert len(next(s for c, s in view.offered if c.uuid == H100)) == 25


def test_a_placement_the_card_refuses_fails_the_claim_and_leaves_nothing(tmp_path: Path) -> None:
    gpus(tmp_path)
    claims = Claims(
        mig_claim({"a": "gpu-0-mig-3g-40gb-0"}),
        mig_claim({"a": "gpu-0-mig-1g-10gb-6", "b": "gpu-0-mig-4g-40gb-0"}, uid=UID2, name="d"),
    )
    p, mig = preparer(tmp_path, claims)
    p.prepare("ns", UID, "c")
    with pytest.raises(ClaimError, match="INSUFFICIENT_RESOURCES"):
        p.prepare("ns", UID2, "d")  # its 4g overlaps the first claim's 3g: the card refuses
    assert [d.profile for d in mig.devices(H100)] == ["3g.40gb"]  # the 1g made for it undone
    assert UID2 not in p.prepared()


def test_a_result_naming_a_placement_the_node_does_not_have_is_refused(tmp_path: Path) -> None:
    p, _ = preparer(tmp_path, Claims(mig_claim({"a": "gpu-0-mig-1g-10gb-7"})))
    with pytest.raises(ClaimError, match="not a healthy card"):
        p.prepare("ns", UID, "c")


def test_an_instance_at_the_placement_with_processes_no_claim_holds_is_not_handed_out(tmp_path: Path) -> None:
    gpus(tmp_path, "[{profile: 1g.10gb, start: 6}]")
    p, mig = preparer(tmp_path, Claims(mig_claim({"a": "gpu-0-mig-1g-10gb-6"})))
    (dev,) = mig.devices(H100)
    proc = busy(tmp_path, dev.uuid)
    with pytest.raises(ClaimError, match="processes no claim accounts for"):
        p.prepare("ns", UID, "c")
    proc.unlink()
    assert [a["deviceName"] for a in p.prepare("ns", UID, "c")] == ["gpu-0-mig-1g-10gb-6"]
    assert [d.uuid for d in mig.devices(H100)] == [dev.uuid]  # found, not made again


def test_under_driver_inject_plugin_the_spec_carries_the_instances_capability_nodes(tmp_path: Path) -> None:
    from vgpu.node.driver import DriverFiles

    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidiactl"):
        (dev / name).touch()
    d = FakeDiscovery(gpus(tmp_path))
    assert d.mig is not None
    p = Preparer(
        NODE,
        StatePaths(Path("/"), tmp_path / "state"),
        tmp_path / "cdi",
        NodeConfig(driver_inject="plugin"),
        Claims(mig_claim({"gpu": "gpu-0-mig-3g-40gb-4"})),
        d.cards,
        driver=DriverFiles((), (), dev),
        mig=MigNode(d.mig),
    )
    p.prepare("ns", UID, "c")
    (made,) = d.mig.devices(H100)
    spec = json.loads(cdi.spec_path(tmp_path / "cdi", UID).read_text())
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes[-3:] == [
        "/dev/nvidia0",  # the parent card
        f"/dev/nvidia-caps/nvidia-cap{made.gi_minor}",  # the GPU instance's access
        f"/dev/nvidia-caps/nvidia-cap{made.ci_minor}",  # the compute instance's
    ]


def test_a_card_that_left_mig_mode_took_its_instances_and_unprepare_finishes(tmp_path: Path) -> None:
    p, mig = preparer(tmp_path, Claims(mig_claim({"gpu": "gpu-0-mig-1g-10gb-6"})))
    p.prepare("ns", UID, "c")
    state = json.loads(mig.state_path.read_text())
    state["cards"][H100].update(current=False, pending=False)  # reset out of MIG mode
    mig.state_path.write_text(json.dumps(state))
    p.unprepare(UID)
    assert UID not in p.prepared() and not cdi.spec_path(tmp_path / "cdi", UID).exists()


def test_a_slice_of_an_unhealthy_card_is_not_made(tmp_path: Path) -> None:
    f = gpus(tmp_path)
    f.write_text(
        f.read_text().replace(
            "memoryMiB: 81559\n    mig:", "memoryMiB: 81559\n    healthy: false\n    mig:", 1
        )
    )
    p, mig = preparer(tmp_path, Claims(mig_claim({"gpu": "gpu-0-mig-1g-10gb-6"})))
    with pytest.raises(ClaimError, match="unhealthy"):
        p.prepare("ns", UID, "c")
    assert mig.devices(H100) == []
