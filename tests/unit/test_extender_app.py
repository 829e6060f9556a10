"""The extender's HTTP shape (Flask test client): kube-scheduler's JSON, the webhook, 400s naming the problem.

Binding needs the API server; it is covered by the e2e tests.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest
from flask.testing import FlaskClient

from tests.support import container, pod
from tests.support.dra import claim_template, resource_claim, vgpu_config
from vgpu.core import annotations as ann
from vgpu.core.config import SchedulerConfig
from vgpu.extender.app import create_app
from vgpu.extender.state import SchedulerState

CFG = SchedulerConfig()
NOW = 1_000_000.0


def inventory(n: int, mem: int = 10000, model: str = "NVIDIA H200") -> str:
    return ann.encode_devices(
        ann.NodeInventory(tuple(ann.Device(f"GPU-{n}-{i}", i, model, mem, 100, 4) for i in range(2)))
    )


def node(name: str, raw: str | None) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": {} if raw is None else {ann.DEVICES_ANNOTATION: raw}}}


def lease(node_name: str, age_s: float) -> dict[str, Any]:
    import datetime as dt

    t = dt.datetime.fromtimestamp(NOW - age_s, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"metadata": {"name": f"vgpu-{node_name}"}, "spec": {"renewTime": t, "leaseDurationSeconds": 10}}


def gpu_pod(uid: str = "u1", **limits: Any) -> dict[str, Any]:
    res = {"nvidia.com/" + k.replace("_", "-"): v for k, v in limits.items()}
    return {
        "metadata": {"name": "p", "namespace": "default", "uid": uid},
        "spec": {"containers": [{"name": "main", "resources": {"limits": res}}]},
    }


@pytest.fixture
def state() -> SchedulerState:
    # filter_keep=10: these tests are about the wire shape with every feasible node answered;
    # cutting the answer to the best nodes is tested in test_extender_state.py
    st = SchedulerState(CFG, clock=lambda: NOW, filter_keep=10)
    st.replace_nodes(
        [node("a", inventory(0)), node("b", inventory(1)), node("bad", "{not json"), node("plain", None)]
    )
    st.replace_leases([lease("a", 1), lease("b", 1), lease("bad", 1), lease("plain", 1)])
    st.synced.set()
    st.leader.set()
    return st


@pytest.fixture
def client(state: SchedulerState) -> FlaskClient:
    return create_app(CFG, state).test_client()


def test_filter_answers_in_kube_schedulers_field_names(client: FlaskClient) -> None:
    r = client.post("/filter", json={"Pod": gpu_pod(gpumem=3000), "NodeNames": ["a", "b"]})
    assert r.status_code == 200
    body = r.get_json()
    assert set(body) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert body["NodeNames"] == ["a", "b"] and body["Error"] == ""


def test_filter_rejects_a_node_that_is_full_with_the_shortage_named(
    state: SchedulerState, client: FlaskClient
) -> None:
    state.ledger.commit("other", "a", {"GPU-0-0": ann_usage(9000), "GPU-0-1": ann_usage(9000)})
    body = client.post("/filter", json={"Pod": gpu_pod(gpumem=3000), "NodeNames": ["a", "b"]}).get_json()
    assert body["NodeNames"] == ["b"]
    assert "insufficient memory" in body["FailedNodes"]["a"]


def ann_usage(mem: int) -> Any:
    from vgpu.core.ledger import vgpu_usage

    return vgpu_usage(mem, 0)


def test_a_node_with_a_malformed_inventory_is_skipped_and_counted_while_others_schedule(
    state: SchedulerState, client: FlaskClient
) -> None:
    from vgpu.extender import metrics

    body = client.post(
        "/filter", json={"Pod": gpu_pod(gpumem=1), "NodeNames": ["bad", "a", "plain"]}
    ).get_json()
    assert body["NodeNames"] == ["a"]
    assert "malformed inventory" in body["FailedAndUnresolvableNodes"]["bad"]
    assert "missing" in body["FailedAndUnresolvableNodes"]["plain"]
    assert state.inventory_errors == 1
    assert metrics.INVENTORY_ERRORS.labels("bad")._value.get() >= 1


def test_a_node_whose_plugin_lease_expired_gets_nothing_new(
    state: SchedulerState, client: FlaskClient
) -> None:
    state.apply_lease(lease("b", 60))
    body = client.post("/filter", json={"Pod": gpu_pod(gpumem=1), "NodeNames": ["a", "b"]}).get_json()
    assert body["NodeNames"] == ["a"] and "expired" in body["FailedAndUnresolvableNodes"]["b"]


def test_a_pod_without_vgpu_passes_every_node(client: FlaskClient) -> None:
    pod = {"metadata": {"name": "x", "uid": "x"}, "spec": {"containers": [{"name": "c"}]}}
    body = client.post("/filter", json={"Pod": pod, "NodeNames": ["a", "bad"]}).get_json()
    assert body["NodeNames"] == ["a", "bad"]


def test_prioritize_returns_a_host_priority_list_favouring_the_fuller_node_under_binpack(
    state: SchedulerState, client: FlaskClient
) -> None:
    state.ledger.commit("other", "b", {"GPU-1-0": ann_usage(5000)})
    r = client.post("/prioritize", json={"Pod": gpu_pod(gpumem=1000), "NodeNames": ["a", "b"]})
    assert r.status_code == 200
    assert r.get_json() == [{"Host": "a", "Score": 0}, {"Host": "b", "Score": 10}]
    spread = gpu_pod(gpumem=1000)
    spread["metadata"]["annotations"] = {"vgpu.openaios.io/node-policy": "spread"}
    assert client.post("/prioritize", json={"Pod": spread, "NodeNames": ["a", "b"]}).get_json() == [
        {"Host": "a", "Score": 10},
        {"Host": "b", "Score": 0},
    ]


def test_keys_match_case_insensitively_like_gos_decoder(client: FlaskClient) -> None:
    body = client.post("/filter", json={"pod": gpu_pod(gpumem=1), "nodenames": ["a"]}).get_json()
    assert body["NodeNames"] == ["a"]


@pytest.mark.parametrize(
    ("route", "payload", "words"),
    [
        ("/filter", b"{nope", "not valid JSON"),
        ("/filter", b"", "empty body"),
        ("/filter", b"[]", "JSON object"),
        ("/filter", json.dumps({"NodeNames": ["a"]}).encode(), "Pod"),
        ("/filter", json.dumps({"Pod": gpu_pod(), "NodeNames": "a"}).encode(), "NodeNames"),
        ("/filter", json.dumps({"Pod": gpu_pod(), "NodeNames": ["a", 7]}).encode(), "NodeNames"),
        ("/filter", json.dumps({"Pod": gpu_pod(), "NodeNames": ["a", ""]}).encode(), "NodeNames"),
        ("/filter", json.dumps({"Pod": gpu_pod(), "NodeNames": [["a"]]}).encode(), "NodeNames"),
        ("/filter", json.dumps({"Pod": gpu_pod(), "NodeNames": [None]}).encode(), "NodeNames"),
        ("/filter", json.dumps({"Pod": {"metadata": {}}, "NodeNames": []}).encode(), "Pod.spec"),
        ("/prioritize", json.dumps({"Pod": gpu_pod()}).encode(), "NodeNames"),
        ("/prioritize", b"\xff\xfe", "not valid JSON"),
        ("/bind", json.dumps({"PodName": "p", "PodNamespace": "d", "Node": "a"}).encode(), "PodUID"),
        (
            "/bind",
            json.dumps({"PodName": 3, "PodNamespace": "d", "PodUID": "u", "Node": "a"}).encode(),
            "PodName",
        ),
        ("/webhook/mutate", json.dumps({"request": {"uid": "1"}}).encode(), "request.object"),
        ("/webhook/validate", b"7", "AdmissionReview"),
        ("/webhook/validate-config", json.dumps({"request": {"uid": "1"}}).encode(), "request.object"),
    ],
)
def test_malformed_input_to_any_route_is_a_400_naming_the_problem(
    client: FlaskClient, route: str, payload: bytes, words: str
) -> None:
    r = client.post(route, data=payload, content_type="application/json")
    assert r.status_code == 400
    assert words in r.get_json()["Error"]


def test_an_impossible_pod_that_bypassed_admission_fits_nowhere_with_the_field_named(
    client: FlaskClient,
) -> None:
    body = client.post("/filter", json={"Pod": gpu_pod(gpucores=150), "NodeNames": ["a"]}).get_json()
    assert body["NodeNames"] == [] and "gpucores" in body["FailedAndUnresolvableNodes"]["a"]


def test_verbs_answer_an_error_until_the_state_is_loaded_and_the_lease_held(state: SchedulerState) -> None:
    state.leader.clear()
    client = create_app(CFG, state).test_client()
    body = client.post("/filter", json={"Pod": gpu_pod(gpumem=1), "NodeNames": ["a"]}).get_json()
    assert "standby" in body["Error"]
    assert client.get("/readyz").status_code == 503 and client.get("/healthz").status_code == 200


def review(pod: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "r-1", "operation": operation, "object": pod},
    }


def _configured(kind: str, params: dict[str, Any], driver: str = "vgpu.openaios.io") -> dict[str, Any]:
    """A DRA object of ``kind`` whose one configuration entry carries ``params``."""
    entry = vgpu_config(**params)
    entry["opaque"]["driver"] = driver
    if kind == "DeviceClass":
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": kind,
            "metadata": {"name": "c"},
            "spec": {"config": [entry]},
        }
    return (resource_claim if kind == "ResourceClaim" else claim_template)("c", "ns", config=[entry])


@pytest.mark.parametrize(
    ("kind", "field"),
    [
        ("ResourceClaim", "spec.devices.config[0]"),
        ("ResourceClaimTemplate", "spec.spec.devices.config[0]"),
        ("DeviceClass", "spec.config[0]"),
    ],
)
def test_the_config_webhook_refuses_a_malformed_vgpu_configuration_naming_the_field(
    client: FlaskClient, kind: str, field: str
) -> None:
    bad = review(_configured(kind, {"priority": 5}))
    resp = client.post("/webhook/validate-config", json=bad).get_json()["response"]
    assert resp["allowed"] is False and resp["status"]["code"] == 422
    where = "c" if kind == "DeviceClass" else "ns/c"
    assert resp["status"]["message"] == (
        f"vgpu.openaios.io configuration: {kind} {where}: {field}.opaque.parameters.priority: "
        "must be 0 (high) or 1 (normal), as nvidia.com/priority, got 5"
    )
    good = review(_configured(kind, {"priority": 1, "smPolicy": "elastic"}))
    assert client.post("/webhook/validate-config", json=good).get_json()["response"]["allowed"] is True
    # another driver's entry is its driver's business, and updates are checked as creations
    other = review(_configured(kind, {"priority": 5}, driver="gpu.nvidia.com"), operation="UPDATE")
    assert client.post("/webhook/validate-config", json=other).get_json()["response"]["allowed"] is True
    updated = review(_configured(kind, {"smPolicy": "fair"}), operation="UPDATE")
    assert client.post("/webhook/validate-config", json=updated).get_json()["response"]["allowed"] is False


def test_the_config_webhook_refuses_more_cores_than_a_card_and_warns_of_memory_in_bytes(
    client: FlaskClient,
) -> None:
    over = review(claim_template("t", "ns", cores="150"))
    resp = client.post("/webhook/validate-config", json=over).get_json()["response"]
    assert resp["allowed"] is False
    assert resp["status"]["message"].startswith(
        "vgpu.openaios.io request can never be satisfied: ResourceClaimTemplate ns/t: "
        "spec.spec.devices.requests[0].exactly.capacity.requests.cores: asks for 150 percent of one card"
    )
    small = review(resource_claim("c", "ns", memory="3000"))
    resp = client.post("/webhook/validate-config", json=small).get_json()["response"]
    assert resp["allowed"] is True and "Did you mean 3000Mi?" in resp["warnings"][0]
    fine = review(resource_claim("c", "ns"))
    resp = client.post("/webhook/validate-config", json=fine).get_json()["response"]
    assert resp["allowed"] is True and "warnings" not in resp


def test_the_config_webhook_lets_every_other_object_through(client: FlaskClient) -> None:
    for obj in (gpu_pod(gpu=1), {"kind": "ResourceSlice", "spec": {"config": "anything"}}):
        assert client.post("/webhook/validate-config", json=review(obj)).get_json()["response"]["allowed"]


def test_the_mutating_webhook_routes_vgpu_pods_to_the_vgpu_scheduler(client: FlaskClient) -> None:
    body = client.post("/webhook/mutate", json=review(gpu_pod(gpu=1))).get_json()
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    resp = body["response"]
    assert resp["uid"] == "r-1" and resp["allowed"] and resp["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(resp["patch"]))
    assert patch == [{"op": "add", "path": "/spec/schedulerName", "value": "vgpu-scheduler"}]


def test_the_mutating_webhook_adds_one_gpu_where_only_memory_or_cores_are_given(client: FlaskClient) -> None:
    pod = {
        "metadata": {"name": "p"},
        "spec": {
            "initContainers": [{"name": "i", "resources": {"limits": {"nvidia.com/gpucores": "20"}}}],
            "containers": [
                {
                    "name": "a",
                    "resources": {
                        "limits": {"nvidia.com/gpumem": "1000"},
                        "requests": {"nvidia.com/gpumem": "1000"},
                    },
                },
                {"name": "b", "resources": {"limits": {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "10"}}},
                {"name": "c", "resources": {"limits": {"cpu": "1"}}},
            ],
        },
    }
    resp = client.post("/webhook/mutate", json=review(pod)).get_json()["response"]
    patch = json.loads(base64.b64decode(resp["patch"]))
    assert patch[1:] == [
        {"op": "add", "path": "/spec/initContainers/0/resources/limits/nvidia.com~1gpu", "value": "1"},
        {"op": "add", "path": "/spec/containers/0/resources/limits/nvidia.com~1gpu", "value": "1"},
        {"op": "add", "path": "/spec/containers/0/resources/requests/nvidia.com~1gpu", "value": "1"},
    ]


def test_the_mutating_webhook_leaves_other_pods_and_chosen_schedulers_alone(client: FlaskClient) -> None:
    plain = {"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c"}]}}
    assert "patch" not in client.post("/webhook/mutate", json=review(plain)).get_json()["response"]
    chosen = gpu_pod(gpu=1)
    chosen["spec"]["schedulerName"] = "my-scheduler"
    assert "patch" not in client.post("/webhook/mutate", json=review(chosen)).get_json()["response"]


def test_a_vgpu_pod_addressed_to_another_scheduler_is_admitted_with_a_warning_naming_the_fix(
    client: FlaskClient,
) -> None:
    """A pod left with HAMi's scheduler name would wait Pending without an event: admission says so
    (a warning, not a denial: a node could serve it once it names our scheduler)."""
    hami = gpu_pod(gpu=1, gpumem=3000)
    hami["spec"]["schedulerName"] = "hami-scheduler"
    resp = client.post("/webhook/validate", json=review(hami)).get_json()["response"]
    assert resp["allowed"] is True
    assert resp["warnings"] == [
        "spec.schedulerName: 'hami-scheduler' is not 'vgpu-scheduler', the scheduler that places vGPUs: "
        "a scheduler that does not run leaves the pod Pending with no event, and a vgpu node refuses a pod "
        "that 'vgpu-scheduler' did not place; leave schedulerName out (the webhook then sets "
        "'vgpu-scheduler') or set it to 'vgpu-scheduler'"
    ]
    ours = gpu_pod(gpu=1)
    ours["spec"]["schedulerName"] = "vgpu-scheduler"
    plain = {
        "metadata": {"name": "x"},
        "spec": {"schedulerName": "hami-scheduler", "containers": [{"name": "c"}]},
    }
    for quiet in (ours, plain):  # ours, or a pod that asks for no vGPU: nothing to say
        assert "warnings" not in client.post("/webhook/validate", json=review(quiet)).get_json()["response"]


def test_gpumem_0_is_admitted_as_hami_admits_it(client: FlaskClient) -> None:
    resp = client.post("/webhook/validate", json=review(gpu_pod(gpu=1, gpumem=0))).get_json()["response"]
    assert resp["allowed"] is True, resp


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ({"gpumem": 1000, "gpumem_percentage": 10}, "nvidia.com/gpumem-percentage"),
        ({"gpucores": 101}, "nvidia.com/gpucores"),
        ({"gpumem": -5}, "nvidia.com/gpumem"),
        ({"gpumem": "1.5"}, "nvidia.com/gpumem"),
        ({"gpumem": "lots"}, "nvidia.com/gpumem"),
        ({"gpumem_percentage": 120}, "nvidia.com/gpumem-percentage"),
        ({"gpumem": "4Gi"}, "[nvidia.com/gpumem]: nvidia.com/gpumem is in MiB: did you mean 4096?"),
        ({"gpumem": "4294967296"}, "[nvidia.com/gpumem]: nvidia.com/gpumem is in MiB: did you mean 4096?"),
    ],
)
@pytest.mark.parametrize("reject_unsatisfiable", [False, True])
def test_the_validating_webhook_denies_what_no_node_could_ever_hold_naming_the_field(
    state: SchedulerState, limits: dict[str, Any], field: str, reject_unsatisfiable: bool
) -> None:
    client = create_app(SchedulerConfig(reject_unsatisfiable=reject_unsatisfiable), state).test_client()
    resp = client.post("/webhook/validate", json=review(gpu_pod(**limits))).get_json()["response"]
    assert not resp["allowed"] and resp["status"]["code"] == 422
    message = resp["status"]["message"]
    assert message.startswith("vGPU request can never be satisfied: pod: spec.containers[0]")
    assert field in message


def test_the_validating_webhook_admits_a_pod_larger_than_any_card_or_node_of_today(
    client: FlaskClient,
) -> None:
    """By default: an autoscaler or a batch queue may add the card it needs after the pod exists."""
    for limits in ({"gpumem": 20000}, {"gpu": 3, "gpumem": 1}, {"gpu": 1}, {"gpumem": 100}):
        resp = client.post("/webhook/validate", json=review(gpu_pod(**limits))).get_json()["response"]
        assert resp["allowed"], (limits, resp)


def test_the_validating_webhook_with_reject_unsatisfiable_denies_what_the_cluster_cannot_hold_now(
    state: SchedulerState,
) -> None:
    client = create_app(SchedulerConfig(reject_unsatisfiable=True), state).test_client()

    def answer(**limits: Any) -> dict[str, Any]:
        got: dict[str, Any] = client.post("/webhook/validate", json=review(gpu_pod(**limits))).get_json()
        return got["response"]

    too_big = answer(gpumem=20000)
    assert not too_big["allowed"]
    assert "spec.containers[0].resources.limits[nvidia.com/gpumem]: 20000 MiB" in too_big["status"]["message"]
    assert "largest card has (10000 MiB); ask for at most 10000" in too_big["status"]["message"]
    assert "scheduler.admission.rejectUnsatisfiable" in too_big["status"]["message"]
    too_many = answer(gpu=3, gpumem=1)
    assert not too_many["allowed"]
    assert "spec.containers[0].resources.limits[nvidia.com/gpu]: 3 vGPUs" in too_many["status"]["message"]
    assert answer(gpumem=10000)["allowed"] and answer(gpu=2, gpumem=1)["allowed"]
    # before any node is known there is nothing to compare with: admitted
    state.replace_nodes([])
    assert answer(gpumem=20000)["allowed"]


def test_a_pod_larger_than_every_card_is_refused_by_filter_naming_the_shortage(client: FlaskClient) -> None:
    """What a user sees in FailedScheduling when admission let such a pod in."""
    body = client.post("/filter", json={"Pod": gpu_pod(gpumem=20000), "NodeNames": ["a", "b"]}).get_json()
    assert body["NodeNames"] == [] and body["FailedNodes"] == {}
    for reason in body["FailedAndUnresolvableNodes"].values():
        assert "needs 1 vGPU(s) of 20000 MiB" in reason
        assert "2 card(s) smaller than asked (10000 MiB)" in reason


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({"Pod": gpu_pod(gpumem=1000), "NodeNames": ["a", "b", "bad"]}).encode(),
        b"{not json",
        b"",
    ],
)
def test_a_verb_answers_alike_with_a_content_length_and_with_a_chunked_body(
    state: SchedulerState, body: bytes
) -> None:
    import io

    app = create_app(CFG, state)

    def call(environ: dict[str, Any]) -> tuple[int, bytes]:
        got: list[str] = []
        out = b"".join(app.wsgi_app(environ, lambda status, headers, *_: got.append(status)))
        return int(got[0].split()[0]), out

    base = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/filter",
        "SERVER_NAME": "x",
        "SERVER_PORT": "443",
        "wsgi.url_scheme": "https",
        "CONTENT_TYPE": "application/json",
    }
    sized = call({**base, "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body)})
    # gunicorn hands a chunked body over without a length: Flask reads it to the end
    chunked = call({**base, "wsgi.input": io.BytesIO(body), "wsgi.input_terminated": True})
    assert sized == chunked
    assert sized[0] == (200 if body.startswith(b'{"') else 400)


def test_a_body_over_the_limit_is_refused_with_413_naming_the_limit(state: SchedulerState) -> None:
    import io

    from vgpu.extender.app import MAX_BODY

    environ = {  # as gunicorn hands a request to the app
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/bind",
        "SERVER_NAME": "x",
        "SERVER_PORT": "443",
        "wsgi.url_scheme": "https",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(MAX_BODY + 1),
        "wsgi.input": io.BytesIO(b"{}"),
    }
    got: list[str] = []
    out = b"".join(create_app(CFG, state).wsgi_app(environ, lambda status, headers, *_: got.append(status)))
    assert got[0].startswith("413") and str(MAX_BODY) in json.loads(out)["Error"]


def test_no_reason_the_extender_answers_holds_a_percent_sign(
    state: SchedulerState, client: FlaskClient
) -> None:
    """kube-scheduler's event recorder reads its message as a printf format: a "%" in a reason
    became "%!c(MISSING)" in every FailedScheduling event. Our own reasons hold none; a "%" that a
    user's value or an inventory brings in is answered as the full-width sign."""
    state.ledger.commit("other", "a", {"GPU-0-0": ann_usage(9000), "GPU-0-1": ann_usage(9000)})
    state.apply_lease(lease("b", 60))
    bodies = [
        client.post("/filter", json={"Pod": pod, "NodeNames": ["a", "b", "bad", "plain", "ghost"]}).get_json()
        for pod in (
            gpu_pod(gpumem=3000, gpucores=30),
            gpu_pod(gpumem_percentage=50, gpucores=100),
            gpu_pod(gpu=3, gpumem=1),
            gpu_pod(gpumem_percentage="50%"),  # admission bypassed: the user's value is quoted
            {
                **gpu_pod(gpumem=1),
                "metadata": {"uid": "u", "annotations": {"nvidia.com/use-gputype": "A100%"}},
            },
        )
    ]
    reasons = [
        r for b in bodies for part in ("FailedNodes", "FailedAndUnresolvableNodes") for r in b[part].values()
    ]
    assert len(reasons) == 5 * 5
    assert not [r for r in reasons if "%" in r]
    assert any("'50\uff05'" in r for r in reasons) and any("'A100\uff05'" in r for r in reasons)
    # each reads right after kube-scheduler's count of nodes: "0/5 nodes are available: 2 node(s) had ..."
    assert all(r.startswith(("node(s) had ", "node(s) were not tried: ", "node(s) could ")) for r in reasons)


