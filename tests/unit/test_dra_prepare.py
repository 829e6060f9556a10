"""NodePrepareResources' logic (vgpu/dra/claims.py, prepare.py, cdi.py, state.py) on real files:
a claim's allocation read and checked field by field, the grant, region folder, hook record, CDI
spec and claim record written, idempotent across a new Preparer (a restarted plugin), removed
by unprepare; the checkpoint written whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.dra import allocation_result, asked_for, vgpu_config
from vgpu.core.drarecord import record_path
from vgpu.dra import cdi
from vgpu.dra.claims import ClaimError, plan
from vgpu.dra.prepare import Preparer, StatePaths, folder_name
from vgpu.dra.state import Checkpoint
from vgpu.hookabi.grant import read_grant
from vgpu.node.config import NodeConfig
from vgpu.node.discovery import Card
from vgpu.node.hooklib import install_hook

NODE = "node-a"
UID = "11111111-2222-3333-4444-555555555555"
CARDS = [
    Card(uuid="GPU-a", index=0, model="H200", memory_mib=143771),
    Card(uuid="GPU-b", index=1, model="H200", memory_mib=143771, minor=7),
]
BY_NAME = {"gpu-0": CARDS[0], "gpu-1": CARDS[1]}


def claim(
    results: list[dict[str, Any]] | None = None, uid: str = UID, config: list[Any] | None = None
) -> dict[str, Any]:
    if results is None:
        results = [result()]
    devices: dict[str, Any] = {"results": results}
    if config is not None:
        devices["config"] = config
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": uid},
        "spec": {"devices": asked_for(results)},
        "status": {
            "allocation": {"devices": devices},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}],
        },
    }


def result(**over: Any) -> dict[str, Any]:
    return allocation_result(over.pop("pool", NODE), **over)


def test_a_claim_becomes_shares_of_cards() -> None:
    p = plan(
        claim(
            [result(), result(request="b", device="gpu-1", consumedCapacity={"memory": "1Gi", "cores": 5})]
        ),
        UID,
        BY_NAME,
        NODE,
    )
    assert [(s.request, s.uuid, s.memory_mib, s.cores, s.minor) for s in p.shares] == [
        ("gpu", "GPU-a", 3000, 30, 0),
        ("b", "GPU-b", 1024, 5, 7),
    ]
    assert p.shares[0].share_id == "share-1"
    assert p.reserved_for == ({"resource": "pods", "name": "p", "uid": "pod-1"},)


def test_results_of_other_drivers_are_left_to_them() -> None:
    p = plan(
        claim([result(), result(driver="gpu.nvidia.com", device="x", pool="other", request="nic")]),
        UID,
        BY_NAME,
        NODE,
    )
    assert len(p.shares) == 1


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"consumedCapacity": None}, "results[0].consumedCapacity", "DRAConsumableCapacity"),
        ({"consumedCapacity": {"cores": "3"}}, "consumedCapacity.memory", "missing"),
        ({"consumedCapacity": {"memory": "1000000", "cores": "3"}}, "consumedCapacity.memory", "whole MiB"),
        ({"consumedCapacity": {"memory": "1.5Mi", "cores": "3"}}, "consumedCapacity.memory", "whole"),
        ({"consumedCapacity": {"memory": "1Mi"}}, "consumedCapacity.cores", "missing"),
        ({"consumedCapacity": {"memory": "1Mi", "cores": "101"}}, "consumedCapacity.cores", "1..100"),
        ({"device": "gpu-9"}, "results[0].device", "not a healthy card"),
        ({"pool": "node-b"}, "results[0].pool", "another node"),
        ({"request": ""}, "results[0].request", "missing"),
    ],
)
def test_a_claim_that_cannot_be_held_is_an_error_naming_the_field(change, field, words) -> None:
    r = result(**change)
    if r["consumedCapacity"] is None:
        del r["consumedCapacity"]
    with pytest.raises(ClaimError) as err:
        plan(claim([r]), UID, BY_NAME, NODE)
    assert field in err.value.field and words in str(err.value)
    assert "ResourceClaim ns/c" in str(err.value)


def test_an_unallocated_or_replaced_claim_is_refused() -> None:
    with pytest.raises(ClaimError, match="status.allocation"):
        plan({"metadata": {"namespace": "ns", "name": "c", "uid": UID}, "status": {}}, UID, BY_NAME, NODE)
    with pytest.raises(ClaimError, match="metadata.uid"):
        plan(claim(uid="other"), UID, BY_NAME, NODE)
    with pytest.raises(ClaimError, match="no device of driver"):
        plan(claim([result(driver="x")]), UID, BY_NAME, NODE)


class Claims:
    def __init__(self, *claims: dict[str, Any]) -> None:
        self.claims = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in claims}
        self.reads = 0

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return self.claims.get((namespace, name))


HOOK = Path(__file__).resolve().parents[2] / "native/hook/build/libvgpu.so"


def preparer(tmp_path: Path, claims: Claims, config: NodeConfig | None = None) -> Preparer:
    paths = StatePaths(Path("/"), tmp_path / "state")
    hook = install_hook(HOOK, paths) if HOOK.is_file() else None
    return Preparer(
        NODE, paths, tmp_path / "cdi", config or NodeConfig(), claims, lambda: list(CARDS), hook=hook
    )


def test_prepare_writes_what_allocate_writes_and_answers_cdi_ids(tmp_path: Path) -> None:
    claims = Claims(claim())
    p = preparer(tmp_path, claims)
    devices = p.prepare("ns", UID, "c")
    cdi_id = f"vgpu.openaios.io/claim={UID}-gpu"
    assert devices == [
        {"requestNames": ["gpu"], "poolName": NODE, "deviceName": "gpu-0", "cdiDeviceIDs": [cdi_id]}
    ]
    folder = folder_name(UID, "gpu")
    assert folder == f"dra_{UID}_gpu"
    state = tmp_path / "state"
    grant = read_grant(state / "grants" / f"{folder}.limits")
    assert grant.uuids == ("GPU-a",) and grant.limits == (3000 << 20,) and grant.sm_limits == (30,)
    assert grant.region_path == f"/var/lib/vgpu/containers/{folder}/vgpu.region"
    assert (state / "containers" / folder).stat().st_mode & 0o777 == 0o777
    assert (state / "containers").stat().st_mode & 0o777 == 0o700
    assert (state / "grants" / f"{folder}.hook").is_file()
    spec = json.loads(cdi.spec_path(tmp_path / "cdi", UID).read_text())
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == "vgpu.openaios.io/claim"
    (dev,) = spec["devices"]
    assert dev["name"] == f"{UID}-gpu"
    env = dict(e.split("=", 1) for e in dev["containerEdits"]["env"])
    assert env == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-a",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/var/lib/vgpu/containers/{folder}/vgpu.region",
        "CUDA_TASK_PRIORITY": "1",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "3000m",
        "CUDA_DEVICE_SM_LIMIT_0": "30",
        "CUDA_SM_POLICY": "cap",
    }
    mounts = {m["containerPath"]: m for m in dev["containerEdits"]["mounts"]}
    assert mounts["/etc/vgpu/limits"]["hostPath"] == str(state / "grants" / f"{folder}.limits")
    assert "ro" in mounts["/etc/vgpu/limits"]["options"]
    assert mounts[f"/var/lib/vgpu/containers/{folder}"]["options"][0] == "rw"
    if HOOK.is_file():
        assert mounts["/usr/local/vgpu/libvgpu.so"]["hostPath"].startswith(str(state / "lib"))
        assert mounts["/etc/ld.so.preload"]["hostPath"].endswith("/ld.so.preload")
    record = json.loads(record_path(state, UID).read_text())
    assert record["uid"] == UID and record["namespace"] == "ns" and record["name"] == "c"
    assert record["pods"] == [{"name": "p", "uid": "pod-1"}]
    assert record["requests"] == [
        {
            "request": "gpu",
            "device": "gpu-0",
            "uuid": "GPU-a",
            "memoryBytes": 3000 << 20,
            "cores": 30,
            "shareID": "share-1",
            "priority": 1,
            "smPolicy": "cap",
            "grant": str(state / "grants" / f"{folder}.limits"),
            "regionDir": str(state / "containers" / folder),
        }
    ]


def test_spill_and_elastic_reach_the_claim_as_the_device_plugins_containers(tmp_path: Path) -> None:
    config = NodeConfig(device_memory_scaling=2.0, oversubscribe=True, sm_policy="elastic")
    p = preparer(tmp_path, Claims(claim()), config)
    p.prepare("ns", UID, "c")
    env = dict(
        e.split("=", 1)
        for e in json.loads(cdi.spec_path(tmp_path / "cdi", UID).read_text())["devices"][0]["containerEdits"][
            "env"
        ]
    )
    assert env["CUDA_DEVICE_MEMORY_BUDGET_0"] == "1500m" and env["CUDA_OVERSUBSCRIBE"] == "true"
    assert env["CUDA_SM_POLICY"] == "elastic"


def opaque(source: str, requests: list[str] | None = None, **params: Any) -> dict[str, Any]:
    """An entry of status.allocation.devices.config as kube-scheduler copies it from the class or claim."""
    return {"source": source, **vgpu_config(requests, **params)}


def _env(tmp_path: Path, index: int = 0) -> dict[str, str]:
    spec = json.loads(cdi.spec_path(tmp_path / "cdi", UID).read_text())
    return dict(e.split("=", 1) for e in spec["devices"][index]["containerEdits"]["env"])


def test_the_claims_configuration_over_its_classs_gives_each_request_its_priority_and_policy(
    tmp_path: Path,
) -> None:
    c = claim(
        [result(), result(request="b", device="gpu-1", shareID="s2")],
        config=[
            opaque("FromClass", priority=0, smPolicy="elastic"),  # every request of the claim
            opaque("FromClaim", ["b"], priority=1),  # the claim's own, over the class's, for b
            {"source": "FromClaim", "opaque": {"driver": "gpu.nvidia.com", "parameters": {"x": 1}}},
        ],
    )
    p = preparer(tmp_path, Claims(c))
    p.prepare("ns", UID, "c")
    grants = tmp_path / "state/grants"
    a = read_grant(grants / f"{folder_name(UID, 'gpu')}.limits")
    b = read_grant(grants / f"{folder_name(UID, 'b')}.limits")
    assert (a.priority, a.sm_policy) == (0, 1)
    assert (b.priority, b.sm_policy) == (1, 1)
    assert _env(tmp_path, 0)["CUDA_TASK_PRIORITY"] == "0" and _env(tmp_path, 0)["CUDA_SM_POLICY"] == "elastic"
    assert _env(tmp_path, 1)["CUDA_TASK_PRIORITY"] == "1"
    record = json.loads(record_path(tmp_path / "state", UID).read_text())
    assert [(r["request"], r["priority"], r["smPolicy"]) for r in record["requests"]] == [
        ("gpu", 0, "elastic"),
        ("b", 1, "elastic"),
    ]


def test_a_claim_setting_cap_holds_it_on_an_elastic_node(tmp_path: Path) -> None:
    c = claim(config=[opaque("FromClaim", smPolicy="cap")])
    preparer(tmp_path, Claims(c), NodeConfig(sm_policy="elastic")).prepare("ns", UID, "c")
    grant = read_grant(tmp_path / "state/grants" / f"{folder_name(UID, 'gpu')}.limits")
    assert grant.sm_policy == 0 and _env(tmp_path)["CUDA_SM_POLICY"] == "cap"


def test_a_malformed_configuration_is_refused_naming_the_field_and_nothing_is_written(tmp_path: Path) -> None:
    c = claim(config=[opaque("FromClass"), opaque("FromClaim", priority="high")])
    p = preparer(tmp_path, Claims(c))
    with pytest.raises(ClaimError) as err:
        p.prepare("ns", UID, "c")
    assert err.value.field == "status.allocation.devices.config[1].opaque.parameters.priority"
    assert "0 (high) or 1 (normal)" in str(err.value) and "ResourceClaim ns/c" in str(err.value)
    assert "create it again" in str(err.value)
    assert not (tmp_path / "state/grants").exists() and p.checkpoint.get(UID) is None


def test_a_request_of_two_cards_is_one_cdi_device_holding_both(tmp_path: Path) -> None:
    c = claim([result(), result(device="gpu-1", shareID="s2")])
    devices = preparer(tmp_path, Claims(c)).prepare("ns", UID, "c")
    assert [d["deviceName"] for d in devices] == ["gpu-0", "gpu-1"]
    assert devices[0]["cdiDeviceIDs"] and devices[1]["cdiDeviceIDs"] == []
    grant = read_grant(tmp_path / "state/grants" / f"{folder_name(UID, 'gpu')}.limits")
    assert grant.uuids == ("GPU-a", "GPU-b")


def test_prepare_again_and_after_a_restart_answers_the_same_without_writing(tmp_path: Path) -> None:
    claims = Claims(claim())
    first = preparer(tmp_path, claims)
    answer = first.prepare("ns", UID, "c")
    spec = cdi.spec_path(tmp_path / "cdi", UID)
    stamp = spec.stat().st_mtime_ns, spec.stat().st_ino
    assert first.prepare("ns", UID, "c") == answer
    again = preparer(tmp_path, claims)  # a plugin started again reads its checkpoint
    assert again.prepare("ns", UID, "c") == answer
    assert claims.reads == 1 and again.writes == 0
    assert (spec.stat().st_mtime_ns, spec.stat().st_ino) == stamp


def test_unprepare_removes_everything_and_is_idempotent(tmp_path: Path) -> None:
    p = preparer(tmp_path, Claims(claim()))
    p.prepare("ns", UID, "c")
    p.unprepare(UID)
    state = tmp_path / "state"
    assert not list((state / "grants").glob("dra_*")) and not list((state / "containers").iterdir())
    assert not cdi.spec_path(tmp_path / "cdi", UID).exists() and not record_path(state, UID).exists()
    assert Checkpoint(state).uids() == []
    p.unprepare(UID)  # the kubelet retries: nothing left is no error


def test_unprepare_without_a_checkpoint_finds_the_claims_files_by_uid(tmp_path: Path) -> None:
    p = preparer(tmp_path, Claims(claim()))
    p.prepare("ns", UID, "c")
    (tmp_path / "state/dra/checkpoint.json").write_text("{not json")
    fresh = preparer(tmp_path, Claims())  # the bad checkpoint is set aside
    assert list((tmp_path / "state/dra").glob("checkpoint.json.bad-*"))
    fresh.unprepare(UID)
    assert not list((tmp_path / "state/grants").glob("dra_*"))
    assert not cdi.spec_path(tmp_path / "cdi", UID).exists()


def test_a_claim_missing_from_the_api_server_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ClaimError, match="not found"):
        preparer(tmp_path, Claims()).prepare("ns", UID, "c")


def test_the_checkpoint_is_written_whole_and_read_back(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path)
    cp.put("a", {"devices": [], "folders": ["dra_a_x"], "namespace": "n", "name": "c"})
    doc = json.loads((tmp_path / "dra/checkpoint.json").read_text())
    assert doc == {
        "version": 1,
        "claims": {"a": {"devices": [], "folders": ["dra_a_x"], "namespace": "n", "name": "c"}},
    }
    assert (tmp_path / "dra/checkpoint.json").stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "dra").glob(".*tmp"))
    assert Checkpoint(tmp_path).get("a") == doc["claims"]["a"]
    (tmp_path / "dra/checkpoint.json").write_text(json.dumps({"version": 99, "claims": {}}))
    assert Checkpoint(tmp_path).uids() == []  # a version it does not know: set aside, not guessed


def test_the_device_plugins_sweep_leaves_prepared_claims_alone(tmp_path: Path) -> None:
    from vgpu.node.paths import sweep_container_dirs

    p = preparer(tmp_path, Claims(claim()))
    p.prepare("ns", UID, "c")
    gone_pod = p.paths.containers_dir / "pod-gone_main"
    gone_pod.mkdir()
    removed = sweep_container_dirs(p.paths, live_pod_uids=set(), min_age_s=0, now=2e9)
    assert removed == [gone_pod]  # a pod's folder goes; the claim's does not
    folder = folder_name(UID, "gpu")
    assert (p.paths.containers_dir / folder).is_dir() and p.paths.grant(folder).is_file()


def test_a_prepare_cut_short_is_finished_by_the_next_one(tmp_path: Path) -> None:
    (tmp_path / "cdi").write_text("not a folder")  # the spec cannot be written: cut short after the grant
    claims = Claims(claim())
    p = preparer(tmp_path, claims)
    with pytest.raises(OSError):
        p.prepare("ns", UID, "c")
    folder = folder_name(UID, "gpu")
    assert p.paths.grant(folder).is_file() and Checkpoint(tmp_path / "state").uids() == []
    (tmp_path / "cdi").unlink()
    again = preparer(tmp_path, claims)  # as after a restart: nothing says the claim is prepared
    devices = again.prepare("ns", UID, "c")
    assert devices[0]["cdiDeviceIDs"] == [f"vgpu.openaios.io/claim={UID}-gpu"]
    assert read_grant(p.paths.grant(folder)).limits == (3000 << 20,)
    assert sorted(q.name for q in p.paths.grants_dir.iterdir()) == [f"{folder}.hook", f"{folder}.limits"]
    assert Checkpoint(tmp_path / "state").uids() == [UID]


# -- the tenant boundary: a share is prepared only if it is what the claim's own spec asks for --


def _asking(
    results: list[dict[str, Any]], memory: str | None, cores: str | None, count: int = 1
) -> dict[str, Any]:
    """A claim whose spec asks ``memory``/``cores`` (None: unnamed) of ``count`` cards, given ``results``."""
    c = claim(results)
    exactly = c["spec"]["devices"]["requests"][0]["exactly"]
    exactly["count"] = count
    exactly["capacity"] = {
        "requests": {k: v for k, v in (("memory", memory), ("cores", cores)) if v is not None}
    }
    return c


def test_a_status_that_gives_more_than_the_claims_spec_asks_is_not_prepared() -> None:
    more = _asking([result(consumedCapacity={"memory": "8000Mi", "cores": "30"})], "3000Mi", "30")
    with pytest.raises(ClaimError) as err:
        plan(more, UID, BY_NAME, NODE)
    assert err.value.field == "status.allocation.devices.results[0].consumedCapacity.memory"
    assert "is 8000Mi, but the claim asks for 3000Mi (spec.devices.requests[0].exactly.capacity" in str(
        err.value
    )
    cores = _asking([result(consumedCapacity={"memory": "3000Mi", "cores": "90"})], "3000Mi", "30")
    with pytest.raises(ClaimError, match="consumedCapacity.cores: is 90, but the claim asks for 30"):
        plan(cores, UID, BY_NAME, NODE)
    twice = _asking([result(), result(device="gpu-1", share_id="s2")], "3000Mi", "30", count=1)
    with pytest.raises(ClaimError, match=r"gives request 'gpu' 2 device\(s\), but it asks for 1"):
        plan(twice, UID, BY_NAME, NODE)
    ghost = claim([result(request="ghost")])
    ghost["spec"]["devices"]["requests"][0]["name"] = "gpu"
    with pytest.raises(ClaimError, match="'ghost' is not a request of the claim's spec"):
        plan(ghost, UID, BY_NAME, NODE)


def test_the_cards_request_policy_reads_the_spec_as_the_scheduler_does() -> None:
    # rounded up to whole MiB and percent; the policy's default (1Gi, 100 %) where none is named
    rounded = _asking([result(consumedCapacity={"memory": "2Mi", "cores": "4"})], "1500Ki", "3.5")
    assert plan(rounded, UID, BY_NAME, NODE).shares[0].memory_mib == 2
    defaults = _asking([result(consumedCapacity={"memory": "1Gi", "cores": "100"})], None, None)
    assert plan(defaults, UID, BY_NAME, NODE).shares[0].cores == 100
    over_card = _asking([result(consumedCapacity={"memory": "900000Mi", "cores": "30"})], "900000Mi", "30")
    with pytest.raises(ClaimError, match="is more than the card has"):
        plan(over_card, UID, BY_NAME, NODE)
