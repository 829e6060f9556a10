"""The Ansible side as a whole: ansible-lint, syntax checks of every playbook with each inventory,
every role variable prefixed and declared, and the cluster-version rules of roles/vgpu_scheduler
run through ansible-playbook itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PLAYBOOKS = sorted(p.name for p in (ROOT / "playbooks").glob("*.yml"))
INVENTORIES = sorted(p.name for p in (ROOT / "inventory").glob("*.yml"))
ROLES = ("gpu_node", "vgpu_scheduler")

pytestmark = pytest.mark.xdist_spread  # each test runs ansible alone: workers share nothing (tests/README.md)


def _env() -> dict[str, str]:
    env = dict(
        os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", ANSIBLE_ROLES_PATH=str(ROOT / "roles")
    )
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    return env


def test_the_expected_playbooks_and_inventories_exist() -> None:
    assert set(PLAYBOOKS) >= {"site.yml", "gpu_nodes.yml", "vgpu.yml", "upgrade.yml", "uninstall.yml"}
    assert set(INVENTORIES) >= {"hosts.example.yml", "sandbox.yml"}


def test_ansible_lint_passes_with_the_production_profile() -> None:
    result = subprocess.run(
        [str(BIN / "ansible-lint"), "--nocolor"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in result.stdout + result.stderr


@pytest.mark.parametrize("inventory", INVENTORIES)
@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_every_playbook_passes_the_syntax_check_with_every_inventory(playbook: str, inventory: str) -> None:
    result = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "--syntax-check",
            "-i",
            f"inventory/{inventory}",
            f"playbooks/{playbook}",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _set_by_tasks(role: Path) -> set[str]:
    """Variables the role itself sets (set_fact outputs and task vars), not inputs."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for key in ("ansible.builtin.set_fact", "set_fact", "vars"):
                if isinstance(node.get(key), dict):
                    found.update(node[key])
            for key in ("block", "rescue", "always"):
                walk(node.get(key))

    for path in [*(role / "tasks").glob("*.yml"), *(role / "vars").glob("*.yml")]:
        data = _yaml(path)
        if path.parent.name == "vars" and isinstance(data, dict):
            found.update(data)
        else:
            walk(data)
    return found


@pytest.mark.parametrize("role_name", ROLES)
def test_every_role_variable_is_prefixed_with_the_role_name_and_declared_in_argument_specs(
    role_name: str,
) -> None:
    role = ROOT / "roles" / role_name
    defaults = set(_yaml(role / "defaults" / "main.yml"))
    spec = _yaml(role / "meta" / "argument_specs.yml")["argument_specs"]["main"]["options"]
    assert defaults == set(spec), (
        f"defaults/main.yml and meta/argument_specs.yml differ: {defaults ^ set(spec)}"
    )
    for name, option in spec.items():
        assert name.startswith(role_name + "_"), f"{name} is not prefixed with {role_name}_"
        assert option.get("description"), f"{name} has no description"
        assert "type" in option, f"{name} has no type"

    texts = [p.read_text() for p in role.rglob("*.yml")]
    referenced = set(re.findall(rf"\b({role_name}_[a-z0-9_]+)", "\n".join(texts)))
    internal = {name for name in referenced if name.startswith(role_name + "__")}
    undeclared = referenced - internal - set(spec) - _set_by_tasks(role)
    assert not undeclared, f"used but neither declared nor set by the role: {sorted(undeclared)}"


def _version_play(tmp_path: Path, git_version: str, **extra: str) -> subprocess.CompletedProcess[str]:
    play = [
        {
            "name": "Version rules",
            "hosts": "localhost",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Check the version",
                    "ansible.builtin.include_role": {"name": "vgpu_scheduler", "tasks_from": "version.yml"},
                    "vars": {"vgpu_scheduler_cluster_git_version": git_version, **extra},
                },
                {
                    "name": "Show the tag",
                    "ansible.builtin.debug": {"msg": "TAG={{ vgpu_scheduler_kube_scheduler_tag }}"},
                },
            ],
        }
    ]
    playbook = tmp_path / f"version-{abs(hash(git_version))}.yml"
    playbook.write_text(json.dumps(play))
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(playbook)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("git_version", "tag"),
    [
        ("v1.33.4", "v1.33.4"),
        ("v1.36.3", "v1.36.3"),
        ("v1.33.4-eks-2f8c1e3", "v1.33.4"),
        ("v1.30.2-gke.1587003", "v1.30.2"),
        ("v1.31.1+k3s1", "v1.31.1"),
        ("1.29.0", "v1.29.0"),
    ],
)
def test_the_kube_scheduler_tag_follows_the_clusters_version_also_for_eks_gke_and_k3s_strings(
    tmp_path: Path, git_version: str, tag: str
) -> None:
    result = _version_play(tmp_path, git_version)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f'TAG={tag}"' in result.stdout


@pytest.mark.parametrize(
    ("git_version", "message"),
    [
        ("v1.24.17-eks-5e0fdde", "Fix: upgrade the cluster to 1.25.0 or newer"),
        ("v1.37.0", "Fix: use a vgpu release that supports 1.37"),
        ("v1.36.99-gke.1", None),
        ("unknown", 'reports its version as \\"unknown\\", which has no MAJOR.MINOR.PATCH'),
    ],
)
def test_a_cluster_version_the_chart_does_not_support_stops_the_play_with_the_fix(
    tmp_path: Path, git_version: str, message: str | None
) -> None:
    result = _version_play(tmp_path, git_version)
    if message is None:  # the newest supported minor, any patch: accepted
        assert result.returncode == 0, result.stdout[-3000:]
        return
    assert result.returncode != 0
    assert message in result.stdout, result.stdout[-3000:]
    assert "Nothing was installed." in result.stdout


def test_an_explicit_kube_scheduler_tag_wins_over_an_unreadable_cluster_version(tmp_path: Path) -> None:
    result = _version_play(tmp_path, "unknown", vgpu_scheduler_kube_scheduler_image_tag="v1.33.9")
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'TAG=v1.33.9"' in result.stdout


def test_a_role_variable_of_the_wrong_kind_stops_the_play_naming_the_variable() -> None:
    result = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "inventory/sandbox.yml",
            "playbooks/gpu_nodes.yml",
            "-e",
            "gpu_node_container_runtime=podman",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "gpu_node_container_runtime" in result.stdout
    assert "docker, containerd" in result.stdout, result.stdout[-3000:]


def test_a_gpu_mode_other_than_the_two_stops_the_play_before_any_label_changes() -> None:
    result = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "inventory/sandbox.yml",
            "playbooks/gpu_nodes.yml",
            "-e",
            "gpu_node_gpu_mode=both",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "gpu_node_gpu_mode" in result.stdout
    assert "device-plugin, dra" in result.stdout, result.stdout[-3000:]
    assert "Label the node" not in result.stdout