def test_a_bind_that_lost_its_room_names_the_node_and_the_shortage(state: SchedulerState) -> None:
    class Kube:
        def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
            return gpu_pod("u9", gpumem=3000, gpucores=30)

        def bind_pod(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("no room: must not bind")

    state.kube = Kube()
    state.ledger.commit("other", "a", {"GPU-0-0": ann_usage(9000), "GPU-0-1": ann_usage(9000)})
    client = create_app(CFG, state).test_client()
    args = {"PodName": "p", "PodNamespace": "default", "PodUID": "u9", "Node": "a"}
    error = client.post("/bind", json=args).get_json()["Error"]
    assert error.startswith("node a had no room now for container 'main', which needs 1 vGPU(s) of 3000 MiB")
    assert "%" not in error


def selective_pod(**annotations: str) -> dict[str, Any]:
    pod = gpu_pod(gpumem=1000)
    pod["metadata"]["annotations"] = annotations
    return pod


@pytest.mark.parametrize("reject_unsatisfiable", [False, True])
def test_the_validating_webhook_names_a_selection_that_matches_no_card_of_the_cluster(
    state: SchedulerState, reject_unsatisfiable: bool
) -> None:
    """Admitted with a warning by default (a card of that model may join), denied with the opt-in."""
    client = create_app(SchedulerConfig(reject_unsatisfiable=reject_unsatisfiable), state).test_client()

    def answer(**annotations: str) -> dict[str, Any]:
        body = client.post("/webhook/validate", json=review(selective_pod(**annotations))).get_json()
        resp: dict[str, Any] = body["response"]
        return resp

    for annos, words in (
        (
            {"nvidia.com/use-gputype": "A100"},
            "metadata.annotations[nvidia.com/use-gputype]: 'A100' matches no card of this cluster "
            "(its models: 'NVIDIA H200')",
        ),
        (
            {"nvidia.com/use-gpuuuid": "GPU-nope"},
            "metadata.annotations[nvidia.com/use-gpuuuid]: names no card of this cluster (4 cards known, "
            "of models 'NVIDIA H200')",
        ),
        ({"nvidia.com/nouse-gputype": "h200"}, "together rule out every card of this cluster (4 cards"),
    ):
        resp = answer(**annos)
        if reject_unsatisfiable:
            assert not resp["allowed"] and words in resp["status"]["message"]
            assert "rejectUnsatisfiable" in resp["status"]["message"]
        else:
            assert resp["allowed"] and "status" not in resp
            (warning,) = resp["warnings"]
            assert words in warning and warning.endswith("the pod waits Pending until one joins")
    # no MPS card in the cluster yet: the mode is not the selection's to judge (a node may turn MPS on)
    mps_h200 = {"nvidia.com/use-gputype": "H200", "nvidia.com/vgpu-mode": "mps"}
    for fits in (
        {"nvidia.com/use-gputype": "a100,H200"},
        {"nvidia.com/use-gpuuuid": "GPU-1-1"},
        {},
        mps_h200,
    ):
        resp = answer(**fits)
        assert resp["allowed"] and "warnings" not in resp
    state.replace_nodes([])  # no card known yet: nothing to compare with
    resp = answer(**{"nvidia.com/use-gputype": "A100"})
    assert resp["allowed"] and "warnings" not in resp


# -- the tenant boundary (vgpu/core/boundary.py): the webhook where the admission policies are off --

SCHEDULER = "system:serviceaccount:kube-system:vgpu-scheduler"
PLUGIN = "system:serviceaccount:kube-system:vgpu-device-plugin"
GUARDED = SchedulerConfig(
    scheduler_account=SCHEDULER, node_agent_account=PLUGIN, high_priority_namespaces="serving, infer"
)


def _as(body: dict[str, Any], user: str, node: str = "", old: dict[str, Any] | None = None) -> dict[str, Any]:
    req = body["request"]
    req["userInfo"] = {"username": user}
    if node:
        req["userInfo"]["extra"] = {"authentication.kubernetes.io/node-name": [node]}
    if old is not None:
        req["oldObject"] = old
    return body


def _placed(node: str = "node-a", phase: str = "bound") -> dict[str, Any]:
    p = pod("p", container("main", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}), node=node)
    p["metadata"]["annotations"] = {
        "vgpu.openaios.io/allocation": '{"version":1}',
        "vgpu.openaios.io/phase": phase,
    }
    return p


