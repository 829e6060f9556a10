"""The Helm chart rendered offline by the real helm: lint, Kubernetes 1.33 schemas, and what the
objects say for the values given. Needs helm from `make setup` ($VGPU_BIN_DIR/current/helm)."""

from __future__ import annotations

import argparse
import base64
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chart_support import (
    CHART,
    KUBE_VERSION,
    NS,
    SCENARIOS,
    container,
    find,
    helm,
    kube_scheduler_checks,
    render,
    scenario_id,
    template,
)
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from vgpu.core.annotations import LEASE_PREFIX
from vgpu.core.config import load_config
from vgpu.core.mig import mig_resources
from vgpu.deviceplugin import cli as plugin_cli
from vgpu.extender import cli as extender_cli
from vgpu.node.config import NodeConfig, parse_node_config


def scheduler_config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = find(objs, "ConfigMap", "vgpu-scheduler-config")
    return yaml.safe_load(cm["data"]["scheduler-config.yaml"])


def checkable_config(objs: list[dict[str, Any]], tmp: Path) -> Path:
    """The rendered KubeSchedulerConfiguration written to ``tmp``, with the Secrets the
    kube-scheduler container mounts (its client certificate and key) written there as the pod
    mounts them and the config's paths pointing at them, so the real kube-scheduler can build
    its extender client."""
    text = find(objs, "ConfigMap", "vgpu-scheduler-config")["data"]["scheduler-config.yaml"]
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container(pod, "kube-scheduler")["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        data = find(objs, "Secret", secret["secretName"])["data"]
        folder = tmp / mount["name"]
        folder.mkdir()
        for item in secret["items"]:
            (folder / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
        text = text.replace(mount["mountPath"] + "/", f"{folder}/")
    config = tmp / "scheduler-config.yaml"
    config.write_text(text)
    return config


def node_config(objs: list[dict[str, Any]], node: str) -> NodeConfig:
    """What the real device plugin makes of the rendered node settings on ``node``."""
    cm = find(objs, "ConfigMap", "vgpu-device-plugin-config")
    return parse_node_config(cm["data"]["node-config.yaml"], node, "chart")


def test_the_chart_has_a_ci_values_file_for_each_install_scenario() -> None:
    assert {scenario_id(p) for p in SCENARIOS} >= {
        "defaults",
        "virtual-memory",
        "custom-split-scaling",
        "no-webhook",
        "custom-registry",
        "driverless-node",
    }


@pytest.mark.parametrize("values", SCENARIOS, ids=scenario_id)
def test_helm_lint_strict_passes_for_the_scenario(values: Path) -> None:
    result = helm("lint", "--strict", str(CHART), "-f", str(values), "--kube-version", KUBE_VERSION)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("values", SCENARIOS, ids=scenario_id)
def test_every_object_of_the_scenario_is_valid_against_the_kubernetes_1_33_schemas(values: Path) -> None:
    objs = render("-f", str(values))
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "DaemonSet", "ConfigMap", "Service", "ClusterRole", "Secret"} <= kinds
    for obj in objs:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_the_schema_check_rejects_a_misspelt_field_so_the_scenario_checks_can_fail() -> None:
    deployment = find(render(), "Deployment", "vgpu-scheduler")
    deployment["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_kube_scheduler_follows_the_cluster_version_without_its_build_suffix() -> None:
    objs = render(kube_version="v1.33.4+k3s1")
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    assert container(pod, "kube-scheduler")["image"] == "registry.k8s.io/kube-scheduler:v1.33.4"


def test_a_pinned_kube_scheduler_tag_wins_over_the_cluster_version() -> None:
    objs = render("--set", "scheduler.kubeScheduler.imageTag=v1.32.9", kube_version="1.33.2")
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    assert container(pod, "kube-scheduler")["image"] == "registry.k8s.io/kube-scheduler:v1.32.9"


def test_a_digest_pins_each_image_in_place_of_its_tag() -> None:
    digests = {name: "sha256:" + char * 64 for name, char in (("ks", "a"), ("ext", "b"), ("dp", "c"))}
    objs = render(
        "--set",
        f"scheduler.kubeScheduler.image.digest={digests['ks']},scheduler.extender.image.digest={digests['ext']}",
        "--set",
        f"devicePlugin.image.digest={digests['dp']},global.imageRegistry=mirror.example:5000/m",
    )
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    plugin = find(objs, "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    assert (
        container(pod, "kube-scheduler")["image"] == f"mirror.example:5000/m/kube-scheduler@{digests['ks']}"
    )
    assert container(pod, "extender")["image"] == f"mirror.example:5000/m/vgpu/scheduler@{digests['ext']}"
    assert (
        container(plugin, "device-plugin")["image"]
        == f"mirror.example:5000/m/vgpu/device-plugin@{digests['dp']}"
    )
    # without a digest: by tag, as before
    plain = find(render(), "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    assert container(plain, "device-plugin")["image"] == "docker.io/vgpu/device-plugin:0.1.0"


def test_kube_scheduler_retries_refused_pods_every_ten_seconds_unless_turned_off() -> None:
    """A pod the extender refused must not wait kube-scheduler's 5 minutes once room frees."""

    def command(*args: str) -> list[str]:
        pod = find(render(*args), "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
        return list(container(pod, "kube-scheduler")["command"])

    assert "--pod-max-in-unschedulable-pods-duration=10s" in command()
    assert "--pod-max-in-unschedulable-pods-duration=45s" in command(
        "--set", "scheduler.kubeScheduler.retryRefusedSeconds=45"
    )
    off = command("--set", "scheduler.kubeScheduler.retryRefusedSeconds=0")
    assert not any(a.startswith("--pod-max-in-unschedulable-pods-duration") for a in off)


def test_percentage_of_nodes_to_score_reaches_the_profile_only_when_set(tmp_path: Path) -> None:
    assert "percentageOfNodesToScore" not in scheduler_config(render())["profiles"][0]
    objs = render("--set", "scheduler.kubeScheduler.percentageOfNodesToScore=100")
    cfg = scheduler_config(objs)
    assert cfg["profiles"][0]["percentageOfNodesToScore"] == 100
    # and the real kube-scheduler takes it
    result = kube_scheduler_checks(checkable_config(objs, tmp_path), [], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    written = yaml.safe_load((tmp_path / "written.yaml").read_text())
    assert written["profiles"][0]["percentageOfNodesToScore"] == 100


def test_kube_scheduler_calls_the_extender_over_https_with_the_release_ca() -> None:
    objs = render()
    cfg = scheduler_config(objs)
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert cfg["leaderElection"]["leaderElect"] is True
    assert [p["schedulerName"] for p in cfg["profiles"]] == ["vgpu-scheduler"]
    (ext,) = cfg["extenders"]
    assert ext["urlPrefix"].startswith("https://")
    assert ext["enableHTTPS"] is True and ext["tlsConfig"]["insecure"] is False
    assert ext["nodeCacheCapable"] is True
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == ("filter", "prioritize", "bind")
    managed = {r["name"]: r["ignoredByScheduler"] for r in ext["managedResources"]}
    assert managed == {
        "nvidia.com/gpu": True,
        "nvidia.com/gpumem": True,
        "nvidia.com/gpumem-percentage": True,
        "nvidia.com/gpucores": True,
        "nvidia.com/priority": True,
        **dict.fromkeys(mig_resources(), True),  # a pod asking for MIG devices alone reaches it too
    }
    secret = find(objs, "Secret", "vgpu-extender-tls")
    assert ext["tlsConfig"]["caData"] == secret["data"]["ca.crt"]


def _certs(objs: list[dict[str, Any]]) -> tuple[x509.Certificate, x509.Certificate]:
    data = find(objs, "Secret", "vgpu-extender-tls")["data"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(data["ca.crt"]))
    crt = x509.load_pem_x509_certificate(base64.b64decode(data["tls.crt"]))
    return ca, crt


def test_the_serving_certificate_is_signed_by_the_ca_every_client_is_given() -> None:
    objs = render()
    ca, crt = _certs(objs)
    key = ca.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)  # cheaper handshakes than RSA (see _helpers.tpl)
    assert isinstance(key.curve, ec.SECP256R1)
    assert isinstance(crt.public_key(), ec.EllipticCurvePublicKey)
    assert crt.signature_hash_algorithm is not None
    key.verify(crt.signature, crt.tbs_certificate_bytes, ec.ECDSA(crt.signature_hash_algorithm))
    assert crt.issuer == ca.subject
    sans = crt.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "vgpu-extender.kube-system.svc" in sans.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    ca_b64 = find(objs, "Secret", "vgpu-extender-tls")["data"]["ca.crt"]
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (hook,) = find(objs, kind, "vgpu-kube-system")["webhooks"]
        assert hook["clientConfig"]["caBundle"] == ca_b64
        assert hook["clientConfig"]["service"]["name"] == "vgpu-extender"


def test_only_kube_schedulers_client_certificate_may_call_the_scheduling_verbs() -> None:
    """kube-scheduler gets a client certificate of the release's CA, and only it (never the
    extender's serving key); the extender takes that CA for its verbs. Off, neither is rendered."""
    objs = render()
    data = find(objs, "Secret", "vgpu-extender-tls")["data"]
    ca, _ = _certs(objs)
    client = x509.load_pem_x509_certificate(base64.b64decode(data["client.crt"]))
    assert client.issuer == ca.subject and client.signature_hash_algorithm is not None
    key = ca.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    key.verify(client.signature, client.tbs_certificate_bytes, ec.ECDSA(client.signature_hash_algorithm))
    usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH in usage
    (ext,) = scheduler_config(objs)["extenders"]
    tls = ext["tlsConfig"]
    assert (tls["certFile"], tls["keyFile"]) == (
        "/etc/vgpu/extender-client/tls.crt",
        "/etc/vgpu/extender-client/tls.key",
    )
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    mount = next(
        m for m in container(pod, "kube-scheduler")["volumeMounts"] if m["name"] == "extender-client"
    )
    assert mount["mountPath"] == "/etc/vgpu/extender-client" and mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "extender-client")["secret"]
    assert volume["secretName"] == "vgpu-extender-tls"
    assert {i["key"]: i["path"] for i in volume["items"]} == {
        "client.crt": "tls.crt",
        "client.key": "tls.key",
    }
    assert "--client-ca-file=/etc/vgpu/tls/ca.crt" in container(pod, "extender")["command"]

    # a release upgraded with --reuse-values keeps the values of a chart without the key: on
    absent = render("--set", "scheduler.extender.clientAuth=null")
    assert "certFile" in scheduler_config(absent)["extenders"][0]["tlsConfig"]
    assert "client.crt" in find(absent, "Secret", "vgpu-extender-tls")["data"]

    off = render("--set", "scheduler.extender.clientAuth=false")
    assert not {"client.crt", "client.key"} & set(find(off, "Secret", "vgpu-extender-tls")["data"])
    (ext,) = scheduler_config(off)["extenders"]
    assert "certFile" not in ext["tlsConfig"] and "keyFile" not in ext["tlsConfig"]
    pod = find(off, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    assert all(v["name"] != "extender-client" for v in pod["volumes"])
    assert not [a for a in container(pod, "extender")["command"] if a.startswith("--client-ca-file")]


def test_the_certificate_lasts_the_days_asked_for() -> None:
    _, crt = _certs(render("--set", "webhook.certificate.validityDays=30"))
    days = (crt.not_valid_after_utc - crt.not_valid_before_utc).days
    assert days == 30


def test_every_render_makes_a_new_certificate_and_rolls_the_scheduler_pods() -> None:
    first, second = render(), render()
    assert _certs(first)[1].serial_number != _certs(second)[1].serial_number
    checksums = [
        find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["metadata"]["annotations"][
            "checksum/tls"
        ]
        for objs in (first, second)
    ]
    assert checksums[0] != checksums[1]
    # the device plugin does not use the certificate: it is not restarted for it
    ds = [find(objs, "DaemonSet", "vgpu-device-plugin")["spec"]["template"] for objs in (first, second)]
    assert ds[0] == ds[1]


def test_the_extender_runs_with_the_contracts_command_line() -> None:
    pod = find(render(), "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    cmd = container(pod, "extender")["command"]
    assert cmd[:2] == ["vgpu", "extender"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in cmd[2:])
    assert flags == {
        "listen": "0.0.0.0:8443",
        "cert-file": "/etc/vgpu/tls/tls.crt",
        "key-file": "/etc/vgpu/tls/tls.key",
        "client-ca-file": "/etc/vgpu/tls/ca.crt",
        "metrics-listen": "0.0.0.0:9395",
        "namespace": NS,
        "scheduler-name": "vgpu-scheduler",
        "node-policy": "binpack",
        "gpu-policy": "spread",
        "default-mem": "0",
        "default-cores": "0",
        "reject-unsatisfiable": "false",
        "scheduler-account": f"system:serviceaccount:{NS}:vgpu-scheduler",
        "node-agent-account": f"system:serviceaccount:{NS}:vgpu-device-plugin",
        "high-priority-namespaces": "",
    }
    mounts = {m["mountPath"]: m["name"] for m in container(pod, "extender")["volumeMounts"]}
    assert mounts["/etc/vgpu/tls"] == "extender-tls"


@pytest.mark.parametrize("values", SCENARIOS, ids=scenario_id)
def test_the_extender_command_line_is_accepted_by_the_real_extender_settings(values: Path) -> None:
    pod = find(render("-f", str(values)), "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    parser = argparse.ArgumentParser()
    extender_cli.register(parser)
    args = parser.parse_args(container(pod, "extender")["command"][2:])
    config = load_config({k: getattr(args, k) for k in extender_cli.FLAGS}, env={})
    assert config.scheduler_name == "vgpu-scheduler" and config.namespace == NS
    assert config.cert_file and config.key_file


def test_extender_values_reach_its_settings() -> None:
    objs = render(
        "-f", str(CHART / "ci" / "custom-split-scaling-values.yaml"), "--set", "scheduler.extender.workers=3"
    )
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    parser = argparse.ArgumentParser()
    extender_cli.register(parser)
    args = parser.parse_args(container(pod, "extender")["command"][2:])
    config = load_config({k: getattr(args, k) for k in extender_cli.FLAGS}, env={})
    assert (config.node_policy, config.gpu_policy) == ("spread", "binpack")
    assert (config.default_mem, config.default_cores, config.workers) == (4096, 25, 3)


def test_reject_unsatisfiable_reaches_the_extender_settings_and_only_as_a_boolean() -> None:
    def settings(*args: str) -> bool:
        pod = find(render(*args), "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
        parser = argparse.ArgumentParser()
        extender_cli.register(parser)
        parsed = parser.parse_args(container(pod, "extender")["command"][2:])
        return load_config({k: getattr(parsed, k) for k in extender_cli.FLAGS}, env={}).reject_unsatisfiable

    assert settings() is False
    assert settings("--set", "scheduler.admission.rejectUnsatisfiable=true") is True
    refused = template("--set-string", "scheduler.admission.rejectUnsatisfiable=yes")
    assert refused.returncode != 0
    assert "/scheduler/admission/rejectUnsatisfiable" in refused.stderr and "want boolean" in refused.stderr


def test_extender_extra_env_reaches_only_the_extender_container() -> None:
    default = find(render(), "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    assert "env" not in container(default, "extender")
    objs = render(
        "--set", "scheduler.extender.extraEnv[0].name=VGPU_EXTENDER_SHORT_PARSER",
        "--set-string", "scheduler.extender.extraEnv[0].value=0",
    )  # fmt: skip
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    assert container(pod, "extender")["env"] == [{"name": "VGPU_EXTENDER_SHORT_PARSER", "value": "0"}]
    assert "env" not in container(pod, "kube-scheduler")


def test_without_a_service_proxy_the_scheduler_pod_uses_the_nodes_network_and_its_own_extender() -> None:
    """scheduler.hostNetwork, kubeScheduler.port/extraEnv and extender.route=pod, as the sandbox's
    real node runs the chart's scheduler pod: both containers reach the API server at the address
    given, kube-scheduler serves its health on the port chosen and calls the extender of its own
    pod at 127.0.0.1, still verifying the release's CA, which the serving certificate names."""
    objs = render("-f", str(CHART / "ci" / "driverless-node-values.yaml"))
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    ks, ext = container(pod, "kube-scheduler"), container(pod, "extender")
    assert "--secure-port=20259" in ks["command"]
    assert [p["containerPort"] for p in ks["ports"]] == [20259]
    assert ks["livenessProbe"]["httpGet"]["port"] == "healthz"
    for c in (ks, ext):
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env == {"KUBERNETES_SERVICE_HOST": "10.0.0.10", "KUBERNETES_SERVICE_PORT": "6443"}, c["name"]
    assert "--listen=0.0.0.0:20443" in ext["command"]
    (cfg_ext,) = scheduler_config(objs)["extenders"]
    assert cfg_ext["urlPrefix"] == "https://127.0.0.1:20443"
    assert cfg_ext["tlsConfig"]["insecure"] is False
    assert cfg_ext["tlsConfig"]["caData"] == find(objs, "Secret", "vgpu-extender-tls")["data"]["ca.crt"]
    _, crt = _certs(objs)
    sans = crt.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    # the default stays: the Service, the standard port, the pod's own network
    default = find(render(), "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    assert (
        "hostNetwork" not in default
        and "--secure-port=10259" in container(default, "kube-scheduler")["command"]
    )


def test_kube_scheduler_reaches_only_the_ready_extender_through_its_service() -> None:
    objs = render()
    (ext,) = scheduler_config(objs)["extenders"]
    assert ext["urlPrefix"] == "https://vgpu-extender.kube-system.svc:443"
    service = find(objs, "Service", "vgpu-extender")["spec"]
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    # readiness is the extender's /readyz, which is 503 on a standby replica
    assert container(pod["spec"], "extender")["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_the_device_plugin_command_line_is_accepted_by_the_real_plugin_cli() -> None:
    pod = find(render(), "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    cmd = container(pod, "device-plugin")["command"]
    assert cmd[:2] == ["vgpu", "device-plugin"]
    parser = argparse.ArgumentParser()
    plugin_cli.register(parser)
    args = parser.parse_args([a.replace("$(NODE_NAME)", "gpu-node-1") for a in cmd[2:]])
    assert args.node == "gpu-node-1"
    assert args.namespace == NS
    assert args.monitor_listen == "0.0.0.0:9394"
    assert args.fake_nvml is None and args.kubeconfig is None and args.root == Path("/")
    assert str(args.hook_library) == "/usr/local/vgpu/libvgpu.so"
    mounts = {m["mountPath"] for m in container(pod, "device-plugin")["volumeMounts"]}
    assert str(args.config.parent) in mounts


def test_a_driverless_node_gets_the_fake_nvml_file_the_host_network_and_its_api_address() -> None:
    """devicePlugin.hostNetwork/extraArgs/extraEnv/extraVolumes/extraVolumeMounts, as the real
    plugin CLI reads the result (the sandbox's real node runs exactly this)."""
    objs = render("-f", str(CHART / "ci" / "driverless-node-values.yaml"))
    pod = find(objs, "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    plugin = container(pod, "device-plugin")
    parser = argparse.ArgumentParser()
    plugin_cli.register(parser)
    args = parser.parse_args([a.replace("$(NODE_NAME)", "n") for a in plugin["command"][2:]])
    assert args.fake_nvml == Path("/etc/vgpu/fake-nvml/gpus.yaml")
    assert str(args.hook_library) == "/usr/local/vgpu/libvgpu.so"  # the chart's own flags stay
    env = {e["name"]: e.get("value") for e in plugin["env"]}
    # inject: cdi: no NVIDIA runtime gives the plugin's pod the cards, so it asks for none
    assert env["KUBERNETES_SERVICE_HOST"] == "10.0.0.10" and "NVIDIA_VISIBLE_DEVICES" not in env
    assert node_config(objs, "n").driver_inject == "cdi"
    assert "/host/sys/fs/cgroup/k8s.io" in {m["mountPath"] for m in plugin["volumeMounts"]}
    mount = next(m for m in plugin["volumeMounts"] if m["name"] == "fake-nvml")
    assert mount["mountPath"] == str(args.fake_nvml.parent) and mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "fake-nvml")
    assert volume["hostPath"]["path"] == "/etc/vgpu-sandbox"
    # The default keeps the pod network.
    default = find(render(), "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    assert "hostNetwork" not in default and all(v["name"] != "fake-nvml" for v in default["volumes"])


def test_node_settings_reach_the_plugin_as_it_reads_them() -> None:
    objs = render("-f", str(CHART / "ci" / "custom-split-scaling-values.yaml"))
    everywhere = node_config(objs, "gpu-node-3")
    assert (everywhere.split, everywhere.device_memory_scaling, everywhere.device_core_scaling) == (
        4,
        0.9,
        2.0,
    )
    assert everywhere.oversubscribe is False
    tuned = node_config(objs, "gpu-node-h200-0")
    assert (tuned.split, tuned.device_memory_scaling, tuned.device_core_scaling) == (16, 0.9, 1.0)


def test_virtual_memory_turns_on_spilling_except_on_the_node_that_opts_out() -> None:
    objs = render("-f", str(CHART / "ci" / "virtual-memory-values.yaml"))
    spilling = node_config(objs, "gpu-node-1")
    assert spilling.oversubscribe is True and spilling.device_memory_scaling == 1.5
    small = node_config(objs, "gpu-node-small-ram")
    assert small.oversubscribe is False and small.device_memory_scaling == 1.0


def test_a_new_split_count_changes_the_device_plugin_pod_template() -> None:
    before = find(render(), "DaemonSet", "vgpu-device-plugin")["spec"]["template"]
    after = find(render("--set", "devicePlugin.deviceSplitCount=5"), "DaemonSet", "vgpu-device-plugin")
    assert (
        before["metadata"]["annotations"]["checksum/config"]
        != (after["spec"]["template"]["metadata"]["annotations"]["checksum/config"])
    )


def test_an_upgrade_replaces_the_device_plugin_pod_without_a_second_one_beside_it() -> None:
    """The old pod goes before the new one starts: two plugins would both serve kubelet's socket.
    Running containers are not restarted by it (docs/device-plugin.md, "Upgrading the hook")."""
    ds = find(render("--set", "devicePlugin.maxUnavailable=3"), "DaemonSet", "vgpu-device-plugin")["spec"]
    assert ds["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 3, "maxSurge": 0},
    }


# Where nothing needs privilege: NVIDIA's runtime gives the plugin its cards, and the containers'
# folders are plain ones (the chart's defaults, plugin and tmpfs, need it: the next test).
UNPRIVILEGED = ("--set", "driver.inject=runtime", "--set", "devicePlugin.containerFolder=directory")


def test_the_device_plugin_runs_on_gpu_nodes_without_privilege_where_nothing_needs_it() -> None:
    pod = find(render(*UNPRIVILEGED), "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "on"}
    # the host's PID namespace for the memory enforcer's view of every container; not its network
    assert not pod.get("hostNetwork") and pod.get("hostPID") is True
    sc = container(pod, "device-plugin")["securityContext"]
    assert not sc.get("privileged") and sc["allowPrivilegeEscalation"] is False
    # the one capability: KILL, for enforcement.memory kill (the default)
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
    host = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in pod["volumes"] if "hostPath" in v}
    assert host == {
        "/var/lib/kubelet/device-plugins": "Directory",
        "/var/lib/vgpu": "DirectoryOrCreate",
        # enforcement.compute: throttle (the default), the freezer: the kubelet's part alone
        "/sys/fs/cgroup/kubepods.slice": "Directory",
    }
    state = next(m for m in container(pod, "device-plugin")["volumeMounts"] if m["name"] == "state")
    assert "mountPropagation" not in state
    env = {e["name"]: e.get("value") for e in container(pod, "device-plugin")["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"  # privileged or not, the runtime's own way in


def test_by_default_the_device_plugin_is_privileged_for_the_driver_and_the_tmpfs_folders_alone() -> None:
    """driver.inject plugin opens the cards' device nodes for NVML without NVIDIA's runtime, and
    containerFolder tmpfs mounts each container's folder on the host: both need privilege, and
    the tmpfs mounts reach the kubelet through Bidirectional propagation of /var/lib/vgpu."""
    pod = find(render(), "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    plugin = container(pod, "device-plugin")
    assert plugin["securityContext"] == {"privileged": True, "readOnlyRootFilesystem": True}
    state = next(m for m in plugin["volumeMounts"] if m["name"] == "state")
    assert state == {"name": "state", "mountPath": "/var/lib/vgpu", "mountPropagation": "Bidirectional"}
    assert "--driver-root=/driver-root" in plugin["command"]
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in plugin["env"]}
    assert node_config(render(), "n").container_folder == "tmpfs"
    for args in (("--set", "devicePlugin.containerFolder=directory"), ("--set", "driver.inject=runtime")):
        one = container(
            find(render(*args), "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"],
            "device-plugin",
        )
        assert one["securityContext"].get("privileged") is True, args  # the other still needs it


@pytest.mark.parametrize("action", ["kill", "evict", "report"])
def test_the_memory_enforcement_reaches_the_node_config_with_only_the_rights_it_needs(action: str) -> None:
    objs = render("--set", f"devicePlugin.enforcement.memory={action}", *UNPRIVILEGED)
    cfg = node_config(objs, "gpu-node-1")
    assert (cfg.enforce_memory, cfg.memory_tolerance_mib, cfg.enforce_interval_ms) == (action, 256, 100)
    sc = container(find(objs, "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"], "device-plugin")
    assert sc["securityContext"]["capabilities"].get("add") == (["KILL"] if action == "kill" else None)
    rules = find(objs, "ClusterRole", "vgpu-kube-system-device-plugin")["rules"]
    granted = {(r, v) for rule in rules for r in rule["resources"] for v in rule["verbs"]}
    assert ("events", "create") in granted
    assert (("pods/eviction", "create") in granted) == (action == "evict")


@pytest.mark.parametrize("action", ["throttle", "evict", "kill", "report"])
def test_the_compute_enforcement_reaches_the_node_config_with_only_the_rights_it_needs(action: str) -> None:
    objs = render(
        "--set",
        "devicePlugin.enforcement.memory=report",
        "--set",
        f"devicePlugin.enforcement.compute={action}",
        *UNPRIVILEGED,
    )
    assert node_config(objs, "gpu-node-1").enforce_compute == action
    pod = find(objs, "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    sc = container(pod, "device-plugin")["securityContext"]
    assert sc["capabilities"].get("add") == (["KILL"] if action == "kill" else None)
    mounts = {m["mountPath"]: m for m in container(pod, "device-plugin")["volumeMounts"]}
    host = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    cgroups = "/sys/fs/cgroup/kubepods.slice"
    assert ("/host" + cgroups in mounts) == (cgroups in host) == (action == "throttle")
    rules = find(objs, "ClusterRole", "vgpu-kube-system-device-plugin")["rules"]
    granted = {(r, v) for rule in rules for r in rule["resources"] for v in rule["verbs"]}
    assert ("events", "create") in granted
    assert (("pods/eviction", "create") in granted) == (action == "evict")


@pytest.mark.parametrize(
    ("cap", "override", "mounted", "kill"),
    [("auto", None, False, False), ("off", None, False, False), ("off", "required", True, True)],
)
def test_the_driver_cap_reaches_the_node_config_and_mounts_the_pods_cgroups(
    cap: str, override: str | None, mounted: bool, kill: bool
) -> None:
    """enforcement.driverCap: the node config says it (off quoted: YAML would read a bare off as
    false); required mounts the kubelet's cgroups (the containers' folders the driver caps) and adds
    KILL (it refuses a container no line holds); auto mounts nothing of its own (here compute is
    report: no freezer either), so an upgrade adds no hostPath a node may lack."""
    more = ("--set", "devicePlugin.nodeOverrides[0].name=strict")
    more += ("--set", f"devicePlugin.nodeOverrides[0].enforcement.driverCap={override}") if override else ()
    objs = render(
        *(
            "--set",
            "devicePlugin.enforcement.memory=report",
            "--set",
            "devicePlugin.enforcement.compute=report",
        ),
        *("--set", f"devicePlugin.enforcement.driverCap={cap}"),
        *more,
        *UNPRIVILEGED,
    )
    assert node_config(objs, "gpu-node-1").driver_cap == cap
    assert node_config(objs, "strict").driver_cap == (override or cap)
    pod = find(objs, "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    plugin = container(pod, "device-plugin")
    assert (
        "/host/sys/fs/cgroup/kubepods.slice" in {m["mountPath"] for m in plugin["volumeMounts"]}
    ) == mounted
    assert plugin["securityContext"]["capabilities"].get("add") == (["KILL"] if kill else None)


def test_a_node_override_changes_enforcement_on_its_node_only_and_the_pods_get_every_right_it_needs() -> None:
    """One DaemonSet and one role serve every node, so a right one node's action needs (KILL, the
    host's cgroups, pods/eviction) is given where any node may take that action."""
    objs = render(
        *(
            "--set",
            "devicePlugin.enforcement.memory=report",
            "--set",
            "devicePlugin.enforcement.compute=report",
        ),
        *("--set", "devicePlugin.nodeOverrides[0].name=strict"),
        *("--set", "devicePlugin.nodeOverrides[0].enforcement.memory=kill"),
        *("--set", "devicePlugin.nodeOverrides[0].enforcement.compute=throttle"),
        *("--set", "devicePlugin.nodeOverrides[0].enforcement.intervalMs=50"),
        *("--set", "devicePlugin.nodeOverrides[1].name=soft"),
        *("--set", "devicePlugin.nodeOverrides[1].enforcement.memory=evict"),
        *UNPRIVILEGED,
    )

    def actions(node: str) -> tuple[str, str, int, int]:
        cfg = node_config(objs, node)
        return cfg.enforce_memory, cfg.enforce_compute, cfg.enforce_interval_ms, cfg.memory_tolerance_mib

    assert actions("gpu-node-1") == ("report", "report", 100, 256)
    assert actions("strict") == ("kill", "throttle", 50, 256)
    assert actions("soft") == ("evict", "report", 100, 256)
    pod = find(objs, "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    plugin = container(pod, "device-plugin")
    assert plugin["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
    assert "/host/sys/fs/cgroup/kubepods.slice" in {m["mountPath"] for m in plugin["volumeMounts"]}
    assert "/sys/fs/cgroup/kubepods.slice" in {
        v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v
    }
    rules = find(objs, "ClusterRole", "vgpu-kube-system-device-plugin")["rules"]
    assert ("pods/eviction", "create") in {
        (r, v) for rule in rules for r in rule["resources"] for v in rule["verbs"]
    }
    refused = template(
        "--set",
        "devicePlugin.nodeOverrides[0].name=n",
        "--set",
        "devicePlugin.nodeOverrides[0].enforcement.memory=freeze",
    )
    assert refused.returncode != 0 and "enforcement" in refused.stderr and "memory" in refused.stderr, (
        refused.stderr
    )
    refused = template(
        "--set",
        "devicePlugin.nodeOverrides[0].name=n",
        "--set",
        "devicePlugin.nodeOverrides[0].enforcement.interval=50",
    )
    assert refused.returncode != 0 and "interval" in refused.stderr, refused.stderr


def test_a_bad_compute_enforcement_value_is_refused_by_the_schema() -> None:
    result = template("--set", "devicePlugin.enforcement.compute=freeze")
    assert result.returncode != 0 and "compute" in result.stderr, result.stderr


def test_the_monitor_and_metrics_services_use_the_contract_ports_inside_the_cluster_by_default() -> None:
    objs = render()
    monitor = find(objs, "Service", "vgpu-monitor")["spec"]
    assert monitor["type"] == "ClusterIP" and "externalTrafficPolicy" not in monitor
    assert [(p["port"], p.get("nodePort")) for p in monitor["ports"]] == [(9394, None)]
    metrics = find(objs, "Service", "vgpu-scheduler-metrics")["spec"]
    assert metrics["type"] == "ClusterIP"
    assert [(p["port"], p.get("nodePort")) for p in metrics["ports"]] == [(9395, None)]
    # node ports are an opt-in, HAMi's numbers by choice
    opened = render(
        "--set", "devicePlugin.monitor.service.type=NodePort,devicePlugin.monitor.service.nodePort=31992",
        "--set", "scheduler.metrics.service.type=NodePort,scheduler.metrics.service.nodePort=31993",
    )  # fmt: skip
    monitor = find(opened, "Service", "vgpu-monitor")["spec"]
    assert monitor["type"] == "NodePort" and monitor["externalTrafficPolicy"] == "Local"
    assert [(p["port"], p["nodePort"]) for p in monitor["ports"]] == [(9394, 31992)]
    metrics = find(opened, "Service", "vgpu-scheduler-metrics")["spec"]
    assert [(p["port"], p["nodePort"]) for p in metrics["ports"]] == [(9395, 31993)]


def test_without_the_webhook_no_webhook_configuration_is_rendered_but_tls_to_the_extender_stays() -> None:
    objs = render("-f", str(CHART / "ci" / "no-webhook-values.yaml"))
    kinds = {o["kind"] for o in objs}
    assert "MutatingWebhookConfiguration" not in kinds and "ValidatingWebhookConfiguration" not in kinds
    assert scheduler_config(objs)["extenders"][0]["tlsConfig"]["caData"]


def test_a_service_monitor_is_rendered_only_where_the_prometheus_operator_serves_it() -> None:
    assert "ServiceMonitor" not in {o["kind"] for o in render()}
    objs = render("--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")
    sm = find(objs, "ServiceMonitor", "vgpu")
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    off = render(
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
        "--set",
        "monitoring.serviceMonitor.enabled=false",
    )
    assert "ServiceMonitor" not in {o["kind"] for o in off}


def test_the_custom_registry_scenario_pulls_every_image_from_the_mirror_with_credentials() -> None:
    objs = render("-f", str(CHART / "ci" / "custom-registry-values.yaml"))
    pods = [
        find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"],
        find(objs, "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"],
    ]
    images = [c["image"] for pod in pods for c in pod["containers"] + pod.get("initContainers", [])]
    assert images and all(i.startswith("registry.internal.example:5000/mirror/") for i in images), images
    assert "registry.internal.example:5000/mirror/kube-scheduler:v1.33.4" in images
    assert all(pod["imagePullSecrets"] == [{"name": "mirror-credentials"}] for pod in pods)


@pytest.mark.parametrize("values", SCENARIOS, ids=scenario_id)
def test_kube_scheduler_1_33_accepts_the_rendered_configuration_and_flags(
    values: Path, tmp_path: Path
) -> None:
    """The real kube-scheduler decodes the config strictly and validates it, builds its extender
    client (its client certificate and key, from the Secret as the pod mounts them), then writes
    the config out."""
    objs = render("-f", str(values))
    config = checkable_config(objs, tmp_path)
    pod = find(objs, "Deployment", "vgpu-scheduler")["spec"]["template"]["spec"]
    command = container(pod, "kube-scheduler")["command"]
    assert command[0] == "kube-scheduler"
    flags = [a for a in command[1:] if not a.startswith("--config=")]
    result = kube_scheduler_checks(config, flags, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    written = tmp_path / "written.yaml"
    effective = yaml.safe_load(written.read_text())
    assert effective["profiles"][0]["schedulerName"] == "vgpu-scheduler"
    assert effective["extenders"][0]["nodeCacheCapable"] is True


def test_kube_scheduler_refuses_a_broken_configuration_so_the_check_above_can_fail(tmp_path: Path) -> None:
    cfg = scheduler_config(render())
    cfg["extenders"][0]["nodeCachecapable"] = cfg["extenders"][0].pop("nodeCacheCapable")
    config = tmp_path / "broken.yaml"
    config.write_text(yaml.safe_dump(cfg))
    result = kube_scheduler_checks(config, [], tmp_path)
    assert result.returncode != 0
    assert "nodeCachecapable" in result.stderr


def test_a_scaling_given_as_text_by_helm_set_reaches_the_plugin_as_a_number() -> None:
    objs = render("--set", "devicePlugin.deviceMemoryScaling=1.25,devicePlugin.virtualMemory.enabled=true")
    cfg = node_config(objs, "gpu-node-1")
    assert cfg.device_memory_scaling == 1.25 and cfg.oversubscribe is True


def test_the_webhook_fails_closed_but_never_sees_the_release_namespace() -> None:
    for ns, custom in (
        ("kube-system", []),
        ("gpu-system", ["--set-json", 'webhook.namespaceSelector={"matchLabels":{"a":"b"}}']),
    ):
        result = helm("template", "vgpu", str(CHART), "-n", ns, *custom)
        assert result.returncode == 0, result.stderr
        objs = [o for o in yaml.safe_load_all(result.stdout) if o]
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            (hook,) = find(objs, kind, f"vgpu-{ns}")["webhooks"]
            assert hook["failurePolicy"] == "Fail"
            own = {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [ns]}
            assert hook["namespaceSelector"]["matchExpressions"].count(own) == 1


def test_kube_schedulers_leader_lease_can_never_be_taken_for_a_plugins_lease() -> None:
    objs = render()
    lease = scheduler_config(objs)["leaderElection"]["resourceName"]
    assert not lease.startswith(LEASE_PREFIX)
    role = find(objs, "Role", "vgpu-scheduler")
    assert [lease] in [rule.get("resourceNames") for rule in role["rules"]]


def test_the_sm_policy_reaches_the_plugin_per_node_and_a_bad_one_is_refused() -> None:
    objs = render(
        "--set", "devicePlugin.smPolicy=elastic", "--set", "devicePlugin.nodeOverrides[0].name=strict"
    )
    assert node_config(objs, "gpu-node-1").sm_policy == "elastic"
    assert node_config(render(), "gpu-node-1").sm_policy == "cap"
    strict = render(
        "--set",
        "devicePlugin.smPolicy=elastic",
        "--set",
        "devicePlugin.nodeOverrides[0].name=strict",
        "--set",
        "devicePlugin.nodeOverrides[0].smPolicy=cap",
    )
    assert node_config(strict, "strict").sm_policy == "cap"
    refused = template("--set", "devicePlugin.smPolicy=greedy")
    assert refused.returncode != 0 and "smPolicy" in refused.stderr


def test_driver_inject_plugin_mounts_the_driver_root_and_reaches_the_node_config() -> None:
    assert node_config(render(), "gpu-node-1").driver_inject == "plugin"  # the default
    objs = render("--set", "driver.inject=plugin", "--set", "driver.root=/run/nvidia/driver")
    assert node_config(objs, "gpu-node-1").driver_inject == "plugin"
    ds = find(objs, "DaemonSet", "vgpu-device-plugin")
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "--driver-root=/driver-root" in container["command"]
    assert "--driver-host-root=/run/nvidia/driver" in container["command"]
    assert container["securityContext"]["privileged"] is True
    mount = next(m for m in container["volumeMounts"] if m["name"] == "driver-root")
    assert mount == {"name": "driver-root", "mountPath": "/driver-root", "readOnly": True}
    volume = next(v for v in pod["volumes"] if v["name"] == "driver-root")
    assert volume["hostPath"] == {"path": "/run/nvidia/driver", "type": "Directory"}
    # runtime keeps the plugin without the host's driver folder (and, with plain folders, unprivileged)
    runtime = find(render(*UNPRIVILEGED), "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    assert runtime["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    assert not [v for v in runtime["volumes"] if v["name"] == "driver-root"]
    # cdi: the driver root for NVML, the kind for the names
    cdi = render("--set", "driver.inject=cdi", "--set", "driver.cdiKind=example.com/gpu")
    assert (node_config(cdi, "n").driver_inject, node_config(cdi, "n").cdi_kind) == ("cdi", "example.com/gpu")
    cdi_pod = find(cdi, "DaemonSet", "vgpu-device-plugin")["spec"]["template"]["spec"]
    assert [v for v in cdi_pod["volumes"] if v["name"] == "driver-root"]
    refused = template("--set", "driver.inject=toolkit")
    assert refused.returncode != 0 and "inject" in refused.stderr
