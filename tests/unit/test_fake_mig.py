"""The fake NVML's MIG (vgpu/node/fake_mig.py): answers and refusals as NVML gives them, and
state that outlives the process holding it."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from vgpu.core.errors import ConfigError
from vgpu.core.mig import Placement
from vgpu.node.fake_nvml import FakeDiscovery
from vgpu.node.mig import (
    IN_USE,
    INSUFFICIENT_RESOURCES,
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    MigRefused,
)

H100 = "GPU-11111111-0000-4000-8000-000000000000"
L40S = "GPU-22222222-0000-4000-8000-000000000000"


def write(
    tmp_path: Path, mig: str = "{mode: enabled, instances: [{profile: 3g.40gb, start: 4}]}", extra: str = ""
) -> Path:
    procs = tmp_path / "procs"
    procs.mkdir(exist_ok=True)
    f = tmp_path / "gpus.yaml"
    f.write_text(
        textwrap.dedent(f"""\
        gpus:
          - uuid: {H100}
            model: NVIDIA H100 80GB HBM3
            memoryMiB: 81559
            mig: {mig}
          - uuid: {L40S}
            model: NVIDIA L40S
            memoryMiB: 46068
        processDir: {procs}
        """)
        + extra
    )
    return f


def own_process_file(procs: Path, key: str) -> Path:
    """A stub-driver process file for this test's own process, holding memory on ``key``."""
    stat = Path("/proc/self/stat").read_text()
    started = stat[stat.rindex(")") + 2 :].split()[19]
    f = procs / f"{os.getpid()}@{started}"
    f.write_text(f"{key} 1048576\n")
    return f


def test_seeded_from_the_file_and_listed_as_nvml_would(tmp_path: Path) -> None:
    d = FakeDiscovery(write(tmp_path))
    mig = d.mig
    assert mig is not None
    assert mig.mode(H100).enabled and not mig.mode(H100).pending_reset
    (dev,) = mig.devices(H100)
    assert dev.profile == "3g.40gb" and dev.placement == Placement(4, 4) and dev.memory_mib == 40448
    assert dev.uuid.startswith("MIG-") and dev.parent == H100 and dev.gpu_instance == 2
    assert (dev.gi_minor, dev.ci_minor) == (3 + 9 * 2, 3 + 9 * 2 + 1)  # mig-minors numbering, gpu 0
    (gi,) = mig.gpu_instances(H100)
    assert gi.profile_id == 9 and gi.compute_instances == (0,)
    assert (tmp_path / "gpus.yaml.mig.json").exists()
    with pytest.raises(MigRefused) as err:
        mig.mode(L40S)
    assert err.value.code == NOT_SUPPORTED


def test_create_and_destroy_survive_a_restart(tmp_path: Path) -> None:
    f = write(tmp_path)
    mig = FakeDiscovery(f).mig
    assert mig is not None
    made = mig.create(H100, "1g.10gb", 0)
    assert made.placement == Placement(0, 1) and made.gpu_instance == 7
    again = FakeDiscovery(f).mig  # a restarted plugin: the card kept its instances
    assert again is not None
    assert {d.uuid for d in again.devices(H100)} == {d.uuid for d in mig.devices(H100)}
    again.destroy(H100, made.gpu_instance)
    assert [d.profile for d in mig.devices(H100)] == ["3g.40gb"]
    # a new instance at the same place is a new device
    assert mig.create(H100, "1g.10gb", 0).uuid != made.uuid


def test_refusals_carry_nvmls_codes(tmp_path: Path) -> None:
    f = write(tmp_path)
    d = FakeDiscovery(f)
    mig = d.mig
    assert mig is not None

    def code(fn: object, *args: object) -> int:
        with pytest.raises(MigRefused) as err:
            fn(*args)  # type: ignore[operator]
        return err.value.code

    assert code(mig.create, H100, "3g.40gb", 4) == INSUFFICIENT_RESOURCES  # occupied
    assert code(mig.create, H100, "1g.20gb", 4) == INSUFFICIENT_RESOURCES  # overlaps 4..7
    assert code(mig.create, H100, "2g.20gb", 1) == INVALID_ARGUMENT  # not a 2g start
    assert code(mig.create, H100, "2g.10gb", 0) == INVALID_ARGUMENT  # no such H100 profile
    assert code(mig.destroy, H100, 5) == NOT_FOUND
    mig.create(H100, "1g.10gb+me", 0)
    assert code(mig.create, H100, "1g.10gb+me", 1) == INSUFFICIENT_RESOURCES  # one +me a card
    # a process on a MIG device: its GI cannot go
    dev = next(x for x in mig.devices(H100) if x.profile == "3g.40gb")
    proc = own_process_file(tmp_path / "procs", dev.uuid)
    assert [p.memory_bytes for p in mig.processes(dev.uuid) or []] == [1048576]
    assert code(mig.destroy, H100, dev.gpu_instance) == IN_USE
    proc.unlink()
    mig.destroy(H100, dev.gpu_instance)
    # a process on the card itself: nothing is made
    proc = own_process_file(tmp_path / "procs", H100)
    assert code(mig.create, H100, "3g.40gb", 4) == IN_USE
    proc.unlink()
    assert mig.create(H100, "3g.40gb", 4).profile == "3g.40gb"