def _validate(cfg: SchedulerConfig, body: dict[str, Any]) -> dict[str, Any]:
    state = SchedulerState(cfg, clock=lambda: 0.0)
    return create_app(cfg, state).test_client().post("/webhook/validate", json=body).get_json()["response"]


def test_the_webhook_refuses_a_tenant_that_writes_its_own_placement_naming_the_rule() -> None:
    resp = _validate(GUARDED, _as(review(_placed()), "system:serviceaccount:team-a:alice"))
    assert resp["allowed"] is False
    assert resp["status"]["message"].startswith(
        "vgpu.openaios.io/allocation, phase and reason are written by the vgpu scheduler alone, never by "
        "system:serviceaccount:team-a:alice"
    )
    # shrinking or removing it on an update is the same write
    running = _placed(phase="allocated")
    shrunk = copy.deepcopy(running)
    shrunk["metadata"]["annotations"]["vgpu.openaios.io/allocation"] = '{"version":1,"node":"x"}'
    assert _validate(GUARDED, _as(review(shrunk, "UPDATE"), "alice", old=running))["allowed"] is False
    del shrunk["metadata"]["annotations"]["vgpu.openaios.io/phase"]
    assert _validate(GUARDED, _as(review(shrunk, "UPDATE"), "alice", old=running))["allowed"] is False
    # any other change of the pod is the tenant's own
    labelled = copy.deepcopy(running)
    labelled["metadata"]["labels"] = {"team": "a"}
    assert _validate(GUARDED, _as(review(labelled, "UPDATE"), "alice", old=running))["allowed"] is True
    # without the accounts configured the webhook leaves placements to the admission policies
    assert _validate(CFG, _as(review(_placed()), "alice"))["allowed"] is True


