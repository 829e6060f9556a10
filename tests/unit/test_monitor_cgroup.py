"""A process's container from its /proc/<pid>/cgroup: each runtime's and cgroup driver's path form,
cgroup v1 and v2, as the files read on real nodes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vgpu.monitor.cgroup import ContainerRef, container_of, parse_cgroup, start_time

UID = "0f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
UNDERSCORED = UID.replace("-", "_")
CID = "4c01db0b339c3e9a1b3e3c9f5d0b1a2e7c6f9e8d7c6b5a4f3e2d1c0b9a8f7e6d"

V1_CGROUPFS = f"""12:pids:/kubepods/burstable/pod{UID}/{CID}
11:hugetlb:/kubepods/burstable/pod{UID}/{CID}
10:memory:/kubepods/burstable/pod{UID}/{CID}
9:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}
1:name=systemd:/kubepods/burstable/pod{UID}/{CID}
0::/
"""
V1_SYSTEMD = f"""13:rdma:/
7:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UNDERSCORED}.slice/cri-containerd-{CID}.scope
1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UNDERSCORED}.slice/cri-containerd-{CID}.scope
"""


@pytest.mark.parametrize(
    ("text", "runtime"),
    [
        # containerd, systemd driver, cgroup v2
        (
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/"
            f"cri-containerd-{CID}.scope\n",
            "containerd",
        ),
        # containerd, systemd driver, cgroup v1
        (V1_SYSTEMD, "containerd"),
        # a Guaranteed pod (no QoS slice), systemd driver
        (f"0::/kubepods.slice/kubepods-pod{UNDERSCORED}.slice/cri-containerd-{CID}.scope\n", "containerd"),
        # containerd (or any CRI runtime), cgroupfs driver, cgroup v1 and v2
        (V1_CGROUPFS, ""),
        (f"0::/kubepods/besteffort/pod{UID}/{CID}\n", ""),
        (f"0::/kubepods/pod{UID}/{CID}\n", ""),
        # CRI-O, systemd driver
        (
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/crio-{CID}.scope\n",
            "cri-o",
        ),
        # cri-dockerd under the systemd driver
        (
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/docker-{CID}.scope\n",
            "docker",
        ),
        # read from the device plugin's own cgroup namespace: parts above its root show as ..
        (
            f"0::/../../kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/cri-containerd-{CID}.scope\n",
            "containerd",
        ),
    ],
)
def test_a_kubernetes_containers_process_names_its_pod_and_container(text: str, runtime: str) -> None:
    assert parse_cgroup(text) == ContainerRef(CID, UID, runtime)


@pytest.mark.parametrize(
    "text",
    [
        f"0::/system.slice/docker-{CID}.scope\n",  # Docker, systemd driver
        f"12:pids:/docker/{CID}\n4:memory:/docker/{CID}\n1:name=systemd:/docker/{CID}\n",  # cgroupfs
    ],
)
def test_a_plain_docker_container_has_an_id_and_no_pod(text: str) -> None:
    assert parse_cgroup(text) == ContainerRef(CID, None, "docker")


def test_containerd_without_the_kubelets_pod_cgroups_has_an_id_and_no_pod() -> None:
    # cgroupsPerQOS: false (the sandbox's real node): containerd's default under its CRI namespace
    text = f"8:pids:/k8s.io/{CID}\n4:memory:/k8s.io/{CID}\n1:name=systemd:/k8s.io/{CID}\n0::/k8s.io/{CID}\n"
    assert parse_cgroup(text) == ContainerRef(CID, None, "containerd")


@pytest.mark.parametrize(
    "text",
    [
        "0::/\n",
        "0::/system.slice/kubelet.service\n",
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        "12:pids:/\n1:name=systemd:/init.scope\n0::/init.scope\n",
        # the runtime's monitor of a CRI-O container is not the container
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/crio-conmon-{CID}.scope\n",
        # a pod's own slice (no container under it) and a bare id outside kubepods and /docker
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice\n",
        f"0::/machine.slice/{CID}\n",
        "garbage\n\n7:memory\n",
    ],
)
def test_a_process_of_no_container_has_none(text: str) -> None:
    assert parse_cgroup(text) is None


def test_the_reader_reads_a_real_process(tmp_path: Path) -> None:
    assert start_time(os.getpid()) > 0
    container_of(os.getpid())  # whatever this machine is, its own file parses without error
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "cgroup").write_text(V1_CGROUPFS)
    assert container_of(77, tmp_path) == ContainerRef(CID, UID, "")
    with pytest.raises(OSError):
        container_of(78, tmp_path)
