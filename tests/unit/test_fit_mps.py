"""MPS cards in the fit: only a pod whose nvidia.com/vgpu-mode names mps lands there, and a reason
naming the annotation and the card's mode tells the others why not (vgpu/core/selection.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.test_fit import CFG, ctr, pod
from vgpu.core.annotations import Device, MigDynamic, NodeInventory
from vgpu.core.capacity import quick_fits
from vgpu.core.fit import Plan, Rejection, fit_node
from vgpu.core.requests import parse_pod
from vgpu.core.selection import DEFAULT_KINDS, KIND_HAMI_CORE, KIND_MIG, KIND_MPS, Selection, card_kind

TS = Device("GPU-ts", 0, "NVIDIA H100", 81920, 100, 10)
MPS = Device("GPU-mps", 1, "NVIDIA H100", 81920, 100, 10, sharing="mps")
BOTH = NodeInventory((TS, MPS))


def test_a_cards_kind_is_mig_when_cut_on_demand_mps_when_shared_through_mps_else_hami_core() -> None:
    assert card_kind(TS) == KIND_HAMI_CORE
    assert card_kind(MPS) == KIND_MPS
    assert card_kind(replace(TS, mig_dynamic=MigDynamic("H100-80GB"))) == KIND_MIG
    assert Selection().kinds == DEFAULT_KINDS == {KIND_HAMI_CORE, KIND_MIG}


def landed(result: Plan | Rejection) -> list[str]:
    assert isinstance(result, Plan), result
    return [d.uuid for c in result.allocation.containers for d in c.devices]


@pytest.mark.parametrize("fast", [True, False])
def test_only_an_mps_pod_lands_on_the_mps_card(fast: bool) -> None:
    for policy in ("binpack", "spread"):
        mps = pod(ctr(gpumem=1000, gpucores=30), nvidia_com__vgpu_mode="mps")
        assert landed(fit_node("n", BOTH, {}, mps, policy, fast=fast)) == ["GPU-mps"]
        for other in (pod(ctr(gpumem=1000)), pod(ctr(gpumem=1000), nvidia_com__vgpu_mode="hami-core")):
            assert landed(fit_node("n", BOTH, {}, other, policy, fast=fast)) == ["GPU-ts"]
        either = pod(ctr(gpumem=1000), nvidia_com__vgpu_mode="mps,hami-core")
        assert landed(fit_node("n", BOTH, {}, either, policy, fast=fast)) in (["GPU-ts"], ["GPU-mps"])


def test_the_reasons_name_the_annotation_and_the_cards_mode() -> None:
    only_mps = NodeInventory((MPS,))
    unannotated = fit_node("n", only_mps, {}, pod(ctr(gpumem=1000)))
    assert isinstance(unannotated, Rejection) and unannotated.unresolvable
    assert (
        "1 card(s) shared through MPS (mps), taken only by a pod whose nvidia.com/vgpu-mode names mps"
        in unannotated.reason
    )
    core = fit_node("n", only_mps, {}, pod(ctr(gpumem=1000), nvidia_com__vgpu_mode="hami-core"))
    assert isinstance(core, Rejection)
    assert "1 card(s) shared through MPS (mps), not one nvidia.com/vgpu-mode hami-core takes" in core.reason
    mps = fit_node("n", NodeInventory((TS,)), {}, pod(ctr(gpumem=1000), nvidia_com__vgpu_mode="mps"))
    assert isinstance(mps, Rejection)
    assert (
        "1 card(s) time-sliced under the hook (hami-core), not one nvidia.com/vgpu-mode mps takes"
        in mps.reason
    )


def test_an_mps_card_takes_a_container_of_one_card_only_even_where_the_pod_takes_other_kinds_too() -> None:
    two_mps = NodeInventory((MPS, replace(MPS, uuid="GPU-mps2", index=2)))
    either = pod(ctr(gpu=2, gpumem=1000), nvidia_com__vgpu_mode="mps,hami-core")
    refused = fit_node("n", two_mps, {}, either)
    assert isinstance(refused, Rejection) and "which gives a container one card, not 2" in refused.reason
    assert sorted(
        landed(fit_node("n", NodeInventory((TS, MPS, replace(TS, uuid="GPU-t2", index=2))), {}, either))
    ) == [
        "GPU-t2",
        "GPU-ts",
    ]


def test_the_filters_quick_check_agrees() -> None:
    only_mps = NodeInventory((MPS,))
    for annos, fits in (
        ({}, False),
        ({"nvidia.com/vgpu-mode": "hami-core"}, False),
        ({"nvidia.com/vgpu-mode": "mps"}, True),
    ):
        request = parse_pod(
            {"metadata": {"annotations": annos}, "spec": {"containers": [ctr(gpumem=1000)]}}, CFG
        )
        (c,) = request.containers
        assert quick_fits(only_mps, {}, c, request.selection) is fits, annos