def test_the_scheduler_writes_placements_and_the_nodes_plugin_only_its_own_pods_phase() -> None:
    bound = _placed()
    assert _validate(GUARDED, _as(review(bound, "UPDATE"), SCHEDULER, old=pod("p")))["allowed"] is True
    done = copy.deepcopy(bound)
    done["metadata"]["annotations"]["vgpu.openaios.io/phase"] = "allocated"
    ok = _validate(GUARDED, _as(review(done, "UPDATE"), PLUGIN, "node-a", old=bound))
    assert ok["allowed"] is True
    other = _validate(GUARDED, _as(review(done, "UPDATE"), PLUGIN, "node-b", old=bound))
    assert other["status"]["message"] == (
        "the vgpu device plugin of node node-b may write the phase of pods bound to its own node only, "
        "not of a pod on node node-a"
    )
    nameless = _validate(GUARDED, _as(review(done, "UPDATE"), PLUGIN, old=bound))
    assert "(its token names no node)" in nameless["status"]["message"]
    forged = copy.deepcopy(done)
    forged["metadata"]["annotations"]["vgpu.openaios.io/allocation"] = "{}"
    refused = _validate(GUARDED, _as(review(forged, "UPDATE"), PLUGIN, "node-a", old=bound))
    assert refused["status"]["message"].startswith(
        "the vgpu device plugin writes a pod's phase and reason, never"
    )


