"""Which freezer file a container's process is frozen through: the hierarchy whose path names its
container, on a pure cgroup v2 host, a hybrid one (v1 controllers beside a unified hierarchy) and
from inside a cgroup namespace; and the error that names what to mount when there is none."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu.monitor.freezer import FreezerError, freezer_of

POD = "pod0f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
CID = "c" * 64


def _proc(tmp: Path, text: str) -> Path:
    proc = tmp / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text(text)
    return proc


def test_cgroup_v2_freezes_through_cgroup_freeze(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    folder = root / "kubepods" / "burstable" / POD / CID
    folder.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory")
    (folder / "cgroup.freeze").write_text("0")
    proc = _proc(tmp_path, f"0::/kubepods/burstable/{POD}/{CID}\n")
    f = freezer_of(42, proc, root)
    assert f.file == folder / "cgroup.freeze"
    f.freeze()
    assert f.file.read_text() == "1"
    f.thaw()
    assert f.file.read_text() == "0"


def test_a_hybrid_host_uses_the_v1_freezer_where_the_unified_path_names_no_container(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "unified").mkdir(parents=True)
    (root / "unified" / "cgroup.controllers").write_text("")
    folder = root / "freezer" / "k8s.io" / CID
    folder.mkdir(parents=True)
    (folder / "freezer.state").write_text("THAWED")
    proc = _proc(tmp_path, f"6:freezer:/k8s.io/{CID}\n0::/system.slice/containerd.service\n")
    f = freezer_of(42, proc, root)
    assert f.file == folder / "freezer.state"
    f.freeze()
    assert f.file.read_text() == "FROZEN"


def test_inside_a_cgroup_namespace_the_rest_of_the_path_is_found_below_the_root(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    folder = root / "kubepods.slice" / "kubepods-burstable.slice" / f"cri-containerd-{CID}.scope"
    folder.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("")
    (folder / "cgroup.freeze").write_text("0")
    proc = _proc(tmp_path, f"0::/../../kubepods-burstable.slice/cri-containerd-{CID}.scope\n")
    assert freezer_of(42, proc, root).file == folder / "cgroup.freeze"


def test_no_freezer_names_what_to_mount(tmp_path: Path) -> None:
    proc = _proc(tmp_path, f"0::/kubepods/burstable/{POD}/{CID}\n")
    with pytest.raises(FreezerError, match="devicePlugin.hostPaths.podCgroups"):
        freezer_of(42, proc, tmp_path / "empty")
    with pytest.raises(FreezerError, match="no container"):
        freezer_of(42, _proc(tmp_path / "b", "0::/user.slice\n"), tmp_path)


def test_only_the_kubelets_part_of_the_hierarchy_mounted_is_found_as_v2_and_as_v1(tmp_path: Path) -> None:
    """The chart mounts the kubepods folder alone at its own path (devicePlugin.hostPaths.podCgroups),
    so the hierarchy's root has no cgroup.controllers of its own: the kubepods folder's tells."""
    root = tmp_path / "cg"
    folder = root / "kubepods.slice" / "kubepods-burstable.slice" / f"cri-containerd-{CID}.scope"
    folder.mkdir(parents=True)
    (root / "kubepods.slice" / "cgroup.controllers").write_text("cpu")
    (folder / "cgroup.freeze").write_text("0")
    path = f"/kubepods.slice/kubepods-burstable.slice/cri-containerd-{CID}.scope"
    assert freezer_of(42, _proc(tmp_path, f"0::{path}\n"), root).file == folder / "cgroup.freeze"
    v1 = tmp_path / "v1"
    folder = v1 / "freezer" / "kubepods" / "besteffort" / POD / CID
    folder.mkdir(parents=True)
    (folder / "freezer.state").write_text("THAWED")
    proc = _proc(tmp_path / "b", f"6:freezer:/kubepods/besteffort/{POD}/{CID}\n0::/\n")
    assert freezer_of(42, proc, v1).file == folder / "freezer.state"
