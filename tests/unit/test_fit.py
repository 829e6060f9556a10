"""The fit: which cards a pod's vGPUs land on, and why a node is rejected."""

from __future__ import annotations

from typing import Any

from vgpu.core.annotations import Device, NodeInventory
from vgpu.core.config import SchedulerConfig
from vgpu.core.fit import Plan, Rejection, fit_node
from vgpu.core.ledger import Ledger, Usage
from vgpu.core.policy import node_scores
from vgpu.core.requests import parse_pod

CFG = SchedulerConfig()


def card(i: int, mem: int = 10000, split: int = 4, cores: int = 100, **kw: Any) -> Device:
    return Device(
        uuid=f"GPU-{i}",
        index=i,
        model=kw.pop("model", "NVIDIA H200"),
        memory_mib=mem,
        cores=cores,
        split=split,
        **kw,
    )


def node(*cards: Device) -> NodeInventory:
    return NodeInventory(devices=tuple(cards))


def pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = (), **annotations: str):
    annos = {
        k.replace("__", "/")
        .replace("_", "-")
        .replace("nvidia-com", "nvidia.com")
        .replace("vgpu-openaios-io", "vgpu.openaios.io"): v
        for k, v in annotations.items()
    }
    doc = {
        "metadata": {"annotations": annos},
        "spec": {"containers": list(containers), "initContainers": list(init)},
    }
    return parse_pod(doc, CFG)


def ctr(name: str = "main", **limits: Any) -> dict[str, Any]:
    return {
        "name": name,
        "resources": {"limits": {"nvidia.com/" + k.replace("_", "-"): v for k, v in limits.items()}},
    }


def plan(result: Plan | Rejection) -> Plan:
    assert isinstance(result, Plan), result
    return result


def uuids(p: Plan, container: str = "main") -> list[str]:
    c = p.allocation.container(container)
    assert c is not None
    return [d.uuid for d in c.devices]


def test_a_pod_that_fits_gets_the_memory_and_cores_it_asked_for() -> None:
    p = plan(fit_node("n", node(card(0)), {}, pod(ctr(gpumem=3000, gpucores=30))))
    (c,) = p.allocation.containers
    assert (c.name, c.devices[0].memory_mib, c.devices[0].cores) == ("main", 3000, 30)
    assert p.footprint == {"GPU-0": Usage(3000, 30, 1, 0)}


def test_gpu_binpack_fills_the_busiest_card_and_spread_the_emptiest() -> None:
    inv = node(card(0), card(1))
    usage = {"GPU-1": Usage(2000, 0, 1, 0)}
    assert uuids(plan(fit_node("n", inv, usage, pod(ctr(gpumem=1000)), gpu_policy="binpack"))) == ["GPU-1"]
    assert uuids(plan(fit_node("n", inv, usage, pod(ctr(gpumem=1000)), gpu_policy="spread"))) == ["GPU-0"]


def test_the_pod_annotation_overrides_the_cluster_gpu_policy() -> None:
    inv = node(card(0), card(1))
    usage = {"GPU-1": Usage(2000, 0, 1, 0)}
    p = pod(ctr(gpumem=1000), vgpu_openaios_io__gpu_policy="spread")
    assert uuids(plan(fit_node("n", inv, usage, p, gpu_policy="binpack"))) == ["GPU-0"]


def test_each_vgpu_of_a_container_lands_on_a_different_card() -> None:
    p = plan(fit_node("n", node(card(0), card(1), card(2)), {}, pod(ctr(gpu=3, gpumem=100))))
    assert sorted(uuids(p)) == ["GPU-0", "GPU-1", "GPU-2"]
    assert isinstance(fit_node("n", node(card(0), card(1)), {}, pod(ctr(gpu=3, gpumem=100))), Rejection)


