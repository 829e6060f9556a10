"""`vgpu limits` reads and changes the region of a running hooked process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hook_harness import Built, Holder, build, env, run

from vgpu.commands.cli import main

MIB = 1 << 20


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


def test_show_lists_the_limit_the_usage_and_the_processes(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    region = tmp_path / "region"
    holder = Holder(
        built, 300, env(built, CUDA_DEVICE_MEMORY_LIMIT="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region))
    )
    try:
        assert main(["limits", "show", str(region), "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert main(["limits", "show", str(region)]) == 0
        table = capsys.readouterr().out
    finally:
        holder.release()
    assert shown["devices"][0]["limit_bytes"] == 1 << 30 and shown["devices"][0]["used_bytes"] == 300 * MIB
    assert shown["processes"][0]["pid"] == holder.pid
    assert "1024 MiB" in table and "300 MiB" in table and f"process {holder.pid}" in table


def test_set_changes_the_limit_a_running_container_allocates_against(built: Built, tmp_path: Path) -> None:
    region = tmp_path / "region"
    environ = env(built, CUDA_DEVICE_MEMORY_LIMIT="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region))
    holder = Holder(built, 0, environ)
    try:
        assert main(["limits", "set", str(region), "--device", "0", "--memory", "2g", "--sm", "50"]) == 0
        assert run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ).int("chunks") == 8
    finally:
        holder.release()


def test_set_by_container_folder_resizes_live_in_mib(built: Built, tmp_path: Path) -> None:
    """The issue's form: the folder the plugin mounts, --memory in MiB, --cores in percent."""
    folder = tmp_path / "uid-1_main"
    folder.mkdir()
    environ = env(
        built, CUDA_DEVICE_MEMORY_LIMIT="512m", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(folder / "vgpu.region")
    )
    holder = Holder(built, 256, environ)
    try:
        assert run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ).int("chunks") == 1
        args = ["--container-dir", str(folder), "--device", "0"]
        assert main(["limits", "set", *args, "--memory", "1280", "--cores", "40"]) == 0
        assert run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ).int("chunks") == 4
        assert main(["limits", "set", *args, "--memory", "128"]) == 0  # below the 256 MiB held
        assert run(built, "t_alloc", "procaddr", "alloc", "256", environ=environ).int("chunks") == 0
    finally:
        holder.release()


def test_bad_input_is_refused_with_a_message_naming_the_field(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["limits", "set", str(tmp_path / "none"), "--device", "0", "--memory", "4x"]) == 2
    assert "--memory" in capsys.readouterr().err
    assert main(["limits", "show", str(tmp_path / "none")]) == 2
    assert "cannot open region file" in capsys.readouterr().err
    region = tmp_path / "region"
    holder = Holder(
        built, 0, env(built, CUDA_DEVICE_MEMORY_LIMIT="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region))
    )
    try:
        before = region.read_bytes()
        assert main(["limits", "set", str(region), "--device", "1", "--memory", "100"]) == 2
        assert "--device: 1 is out of range" in capsys.readouterr().err
        assert region.read_bytes() == before
    finally:
        holder.release()