def test_priority_zero_is_admitted_only_in_the_namespaces_the_admin_lists() -> None:
    def pod_in(namespace: str) -> dict[str, Any]:
        limits = {"nvidia.com/gpu": "1", "nvidia.com/priority": "0"}
        return pod("p", container("main", limits=limits), namespace=namespace)

    resp = _validate(GUARDED, _as(review(pod_in("team-a")), "alice"))
    assert resp["allowed"] is False
    assert resp["status"]["message"] == (
        "nvidia.com/priority: 0 (high priority: every priority-1 container on the card yields to it) is "
        "allowed only in the namespaces the cluster admin lists in the chart value "
        "tenantBoundary.highPriorityNamespaces, and team-a is not one of them: drop it (priority 1 is the "
        "default), or ask the admin to add the namespace"
    )
    assert _validate(GUARDED, _as(review(pod_in("infer")), "alice"))["allowed"] is True
    assert _validate(CFG, _as(review(pod_in("team-a")), "alice"))["allowed"] is False  # none listed: none


def test_a_claims_priority_zero_is_refused_outside_the_listed_namespaces_a_classes_is_the_admins() -> None:
    def check(cfg: SchedulerConfig, kind: str) -> dict[str, Any]:
        state = SchedulerState(cfg, clock=lambda: 0.0)
        client = create_app(cfg, state).test_client()
        body = review(_configured(kind, {"priority": 0}))
        return client.post("/webhook/validate-config", json=body).get_json()["response"]

    claim = check(GUARDED, "ResourceClaim")
    assert claim["allowed"] is False and claim["status"]["message"].startswith("VgpuConfig priority: 0")
    assert check(GUARDED, "DeviceClass")["allowed"] is True
    listed = SchedulerConfig(high_priority_namespaces="ns")
    assert check(listed, "ResourceClaimTemplate")["allowed"] is True