def test_a_multi_gpu_container_prefers_cards_joined_by_nvlink_then_on_one_numa_node() -> None:
    cards = (
        card(0, numa=0, links={"GPU-1": "pcie"}),
        card(1, numa=0),
        card(2, numa=1, links={"GPU-3": "nvlink"}),
        card(3, numa=1),
    )
    assert sorted(uuids(plan(fit_node("n", node(*cards), {}, pod(ctr(gpu=2, gpumem=100)))))) == [
        "GPU-2",
        "GPU-3",
    ]
    no_links = tuple(card(i, numa=i // 2 if i != 1 else 1) for i in range(4))
    # GPU-1 moved to NUMA 1 alongside GPU-2 and GPU-3: two of those three share a node
    chosen = uuids(plan(fit_node("n", node(*no_links), {}, pod(ctr(gpu=2, gpumem=100)))))
    assert {c.numa for c in no_links if c.uuid in chosen} == {1}


def test_split_limits_the_number_of_vgpus_on_a_card() -> None:
    inv = node(card(0, split=2))
    assert isinstance(fit_node("n", inv, {"GPU-0": Usage(0, 0, 2, 0)}, pod(ctr(gpumem=1))), Rejection)
    plan(fit_node("n", inv, {"GPU-0": Usage(0, 0, 1, 0)}, pod(ctr(gpumem=1))))


def test_an_exclusive_vgpu_needs_an_empty_card_and_keeps_it_alone() -> None:
    inv = node(card(0))
    assert isinstance(fit_node("n", inv, {"GPU-0": Usage(10, 0, 1, 0)}, pod(ctr(gpucores=100))), Rejection)
    assert isinstance(fit_node("n", inv, {"GPU-0": Usage(10, 100, 1, 1)}, pod(ctr(gpumem=10))), Rejection)
    plan(fit_node("n", inv, {}, pod(ctr(gpucores=100))))


def test_unhealthy_and_unselected_cards_get_nothing() -> None:
    inv = node(card(0, healthy=False), card(1, model="Tesla T4"), card(2))
    assert uuids(plan(fit_node("n", inv, {}, pod(ctr(gpumem=1))))) in (["GPU-1"], ["GPU-2"])
    assert uuids(plan(fit_node("n", inv, {}, pod(ctr(gpumem=1), nvidia_com__use_gputype="t4")))) == ["GPU-1"]
    assert uuids(plan(fit_node("n", inv, {}, pod(ctr(gpumem=1), nvidia_com__nouse_gpuuuid="GPU-1")))) == [
        "GPU-2"
    ]
    r = fit_node("n", inv, {}, pod(ctr(gpumem=1), nvidia_com__use_gputype="A100"))
    assert isinstance(r, Rejection) and r.unresolvable


def test_init_containers_reuse_the_capacity_of_the_app_containers() -> None:
    inv = node(card(0, mem=10000))
    p = pod(ctr("app", gpumem=6000), init=(ctr("setup", gpumem=8000), ctr("warm", gpumem=5000)))
    result = plan(fit_node("n", inv, {}, p))
    assert result.footprint == {"GPU-0": Usage(8000, 0, 1, 0)}
    assert [c.name for c in result.allocation.containers] == ["setup", "warm", "app"]


def test_a_sidecar_init_container_counts_in_every_phase_after_it_starts() -> None:
    inv = node(card(0, mem=10000))
    side = {**ctr("side", gpumem=3000), "restartPolicy": "Always"}
    fits = pod(ctr("app", gpumem=6000), init=(side, ctr("warm", gpumem=7000)))
    assert plan(fit_node("n", inv, {}, fits)).footprint["GPU-0"].memory_mib == 10000
    too_big = pod(ctr("app", gpumem=6000), init=(side, ctr("warm", gpumem=7001)))
    assert isinstance(fit_node("n", inv, {}, too_big), Rejection)


def test_a_rejection_names_the_shortage() -> None:
    r = fit_node("n", node(card(0)), {"GPU-0": Usage(9000, 0, 1, 0)}, pod(ctr(gpumem=3000)))
    assert isinstance(r, Rejection) and not r.unresolvable
    assert "insufficient memory" in r.reason and "3000 MiB" in r.reason


def test_a_memory_shortage_says_the_most_memory_free_on_one_card() -> None:
    """'4 card(s) insufficient memory' alone did not say how far off the request is."""
    inv = node(card(0), card(1), card(2), card(3))
    busy = {"GPU-0": Usage(9000, 0, 1, 0), "GPU-1": Usage(4000, 0, 1, 0), "GPU-2": Usage(7500, 0, 1, 0)}
    busy["GPU-3"] = Usage(1000, 100, 1, 1)  # held exclusively: another reason, its free memory not counted
    r = fit_node("n", inv, busy, pod(ctr(gpumem=6500)))
    assert isinstance(r, Rejection)
    assert r.reason.endswith(
        ": 0 card(s) fit; 3 card(s) insufficient memory (the most free: 6000 MiB), 1 card(s) held exclusively"
    )
    # a container of two vGPUs: the same figure, over the cards short of memory
    r = fit_node("n", inv, busy, pod(ctr(gpu=2, gpumem=5000)))
    assert isinstance(r, Rejection)
    assert "1 card(s) fit; 2 card(s) insufficient memory (the most free: 2500 MiB)" in r.reason


def test_more_memory_than_the_card_has_is_unresolvable() -> None:
    r = fit_node("n", node(card(0)), {}, pod(ctr(gpumem=20000)))
    assert isinstance(r, Rejection) and r.unresolvable


def test_a_card_smaller_than_the_request_is_named_as_such_not_as_full() -> None:
    """Waiting for other pods to leave cannot help there: the reason says so, busy card or not."""
    busy = {"GPU-0": Usage(9000, 0, 1, 0)}
    r = fit_node("n", node(card(0), card(1, mem=40000)), busy, pod(ctr(gpumem=20000)))
    assert isinstance(r, Plan)  # the larger card takes it
    r = fit_node("n", node(card(0), card(1, mem=16000)), busy, pod(ctr(gpumem=20000)))
    assert isinstance(r, Rejection) and r.unresolvable
    assert "2 card(s) smaller than asked (10000 MiB)" not in r.reason
    assert "1 card(s) smaller than asked (10000 MiB)" in r.reason
    assert "1 card(s) smaller than asked (16000 MiB)" in r.reason
    scaled = fit_node("n", node(card(0, cores=50)), {}, pod(ctr(gpumem=100, gpucores=80)))
    assert isinstance(scaled, Rejection) and scaled.unresolvable
    assert "1 card(s) fewer cores than asked (50 percent)" in scaled.reason


def test_a_pod_without_vgpu_fits_any_node_with_an_empty_allocation() -> None:
    p = plan(fit_node("n", node(), {}, pod({"name": "c"})))
    assert p.allocation.containers == () and p.footprint == {}


def test_node_binpack_scores_the_fullest_node_highest_and_spread_the_emptiest() -> None:
    util = {"a": 0.1, "b": 0.5, "c": 0.3}
    assert node_scores(util, "binpack") == {"a": 0, "b": 10, "c": 5}
    assert node_scores(util, "spread") == {"a": 10, "b": 0, "c": 5}
    assert node_scores({"a": 0.2, "b": 0.2}, "spread") == {"a": 10, "b": 10}


def test_the_ledger_frees_what_a_deleted_pod_held() -> None:
    ledger = Ledger()
    ledger.commit("u1", "n", {"GPU-0": Usage(100, 10, 1, 0)})
    ledger.commit("u2", "n", {"GPU-0": Usage(200, 0, 1, 0)})
    assert ledger.usage("n") == {"GPU-0": Usage(300, 10, 2, 0)}
    assert ledger.usage("n", excluding="u1") == {"GPU-0": Usage(200, 0, 1, 0)}
    assert ledger.release("u1") and not ledger.release("u1")
    ledger.commit("u2", "n", {"GPU-1": Usage(5, 0, 1, 0)})  # a new plan replaces the old one
    assert ledger.usage("n") == {"GPU-1": Usage(5, 0, 1, 0)}
    assert ledger.release("u2") and ledger.usage("n") == {} and ledger.nodes() == []


def test_an_init_container_avoids_the_card_a_running_sidecar_already_fills() -> None:
    inv = node(card(0, mem=10000), card(1, mem=10000))
    side = {**ctr("side", gpumem=3000), "restartPolicy": "Always"}
    p = pod(ctr("app", gpumem=1000), init=(side, ctr("warm", gpumem=8000)))
    result = plan(fit_node("n", inv, {}, p, gpu_policy="binpack"))
    assert uuids(result, "warm") != uuids(result, "side")


def test_a_node_with_fewer_cards_than_asked_says_so_whatever_its_cards_hold() -> None:
    """The most decisive reason wins: no amount of waiting gives a 4-card node a fifth card."""
    inv = node(card(0), card(1), card(2), card(3))
    five = pod(ctr(gpu=5, gpumem=3000, gpucores=30))
    for usage in ({}, {"GPU-0": Usage(9000, 0, 1, 0), "GPU-1": Usage(9000, 0, 1, 0)}):
        r = fit_node("n", inv, usage, five)
        assert isinstance(r, Rejection) and r.unresolvable
        assert r.reason == (
            "had too few cards for container 'main', which needs 5 vGPU(s) of 3000 MiB and 30 percent "
            "of the cores each, one per card: the node has only 4 card(s)"
        )
    # among several containers too, the one that can never fit is named, not the others' shortage
    two = pod(ctr("small", gpumem=1000), ctr("wide", gpu=5, gpumem=1))
    r = fit_node("n", inv, {u.uuid: Usage(10000, 0, 1, 0) for u in inv.devices}, two)
    assert isinstance(r, Rejection) and r.unresolvable and "container 'wide'" in r.reason


def test_cards_that_can_never_take_a_vgpu_outrank_cards_that_are_full_now() -> None:
    inv = node(card(0), card(1, mem=40000), card(2, healthy=False))
    busy = {"GPU-1": Usage(39000, 0, 1, 0)}
    r = fit_node("n", inv, busy, pod(ctr(gpu=2, gpumem=20000)))
    assert isinstance(r, Rejection) and r.unresolvable
    assert r.reason.startswith("had only 1 card(s) that can ever take container 'main'")
    assert "1 card(s) smaller than asked (10000 MiB), 1 card(s) unhealthy" in r.reason
    assert "insufficient" not in r.reason
    # once enough cards could take it, the shortage now is the reason, with every card's cause
    r = fit_node(
        "n", node(card(0), card(1, mem=40000), card(2, mem=40000)), busy, pod(ctr(gpu=2, gpumem=20000))
    )
    assert isinstance(r, Rejection) and not r.unresolvable
    assert r.reason.startswith("had no room now for container 'main'")
    assert (
        "1 card(s) fit; 1 card(s) insufficient memory (the most free: 1000 MiB), "
        "1 card(s) smaller than asked (10000 MiB)" in r.reason
    )


def test_a_reason_reads_right_after_kube_schedulers_node_count() -> None:
    """kube-scheduler writes "0/3 nodes are available: 3 <reason>."; each reason starts "node(s)"."""
    from vgpu.core.fit import for_nodes

    full = fit_node("n", node(card(0)), {"GPU-0": Usage(9000, 0, 1, 0)}, pod(ctr(gpumem=3000)))
    assert isinstance(full, Rejection)
    assert f"3 {for_nodes(full.reason)}".startswith("3 node(s) had no room now for container 'main', which")


def test_a_selection_that_rules_out_every_card_names_the_annotation_and_what_the_node_has() -> None:
    inv = node(card(0, model="Tesla T4"), card(1, model="Tesla T4"), card(2))
    r = fit_node("n", inv, {}, pod(ctr(gpumem=1), nvidia_com__use_gputype="A100"))
    assert isinstance(r, Rejection) and r.unresolvable
    assert "2 card(s) of model 'Tesla T4', not in nvidia.com/use-gputype 'A100'" in r.reason
    assert "1 card(s) of model 'NVIDIA H200', not in nvidia.com/use-gputype 'A100'" in r.reason
    r = fit_node("n", inv, {}, pod(ctr(gpumem=1), nvidia_com__use_gpuuuid="GPU-9"))
    assert isinstance(r, Rejection) and r.unresolvable
    assert (
        "3 card(s) not in nvidia.com/use-gpuuuid 'GPU-9' (the node's cards: GPU-0, GPU-1, GPU-2)" in r.reason
    )
    r = fit_node("n", inv, {}, pod(ctr(gpumem=1), nvidia_com__nouse_gputype="T4,H200"))
    assert isinstance(r, Rejection) and "excluded by nvidia.com/nouse-gputype 'T4,H200'" in r.reason
    many = node(*(card(i) for i in range(10)))
    r = fit_node(
        "n", many, {}, pod(ctr(gpumem=1), nvidia_com__nouse_gpuuuid=",".join(f"GPU-{i}" for i in range(10)))
    )
    assert isinstance(r, Rejection) and "excluded by nvidia.com/nouse-gpuuuid" in r.reason
    assert "GPU-7 and 2 more)" in r.reason


def test_no_reason_holds_a_percent_sign_which_kube_schedulers_event_would_garble() -> None:
    """kube-scheduler uses its message as a printf format: "30% cores" became "30%!c(MISSING)ores"."""
    inv = node(card(0, cores=50), card(1, model="Tesla T4"), card(2, healthy=False), card(3, split=1))
    busy = {"GPU-0": Usage(9000, 40, 1, 0), "GPU-3": Usage(10, 0, 1, 0)}
    pods = [
        pod(ctr(gpumem=3000, gpucores=30)),
        pod(ctr(gpumem_percentage=50, gpucores=30)),
        pod(ctr(gpumem_percentage=100, gpucores=100)),
        pod(ctr(gpu=2, gpumem_percentage=30, gpucores=80)),
        pod(ctr(gpu=5, gpumem=1)),
        pod(ctr(gpumem=20000)),
        pod(ctr(gpumem=1), nvidia_com__use_gputype="A100"),
        pod(ctr(gpumem=1), nvidia_com__use_gpuuuid="GPU-9"),
        pod(ctr("a", gpu=2, gpumem=6000), ctr("b", gpu=2, gpumem=6000)),
        pod(ctr("app", gpumem_percentage=60), init=(ctr("setup", gpumem_percentage=90, gpucores=60),)),
    ]
    reasons = []
    for p in pods:
        for usage in ({}, busy):
            for budget in (20_000, 1):
                r = fit_node("n", inv, usage, p, budget=budget)
                if isinstance(r, Rejection):
                    reasons.append(r.reason)
    assert len(reasons) > 20
    assert not [r for r in reasons if "%" in r]
