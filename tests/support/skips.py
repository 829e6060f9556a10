"""Which tests may skip where the run says everything must run, and why: the one list.

A skipped test is not a passed one. Two switches make a skip a failure, naming the reason the
test gave:

- ``VGPU_STRICT_SKIPS=1``: every test. ``.ci/run`` sets it as root, where the machine has, or
  ``make setup`` installs, all that any test here needs (the real node, cgroups, the images, the
  chroot hosts); without root it says which tests will skip instead.
- ``VGPU_GPU_REQUIRED`` (on unless ``0``): the GPU tests (``pytest -m gpu``, ``make gpu-test``), on
  the GPU machine, where a missing GPU, PyTorch, pynvml or real node means the proof did not run.
  ``VGPU_GPU_REQUIRED=0`` lets them skip, saying why, on a machine that cannot run them all.

A skip that is right even there (the test covers another kind of machine) is listed in
``ALLOWED`` with the words its reason must contain, so that the same test skipping for another
reason still fails. The run prints the list (``-p tests.support.skips`` is loaded by
tests/conftest.py; tests/README.md says more).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from dataclasses import dataclass

import pytest

STRICT = "VGPU_STRICT_SKIPS"
GPU_REQUIRED = "VGPU_GPU_REQUIRED"


@dataclass(frozen=True)
class Allowed:
    test: str  # path::function (no class, no parameters)
    reason: str  # words the skip's reason must contain
    why: str  # why that skip is right on a machine that runs everything


ALLOWED: tuple[Allowed, ...] = (
    Allowed(
        "tests/integration/test_plugin_cli.py::test_without_nvml_the_plugin_says_to_use_a_gpu_node_or_the_fake",
        "NVML works on this machine",
        "it shows what the plugin says on a machine without NVML; a machine with a GPU cannot show that",
    ),
)


def _on(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip() not in ("", "0", "false", "no")


def strict_for(is_gpu: bool) -> bool:
    """Whether a skip of this kind of test fails the run here."""
    return _on(GPU_REQUIRED, "1") if is_gpu else _on(STRICT, "0")


def short_name(nodeid: str) -> str:
    """``path::function`` of a test id: no class, no parameters, no pytest-xdist ``@group``."""
    path, _, rest = nodeid.partition("::")
    function = rest.split("::")[-1].split("[")[0].split("@")[0]
    return f"{path}::{function}"


def allowed(nodeid: str, reason: str) -> Allowed | None:
    name = short_name(nodeid)
    return next((a for a in ALLOWED if a.test == name and a.reason in reason), None)


def verdict(nodeid: str, reason: str, is_gpu: bool) -> str | None:
    """The failure a skip becomes, or None where it may stay a skip."""
    if not strict_for(is_gpu) or allowed(nodeid, reason):
        return None
    switch = f"{GPU_REQUIRED}=0" if is_gpu else f"unset {STRICT}"
    return (
        f"SKIPPED where every test must run: {reason}\n"
        f"This run needs what that names: install or start it (the reason says how). A skip that is "
        f"right even on such a machine goes into tests/support/skips.py (ALLOWED) with why; to let "
        f"tests skip on a machine that lacks parts, {switch}."
    )


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    del call
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        failure = verdict(item.nodeid, _reason(report), item.get_closest_marker("gpu") is not None)
        if failure is not None:
            report.outcome = "failed"
            report.longrepr = failure
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reports = [r for rs in terminalreporter.stats.values() for r in rs if isinstance(r, pytest.TestReport)]
    gpu_ran = any("gpu" in r.keywords for r in reports)
    if not (_on(STRICT, "0") or (gpu_ran and _on(GPU_REQUIRED, "1"))):
        return
    skipped = terminalreporter.stats.get("skipped", [])
    write = terminalreporter.write_line
    terminalreporter.section("skips allowed where every test must run (tests/support/skips.py)")
    for entry in ALLOWED:
        hits = [r for r in skipped if short_name(r.nodeid) == entry.test]
        here = "skipped" if hits else "ran"
        write(f"{entry.test}: {here} here; may skip when {entry.reason!r}: {entry.why}")
