"""The sandbox's pure parts: certificates, kubeconfigs, scheduler config, node manifests, spec checks."""

from __future__ import annotations

import base64
import json
import os
import ssl
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from vgpu_sandbox import controlplane, demo, kubeconfig, nodes, pki
from vgpu_sandbox.cluster import Component, Sandbox, Spec, State
from vgpu_sandbox.errors import SandboxError

from vgpu.commands.cli import main


def test_serving_certificates_verify_against_the_ca_and_keys_are_private(tmp_path: Path) -> None:
    ca = pki.CertificateAuthority(tmp_path / "pki")
    pair = ca.issue("extender", ["127.0.0.1", "vgpu-extender.kube-system.svc"])
    cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.pem))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert sans.get_values_for_type(x509.DNSName) == ["vgpu-extender.kube-system.svc"]
    for key in (pair.key, ca.key_path):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    # An ssl context accepts the pair: the key matches the certificate.
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(pair.cert, pair.key)


def test_kubeconfig_carries_the_ca_and_token_and_is_private(tmp_path: Path) -> None:
    path = kubeconfig.write(
        tmp_path / "kc", server="https://127.0.0.1:1234", ca_pem=b"PEM", user="u", token="t"
    )
    loaded = yaml.safe_load(path.read_text())
    assert loaded["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:1234"
    assert base64.b64decode(loaded["clusters"][0]["cluster"]["certificate-authority-data"]) == b"PEM"
    assert loaded["users"][0]["user"]["token"] == "t"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_scheduler_config_calls_the_extender_over_verified_tls() -> None:
    text = controlplane.scheduler_config(
        Path("/k"),
        scheduler_name="vgpu-scheduler",
        extender_url="https://127.0.0.1:9443",
        extender_ca_b64="Q0E=",
        managed_resources=("nvidia.com/gpu", "nvidia.com/gpumem"),
    )
    config = json.loads(text)
    assert config["profiles"] == [{"schedulerName": "vgpu-scheduler"}]
    (ext,) = config["extenders"]
    assert ext["enableHTTPS"] is True and ext["tlsConfig"] == {"insecure": False, "caData": "Q0E="}
    assert ext["nodeCacheCapable"] is True and ext["bindVerb"] == "bind" and ext["weight"] > 0
    assert {m["name"] for m in ext["managedResources"]} == {"nvidia.com/gpu", "nvidia.com/gpumem"}
    assert "extenders" not in json.loads(controlplane.scheduler_config(Path("/k")))
    exact = json.loads(controlplane.scheduler_config(Path("/k"), percentage_of_nodes_to_score=100))
    assert exact["profiles"] == [{"schedulerName": "default-scheduler", "percentageOfNodesToScore": 100}]


def test_node_manifest_is_kwok_managed_labelled_and_advertises_split_times_cards() -> None:
    spec = nodes.GPUSpec(count=4, memory_mib=81920, model="NVIDIA A100", split=10)
    node = nodes.manifest("vgpu-node-7", spec, advertise_gpus=True)
    assert node["metadata"]["annotations"][nodes.KWOK_ANNOTATION] == "fake"
    assert node["metadata"]["labels"]["gpu"] == "on"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "40"
    assert "nvidia.com/gpu" not in nodes.manifest("n", spec, advertise_gpus=False)["status"]["allocatable"]


def test_fake_gpus_have_stable_distinct_uuids_and_symmetric_links() -> None:
    spec = nodes.GPUSpec(count=4, memory_mib=1024, model="M", split=2)
    gpus = nodes.fake_gpus("n0", spec)
    assert gpus == nodes.fake_gpus("n0", spec)
    assert len({g["uuid"] for g in gpus}) == 4
    assert not {g["uuid"] for g in gpus} & {g["uuid"] for g in nodes.fake_gpus("n1", spec)}
    by_uuid = {g["uuid"]: g for g in gpus}
    for g in gpus:
        for peer, kind in g["links"].items():
            assert by_uuid[peer]["links"][g["uuid"]] == kind
    assert gpus[0]["links"][gpus[1]["uuid"]] == "nvlink" and gpus[0]["links"][gpus[2]["uuid"]] == "pcie"


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("nodes", 0, "--nodes"),
        ("gpus_per_node", 0, "--gpus-per-node"),
        ("gpu_memory_mib", 10, "--gpu-memory"),
        ("gpu_model", " ", "--gpu-model"),
        ("split", 0, "--split"),
        ("apiserver_port", 70000, "--apiserver-port"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_flag(field: str, value: object, flag: str) -> None:
    spec = Spec(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(SandboxError, match=flag):
        spec.validate()


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def write_state(folder: Path, *, alive: list[bool], ready: bool, stopped: float) -> Path:
    pids = [os.getpid() if a else dead_pid() for a in alive]
    state = State(
        spec=Spec(nodes=1),
        ports={"apiserver": 1, "etcd": 2, "extender-metrics": 3, "monitor-vgpu-node-0": 4},
        components=[Component(f"c{i}", pid, ["x"], None) for i, pid in enumerate(pids)],
        started=1.0,
        ready=ready,
        stopped=stopped,
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state.json").write_text(state.to_json())
    return folder


@pytest.mark.parametrize(
    ("alive", "ready", "stopped", "word", "code", "says"),
    [
        ([False, False], False, 5.0, "stopped", 0, "sandbox stopped at"),
        ([False, False], True, 0.0, "dead", 1, "every component is gone without `vgpu sandbox down`"),
        ([True, False], True, 0.0, "degraded", 1, "c1 pid"),
        ([True, True], False, 0.0, "starting", 1, "has not finished"),
        ([True, True], True, 0.0, "healthy", 0, "monitor-vgpu-node-0 http://127.0.0.1:4/metrics the node"),
    ],
)
def test_status_says_what_the_sandbox_is_and_fails_only_when_something_is_wrong(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    alive: list[bool],
    ready: bool,
    stopped: float,
    word: str,
    code: int,
    says: str,
) -> None:
    folder = write_state(tmp_path / "sb", alive=alive, ready=ready, stopped=stopped)
    assert Sandbox(folder).status()["state"] == word
    assert main(["sandbox", f"--dir={folder}", "status"]) == code
    out = capsys.readouterr().out
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert says in "\n".join(lines)
    if word != "stopped":
        assert out.startswith(f"sandbox {word}, started ")
        for port_line in (
            "apiserver https://127.0.0.1:1 kube-apiserver",
            "etcd http://127.0.0.1:2 etcd, clients",
            "extender-metrics http://127.0.0.1:3/metrics the extender's metrics",
        ):
            assert port_line in lines, out


def test_status_of_a_folder_never_started_says_so_and_is_not_a_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sandbox", f"--dir={tmp_path}", "status"]) == 0
    assert capsys.readouterr().out == f"no sandbox in {tmp_path}: start one with `vgpu sandbox up`\n"


def test_dir_is_taken_before_or_after_the_action(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`vgpu sandbox down --dir X`, as the real node's refusal words it, names the same folder as
    `vgpu sandbox --dir X down`; after the action it wins."""
    for argv in (
        ["sandbox", "status", f"--dir={tmp_path}"],
        ["sandbox", f"--dir={tmp_path}", "status"],
        ["sandbox", f"--dir={tmp_path / 'other'}", "status", "--dir", str(tmp_path)],
    ):
        assert main(argv) == 0
        said = capsys.readouterr().out
        assert said == f"no sandbox in {tmp_path}: start one with `vgpu sandbox up`\n", argv
    assert main(["sandbox", "down", f"--dir={tmp_path}"]) == 0
    assert capsys.readouterr().out.strip() == "sandbox: nothing was running"


def test_the_demo_with_a_real_node_refuses_a_running_sandbox_without_one(tmp_path: Path) -> None:
    folder = write_state(tmp_path / "sb", alive=[True], ready=True, stopped=0.0)
    refusal = demo.reuse_refusal(Sandbox(folder), real_node=True)
    assert "REAL_NODE=1 needs a sandbox with the real node" in refusal
    assert "vgpu sandbox down" in refusal and "make demo REAL_NODE=1" in refusal
    assert demo.reuse_refusal(Sandbox(folder), real_node=False) == ""
