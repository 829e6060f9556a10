"""The MIG profile tables and the pure rules over them (vgpu/core/mig.py)."""

from __future__ import annotations

import pytest

from vgpu.core.mig import (
    H100_80GB,
    H200_141GB,
    MigError,
    Placement,
    best_placement,
    free_placements,
    profile_of_resource,
    resource_for,
    room_after,
    table_for_model,
)


def test_tables_match_nvidias_published_figures() -> None:
    t = H100_80GB
    assert [p.name for p in t.profiles] == [
        "1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
    ]  # fmt: skip
    # nvidia-smi mig -lgip ids and NVML_GPU_INSTANCE_PROFILE_* constants
    assert [(p.profile_id, p.nvml_profile) for p in t.profiles] == [
        (19, 0), (20, 7), (15, 9), (14, 1), (9, 2), (5, 3), (0, 4),
    ]  # fmt: skip
    assert [p.instances for p in t.profiles] == [7, 1, 4, 3, 2, 1, 1]
    assert [p.starts for p in t.profiles][2:] == [(0, 2, 4, 6), (0, 2, 4), (0, 4), (0,), (0,)]
    me = t.profile("1g.10gb+me")
    assert (me.decoders, me.jpegs, me.ofas) == (1, 1, 1) and t.profile("1g.10gb").ofas == 0
    assert t.profile("7g.80gb").copy_engines == 8 and t.profile("7g.80gb").sms == 132
    assert [p.name for p in H200_141GB.profiles][-1] == "7g.141gb"
    assert H200_141GB.profile("1g.18gb").memory_mib == 16384
    for table in (H100_80GB, H200_141GB):
        for p in table.profiles:
            # every placement lies on the card, and size is the profile's memory slices
            assert all(pl.start + pl.size <= 8 and pl.size == p.memory_slices for pl in p.placements)


def test_table_by_model_name() -> None:
    assert table_for_model("NVIDIA H100 80GB HBM3", 81559) is H100_80GB
    assert table_for_model("NVIDIA H100 PCIe") is H100_80GB
    assert table_for_model("NVIDIA H200", 143771) is H200_141GB
    assert table_for_model("NVIDIA H200 NVL") is H200_141GB
    with pytest.raises(MigError, match="no MIG profile table for 'NVIDIA L40S'.*H100 80GB, H200 141GB"):
        table_for_model("NVIDIA L40S")
    with pytest.raises(MigError, match="H100 NVL"):
        table_for_model("NVIDIA H100 NVL", 95830)  # 94 GB: other profiles
    with pytest.raises(MigError, match="no MIG profile '2g.10gb'; its profiles: 1g.10gb"):
        H100_80GB.profile("2g.10gb")


def test_resource_names_round_trip() -> None:
    assert resource_for("1g.10gb") == "nvidia.com/mig-1g.10gb"
    assert resource_for("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"
    assert profile_of_resource("nvidia.com/mig-1g.10gb.me") == "1g.10gb+me"
    assert profile_of_resource("nvidia.com/mig-3g.40gb") == "3g.40gb"
    assert profile_of_resource("nvidia.com/gpu") is None


def test_free_placements_respect_overlap_and_counts() -> None:
    t = H100_80GB
    assert free_placements(t, "3g.40gb", []) == [Placement(0, 4), Placement(4, 4)]
    held = [("1g.10gb", Placement(5, 1))]
    assert free_placements(t, "3g.40gb", held) == [Placement(0, 4)]
    assert free_placements(t, "7g.80gb", held) == []
    assert free_placements(t, "1g.20gb", held) == [Placement(0, 2), Placement(2, 2), Placement(6, 2)]
    # one +me per card, wherever it is
    assert free_placements(t, "1g.10gb+me", [("1g.10gb+me", Placement(0, 1))]) == []
    # 4g.40gb: one per card even with room for a second
    assert free_placements(t, "4g.40gb", [("4g.40gb", Placement(0, 4))]) == []


def test_best_placement_keeps_large_profiles_possible() -> None:
    t = H100_80GB
    # a lone 1g goes to the top, leaving 4g.40gb (start 0) and 3g.40gb at 0 possible
    assert best_placement(t, "1g.10gb", []) == Placement(6, 1)
    # with a 3g at 0 the only 2g start left is 4
    assert best_placement(t, "2g.20gb", [("3g.40gb", Placement(0, 4))]) == Placement(4, 2)
    # a second 1g packs beside the first rather than breaking another quarter
    first = [("1g.10gb", Placement(6, 1))]
    assert best_placement(t, "1g.10gb", first) == Placement(5, 1)
    after = room_after(t, [*first, ("1g.10gb", Placement(5, 1))])
    assert after[0] == 0 and after[1] == 1  # 7g gone, 4g still possible
    assert best_placement(t, "7g.80gb", first) is None
