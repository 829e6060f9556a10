"""The playbooks against the sandbox, as `make demo` runs them: `ansible-playbook -i
inventory/sandbox.yml playbooks/site.yml` labels the (KWOK) GPU nodes through the API and installs
charts/vgpu with helm; upgrade.yml and uninstall.yml move and remove the release. Everything this
module creates (the release, an extra node) is removed at the end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from vgpu_sandbox.cluster import Sandbox

from playbooks import play, play_recap

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "kube-system"
RELEASE = "vgpu"
EXTRA_NODE = "vgpu-ansible-e2e"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _helm(sandbox: Sandbox, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(sandbox.bin("helm")), f"--kubeconfig={sandbox.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _release(sandbox: Sandbox, name: str = RELEASE) -> dict[str, Any] | None:
    listed = json.loads(_helm(sandbox, "list", "-n", NAMESPACE, "-o", "json", "--all").stdout or "[]")
    return next((r for r in listed if r["name"] == name), None)


def _get(sandbox: Sandbox, *args: str) -> Any:
    return json.loads(sandbox.kubectl("get", *args, "-o", "json").stdout)


@pytest.fixture(scope="module")
def site_run(sandbox: Sandbox) -> Iterator[subprocess.CompletedProcess[str]]:
    result = play(sandbox, "site.yml")
    try:
        yield result
    finally:
        _helm(sandbox, "uninstall", RELEASE, "-n", NAMESPACE, "--wait")
        sandbox.kubectl("delete", "node", EXTRA_NODE, "--ignore-not-found", check=False)


def test_site_playbook_with_the_sandbox_inventory_installs_the_chart_with_the_clusters_kube_scheduler(
    sandbox: Sandbox, site_run: subprocess.CompletedProcess[str]
) -> None:
    assert site_run.returncode == 0, site_run.stdout[-5000:] + site_run.stderr[-2000:]
    release = _release(sandbox)
    assert release is not None and release["status"] == "deployed", release
    assert release["chart"].startswith("vgpu-")

    version = json.loads(sandbox.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    tag = re.match(r"v?\d+\.\d+\.\d+", version)
    assert tag, version
    expected_tag = "v" + tag.group(0).lstrip("v")
    deployment = _get(sandbox, "deployment", "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}")
    images = [c["image"] for d in deployment["items"] for c in d["spec"]["template"]["spec"]["containers"]]
    assert any(i.endswith(f"kube-scheduler:{expected_tag}") for i in images), images
    assert f"with kube-scheduler {expected_tag}" in site_run.stdout
    assert re.search(r"Deployment/\S+ 1/1 ready", site_run.stdout), site_run.stdout[-3000:]

    # The GPU nodes carry the label the chart's device plugin selects.
    labelled = _get(sandbox, "nodes", "-l", "gpu=on")
    assert {n["metadata"]["name"] for n in labelled["items"]} >= {"vgpu-node-0", "vgpu-node-1", "vgpu-node-2"}


def test_a_second_site_run_changes_nothing(
    sandbox: Sandbox, site_run: subprocess.CompletedProcess[str]
) -> None:
    assert site_run.returncode == 0
    before = _release(sandbox)
    again = play(sandbox, "site.yml")
    assert again.returncode == 0, again.stdout[-4000:]
    recap = play_recap(again)
    assert set(recap) >= {"localhost", "vgpu-node-0"}
    assert all(counts["changed"] == 0 for counts in recap.values()), recap
    after = _release(sandbox)
    assert before is not None and after is not None and after["revision"] == before["revision"]


def test_a_cluster_version_the_chart_does_not_support_stops_before_anything_is_installed(
    sandbox: Sandbox, site_run: subprocess.CompletedProcess[str]
) -> None:
    result = play(
        sandbox,
        "vgpu.yml",
        "-e",
        "vgpu_scheduler_release_name=vgpu-unsupported",
        "-e",
        "vgpu_scheduler_kubernetes_max_version=1.30",
    )
    assert result.returncode != 0
    assert "is not supported by the vgpu chart" in result.stdout
    assert "Fix: use a vgpu release that supports" in result.stdout
    assert _release(sandbox, "vgpu-unsupported") is None


def test_upgrade_playbook_moves_the_release_to_new_images_and_reports_both_revisions(
    sandbox: Sandbox, site_run: subprocess.CompletedProcess[str]
) -> None:
    assert site_run.returncode == 0
    before = _release(sandbox)
    assert before is not None
    result = play(sandbox, "upgrade.yml", "-e", "vgpu_scheduler_image_tag=0.1.0-upgrade-test")
    assert result.returncode == 0, result.stdout[-4000:]
    after = _release(sandbox)
    assert after is not None and int(after["revision"]) == int(before["revision"]) + 1
    assert f"revision {before['revision']}) -> " in result.stdout
    daemonsets = _get(sandbox, "daemonset", "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}")
    images = [c["image"] for d in daemonsets["items"] for c in d["spec"]["template"]["spec"]["containers"]]
    assert images and all(i.endswith(":0.1.0-upgrade-test") for i in images), images


def test_gpu_nodes_play_labels_a_new_node_and_uninstall_removes_the_label_and_the_release(
    sandbox: Sandbox, site_run: subprocess.CompletedProcess[str], tmp_path: Path
) -> None:
    assert site_run.returncode == 0
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": EXTRA_NODE,
            "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {"kubernetes.io/hostname": EXTRA_NODE, "type": "kwok"},
        },
    }
    sandbox.kubectl("create", "-f", "-", input=json.dumps(node))
    sandbox_inventory = yaml.safe_load((ROOT / "inventory" / "sandbox.yml").read_text())
    kube_control = sandbox_inventory["all"]["children"]["kube_control"]
    gpu_vars = sandbox_inventory["all"]["children"]["gpu_nodes"]["vars"]
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {
                        "kube_control": kube_control,
                        "gpu_nodes": {
                            "hosts": {EXTRA_NODE: {"gpu_node_gpu_mode": "dra"}},
                            "vars": gpu_vars,
                        },
                    }
                }
            }
        )
    )

    labelled = play(sandbox, "gpu_nodes.yml", inventory=inventory)
    assert labelled.returncode == 0, labelled.stdout[-4000:]
    assert play_recap(labelled)[EXTRA_NODE]["changed"] == 1
    labels = _get(sandbox, "node", EXTRA_NODE)["metadata"]["labels"]
    assert labels.get("gpu") == "on" and labels.get("openaios.io/gpu-mode") == "dra"
    # the sandbox's own nodes, labelled by site.yml with the default mode
    own = _get(sandbox, "node", "vgpu-node-0")["metadata"]["labels"]
    assert own["openaios.io/gpu-mode"] == "device-plugin"

    removed = play(sandbox, "uninstall.yml", inventory=inventory)
    assert removed.returncode == 0, removed.stdout[-4000:]
    labels = _get(sandbox, "node", EXTRA_NODE)["metadata"]["labels"]
    assert "gpu" not in labels and "openaios.io/gpu-mode" not in labels
    assert _release(sandbox) is None
    assert f"Release {RELEASE} removed from {NAMESPACE}" in removed.stdout
    # The sandbox's own nodes were not in this inventory: they keep their label.
    assert _get(sandbox, "node", "vgpu-node-0")["metadata"]["labels"].get("gpu") == "on"


def test_a_node_missing_from_the_cluster_stops_the_play_naming_the_fix(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {
                        "gpu_nodes": {
                            "hosts": {"no-such-node": None},
                            "vars": {
                                "ansible_connection": "local",
                                "ansible_python_interpreter": sys.executable,
                                "ansible_become": False,
                                "gpu_node_prepare_host": False,
                                "gpu_node_kubernetes_delegate_to": "localhost",
                            },
                        }
                    }
                }
            }
        )
    )
    result = play(sandbox, "gpu_nodes.yml", inventory=inventory)
    assert result.returncode != 0
    assert "Node no-such-node is not registered with the cluster" in result.stdout
    assert "Fix: join the node to the cluster first" in result.stdout


def test_upgrade_playbook_without_an_installed_release_stops_naming_the_fix(sandbox: Sandbox) -> None:
    result = play(sandbox, "upgrade.yml", "-e", "vgpu_scheduler_release_name=never-installed")
    assert result.returncode != 0
    assert "There is no release never-installed in namespace kube-system to upgrade" in result.stdout
    assert "Fix: install it first with playbooks/site.yml" in result.stdout
    assert _release(sandbox, "never-installed") is None
