"""Which grant a process runs under, from its mountinfo: the device plugin's and DRA's grants
alike, as containerd, CRI-O and Docker write the mount, and nothing a tenant could mount instead."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from vgpu.hookabi.grant import Grant, write_grant
from vgpu.monitor.enforce import Enforcer, HostCollector
from vgpu.monitor.hostview import HostView
from vgpu.monitor.mounts import claim_of, grant_name, parse_mountinfo
from vgpu.node.discovery import GpuProcess
from vgpu.node.paths import HostPaths

MIB = 1 << 20
POD = "0f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
CLAIM = "7d0e4c51-93a4-4f0e-b1d6-2c3e4f5a6b7c"
CID = "c" * 64
OVERLAY = (
    "1467 1446 0:279 / / rw,relatime master:600 - overlay overlay rw,lowerdir=/var/lib/containerd/"
    "io.containerd.snapshotter.v1.overlayfs/snapshots/41/fs,upperdir=/var/lib/containerd/"
    "io.containerd.snapshotter.v1.overlayfs/snapshots/52/fs\n"
    "1468 1467 0:281 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
    "1469 1467 0:282 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755,inode64\n"
)

# containerd through the device plugin's Allocate mounts (kubelet's bind mounts)
CONTAINERD = OVERLAY + (
    f"1475 1467 259:2 /var/lib/kubelet/pods/{POD}/etc-hosts /etc/hosts rw,relatime - ext4 /dev/nvme0n1p2 rw\n"
    f"1476 1467 259:2 /var/lib/vgpu/grants/{POD}_cuda.limits /etc/vgpu/limits ro,relatime - ext4 "
    "/dev/nvme0n1p2 rw\n"
    f"1477 1467 259:2 /var/lib/vgpu/containers/{POD}_cuda /var/lib/vgpu/region rw,relatime - ext4 "
    "/dev/nvme0n1p2 rw\n"
)
# CRI-O through a CDI spec (DRA): the CDI mount's options, xfs
CRIO_CDI = (
    "2290 2250 0:512 / / rw,relatime - overlay overlay rw,lowerdir=/var/lib/containers/storage/overlay/l/A\n"
    f"2310 2290 8:1 /var/lib/vgpu/grants/dra_{CLAIM}_gpu.limits /etc/vgpu/limits ro,nosuid,nodev,relatime "
    "- xfs /dev/sda1 rw,attr2,inode64,logbufs=8,logbsize=32k,noquota\n"
    "2311 2290 8:1 /var/lib/containers/storage/overlay-containers/x/userdata/resolv.conf /etc/resolv.conf "
    "rw,nosuid,nodev,relatime - xfs /dev/sda1 rw,attr2\n"
)
# Docker under cri-dockerd, /var/lib its own file system (the root is inside it), shared propagation
DOCKER = (
    "812 790 0:164 / / rw,relatime master:1 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/X\n"
    f"830 812 253:3 /vgpu/grants/{POD}_main.limits /etc/vgpu/limits ro,relatime shared:45 master:12 - xfs "
    "/dev/mapper/vg-varlib rw\n"
)


@pytest.mark.parametrize(
    ("text", "device", "name"),
    [
        (CONTAINERD, (259, 2), f"{POD}_cuda"),
        (CRIO_CDI, (8, 1), f"dra_{CLAIM}_gpu"),
        (DOCKER, (253, 3), f"{POD}_main"),
        (DOCKER, None, f"{POD}_main"),  # the grants folder's device unknown: the name alone
        (OVERLAY, (259, 2), None),  # a container without a vGPU
    ],
    ids=["containerd", "cri-o-cdi", "docker", "docker-any-device", "none"],
)
def test_the_grant_is_the_file_mounted_at_etc_vgpu_limits(
    text: str, device: tuple[int, int] | None, name: str | None
) -> None:
    assert grant_name(text, device) == name


def test_a_file_of_another_device_a_removed_grant_or_a_strange_name_is_no_grant() -> None:
    # a tenant with CAP_SYS_ADMIN mounting a file of its own image there: the overlay's device
    tenant = OVERLAY + f"1500 1467 0:279 /tmp/{POD}_cuda.limits /etc/vgpu/limits ro - overlay overlay rw\n"
    assert grant_name(tenant, (259, 2)) is None
    deleted = CONTAINERD.replace(f"{POD}_cuda.limits ", f"{POD}_cuda.limits//deleted ")
    assert grant_name(deleted, (259, 2)) is None
    assert grant_name(CONTAINERD.replace(".limits ", ".conf "), (259, 2)) is None
    assert grant_name(CONTAINERD.replace(f"{POD}_cuda.limits", r"..\040x.limits"), (259, 2)) is None


def test_the_runtimes_mount_counts_not_one_stacked_over_it_later() -> None:
    stacked = CONTAINERD + (
        f"1600 1467 259:2 /var/lib/vgpu/grants/{CLAIM}_other.limits /etc/vgpu/limits ro - ext4 /dev/x rw\n"
    )
    assert grant_name(stacked, (259, 2)) == f"{POD}_cuda"


def test_escaped_paths_and_malformed_lines() -> None:
    text = "garbage\n1 2 x:y / / rw - ext4 a rw\n"
    text += "7 1 8:1 /a\\040b /mnt\\011c rw shared:1 - ext4 /dev/sda1 rw\n"
    [entry] = parse_mountinfo(text)
    assert (entry.root, entry.mount_point, entry.device, entry.fs_type) == ("/a b", "/mnt\tc", (8, 1), "ext4")


def test_a_dra_grant_names_its_claim_and_request() -> None:
    assert claim_of(f"dra_{CLAIM}_gpu") == (CLAIM, "gpu")
    assert claim_of(f"{POD}_cuda") is None and claim_of("dra_x") is None


# -- the host view and the enforcer find DRA containers through their mounts -----------------------


class Source:
    def __init__(self) -> None:
        self.procs: dict[str, list[GpuProcess]] = {"GPU-a": []}

    def processes(self, uuid: str) -> list[GpuProcess] | None:
        return self.procs.get(uuid)


def _process(proc: Path, pid: int, cgroup: str, mountinfo: str | None) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(cgroup)
    (proc / str(pid) / "stat").write_text(f"{pid} (t) S " + " ".join(["0"] * 18) + f" {1000 + pid} 0 0\n")
    if mountinfo is not None:
        (proc / str(pid) / "mountinfo").write_text(mountinfo)


def test_a_dra_container_is_found_by_its_claims_grant_and_acted_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = HostPaths(tmp_path / "root")
    paths.grants_dir.mkdir(parents=True)
    write_grant(paths.grant(f"dra_{CLAIM}_gpu"), Grant(("GPU-a",), (1000 * MIB,)))
    dev = os.stat(paths.grants_dir).st_dev
    here = f"{os.major(dev)}:{os.minor(dev)}"
    proc = tmp_path / "proc"
    mounts = CRIO_CDI.replace("8:1 /var/lib/vgpu", f"{here} /var/lib/vgpu")
    crio = f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/crio-{CID}.scope\n"
    _process(proc, 401, crio, mounts)
    _process(proc, 402, crio, mounts.replace(here, "0:512"))  # its mount of another device: not the grant
    pods = [
        {
            "metadata": {"uid": POD, "namespace": "team", "name": "trainer"},
            "status": {"containerStatuses": [{"name": "cuda", "containerID": f"cri-o://{CID}"}]},
        }
    ]
    source = Source()
    view = HostView("n1", paths, source, lambda: ["GPU-a"], lambda _node: pods, proc)
    killed: list[int] = []
    enforcer = Enforcer("n1", view, "kill", 0, kill=lambda pid, sig: killed.append(pid))
    source.procs["GPU-a"] = [GpuProcess(401, 900 * MIB), GpuProcess(402, 50 * MIB)]
    assert enforcer.run_pass() == []
    [held] = view.read().held
    assert (held.owner.pod, held.owner.container, held.owner.claim) == ("trainer", "cuda", CLAIM)
    assert held.granted == 1000 * MIB and set(held.pids) == {401}
    assert view.read().unattributed["GPU-a"] == 50 * MIB  # the device plugin has no grant for the pod
    source.procs["GPU-a"][0] = GpuProcess(401, 1200 * MIB)
    with caplog.at_level(logging.WARNING):
        [d] = enforcer.run_pass()
    assert killed == [401] and d.held.owner.folder == f"dra_{CLAIM}_gpu"
    assert f"team/trainer under ResourceClaim UID {CLAIM}" in caplog.text
    text = "".join(f"{s.labels}\n" for m in HostCollector(enforcer).collect() for s in m.samples)
    assert "'pod': 'trainer', 'pod_uid': '" + POD + "', 'container': 'cuda'" in text


def test_a_device_plugin_container_is_named_by_its_mount_even_where_the_cgroup_names_no_pod(
    tmp_path: Path,
) -> None:
    paths = HostPaths(tmp_path / "root")
    paths.grants_dir.mkdir(parents=True)
    write_grant(paths.grant(f"{POD}_cuda"), Grant(("GPU-a",), (1000 * MIB,)))
    proc = tmp_path / "proc"
    dev = os.stat(paths.grants_dir).st_dev
    mounts = CONTAINERD.replace("259:2 /var/lib/vgpu", f"{os.major(dev)}:{os.minor(dev)} /var/lib/vgpu")
    # cgroupsPerQOS: false: containerd's /k8s.io/<id>, no pod UID, and no API server to ask
    _process(proc, 501, f"0::/k8s.io/{CID}\n", mounts)
    source = Source()
    source.procs["GPU-a"] = [GpuProcess(501, 100 * MIB)]
    [held] = HostView("n1", paths, source, lambda: ["GPU-a"], None, proc).read().held
    assert (held.owner.pod_uid, held.owner.container, held.owner.claim) == (POD, "cuda", "")


def test_resolve_reads_a_containers_grant_once_a_pass_and_sees_a_change_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compute gate resolves every sampled process each 100 ms: 300 processes of one container
    must cost one read of its grant per pass, not 300, and a grant resized between passes counts
    from the next pass."""
    paths = HostPaths(tmp_path / "root")
    paths.grants_dir.mkdir(parents=True)
    grant_path = paths.grant(f"{POD}_cuda")
    write_grant(grant_path, Grant(("GPU-a",), (1000 * MIB,), sm_limits=(30,)))
    proc = tmp_path / "proc"
    dev = os.stat(paths.grants_dir).st_dev
    mounts = CONTAINERD.replace("259:2 /var/lib/vgpu", f"{os.major(dev)}:{os.minor(dev)} /var/lib/vgpu")
    pids = range(600, 630)
    for pid in pids:
        _process(proc, pid, f"0::/k8s.io/{CID}\n", mounts)
    view = HostView("n1", paths, Source(), lambda: ["GPU-a"], None, proc)
    reads: list[str] = []
    real = view._grant
    monkeypatch.setattr(view, "_grant", lambda folder: reads.append(folder) or real(folder))
    view.new_pass()
    found = [view.resolve(pid) for pid in pids]
    assert reads == [f"{POD}_cuda"] and all(f is not None and f[1].sm_limits == (30,) for f in found)
    write_grant(grant_path, Grant(("GPU-a",), (1000 * MIB,), sm_limits=(50,)))
    assert view.resolve(pids[0])[1].sm_limits == (30,)  # type: ignore[index]  # within the pass
    view.new_pass()
    assert view.resolve(pids[0])[1].sm_limits == (50,)  # type: ignore[index]
    assert len(reads) == 2
