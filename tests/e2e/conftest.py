"""The e2e tests' cluster: one sandbox per test session, started on first use.

It runs in its own folder under pytest's temp dir, so a developer's own sandbox is never
touched, and it is always taken down at the end, also when tests fail.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from vgpu_sandbox.cluster import Sandbox, Spec

E2E_NODES = 3
E2E_GPUS_PER_NODE = 4


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Sandbox]:
    # A short folder: unix socket paths under it (kubelet.sock per node) must stay within 107 bytes,
    # which pytest's numbered temp folders approach.
    state_dir = Path(
        os.environ.get("VGPU_E2E_SANDBOX_DIR") or tempfile.mkdtemp(prefix="vgpu-e2e-", dir="/tmp")
    )
    sb = Sandbox(state_dir)
    try:
        sb.up(Spec(nodes=E2E_NODES, gpus_per_node=E2E_GPUS_PER_NODE, gpu_memory_mib=81920))
        yield sb
    finally:
        sb.down()
        if "VGPU_E2E_SANDBOX_DIR" not in os.environ:
            shutil.rmtree(state_dir, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "sandbox" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
