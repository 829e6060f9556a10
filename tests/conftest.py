"""Shared test set-up: GPU tests are skipped, with the reason, where no GPU is present (a failure
where ``VGPU_GPU_REQUIRED`` is on, as it is by default: tests/support/skips.py); every test
is put in an ``xdist_group`` so that ``pytest -n 2 --dist loadgroup`` (``make test``) never runs at
once two tests that share something (tests/README.md, "Parallel runs"); a run that is sent SIGTERM
tears its fixtures down before it ends.
"""

from __future__ import annotations

import inspect
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest

try:
    from _pytest.nodeid import NodeId
except ImportError:  # pytest before 9.2: pytest-xdist's own renaming of the test ids works there
    NodeId = None  # type: ignore[assignment,misc]

from tests.support.groups import REAL_NODE, SANDBOX, starts_real_node

# A skip where the run says every test must run fails, naming why (the one list of allowed skips)
pytest_plugins = ["tests.support.skips"]

# Where a worker starts: the longest groups first, so that none is left to run alone at the end.
_FIRST = (REAL_NODE, SANDBOX)


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (``timeout``, a cancelled CI job) ends the run as Ctrl-C does, through the fixtures'
    teardown: by default Python dies at once, and a sandbox or real node it started stays up, its
    kubelet holding the machine's one device-plugin socket, so the next run skips the real node."""
    del config

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}: tearing the fixtures down")

    signal.signal(signal.SIGTERM, interrupt)


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def group_of(item: pytest.Item) -> str | None:
    """The ``xdist_group`` a test carries (its own marks and its module's), as pytest-xdist names
    it: the names, sorted, joined by ``_``."""
    names = {
        str(m.args[0] if m.args else m.kwargs.get("name", "default"))
        for m in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names)) or None


def uses_real_node(item: pytest.Item) -> bool:
    """Whether the test's module, or a module one of its fixtures is defined in, starts the real
    node or reads its images (tests.support.groups.real_node_uses)."""
    files = {str(getattr(getattr(item, "module", None), "__file__", "") or "")}
    info = getattr(item, "_fixtureinfo", None)
    for defs in getattr(info, "name2fixturedefs", {}).values():
        for fixturedef in defs:
            try:
                files.add(inspect.getsourcefile(fixturedef.func) or "")
            except TypeError:  # a builtin
                pass
    return any(f.endswith(".py") and starts_real_node(f) for f in files)


def _group(items: list[pytest.Item]) -> None:
    """Every test gets a group unless it has one: ``realnode`` where it uses the real node;
    ``sandbox`` where its module uses the session's sandbox (one sandbox per run, not one per
    worker: two cores do not carry two); else its module's path, so that a module's own fixtures
    (module scope: a server, a build, a release) are set up once, on one worker. A module marked
    ``xdist_spread`` (long tests that share nothing) gets none: pytest-xdist hands its tests out
    one by one."""
    uses_sandbox: set[str] = set()
    for item in items:
        if "sandbox" in getattr(item, "fixturenames", ()):
            uses_sandbox.add(item.nodeid.split("::")[0])
    for item in items:
        own = group_of(item)
        if uses_real_node(item):
            if own not in (None, REAL_NODE):
                raise pytest.UsageError(
                    f"{item.nodeid} uses the real node but is in the xdist group {own!r}: "
                    f"only {REAL_NODE!r} keeps it apart from the other real-node tests (tests/README.md)"
                )
            item.add_marker(pytest.mark.xdist_group(REAL_NODE))
            continue
        if own is not None or item.get_closest_marker("xdist_spread"):
            continue
        module = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(SANDBOX if module in uses_sandbox else module))


def _name_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker under ``--dist loadgroup``: each test's id ends in ``@GROUP``,
    which is how the scheduler sees groups. pytest-xdist 3.8 writes that into ``item._nodeid``,
    which pytest 9.2 no longer reads (the id is ``item._id``), so without this every test would be
    scheduled on its own, groups ignored."""
    if not (hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False)):
        return
    for item in items:
        group = group_of(item)
        if group is None or item.nodeid.endswith(f"@{group}"):
            continue
        if NodeId is None:
            raise pytest.UsageError(f"cannot name the xdist group of {item.nodeid} with this pytest")
        item._id = NodeId.parse(f"{item.nodeid}@{group}")  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)  # around every other plugin's hook, pytest-xdist's included
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    _group(items)
    if hasattr(config, "workerinput"):
        # a pytest-xdist worker: the scheduler hands out groups in this order; a plain run keeps its own
        items.sort(key=lambda item: _FIRST.index(g) if (g := group_of(item)) in _FIRST else len(_FIRST))
    _skip_gpu_tests(items)
    result = yield
    _name_groups(config, items)
    return result


def _skip_gpu_tests(items: list[pytest.Item]) -> None:
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
