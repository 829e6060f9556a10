"""The image archives tools/images.sh writes (docs/images.md), read as files: the reference each
archive names, its configuration, the files its layers hold, and the base layer that three
images share. Runs only where the images were built (needs root and debootstrap), and needs no
container runtime; importing and running them in containerd is the e2e tests' part."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from vgpu_sandbox.realnode import layout

from tests.support.groups import REAL_NODE

IMAGE_DIR = layout.image_dir()  # make images writes there (VGPU_IMAGE_DIR, else <repo>/.cache/images)
REFS = {
    "device-plugin": "docker.io/vgpu/device-plugin:dev",
    "scheduler": "docker.io/vgpu/scheduler:dev",
    "sample": "docker.io/vgpu/sample:dev",
    "pause": "registry.k8s.io/pause:3.10",
}
# the chart's kube-scheduler: upstream's name at the cluster's version (tools/versions.env)
KUBE_VERSION = dict(
    line.split("=", 1)
    for line in (Path(__file__).resolve().parents[2] / "tools" / "versions.env").read_text().splitlines()
    if "=" in line and not line.startswith("#")
)["KUBE_VERSION"]
REFS["kube-scheduler"] = f"registry.k8s.io/kube-scheduler:{KUBE_VERSION}"

pytestmark = [
    pytest.mark.skipif(
        not all((IMAGE_DIR / f"{name}.tar").exists() for name in REFS)
        or not (IMAGE_DIR / "images.json").exists(),
        reason=f"no images in {IMAGE_DIR}: run `make images` first (needs root and debootstrap)",
    ),
    pytest.mark.xdist_group(REAL_NODE),  # the real node imports these archives: one reader at a time
]


@dataclass(frozen=True)
class Image:
    repo_tags: list[str]
    config: dict
    layers: list[str]  # member names in the archive, bottom first
    path: Path

    def names(self, layer: int) -> set[str]:
        """The paths a layer holds, without a leading ./ or trailing /."""
        with tarfile.open(self.path) as archive:
            blob = archive.extractfile(self.layers[layer])
            assert blob is not None
            data = blob.read()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        with tarfile.open(fileobj=io.BytesIO(data)) as layer_tar:
            return {m.name.removeprefix("./").rstrip("/") for m in layer_tar.getmembers()}

    def all_names(self) -> set[str]:
        return set().union(*(self.names(i) for i in range(len(self.layers))))


@cache
def image(name: str) -> Image:
    path = IMAGE_DIR / f"{name}.tar"
    with tarfile.open(path) as archive:
        manifest_file = archive.extractfile("manifest.json")
        assert manifest_file is not None
        (manifest,) = json.load(manifest_file)
        config_file = archive.extractfile(manifest["Config"])
        assert config_file is not None
        config = json.load(config_file)
    return Image(manifest["RepoTags"], config, manifest["Layers"], path)


@pytest.mark.parametrize("name", REFS)
def test_each_archive_names_its_image_by_the_reference_the_chart_uses(name: str) -> None:
    assert image(name).repo_tags == [REFS[name]]


@pytest.mark.parametrize("name", REFS)
def test_each_image_is_for_linux_on_this_machines_architecture(name: str) -> None:
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    config = image(name).config
    assert (config["os"], config["architecture"]) == ("linux", arch)


def test_images_json_describes_every_archive() -> None:
    index = json.loads((IMAGE_DIR / "images.json").read_text())
    for name, ref in REFS.items():
        entry = index[name]
        assert set(entry) == {"ref", "file", "tar_bytes", "unpacked_bytes", "layers"}
        assert entry["ref"] == ref
        assert Path(entry["file"]) == (IMAGE_DIR / f"{name}.tar").resolve()
        assert entry["tar_bytes"] == Path(entry["file"]).stat().st_size
        assert entry["layers"] == len(image(name).layers)
        assert entry["unpacked_bytes"] > entry["tar_bytes"] / 2


def test_the_device_plugin_runs_vgpu_as_root_with_the_hook_library_named() -> None:
    img = image("device-plugin")
    config = img.config["config"]
    assert config["Entrypoint"] == ["vgpu"]
    assert config["Cmd"] == ["device-plugin", "--help"]
    assert config["User"] == "0:0"
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["VGPU_HOOK_LIBRARY"] == "/usr/local/vgpu/libvgpu.so"
    assert env["PATH"].startswith("/opt/vgpu/bin:")
    assert env["PYTHONDONTWRITEBYTECODE"] == env["PYTHONUNBUFFERED"] == "1"
    names = img.all_names()
    assert {"usr/local/vgpu/libvgpu.so", "opt/vgpu/bin/vgpu", "opt/vgpu/bin/python3"} <= names


def test_the_device_plugins_hook_carries_the_images_tag_as_its_version() -> None:
    """Images of two tags hold hooks of different content, which the plugin installs side by side
    (docs/device-plugin.md, "Upgrading the hook"); the hook logs the tag at VGPU_LOG_LEVEL=info."""
    img = image("device-plugin")
    tag = REFS["device-plugin"].rsplit(":", 1)[1]
    with tarfile.open(img.path) as archive:
        for member in img.layers:
            blob = archive.extractfile(member)
            assert blob is not None
            data = blob.read()
            if data[:2] == b"\x1f\x8b":
                data = gzip.decompress(data)
            with tarfile.open(fileobj=io.BytesIO(data)) as layer_tar:
                names = {m.name.removeprefix("./"): m for m in layer_tar.getmembers()}
                if "usr/local/vgpu/libvgpu.so" in names:
                    library = layer_tar.extractfile(names["usr/local/vgpu/libvgpu.so"])
                    assert library is not None
                    assert f"libvgpu.so version {tag}\0".encode() in library.read()
                    return
    raise AssertionError("no layer holds usr/local/vgpu/libvgpu.so")


def test_the_scheduler_runs_vgpu_as_uid_65532_without_the_hook() -> None:
    img = image("scheduler")
    config = img.config["config"]
    assert (config["Entrypoint"], config["Cmd"]) == (["vgpu"], ["extender", "--help"])
    assert config["User"] == "65532:65532"
    assert any(e.startswith("PATH=/opt/vgpu/bin:") for e in config["Env"])
    names = img.all_names()
    assert "opt/vgpu/bin/vgpu" in names
    assert "usr/local/vgpu/libvgpu.so" not in names


def test_the_venv_holds_compiled_bytecode_of_the_vgpu_package() -> None:
    names = image("scheduler").names(1)
    assert all(n.startswith("opt") for n in names), "the venv layer holds only /opt/vgpu"
    assert any(n.endswith("/vgpu/commands/__pycache__/cli.cpython-311.pyc") for n in names)


@pytest.mark.parametrize("name", ["device-plugin", "scheduler"])
def test_the_product_images_hold_no_sandbox(name: str) -> None:
    """The developer's sandbox is its own distribution (sandbox/): never in a product image."""
    names = image(name).all_names()
    assert any("/site-packages/vgpu/core/" in n for n in names), "the vgpu package is in the image"
    assert not [n for n in names if "vgpu_sandbox" in n or "vgpu/sandbox" in n]


