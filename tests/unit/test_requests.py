"""Request parsing (contract 1, docs/contracts.md): defaults, API-server quantities, errors
naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from vgpu.core.config import SchedulerConfig
from vgpu.core.errors import RequestError
from vgpu.core.requests import asks_for_vgpu, parse_pod, parse_quantity

CFG = SchedulerConfig()


def pod(
    *containers: dict[str, Any],
    init: tuple[dict[str, Any], ...] = (),
    annotations: dict[str, str] | None = None,
):
    return {
        "metadata": {"name": "p", "annotations": annotations or {}},
        "spec": {"containers": list(containers), "initContainers": list(init)},
    }


def ctr(name: str = "main", **limits: Any) -> dict[str, Any]:
    return {
        "name": name,
        "resources": {"limits": {"nvidia.com/" + k.replace("_", "-"): v for k, v in limits.items()}},
    }


@pytest.mark.parametrize(
    ("text", "value"),
    [("3000", 3000), ("3k", 3000), ("1e3", 1000), ("1Ki", 1024), (7, 7), ("2000m", 2), ("0", 0)],
)
def test_quantities_parse_as_the_api_server_writes_them(text: str | int, value: int) -> None:
    assert parse_quantity(text, "f") == value


@pytest.mark.parametrize("text", ["1.5", "500m", "abc", "3 GB", True, ""])
def test_a_quantity_that_is_not_a_whole_number_is_rejected_naming_the_field(text: Any) -> None:
    with pytest.raises(RequestError) as info:
        parse_quantity(text, "spec.containers[0].resources.limits[nvidia.com/gpumem]")
    assert info.value.field.endswith("[nvidia.com/gpumem]")


def test_only_gpu_means_the_whole_card() -> None:
    req = parse_pod(pod(ctr(gpu=2)), CFG)
    (c,) = req.containers
    assert (c.count, c.memory_mib, c.memory_percent, c.cores) == (2, None, 100, 0)
    assert c.memory_on(80000) == 80000


def test_configured_defaults_apply_when_memory_and_cores_are_not_given() -> None:
    (c,) = parse_pod(pod(ctr(gpu=1)), SchedulerConfig(default_mem=4000, default_cores=25)).containers
    assert (c.memory_mib, c.memory_percent, c.cores) == (4000, None, 25)


def test_memory_alone_implies_one_vgpu() -> None:
    (c,) = parse_pod(pod(ctr(gpumem="3k", gpucores=30)), CFG).containers
    assert (c.count, c.memory_mib, c.cores) == (1, 3000, 30)


def test_memory_percentage_scales_with_the_card() -> None:
    (c,) = parse_pod(pod(ctr(gpumem_percentage=25)), CFG).containers
    assert c.memory_on(80000) == 20000 and c.memory_mib is None


def test_cores_of_100_mean_the_card_exclusively() -> None:
    (c,) = parse_pod(pod(ctr(gpu=1, gpucores=100)), CFG).containers
    assert c.exclusive


def test_gpumem_0_reads_as_hami_reads_it_as_not_given_never_as_a_grant_of_0() -> None:
    """HAMi: gpumem 0 is as if it were left out (its defaultMemory, else 100 % of the card). A
    booking of 0 MiB would be a grant the hook reads as no limit at all."""
    (whole,) = parse_pod(pod(ctr(gpu=1, gpumem=0)), CFG).containers
    assert (whole.count, whole.memory_mib, whole.memory_percent) == (1, None, 100)
    assert whole.memory_on(81920) == 81920
    (alone,) = parse_pod(pod(ctr(gpumem="0")), CFG).containers  # no nvidia.com/gpu: one vGPU
    assert (alone.count, alone.memory_percent) == (1, 100)
    (default,) = parse_pod(pod(ctr(gpu=1, gpumem=0)), SchedulerConfig(default_mem=5000)).containers
    assert (default.memory_mib, default.memory_percent) == (5000, None)
    (percent,) = parse_pod(pod(ctr(gpu=1, gpumem=0, gpumem_percentage=25)), CFG).containers
    assert (percent.memory_mib, percent.memory_percent) == (None, 25)


def test_a_container_without_vgpu_resources_asks_for_nothing() -> None:
    req = parse_pod(pod({"name": "side", "resources": {"limits": {"cpu": "1"}}}), CFG)
    assert not req.wants_vgpu
    assert not asks_for_vgpu(pod({"name": "side"}))
    assert asks_for_vgpu(pod(ctr(gpu=1)))


@pytest.mark.parametrize(
    ("limits", "field", "words"),
    [
        ({"gpumem": 1000, "gpumem_percentage": 10}, "[nvidia.com/gpumem-percentage]", "not both"),
        ({"gpucores": 101}, "[nvidia.com/gpucores]", "0..100"),
        ({"gpumem": -5}, "[nvidia.com/gpumem]", "negative"),
        ({"gpu": "1.5"}, "[nvidia.com/gpu]", "whole number"),
        ({"gpumem_percentage": 150}, "[nvidia.com/gpumem-percentage]", "1..100"),
        ({"gpu": 0, "gpumem": 100}, "[nvidia.com/gpu]", "at least one"),
        ({"priority": 3}, "[nvidia.com/priority]", "0 (high) or 1"),
    ],
)
def test_an_impossible_request_is_rejected_naming_the_field(
    limits: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(RequestError) as info:
        parse_pod(pod({"name": "ok"}, ctr("bad", **limits)), CFG)
    assert info.value.field == "spec.containers[1].resources.limits" + field
    assert words in str(info.value)


def test_a_bad_policy_annotation_is_rejected_naming_it() -> None:
    with pytest.raises(RequestError) as info:
        parse_pod(pod(ctr(gpu=1), annotations={"vgpu.openaios.io/node-policy": "pack"}), CFG)
    assert "vgpu.openaios.io/node-policy" in info.value.field


def test_selection_annotations_are_comma_lists() -> None:
    annos = {"nvidia.com/use-gputype": "A100, H200", "nvidia.com/nouse-gpuuuid": "GPU-1,GPU-2"}
    sel = parse_pod(pod(ctr(gpu=1), annotations=annos), CFG).selection
    assert sel.use_types == ("A100", "H200") and sel.nouse_uuids == ("GPU-1", "GPU-2")
    assert sel.why_not("GPU-9", "NVIDIA H200 141GB") is None
    assert sel.why_not("GPU-9", "Tesla T4") is not None
    assert sel.why_not("GPU-1", "NVIDIA A100") is not None


def test_init_containers_run_in_their_own_phases_and_sidecars_stay_for_the_app_phase() -> None:
    init = (ctr("setup", gpu=1), {**ctr("side", gpu=1), "restartPolicy": "Always"}, ctr("warm", gpu=1))
    req = parse_pod(pod(ctr("app", gpu=1), ctr("cpu-only", gpu=0), init=init), CFG)
    names = [[c.name for c in phase] for phase in req.phases()]
    assert names == [["setup"], ["side", "warm"], ["side", "app"]]


@pytest.mark.parametrize(
    ("written", "meant"),
    [
        ("4Gi", 4096),
        ("1Gi", 1024),  # what the API server writes for 1024Mi
        ("4000Mi", 4000),
        ("512Ki", 1),
        ("1Ti", 1048576),
        ("4G", 3815),  # 4,000,000,000 bytes, rounded up
        ("16000M", 15259),
        ("2T", 1907349),
    ],
)
def test_gpumem_written_with_a_memory_suffix_is_refused_with_the_mib_meant(written: str, meant: int) -> None:
    with pytest.raises(RequestError) as info:
        parse_pod(pod(ctr(gpumem=written)), CFG)
    assert info.value.field == "spec.containers[0].resources.limits[nvidia.com/gpumem]"
    assert info.value.message.startswith(
        f"nvidia.com/gpumem is in MiB: did you mean {meant}? ({written!r} reads as"
    )


@pytest.mark.parametrize(("written", "meant"), [(4294967296, 4096), ("4294967296", 4096), ("1048577", 2)])
def test_gpumem_past_one_tib_per_vgpu_is_refused_as_bytes_meant_as_mib(written: Any, meant: int) -> None:
    with pytest.raises(RequestError) as info:
        parse_pod(pod(ctr(gpumem=written)), CFG)
    assert info.value.message.startswith(f"nvidia.com/gpumem is in MiB: did you mean {meant}?")
    assert "at most 1048576 MiB (1 TiB) per vGPU" in info.value.message


@pytest.mark.parametrize(
    ("written", "mib"), [("3k", 3000), ("1048576", 1048576), (143771, 143771), ("1e3", 1000)]
)
def test_gpumem_as_the_api_server_writes_a_plain_number_is_accepted(written: Any, mib: int) -> None:
    """The API server writes a plain 3000 as "3k": a decimal "k" is no unit mistake."""
    (c,) = parse_pod(pod(ctr(gpumem=written)), CFG).containers
    assert c.memory_mib == mib


@pytest.mark.parametrize(
    ("hami", "ours"),
    [
        ("hami.io/node-scheduler-policy", "node_policy"),
        ("hami.io/gpu-scheduler-policy", "gpu_policy"),
    ],
)
def test_hamis_policy_annotations_mean_ours(hami: str, ours: str) -> None:
    for value in ("binpack", "spread", " spread "):
        req = parse_pod(pod(ctr(gpu=1), annotations={hami: value}), CFG)
        assert getattr(req, ours) == value.strip()
    ours_key = "vgpu.openaios.io/" + ours.replace("_", "-")
    agreed = parse_pod(pod(ctr(gpu=1), annotations={hami: "spread", ours_key: "spread"}), CFG)
    assert getattr(agreed, ours) == "spread"
    with pytest.raises(RequestError) as info:
        parse_pod(pod(ctr(gpu=1), annotations={hami: "spread", ours_key: "binpack"}), CFG)
    assert info.value.field == f"metadata.annotations[{hami}]" and ours_key in info.value.message
    with pytest.raises(RequestError) as info:
        parse_pod(pod(ctr(gpu=1), annotations={hami: "topology-aware"}), CFG)
    assert info.value.field == f"metadata.annotations[{hami}]" and "binpack, spread" in info.value.message


def test_hamis_topology_aware_gpu_policy_is_refused_saying_what_placement_does_instead() -> None:
    for value in ("topology-aware", "numa", "mutex", "binpack,numa"):
        with pytest.raises(RequestError) as info:
            parse_pod(pod(ctr(gpu=1), annotations={"hami.io/gpu-scheduler-policy": value}), CFG)
        assert "NVLink-joined cards first" in info.value.message


def test_hamis_vgpu_mode_names_the_kinds_of_card_a_pod_takes() -> None:
    for value, kinds in (
        ("hami-core", {"hami-core"}),
        ("mig", {"mig"}),
        ("mps", {"mps"}),
        ("hami-core,mig", {"hami-core", "mig"}),
        (" mig , mps", {"mig", "mps"}),
        ("mps,unknown", {"mps"}),  # HAMi passes over a name it does not know
    ):
        got = parse_pod(pod(ctr(gpu=1), annotations={"nvidia.com/vgpu-mode": value}), CFG)
        assert got.selection.kinds == kinds, value
        assert got.selection.selective is (kinds != {"hami-core", "mig"})
    unannotated = parse_pod(pod(ctr(gpu=1)), CFG).selection
    assert unannotated.kinds == {"hami-core", "mig"} and not unannotated.selective
    for bad in ("", "hami", "core", "mps2"):
        with pytest.raises(RequestError) as info:
            parse_pod(pod(ctr(gpu=1), annotations={"nvidia.com/vgpu-mode": bad}), CFG)
        assert info.value.field == "metadata.annotations[nvidia.com/vgpu-mode]"
        assert "must name hami-core, mig or mps" in info.value.message


def test_mps_alone_gives_a_container_one_card_naming_the_field_and_the_fix() -> None:
    annos = {"nvidia.com/vgpu-mode": "mps"}
    with pytest.raises(RequestError) as info:
        parse_pod(pod(ctr("a", gpu=1), ctr("b", gpu=2), annotations=annos), CFG)
    assert info.value.field == "spec.containers[1].resources.limits[nvidia.com/gpu]"
    assert "set nvidia.com/gpu to 1" in info.value.message and "MPS daemon" in info.value.message
    # one card per container, several containers: fine; so is mps beside another kind (HAMi's union)
    assert parse_pod(pod(ctr("a", gpu=1), ctr("b", gpu=1), annotations=annos), CFG).selection.kinds == {"mps"}
    parse_pod(pod(ctr(gpu=2), annotations={"nvidia.com/vgpu-mode": "mps,hami-core"}), CFG)


def test_hamis_numa_bind_is_refused_when_true_and_ignored_otherwise_as_hami_does() -> None:
    for ignored in ("false", "0", "no", ""):
        parse_pod(pod(ctr(gpu=2), annotations={"nvidia.com/numa-bind": ignored}), CFG)
    for true in ("true", "1", "TRUE", "t"):
        with pytest.raises(RequestError) as info:
            parse_pod(pod(ctr(gpu=2), annotations={"nvidia.com/numa-bind": true}), CFG)
        assert info.value.field == "metadata.annotations[nvidia.com/numa-bind]"


def test_a_selection_reason_names_the_annotation_and_its_value() -> None:
    annos = {"nvidia.com/use-gputype": "A100,H100", "nvidia.com/nouse-gpuuuid": "GPU-1"}
    sel = parse_pod(pod(ctr(gpu=1), annotations=annos), CFG).selection
    assert (
        sel.why_not("GPU-9", "Tesla T4") == "of model 'Tesla T4', not in nvidia.com/use-gputype 'A100,H100'"
    )
    assert sel.why_not("GPU-1", "NVIDIA A100") == "excluded by nvidia.com/nouse-gpuuuid"
    assert "%" not in (sel.why_not("GPU-9", "Tesla T4") or "")
