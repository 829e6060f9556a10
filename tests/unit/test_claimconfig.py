"""Contract 8, the vgpu DRA driver's opaque configuration (vgpu/core/claimconfig.py): each field
checked and named, other drivers' entries left alone, a later entry over an earlier one, an
entry for a main request applying to its subrequests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.dra import devices, vgpu_config
from vgpu.core.claimconfig import (
    API_VERSION,
    DRIVER,
    KIND,
    ConfigEntryError,
    Entry,
    VgpuConfig,
    check_capacity,
    check_entries,
    for_request,
)

FIELD = "spec.devices.config"


def entry(requests: list[str] | None = None, **params: Any) -> dict[str, Any]:
    return vgpu_config(requests, **params)


def test_an_entry_sets_priority_and_sm_policy_and_leaves_the_rest_unset() -> None:
    [e] = check_entries([entry(["gpu"], priority=0, smPolicy="elastic")], FIELD, "ResourceClaim ns/c")
    assert e == Entry(("gpu",), VgpuConfig(priority=0, sm_policy="elastic"))
    [e] = check_entries([entry()], FIELD, "x")
    assert e == Entry((), VgpuConfig())


def test_other_drivers_entries_are_passed_over_whatever_they_hold() -> None:
    other = {"opaque": {"driver": "gpu.nvidia.com", "parameters": {"priority": "very"}}}
    assert check_entries([other, {"requests": ["gpu"]}], FIELD, "x") == []
    assert check_entries(None, FIELD, "x") == []


@pytest.mark.parametrize(
    ("bad", "field", "words"),
    [
        (entry(priority=2), "[0].opaque.parameters.priority", "0 (high) or 1 (normal)"),
        (entry(priority="0"), "[0].opaque.parameters.priority", "got '0'"),
        (entry(priority=True), "[0].opaque.parameters.priority", "got True"),
        (entry(priority=0.0), "[0].opaque.parameters.priority", "got 0.0"),
        (entry(smPolicy="fair"), "[0].opaque.parameters.smPolicy", "cap (held to its cores) or elastic"),
        (entry(memory="3Gi"), "[0].opaque.parameters.memory", "not a field of VgpuConfig"),
        (entry(apiVersion="v1"), "[0].opaque.parameters.apiVersion", f"must be {API_VERSION}"),
        (entry(kind="GpuConfig"), "[0].opaque.parameters.kind", f"must be {KIND}"),
        ({"opaque": {"driver": DRIVER}}, "[0].opaque.parameters", "must be an object"),
        ({"opaque": {"driver": DRIVER, "parameters": [1]}}, "[0].opaque.parameters", "must be an object"),
        ({**entry(), "requests": "gpu"}, "[0].requests", "must be a list"),
        ({**entry(), "requests": [""]}, "[0].requests", "must name requests"),
        ("gpu", "[0]", "must be an object"),
    ],
)
def test_a_malformed_entry_is_refused_naming_its_field_and_the_fix(bad: Any, field: str, words: str) -> None:
    with pytest.raises(ConfigEntryError) as err:
        check_entries([entry(), bad], FIELD, "ResourceClaim ns/c")
    at = field.replace("[0]", "[1]", 1)
    assert err.value.field == FIELD + at, err.value.field
    assert words in err.value.message
    assert str(err.value).startswith(f"ResourceClaim ns/c: {FIELD}{at}: ")


def test_the_list_itself_must_be_a_list() -> None:
    with pytest.raises(ConfigEntryError, match="must be a list"):
        check_entries({"opaque": {}}, FIELD, "x")
    with pytest.raises(ConfigEntryError, match="must be a list"):
        check_entries("config", FIELD, "x")


def test_a_later_entry_wins_field_by_field_and_requests_choose_where_it_applies() -> None:
    entries = check_entries(
        [
            entry(priority=1, smPolicy="elastic"),  # a class's: every request
            entry(["a"], priority=0),  # the claim's, for a only
            entry(["b"], smPolicy="cap"),
        ],
        FIELD,
        "x",
    )
    assert for_request(entries, "a") == VgpuConfig(priority=0, sm_policy="elastic")
    assert for_request(entries, "b") == VgpuConfig(priority=1, sm_policy="cap")
    assert for_request(entries, "c") == VgpuConfig(priority=1, sm_policy="elastic")
    assert for_request([], "a") == VgpuConfig()


def test_an_entry_for_a_main_request_applies_to_its_subrequests_only() -> None:
    entries = check_entries(
        [entry(["big"], priority=0), entry(["small/h200"], smPolicy="elastic")], FIELD, "x"
    )
    assert for_request(entries, "big/h200") == VgpuConfig(priority=0)
    assert for_request(entries, "small/h200") == VgpuConfig(sm_policy="elastic")
    assert for_request(entries, "small/a100") == VgpuConfig()
    assert for_request(entries, "bigger") == VgpuConfig()


def _requests(**capacity: Any) -> list[dict[str, Any]]:
    return devices(**capacity)["requests"]  # type: ignore[no-any-return]


def test_more_cores_than_a_card_has_is_refused_naming_the_field_and_the_fix() -> None:
    for cores in ("101", "150", 1000, "1k"):
        with pytest.raises(ConfigEntryError) as err:
            check_capacity(_requests(cores=cores), "spec.devices.requests", "ResourceClaim ns/c")
        assert err.value.field == "spec.devices.requests[0].exactly.capacity.requests.cores"
        assert "a card has 100: no node can ever allocate it" in err.value.message
        assert "Ask for 1 to 100 (or count: 2 for two cards)" in err.value.message
    for cores in ("100", "30", "0.5", 1):
        assert check_capacity(_requests(cores=cores), "f", "x") == []


def test_memory_under_1mi_is_admitted_with_a_warning_giving_the_mib_meant() -> None:
    [warning] = check_capacity(_requests(memory="3000"), "spec.devices.requests", "ResourceClaim ns/c")
    assert warning == (
        "ResourceClaim ns/c: spec.devices.requests[0].exactly.capacity.requests.memory: '3000' is 3000 "
        "bytes, less than 1Mi; the card's request policy gives it 1Mi. Did you mean 3000Mi?"
    )
    # as the API server hands it on: canonical, 3000 is 3k
    [warning] = check_capacity(_requests(memory="3k"), "f", "x")
    assert "'3k' is 3000 bytes" in warning and warning.endswith("Did you mean 3000Mi?")
    for memory in ("3000Mi", "1Mi", "2Gi", "1048576"):
        assert check_capacity(_requests(memory=memory), "f", "x") == []


def test_subrequests_are_judged_and_other_classes_left_to_their_drivers() -> None:
    requests = [
        {
            "name": "gpu",
            "firstAvailable": [
                {"name": "big", "deviceClassName": DRIVER, "capacity": {"requests": {"cores": "120"}}},
            ],
        }
    ]
    with pytest.raises(ConfigEntryError) as err:
        check_capacity(requests, "spec.devices.requests", "x")
    assert err.value.field == "spec.devices.requests[0].firstAvailable[0].capacity.requests.cores"
    other = _requests(cores="500")
    other[0]["exactly"]["deviceClassName"] = "gpu.nvidia.com"
    assert check_capacity(other, "f", "x") == []
    assert check_capacity("nonsense", "f", "x") == [] and check_capacity([7, {"exactly": 3}], "f", "x") == []
