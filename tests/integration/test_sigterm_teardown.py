"""A test run sent SIGTERM (``timeout``, a cancelled CI job) tears its fixtures down before it ends,
so that a sandbox or real node it started does not outlive it (tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SLOW = """
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def held():
    yield
    Path({marker!r}).write_text("torn down")


def test_slow(held):
    print("started", flush=True)
    time.sleep(60)
"""


def _run_and_terminate(tmp_path: Path, conftest: str) -> tuple[int, bool]:
    """A pytest run of one slow test under ``conftest``, sent SIGTERM once the test runs:
    (its exit status, whether its session fixture was torn down)."""
    marker = tmp_path / "torn"
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_slow.py").write_text(SLOW.format(marker=str(marker)))
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    for line in child.stdout:
        if "started" in line:
            break
    child.send_signal(signal.SIGTERM)
    child.communicate(timeout=30)
    return child.returncode, marker.exists()


def test_sigterm_tears_the_fixtures_down(tmp_path: Path) -> None:
    code, torn = _run_and_terminate(tmp_path, "from tests.conftest import pytest_configure  # noqa: F401\n")
    assert torn, "the session fixture was not torn down after SIGTERM"
    assert code == 2  # pytest's "interrupted"


def test_without_the_hook_sigterm_leaves_fixtures_up(tmp_path: Path) -> None:
    """The control: Python's default for SIGTERM ends the run without any teardown."""
    code, torn = _run_and_terminate(tmp_path, "")
    assert not torn
    assert code == -signal.SIGTERM
