"""Shared test set-up: GPU tests are skipped, with the reason, where no GPU is present."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    if _has_gpu():
        return
    skip = pytest.mark.skip(
        reason="needs an NVIDIA GPU (nvidia-smi -L failed); run `pytest -m gpu` on the GPU machine"
    )
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
