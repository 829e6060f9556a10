"""``vgpu sandbox up --real-node --dra --mig``: MIG slices through DRA with the real kubelet.

The real node's first card is the fake NVML's H100 80GB in MIG mode and ``vgpu dra-plugin`` runs
with ``--mig dynamic`` (docs/mig.md#mig-with-dra). ``examples/dra-mig.yaml``, applied as it is,
runs its two pods (a 1g.10gb and a 3g.40gb): kube-scheduler allocates placements that do not
overlap, the kubelet prepares the claims and the plugin makes each GPU instance in the card, the
claim's CDI spec naming the MIG device. The plugin is killed mid-way with an instance leaked (as
a prepare cut short leaves one) and started again: the leak is reclaimed, the pods' instances
kept and the pods untouched. The example deleted, the kubelet unprepares the claims and the card
is empty. Needs what tests/e2e/test_dra_real_node.py needs; run it under the real-node lock.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from vgpu_sandbox import realdra
from vgpu_sandbox.binaries import repo_root
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.realnode import layout

from tests.e2e.test_dra_real_node import _why_not
from tests.support import wait_for
from tests.support.groups import REAL_NODE
from vgpu.core.mig import H100_80GB, Placement
from vgpu.dra.migslices import device_name
from vgpu.node.fake_mig import FakeMig
from vgpu.node.fake_nvml import FakeDiscovery

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.xdist_group(REAL_NODE)]
EXAMPLE = repo_root() / "examples" / "dra-mig.yaml"


@pytest.fixture(scope="module")
def node() -> Iterator[Sandbox]:
    why = _why_not()
    if why:
        pytest.skip(f"no real node with CDI here: {why}")
    top = Path(tempfile.mkdtemp(prefix="vgpu-sbx-mig-", dir="/tmp"))
    sb = Sandbox(top / "sandbox")
    try:
        sb.up(Spec(nodes=0, real_node=True, dra=True, mig="dynamic"))  # as docs/mig.md has it
        yield sb
    finally:
        sb.down()
        shutil.rmtree(top, ignore_errors=True)


def _mig(node: Sandbox) -> tuple[FakeMig, str]:
    discovery = FakeDiscovery(layout.layout_of(node).gpus_file)
    assert discovery.mig is not None
    return discovery.mig, discovery.cards()[0].uuid


def _card(node: Sandbox) -> dict[Placement, Any]:
    mig, card = _mig(node)
    return {d.placement: d for d in mig.devices(card)}


def _pods(node: Sandbox, names: list[str]) -> dict[str, dict[str, Any]]:
    items = json.loads(node.kubectl("get", "pods", "-n", "default", "-o", "json").stdout)["items"]
    return {p["metadata"]["name"]: p for p in items if p["metadata"]["name"] in names}


def _claims(node: Sandbox, pods: list[str]) -> dict[str, dict[str, Any]]:
    items = json.loads(node.kubectl("get", "resourceclaims", "-n", "default", "-o", "json").stdout)["items"]
    out = {}
    for c in items:
        for o in c["metadata"].get("ownerReferences") or []:
            if o["name"] in pods:
                out[o["name"]] = c
    return out


def _placement(claim: dict[str, Any]) -> tuple[str, Placement]:
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return next(
        (p.name, pl)
        for p in H100_80GB.profiles
        for pl in p.placements
        if device_name(0, p.name, pl.start) == result["device"]
    )


def test_the_mig_example_runs_its_slices_and_a_plugin_crash_leaks_nothing(node: Sandbox) -> None:
    assert (
        f"{layout.NAME}-vgpu.openaios.io-gpu-0" in node.kubectl("get", "resourceslices", "-o", "name").stdout
    )
    node.kubectl("get", "deviceclass", f"mig.{realdra.DRIVER}")
    pods = [d["metadata"]["name"] for d in yaml.safe_load_all(EXAMPLE.read_text()) if d["kind"] == "Pod"]
    assert sorted(pods) == ["mig-medium", "mig-small"]
    node.kubectl("apply", "-f", str(EXAMPLE))
    try:
        try:
            wait_for(
                lambda: [p["status"].get("phase") for p in _pods(node, pods).values()] == ["Running"] * 2,
                "the example's pods running",
                timeout=180,
                every=2,
            )
        except AssertionError as err:
            described = node.kubectl("describe", "pods", "-n", "default", *pods, check=False).stdout
            plugin = (node.logs_dir / f"{realdra.COMPONENT}.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"{err}\n{described[-4000:]}\n--- plugin\n{plugin}") from err
        claims = _claims(node, pods)
        got = {p: _placement(c) for p, c in claims.items()}
        assert sorted(n for n, _ in got.values()) == ["1g.10gb", "3g.40gb"]
        (a, b) = [pl for _, pl in got.values()]
        assert not a.overlaps(b), got
        made = _card(node)
        assert {(d.profile, pl) for pl, d in made.items()} == set(
            got.values()
        )  # made by the kubelet's prepare
        for pod, claim in claims.items():
            spec = realdra.CDI_DIR / f"{realdra.DRIVER}-claim_{claim['metadata']['uid']}.json"
            env = json.loads(spec.read_text())["devices"][0]["containerEdits"]["env"]
            assert f"NVIDIA_VISIBLE_DEVICES={made[got[pod][1]].uuid}" in env, env

        # the plugin killed mid-way, an instance leaked on the card (made, no claim names it)
        mig, card = _mig(node)
        free = next(
            pl for pl in H100_80GB.profile("1g.10gb").placements if not any(pl.overlaps(x) for x in made)
        )
        mig.create(card, "1g.10gb", free.start)
        realdra.kill_and_restart(node)
        wait_for(lambda: free not in _card(node), "the leaked instance reclaimed", timeout=60, every=1)
        assert {pl: d.uuid for pl, d in _card(node).items()} == {pl: d.uuid for pl, d in made.items()}
        started = {p: s["status"]["containerStatuses"][0] for p, s in _pods(node, pods).items()}
        assert all(s["restartCount"] == 0 and "running" in s["state"] for s in started.values()), started
    finally:
        node.kubectl("delete", "-f", str(EXAMPLE), "--wait=true", "--timeout=120s", timeout=150, check=False)
    wait_for(
        lambda: _card(node) == {}, "every instance destroyed once the pods are gone", timeout=120, every=1
    )
