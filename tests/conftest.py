"""Shared test set-up: GPU tests are skipped, with the reason, where no GPU is present; every test
is put in an ``xdist_group`` so that ``pytest -n 2 --dist loadgroup`` (``make test``) never runs at
once two tests that share something (tests/README.md, "Parallel runs").
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support.groups import REAL_NODE, SANDBOX

# Where a worker starts: the longest groups first, so that none is left to run alone at the end.
_FIRST = (REAL_NODE, SANDBOX)


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def group_of(item: pytest.Item) -> str | None:
    """The ``xdist_group`` a test carries (its own mark or its module's), if any."""
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def _group(items: list[pytest.Item]) -> None:
    """Every test without a group of its own gets one: ``sandbox`` where its module uses the
    session's sandbox (one sandbox per run, not one per worker: two cores do not carry two), else
    its module's path, so that a module's own fixtures (module scope: a server, a build, a release)
    are set up once, on one worker."""
    uses_sandbox: set[str] = set()
    for item in items:
        if "sandbox" in getattr(item, "fixturenames", ()):
            uses_sandbox.add(item.nodeid.split("::")[0])
    for item in items:
        if group_of(item) is not None:
            continue
        module = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(SANDBOX if module in uses_sandbox else module))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _group(items)
    if hasattr(config, "workerinput"):
        # a pytest-xdist worker: the scheduler hands out groups in this order; a plain run keeps its own
        items.sort(key=lambda item: _FIRST.index(g) if (g := group_of(item)) in _FIRST else len(_FIRST))
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