@pytest.mark.parametrize("mode", ["disabled", "pending-enable", "pending-disable"])
def test_no_instance_made_outside_mig_mode(tmp_path: Path, mode: str) -> None:
    mig = FakeDiscovery(write(tmp_path, mig=f"{{mode: {mode}}}")).mig
    assert mig is not None
    with pytest.raises(MigRefused) as err:
        mig.create(H100, "1g.10gb", 0)
    assert err.value.code == NOT_SUPPORTED
    assert mode.removeprefix("pending-") in str(err.value) or mode == "disabled"
    assert mig.devices(H100) == []


@pytest.mark.parametrize(
    ("mig", "field", "says"),
    [
        ("{mode: on}", "gpus[0].mig.mode", "must be one of enabled"),
        (
            "{instances: [{profile: 9g.90gb, start: 0}]}",
            "gpus[0].mig.instances[0].profile",
            "H100 80GB profiles",
        ),
        (
            "{instances: [{profile: 3g.40gb, start: 2}]}",
            "gpus[0].mig.instances[0].start",
            "starts at one of [0, 4]",
        ),
        (
            "{instances: [{profile: 4g.40gb, start: 0}, {profile: 2g.20gb, start: 2}]}",
            "gpus[0].mig.instances[1]",
            "overlaps",
        ),
        (
            "{mode: disabled, instances: [{profile: 7g.80gb, start: 0}]}",
            "gpus[0].mig.instances",
            "no instances",
        ),
        ("[1]", "gpus[0].mig", "must be a mapping"),
    ],
)
def test_bad_mig_sections_name_the_field(tmp_path: Path, mig: str, field: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        FakeDiscovery(write(tmp_path, mig=mig))
    assert err.value.field == field and says in err.value.message


def test_mig_on_a_card_without_a_table_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "gpus.yaml"
    f.write_text(f"gpus: [{{uuid: {L40S}, model: NVIDIA L40S, memoryMiB: 46068, mig: {{mode: enabled}}}}]\n")
    with pytest.raises(ConfigError) as err:
        FakeDiscovery(f)
    assert err.value.field == "gpus[0].mig" and "no MIG profile table for 'NVIDIA L40S'" in err.value.message


def test_state_file_where_the_file_says(tmp_path: Path) -> None:
    state = tmp_path / "elsewhere" / "mig.json"
    mig = FakeDiscovery(write(tmp_path, extra=f"migState: {state}\n")).mig
    assert mig is not None and mig.state_path == state and state.exists()
    with pytest.raises(ConfigError, match="migState"):
        FakeDiscovery(write(tmp_path, extra="migState: relative.json\n"))


def _make_all(path: str, out: object) -> None:
    """In a process of its own: a second holder of the same fake cards (the node's DRA driver,
    say) makes every 1g.10gb it can; ``out`` gets how many it made."""
    mig = FakeDiscovery(Path(path)).mig
    assert mig is not None
    made = 0
    for start in range(7):
        try:
            mig.create(H100, "1g.10gb", start)
            made += 1
        except MigRefused as err:
            assert err.code == INSUFFICIENT_RESOURCES
    out.put(made)  # type: ignore[attr-defined]


def test_two_processes_never_make_one_placement_twice(tmp_path: Path) -> None:
    import multiprocessing

    f = write(tmp_path, mig="{mode: enabled}")
    FakeDiscovery(f)  # seeded once
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    workers = [ctx.Process(target=_make_all, args=(str(f), out)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    assert sum(out.get() for _ in workers) == 7  # each placement made by exactly one of them
    mig = FakeDiscovery(f).mig
    assert mig is not None
    assert sorted(d.placement.start for d in mig.devices(H100)) == list(range(7))