@pytest.mark.parametrize("reject_unsatisfiable", [False, True])
def test_admission_takes_vgpu_mode_mps_and_refuses_it_for_a_container_of_two_cards(
    state: SchedulerState, reject_unsatisfiable: bool
) -> None:
    """No node of this cluster shares a card through MPS yet: the pod is admitted all the same (a
    node may turn MPS on later); only a container of two cards under mps alone can never be held."""
    client = create_app(SchedulerConfig(reject_unsatisfiable=reject_unsatisfiable), state).test_client()

    def answer(mode: str, **limits: Any) -> dict[str, Any]:
        pod = gpu_pod(**limits)
        pod["metadata"]["annotations"] = {"nvidia.com/vgpu-mode": mode}
        got: dict[str, Any] = client.post("/webhook/validate", json=review(pod)).get_json()["response"]
        return got

    assert answer("mps", gpu=1, gpumem=1000, gpucores=30)["allowed"] is True
    assert answer("mps,hami-core", gpu=2)["allowed"] is True
    refused = answer("mps", gpu=2)
    assert not refused["allowed"] and refused["status"]["code"] == 422
    message = refused["status"]["message"]
    assert "pod: spec.containers[0].resources.limits[nvidia.com/gpu]" in message
    assert "set nvidia.com/gpu to 1" in message