def test_the_sample_holds_the_stub_driver_and_the_test_programs_where_a_cuda_image_would() -> None:
    img = image("sample")
    config = img.config["config"]
    assert config.get("Entrypoint") is None
    assert config["Cmd"] == ["/bin/sh"]
    names = img.all_names()
    libdir = f"usr/lib/{os.uname().machine}-linux-gnu"
    for lib in ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"):
        assert f"{libdir}/{lib}" in names
    assert {"usr/local/bin/t_alloc", "usr/local/bin/t_hold", "usr/local/bin/t_info"} <= names
    assert "etc/ld.so.cache" in img.names(1), "the loader's cache lists the stub libraries"


def test_the_pause_image_is_one_static_binary_run_as_65535() -> None:
    img = image("pause")
    config = img.config["config"]
    assert (config["Entrypoint"], config["User"]) == (["/pause"], "65535:65535")
    assert img.names(0) == {"pause"}


def test_the_kube_scheduler_image_runs_the_multi_call_binary_by_the_name_the_chart_calls() -> None:
    """The chart's container runs `command: [kube-scheduler]` as 65532: the name must be on PATH
    and lead to the static kube binary, which dispatches on the name it is called by."""
    img = image("kube-scheduler")
    config = img.config["config"]
    assert config["Entrypoint"] == ["/usr/local/bin/kube-scheduler"] and config["User"] == "65532:65532"
    path = dict(e.split("=", 1) for e in config["Env"])["PATH"].split(":")
    assert "/usr/local/bin" in path
    assert len(img.layers) == 1
    with tarfile.open(img.path) as archive:
        blob = archive.extractfile(img.layers[0])
        assert blob is not None
        data = blob.read()
    with tarfile.open(
        fileobj=io.BytesIO(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    ) as layer:
        members = {m.name.removeprefix("./"): m for m in layer.getmembers()}
        link = members["usr/local/bin/kube-scheduler"]
        assert link.issym() and link.linkname == "kube"
        binary = members["usr/local/bin/kube"]
        assert binary.isfile() and binary.mode & 0o005 == 0o005  # others may run it: uid 65532
        head = layer.extractfile(binary)
        assert head is not None and head.read(4) == b"\x7fELF"


def test_the_debian_base_is_one_layer_shared_by_the_three_debian_images() -> None:
    bases = {name: image(name).layers[0] for name in ("device-plugin", "scheduler", "sample")}
    assert len(set(bases.values())) == 1, bases
    diff_ids = {name: image(name).config["rootfs"]["diff_ids"][0] for name in bases}
    assert len(set(diff_ids.values())) == 1, diff_ids
    assert image("device-plugin").layers[1] == image("scheduler").layers[1], "one venv layer"
