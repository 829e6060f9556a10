"""The Dockerfiles under images/: pinned bases, non-root where the component allows, and the
hook library built by the same make target and placed where the chart tells the plugin to look.
No container engine runs here, so the build steps that can run without one are run for real."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))


def resolved_bases(text: str) -> list[str]:
    """Every FROM image with ARG defaults substituted; stage names are left out."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    stages: set[str] = set()
    bases = []
    for image, stage in re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M):
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        if image not in stages:
            bases.append(image)
        if stage:
            stages.add(stage)
    return bases


def final_user(text: str) -> str:
    stages = re.split(r"^FROM ", text, flags=re.M)
    users = re.findall(r"^USER (\S+)$", stages[-1], re.M)
    return users[-1] if users else "root"


def test_both_images_have_a_dockerfile() -> None:
    assert {p.name for p in DOCKERFILES} == {"scheduler.Dockerfile", "device-plugin.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_image_is_pinned_to_an_exact_version_or_digest(dockerfile: Path) -> None:
    bases = resolved_bases(dockerfile.read_text())
    assert bases
    for base in bases:
        name, _, tag = base.partition("@")[0].rpartition(":")
        pinned_digest = "@sha256:" in base
        # an exact tag carries a full version (3.11.13) or a build date (2024-03-10), never latest
        exact_tag = bool(re.search(r"\d+\.\d+\.\d+|\d{4}-\d{2}-\d{2}", tag)) and tag != "latest"
        assert name and (pinned_digest or exact_tag), f"{dockerfile.name}: {base} is not pinned"


def test_the_scheduler_image_runs_as_a_non_root_user() -> None:
    user = final_user((IMAGES / "scheduler.Dockerfile").read_text())
    assert user.split(":")[0] not in ("root", "0")


def test_the_device_plugin_image_ships_the_hook_where_the_chart_points_the_plugin() -> None:
    text = (IMAGES / "device-plugin.Dockerfile").read_text()
    copies = re.findall(r"^COPY --from=hook \S+ (\S+)$", text, re.M)
    daemonset = (REPO / "charts/vgpu/templates/device-plugin-daemonset.yaml").read_text()
    (flag,) = re.findall(r"--hook-library=(\S+)", daemonset)
    assert copies == [flag]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_build_context_lets_in_only_what_the_dockerfile_copies(dockerfile: Path) -> None:
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copies = re.findall(r"^COPY (?!--from).*$", dockerfile.read_text(), re.M)
    copied = {src.rstrip("/") for line in copies for src in line.split()[1:-1]}  # every source
    assert "*" in ignore and copied and copied <= allowed


def test_the_hook_build_step_of_the_device_plugin_image_makes_an_exporting_libvgpu(tmp_path: Path) -> None:
    """Runs the image's make target on a copy of native/hook with this machine's gcc."""
    text = (IMAGES / "device-plugin.Dockerfile").read_text()
    (target,) = re.findall(r"make (\S*libvgpu\.so)", text)
    src = tmp_path / "hook"
    shutil.copytree(REPO / "native/hook", src, ignore=shutil.ignore_patterns("build"))
    result = subprocess.run(
        ["make", "-C", str(src), target], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    library = src / target
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if line.strip()}
    assert {"cuMemAlloc_v2", "cuGetProcAddress", "dlsym"} <= exported


def _wheel(project: Path, out: Path, pattern: str) -> Path:
    """``pip wheel`` of ``project`` (no dependencies, this venv's setuptools) into ``out``: the one wheel."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
        + [str(project)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = out.glob(pattern)
    return wheel


def test_what_the_build_context_lets_in_is_enough_to_build_the_vgpu_package(tmp_path: Path) -> None:
    """The images' build stage runs `pip install .` on pyproject.toml and vgpu/ only."""
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy(REPO / "pyproject.toml", context)
    shutil.copytree(REPO / "vgpu", context / "vgpu", ignore=shutil.ignore_patterns("__pycache__"))
    wheel = _wheel(context, tmp_path, "vgpu-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"vgpu/commands/cli.py", "vgpu/extender/cli.py", "vgpu/deviceplugin/cli.py"} <= set(names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "vgpu = vgpu.commands.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_products_wheel_built_from_the_whole_repo_leaves_the_sandbox_out(tmp_path: Path) -> None:
    """The sandbox is a developer's tool in its own distribution: `pip wheel .` from a clone holds the
    product's floors and no module of the sandbox, and the sandbox's own wheel holds it."""
    clone = tmp_path / "clone"
    shutil.copytree(
        REPO,
        clone,
        ignore=shutil.ignore_patterns("__pycache__", ".*", "build", "*.egg-info"),  # .venv, .cache, .git
    )
    product = _wheel(clone, tmp_path / "product", "vgpu-*.whl")
    names = zipfile.ZipFile(product).namelist()
    floors = {n.split("/")[1] for n in names if n.startswith("vgpu/") and n.count("/") >= 2}
    product_floors = {"core", "hookabi", "kube", "commands", "extender"}
    product_floors |= {"node", "deviceplugin", "dra", "monitor"}
    assert product_floors <= floors
    assert not [n for n in names if "sandbox" in n.split("/")[0] or n.startswith("vgpu/sandbox")]
    sandbox = _wheel(clone / "sandbox", tmp_path / "sandbox", "vgpu_sandbox-*.whl")
    sandbox_names = zipfile.ZipFile(sandbox).namelist()
    assert "vgpu_sandbox/cluster.py" in sandbox_names
    assert not [n for n in sandbox_names if n.startswith("vgpu/")]
    entry_points = next(n for n in sandbox_names if n.endswith("entry_points.txt"))
    assert "sandbox = vgpu_sandbox.cli" in zipfile.ZipFile(sandbox).read(entry_points).decode()
